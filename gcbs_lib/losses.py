"""Contrastive losses: InfoNCE (hard negatives, symmetric, a learnable logit scale, one vector per
text or ColBERT's late interaction), its per-rank share, MIL-NCE. InfoNCE: L = −(1/B) Σ_i log(
exp(s·S[i, p(i)]) / Σ_j exp(s·S[i, j]) ), S the query × document scores, s the logit scale
(1/temperature); with k hard negatives per query the documents come as `[pos_0, neg_0_1, …,
neg_0_k, pos_1, …]`, so query i's positive is column p(i) = i·(k+1); the others are negatives.
With `groups` (an id per document; a query's is its positive's), the negatives that share the
anchor's group leave the denominator (the supervised oracle for false negatives); positives stay."""

import math
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from gcbs_lib.check import require
from gcbs_lib.distributed import rank_and_world_size

Scale = Union[float, torch.Tensor, Callable[[], torch.Tensor]]


class LogitScale(nn.Module):
    """A learnable logit scale exp(log_scale) from `init_scale`, kept in log space as CLIP does; the
    forward does not clamp (exact gradient): `clamp_()` after each step keeps it in [1, max]."""

    def __init__(self, init_scale: float = 1 / 0.07, max_scale: float = 100.0):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.max_log_scale = math.log(max_scale)

    def forward(self) -> torch.Tensor:
        return self.log_scale.exp()

    @torch.no_grad()
    def clamp_(self) -> None:
        self.log_scale.clamp_(0.0, self.max_log_scale)


def similarity(queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Scores [Q, N]: dot products of vectors [Q, D] and [N, D]; for token vectors [Q, T, D] and
    [N, U, D], ColBERT's late interaction S_qn = Σ_t max_u <q_t, d_u>, where all-zero token vectors
    are padding (a padded query token adds 0; a padded document token is never the max)."""
    if queries.dim() == 2:
        return queries @ docs.T

    tokens = torch.einsum("qtd,nud->qntu", queries, docs)
    padding = (docs == 0).all(dim=-1)
    return tokens.masked_fill(padding[None, :, None, :], -math.inf).amax(dim=-1).sum(dim=-1)


def info_nce(
    query: torch.Tensor,
    docs: torch.Tensor,
    scale: Scale = 20.0,
    symmetric: bool = False,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """InfoNCE over the `similarity` of `query [B, D]` and `docs [B·(1+k), D]` (k hard negatives per
    query; [B, T, D] token vectors for late interaction). `scale`: a number, a tensor or a callable
    such as `LogitScale` (20 suits unit-norm embeddings: temperature 0.05). `symmetric=True`
    averages with the document→query direction over the positive documents (CLIP). `groups
    [B·(1+k)]`: each document's group id; same-group negatives leave the denominators."""
    return rank_info_nce(query, docs, scale, symmetric, rank=0, world_size=1, groups=groups)


def rank_info_nce(
    all_queries: torch.Tensor,
    all_docs: torch.Tensor,
    scale: Scale = 20.0,
    symmetric: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """L_r, rank r's share of InfoNCE over embeddings gathered from all W ranks: its B queries
    against all W·B·(1+k) documents (symmetric: also its B positive documents against all W·B
    queries). The mean of L_r over ranks is `info_nce(all_queries, all_docs, scale, symmetric,
    groups)`, `groups` being the global batch's document groups (gathered like the documents).
    Rank and world size default to this process's."""
    q = all_queries.shape
    d = all_docs.shape
    shapes = f"queries {tuple(q)}, documents {tuple(d)}"
    same = len(q) == len(d) in (2, 3) and q[-1] == d[-1]
    require(same, f"embedding sizes differ or are not [rows, D] (or [rows, tokens, D]): {shapes}")

    own_rank, own_world_size = rank_and_world_size()
    rank = own_rank if rank is None else rank
    world_size = own_world_size if world_size is None else world_size

    n = len(all_queries)
    m = len(all_docs)
    require(
        n and m and not m % n and not n % world_size,
        f"{m} documents for {n} queries on {world_size} ranks: their count must be a multiple of "
        "the query count ([positive, hard negatives...] per query), and the queries must split "
        "over the ranks",
    )
    got = None if groups is None else tuple(groups.shape)
    require(groups is None or got == (m,), f"groups must hold one id per document ({m}), got {got}")

    # documents per query, and queries per rank
    group = m // n
    b = n // world_size
    s = scale() if callable(scale) else scale
    own = torch.arange(rank * b, (rank + 1) * b, device=all_queries.device)
    logits = [similarity(all_queries[own], all_docs) * s]
    if symmetric:
        logits.append(similarity(all_docs[own * group], all_queries) * s)

    if groups is not None:
        anchors = torch.arange(b, device=own.device)
        same = _same_group_mask(groups[own * group], groups, anchors, own * group)
        # query j's group is its positive document's: the mask's columns j·(1+k)
        logits = [x.masked_fill(m, -math.inf) for x, m in zip(logits, (same, same[:, ::group]))]

    targets = (own * group, own)
    return sum(F.cross_entropy(x, target) for x, target in zip(logits, targets)) / len(logits)


def _same_group_mask(anchor_groups, candidate_groups, rows, cols) -> torch.Tensor:
    """`[A, C]`, True where candidate c shares anchor a's group, False at the positives (rows[i],
    cols[i]): the negatives `mask_same_group` leaves out of a denominator."""
    same = anchor_groups[:, None] == candidate_groups[None, :]
    same[rows, cols] = False
    return same


def mil_nce(
    video: torch.Tensor,
    text: torch.Tensor,
    bag_idx: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    direction: str = "v2t",
    chunk_size: int | None = None,
    reduction: str = "mean",
    *,
    exclude_idx: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """MIL-NCE (Miech et al., CVPR 2020): clip i's positive is its bag P_i of neighbouring captions.

    With S = video textᵀ / τ (`video [B, D]`, `text [N, D]`, `bag_idx [B, A]` caption rows, -1 pad):

        "v2t"   ℓ_i = log Σ_{j≤N} e^{S_ij}                                − log Σ_{j∈P_i} e^{S_ij}
        "both"  ℓ_i = log (Σ_{j≤N} e^{S_ij} + Σ_{k≤B} Σ_{j∈P_i} e^{S_kj}) − log Σ_{j∈P_i} e^{S_ij}

    "v2t" is the article's form, "both" the official code's. Bags may be ragged and share captions.
    `exclude_idx [B, E]` (-1 = padding) names captions that are no negatives for clip i: those pairs
    (i, j) leave both sums, as do, with `groups [B]` (each clip's group id; a caption's is that of
    the clips whose bags hold it), the captions of clip i's group outside P_i. `chunk_size` streams
    the denominators in blocks of chunk_size² scores (no B×N score matrix is held; `groups` holds a
    B×N bool mask), with the same values and gradients to rounding. Returns the mean, or `[B]` with
    reduction="none"."""
    exclude = _checked_mil_nce_inputs(
        video, text, bag_idx, temperature, direction, chunk_size, reduction, exclude_idx
    )

    scaled = video / temperature
    padding = bag_idx < 0
    bags = bag_idx.clamp(min=0)
    rows, slots = (exclude >= 0).nonzero(as_tuple=True)
    cols = exclude[rows, slots]

    # the pairs (clip, caption of its group outside its bag) leave too
    if groups is not None:
        same_rows, same_cols = _same_group_captions(groups, bag_idx, len(text))
        rows = torch.cat([rows, same_rows])
        cols = torch.cat([cols, same_cols])

    positive = torch.einsum("bd,bad->ba", scaled, text[bags]).masked_fill(padding, -math.inf)
    denominator = _masked_logsumexp(scaled, text, rows, cols, chunk_size)
    if direction == "both":  # every clip against caption j (column sums), then over clip i's bag
        columns = _masked_logsumexp(text, scaled, cols, rows, chunk_size)[bags]
        columns = columns.masked_fill(padding, -math.inf)
        denominator = torch.logaddexp(denominator, columns.logsumexp(dim=1))
    loss = denominator - positive.logsumexp(dim=1)
    return loss.mean() if reduction == "mean" else loss


def _checked_mil_nce_inputs(
    video, text, bag_idx, temperature, direction, chunk_size, reduction, exclude_idx
) -> torch.Tensor:
    """Refuse what `mil_nce` cannot score (a CUDA gather would return garbage); return the
    exclusions, [B, 0] when none are given."""
    require(direction in ("v2t", "both"), f"direction must be 'v2t' or 'both', got {direction!r}")
    require(reduction in ("mean", "none"), f"reduction must be 'mean' or 'none', got {reduction!r}")
    require(
        chunk_size is None or type(chunk_size) is int and chunk_size > 0,
        f"chunk_size must be None or a positive int, got {chunk_size!r}",
    )

    # the embeddings
    shapes = f"{tuple(video.shape)}, {tuple(text.shape)}"
    require(
        video.dim() == text.dim() == 2
        and video.shape[1] == text.shape[1]
        and len(video)
        and len(text),
        f"expected video [B, D] and text [N, D], B, N > 0; got {shapes}",
    )
    t = torch.as_tensor(temperature).detach()
    require(
        t.numel() == 1 and 0 < t.item() < math.inf,
        f"temperature must be one positive finite number, got {t}",
    )
    require(
        torch.isfinite(video).all() and torch.isfinite(text).all(),
        "the video or text embeddings hold NaN or inf (diverged, or an fp16 overflow?)",
    )

    # the bags and the exclusions: caption rows, -1 pads
    exclude = bag_idx.new_empty(len(video), 0) if exclude_idx is None else exclude_idx
    for name, index in (("bag_idx", bag_idx), ("exclude_idx", exclude)):
        require(
            index.dtype == torch.long and index.dim() == 2 and len(index) == len(video),
            f"{name} must be a long tensor [B={len(video)}, A], "
            f"got {index.dtype} {tuple(index.shape)}",
        )
        require(
            not index.numel() or -1 <= index.min() <= index.max() < len(text),
            f"{name} holds indices outside [-1, {len(text)}): N captions, -1 pads",
        )
    empty = (bag_idx < 0).all(dim=1).nonzero().flatten().tolist()
    require(not empty, f"clips {empty} have an empty bag (a row of only -1)")
    ordered = bag_idx.sort(dim=1).values
    require(
        not ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(),
        "a caption appears twice in one bag; list each caption of a bag once",
    )

    shared = (exclude[:, :, None] == bag_idx[:, None, :]) & (bag_idx[:, None] >= 0)
    require(not shared.any(), "a caption is both in clip i's bag and excluded from its negatives")
    return exclude


def _same_group_captions(groups, bag_idx, captions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (clip, caption) of `_same_group_mask` of clips against captions, as (rows, cols):
    a caption's group is its bags' clips' (one group; captions in no bag: none), bags kept."""
    got = tuple(groups.shape)
    require(got == (len(bag_idx),), f"groups must hold one id per clip ({len(bag_idx)}), got {got}")

    rows, slots = (bag_idx >= 0).nonzero(as_tuple=True)
    cols = bag_idx[rows, slots]

    # a caption in no bag takes a group no clip has
    caption_groups = groups.new_full((captions,), int(groups.min()) - 1)
    caption_groups[cols] = groups[rows]
    one = torch.equal(caption_groups[cols], groups[rows])
    require(one, "a caption is in the bags of clips of different groups: give a caption one group")
    return _same_group_mask(groups, caption_groups, rows, cols).nonzero(as_tuple=True)


def _masked_logsumexp(a, b, rows, cols, chunk_size: int | None) -> torch.Tensor:
    """log Σ_j e^{<a_m, b_j>} over j with (m, j) not among the pairs (rows, cols): `[M]`; excluded
    scores are the dtype's lowest finite value, not −inf (a row with nothing left stays finite)."""
    if chunk_size is None:
        return _masked_block(a, b, rows, cols, slice(0, len(a)), slice(0, len(b))).logsumexp(dim=1)
    return _ChunkedLogSumExp.apply(a, b, rows, cols, chunk_size)


def _masked_block(a, b, rows, cols, r: slice, c: slice) -> torch.Tensor:
    """Scores of rows r of `a` against rows c of `b`, the excluded pairs masked: `[|r|, |c|]`."""
    inside = (rows >= r.start) & (rows < r.stop) & (cols >= c.start) & (cols < c.stop)
    lowest = a.new_tensor(torch.finfo(a.dtype).min)
    return (a[r] @ b[c].T).index_put((rows[inside] - r.start, cols[inside] - c.start), lowest)


class _ChunkedLogSumExp(torch.autograd.Function):
    """`_masked_logsumexp` one block at a time; the backward recomputes each block's P = e^{s − lse}
    = ∂lse/∂s and adds P @ b_c to a's gradient rows, Pᵀ @ a_r to b's."""

    @staticmethod
    def forward(ctx, a, b, rows, cols, chunk_size):
        ctx.blocks = [
            (slice(r, r + chunk_size), slice(c, c + chunk_size))
            for r in range(0, len(a), chunk_size)
            for c in range(0, len(b), chunk_size)
        ]

        lse = a.new_full((len(a),), -math.inf)
        for r, c in ctx.blocks:
            lse[r] = torch.logaddexp(lse[r], _masked_block(a, b, rows, cols, r, c).logsumexp(dim=1))
        ctx.save_for_backward(a, b, rows, cols, lse)
        return lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, rows, cols, lse = ctx.saved_tensors
        grad_a = torch.zeros_like(a)
        grad_b = torch.zeros_like(b)
        for r, c in ctx.blocks:
            scores = _masked_block(a, b, rows, cols, r, c)
            weights = (scores - lse[r, None]).exp_().mul_(grad[r, None])
            grad_a[r].addmm_(weights, b[c])
            grad_b[c].addmm_(weights.T, a[r])
        return grad_a, grad_b, None, None, None
