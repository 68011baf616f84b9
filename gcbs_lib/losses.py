"""Contrastive losses: InfoNCE/CLIP with hard negatives, a learnable logit scale, ColBERT late interaction.

All losses score every query against every document of the batch, so in-batch documents act as negatives:

    L = −(1/B) Σ_i log( exp(s·S[i, p(i)]) / Σ_j exp(s·S[i, j]) )

with S the score matrix, s the logit scale (1/temperature) and p(i) the column of query i's positive.
With k hard negatives per query the documents come interleaved `[pos_0, neg_0_1, …, neg_0_k, pos_1, …]`,
so p(i) = i·(k+1).

Default scales follow each score's range. Dot products of unit vectors (cosines) lie in [−1, 1], so
`info_nce` multiplies them by 20 (temperature 0.05, UniXcoder's and SimCSE's setting). ColBERT's MaxSim
already sums one cosine per query token, up to the query length, and ColBERT trains on it unscaled, so
`late_interaction_loss` uses 1. Pass `scale` explicitly when embeddings are not normalised.
"""
from __future__ import annotations

import math
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn


class LogitScale(nn.Module):
    """A learnable logit scale kept in log space, as CLIP does: scale = exp(log_scale).

    Starts at 1/0.07. The forward applies no clamp, so its gradient is exact; call `clamp_()` after each
    optimizer step to keep the scale within [1, max_scale].
    """

    def __init__(self, init_scale: float = 1 / 0.07, max_scale: float = 100.0):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.max_log_scale = math.log(max_scale)

    def forward(self) -> torch.Tensor:
        return self.log_scale.exp()

    @torch.no_grad()
    def clamp_(self) -> None:
        """Clamp log_scale to [0, ln max_scale] in place (call after `optimizer.step()`)."""
        self.log_scale.clamp_(0.0, self.max_log_scale)


Scale = Union[float, torch.Tensor, Callable[[], torch.Tensor]]


def docs_per_query(n_queries: int, n_docs: int) -> int:
    """How many documents each query owns (1 + hard negatives); a clear error when the counts do not divide."""
    if n_queries == 0 or n_docs == 0:
        raise ValueError(f"empty batch: {n_queries} queries and {n_docs} documents")
    if n_docs % n_queries:
        raise ValueError(
            f"{n_docs} documents for {n_queries} queries: documents must come as [positive, hard negatives...] "
            f"per query, so their count must be a multiple of the query count"
        )
    return n_docs // n_queries


def contrastive_loss(scores: torch.Tensor, scale: Scale = 20.0, symmetric: bool = False) -> torch.Tensor:
    """Cross-entropy of each query row over all documents, positives at columns i·(docs per query).

    `symmetric=True` averages with the document→query direction over the positive documents (CLIP).
    `scale` is a number, a tensor, or a callable such as `LogitScale` returning one.
    """
    n_queries, n_docs = scores.shape
    group = docs_per_query(n_queries, n_docs)
    logits = scores * (scale() if callable(scale) else scale)
    targets = torch.arange(n_queries, device=scores.device)
    loss = F.cross_entropy(logits, targets * group)
    if symmetric:
        loss = (loss + F.cross_entropy(logits[:, ::group].T, targets)) / 2
    return loss


def _check_dims(query: torch.Tensor, docs: torch.Tensor) -> None:
    if query.shape[-1] != docs.shape[-1]:
        raise ValueError(f"embedding sizes differ: queries {tuple(query.shape)}, documents {tuple(docs.shape)}")


def info_nce(query: torch.Tensor, docs: torch.Tensor, scale: Scale = 20.0, symmetric: bool = False) -> torch.Tensor:
    """InfoNCE over dot-product scores: `query [B, D]`, `docs [B·(1+k), D]` (k hard negatives per query).

    `scale` 20 suits unit-norm embeddings (cosine scores, temperature 0.05).
    """
    if query.dim() != 2 or docs.dim() != 2:
        raise ValueError(f"expected 2-d embeddings, got queries {tuple(query.shape)}, documents {tuple(docs.shape)}")
    _check_dims(query, docs)
    return contrastive_loss(query @ docs.T, scale, symmetric)


def late_interaction_scores(query: tuple[torch.Tensor, torch.Tensor], docs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """ColBERT MaxSim: S[q, d] = Σ_{i real token of q} max_{j real token of d} <q_i, d_j>.

    `query = (vectors [Bq, Lq, D], mask [Bq, Lq])`, `docs = (vectors [Bd, Ld, D], mask [Bd, Ld])`; masks are
    True on real tokens. Returns `[Bq, Bd]`.
    """
    (q, q_mask), (d, d_mask) = query, docs
    _check_dims(q, d)
    if q.shape[:2] != q_mask.shape or d.shape[:2] != d_mask.shape:
        raise ValueError(f"masks {tuple(q_mask.shape)}, {tuple(d_mask.shape)} do not match vectors "
                         f"{tuple(q.shape)}, {tuple(d.shape)}")
    if not d_mask.any(dim=1).all():
        raise ValueError("a document has no real token: its MaxSim is undefined")
    q_mask, d_mask = q_mask.bool(), d_mask.bool()
    token_scores = torch.einsum("aid,bjd->abij", q, d)
    token_scores = token_scores.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    best = token_scores.amax(dim=-1).masked_fill(~q_mask[:, None, :], 0.0)
    return best.sum(dim=-1)


def late_interaction_loss(query: tuple[torch.Tensor, torch.Tensor], docs: tuple[torch.Tensor, torch.Tensor],
                          scale: Scale = 1.0, symmetric: bool = False) -> torch.Tensor:
    """InfoNCE over ColBERT MaxSim scores (multi-vector queries and documents with masks).

    `scale` 1: a MaxSim score sums one cosine per query token, so it already spans up to the query length.
    """
    return contrastive_loss(late_interaction_scores(query, docs), scale, symmetric)


# ---- MIL-NCE: a bag of captions as each clip's positive ---------------------------------------------------------

def mil_nce(video: torch.Tensor, text: torch.Tensor, bag_idx: torch.Tensor, temperature: float | torch.Tensor = 1.0,
            direction: str = "v2t", chunk_size: int | None = None, reduction: str = "mean", *,
            exclude_idx: torch.Tensor | None = None) -> torch.Tensor:
    """MIL-NCE (Miech et al., CVPR 2020): clip i's positive is its bag P_i of neighbouring captions.

    With S = video textᵀ / τ (`video [B, D]`, `text [N, D]`, `bag_idx [B, A]` caption rows, -1 = padding):

        "v2t"   ℓ_i = log Σ_{j≤N} e^{S_ij}                            − log Σ_{j∈P_i} e^{S_ij}
        "both"  ℓ_i = log (Σ_{j≤N} e^{S_ij} + Σ_{k≤B} Σ_{j∈P_i} e^{S_kj}) − log Σ_{j∈P_i} e^{S_ij}

    "v2t" is the article's form; "both" the official code's (every clip also against clip i's bag, so the bag
    counts twice and ℓ_i ≥ ln 2). Bags may be ragged and may share captions; a caption twice in one bag is
    refused. `exclude_idx [B, E]` (-1 = padding, optional) names captions that are no negatives for clip i (one
    overlapping its window from another clip's bag): the pairs (i, j) leave both sums. `chunk_size` streams the
    denominators in blocks of `chunk_size` rows × `chunk_size` columns with a hand-written backward, so no B×N
    (nor, for "both", N×B) matrix is ever held; the values and gradients equal the full computation to rounding.
    Returns the mean, or `[B]` with reduction="none".
    """
    _check_mil_nce_inputs(video, text, bag_idx, exclude_idx, temperature, direction, chunk_size, reduction)
    scaled = video / temperature
    rows, cols = _pairs(exclude_idx) if exclude_idx is not None else (bag_idx.new_empty(0),) * 2
    positive = torch.einsum("bd,bad->ba", scaled, text[bag_idx.clamp(min=0)])
    positive = positive.masked_fill(bag_idx < 0, float("-inf")).logsumexp(dim=1)
    denominator = _masked_logsumexp(scaled, text, rows, cols, chunk_size)
    if direction == "both":
        in_bags = bag_idx[bag_idx >= 0].unique()  # only these columns are needed: no all-excluded column enters
        bag_text = text if len(in_bags) == len(text) else text[in_bags]  # every caption in a bag: no copy
        column = _masked_logsumexp(bag_text, scaled, *_pairs_among(cols, rows, in_bags), chunk_size)
        column_of = torch.full((text.shape[0],), float("-inf"), dtype=column.dtype, device=column.device)
        column_of = column_of.index_put((in_bags,), column)
        bag_columns = column_of[bag_idx.clamp(min=0)].masked_fill(bag_idx < 0, float("-inf")).logsumexp(dim=1)
        denominator = torch.logaddexp(denominator, bag_columns)
    loss = denominator - positive
    return loss.mean() if reduction == "mean" else loss


def _pairs(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every entry ≥ 0 of a -1-padded index matrix."""
    rows, slots = (index >= 0).nonzero(as_tuple=True)
    return rows, index[rows, slots]


def _pairs_among(rows: torch.Tensor, cols: torch.Tensor, keep_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs whose row is in the sorted `keep_rows`, with rows renumbered to positions in `keep_rows`."""
    position = torch.searchsorted(keep_rows, rows).clamp(max=max(len(keep_rows) - 1, 0))
    kept = keep_rows[position] == rows if len(keep_rows) else torch.zeros_like(rows, dtype=torch.bool)
    return position[kept], cols[kept]


def _masked_logsumexp(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                      chunk_size: int | None) -> torch.Tensor:
    """log Σ_j e^{<a_m, b_j>} over the columns j with (m, j) not among the pairs (rows, cols): `[M]`."""
    if chunk_size is None:
        scores = (a @ b.T).index_put((rows, cols), a.new_tensor(float("-inf")))
        return scores.logsumexp(dim=1)
    return _ChunkedLogSumExp.apply(a, b, rows, cols, chunk_size)


def _blocks(m: int, n: int, size: int):
    """(rows, columns) slices tiling an m × n matrix in blocks of at most size × size."""
    for r in range(0, m, size):
        for c in range(0, n, size):
            yield slice(r, r + size), slice(c, c + size)


def _masked_block(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, r: slice, c: slice):
    """Scores of rows r of a against rows c of b, the excluded pairs set to −inf: `[|r|, |c|]`."""
    scores = a[r] @ b[c].T
    inside = (rows >= r.start) & (rows < r.stop) & (cols >= c.start) & (cols < c.stop)
    return scores.index_put_((rows[inside] - r.start, cols[inside] - c.start), scores.new_tensor(float("-inf")))


class _ChunkedLogSumExp(torch.autograd.Function):
    """`_masked_logsumexp` streamed over blocks of chunk_size × chunk_size; the backward recomputes each block's
    softmax.

    Forward: lse_m = logaddexp over column blocks of the block's logsumexp. Backward: ∂lse_m/∂<a_m, b_j> =
    e^{s_mj − lse_m}, so each block adds P @ b_block to its rows of a's gradient and Pᵀ @ a_block to its rows of
    b's. Peak memory: one `[chunk_size, chunk_size]` block besides the inputs and their gradients.
    """

    @staticmethod
    def forward(ctx, a, b, rows, cols, chunk_size):
        lse = a.new_full((a.shape[0],), float("-inf"))
        for r, c in _blocks(a.shape[0], b.shape[0], chunk_size):
            lse[r] = torch.logaddexp(lse[r], _masked_block(a, b, rows, cols, r, c).logsumexp(dim=1))
        ctx.save_for_backward(a, b, rows, cols, lse)
        ctx.chunk_size = chunk_size
        return lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, rows, cols, lse = ctx.saved_tensors
        grad_a, grad_b = torch.zeros_like(a), torch.zeros_like(b)
        for r, c in _blocks(a.shape[0], b.shape[0], ctx.chunk_size):
            weights = (_masked_block(a, b, rows, cols, r, c) - lse[r, None]).exp_().mul_(grad[r, None])
            grad_a[r].addmm_(weights, b[c])
            grad_b[c].addmm_(weights.T, a[r])
        return grad_a, grad_b, None, None, None


def _check_index(name: str, index: torch.Tensor, rows: int, n_text: int) -> None:
    if index.dtype != torch.long or index.dim() != 2 or index.shape[0] != rows:
        raise ValueError(f"{name} must be a long tensor [B={rows}, A], got {index.dtype} {tuple(index.shape)}")
    if index.numel() and (index.min() < -1 or index.max() >= n_text):
        bad = index[(index < -1) | (index >= n_text)][0].item()
        raise ValueError(f"{name} holds {bad}, outside [-1, {n_text}) (there are {n_text} captions, -1 pads)")


def _check_mil_nce_inputs(video, text, bag_idx, exclude_idx, temperature, direction, chunk_size, reduction) -> None:
    """Clear errors for everything `mil_nce` cannot score (a CUDA gather would return garbage instead)."""
    if direction not in ("v2t", "both"):
        raise ValueError(f"direction must be 'v2t' or 'both', got {direction!r}")
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if video.dim() != 2 or text.dim() != 2 or video.shape[1] != text.shape[1]:
        raise ValueError(f"expected video [B, D] and text [N, D], got {tuple(video.shape)} and {tuple(text.shape)}")
    if video.shape[0] == 0 or text.shape[0] == 0:
        raise ValueError(f"empty batch: {video.shape[0]} clips and {text.shape[0]} captions")
    _check_index("bag_idx", bag_idx, video.shape[0], text.shape[0])
    if (bag_idx < 0).all(dim=1).any():
        raise ValueError(f"clip {int((bag_idx < 0).all(dim=1).nonzero()[0])} has an empty bag (a row of only -1)")
    ordered = bag_idx.sort(dim=1).values
    if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any():
        raise ValueError("a caption appears twice in one bag; list each caption of a bag once")
    if exclude_idx is not None:
        _check_index("exclude_idx", exclude_idx, video.shape[0], text.shape[0])
        clash = (exclude_idx[:, :, None] == bag_idx[:, None, :]) & (exclude_idx[:, :, None] >= 0)
        if clash.any():
            raise ValueError("a caption is both in clip i's bag and excluded from its negatives")
    t = torch.as_tensor(temperature)
    if t.numel() != 1 or not torch.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be one positive finite number, got {temperature!r}")
    for name, x in (("video", video), ("text", text)):
        if not torch.isfinite(x).all():
            raise ValueError(f"{name} embeddings hold NaN or inf (a diverged encoder, or an fp16 overflow?)")


def energy_hinge(query: torch.Tensor, docs: torch.Tensor, margin: float = 0.2, weight: float = 10.0,
                 reduction: str = "mean") -> torch.Tensor:
    """PromCSE's energy-based hinge term: weight · max(0, margin − cos(h_i, h_i⁺) + max_{j ≠ p(i)} cos(h_i, d_j)).

    Raw cosines (no temperature). `query [B, D]`, `docs [B·(1+k), D]` laid out as in `info_nce`: query i's
    positive is column i·(1+k), and every other document of the batch (other queries' positives and all hard
    negatives) is a negative, so the max runs over all of them as in PromCSE's supervised loss. Defaults
    m = 0.2 and λ = 10 are its example script's. `reduction="none"` returns the weighted term per query.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if query.dim() != 2 or docs.dim() != 2:
        raise ValueError(f"expected 2-d embeddings, got queries {tuple(query.shape)}, documents {tuple(docs.shape)}")
    _check_dims(query, docs)
    group = docs_per_query(len(query), len(docs))
    if len(docs) < 2:
        raise ValueError("the hinge needs at least one negative: one query with one document has none")
    cosines = F.normalize(query, dim=-1) @ F.normalize(docs, dim=-1).T
    positive_column = torch.arange(len(query), device=query.device) * group
    positive = cosines.gather(1, positive_column[:, None]).squeeze(1)
    hardest = cosines.scatter(1, positive_column[:, None], float("-inf")).amax(dim=1)
    per_query = weight * torch.relu(margin - positive + hardest)
    return per_query.mean() if reduction == "mean" else per_query
