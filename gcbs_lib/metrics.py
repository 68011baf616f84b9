"""Retrieval and correlation metrics: ranks, MRR, R@K, median rank, Spearman, and MoCo's weighted
kNN accuracy. A query's rank is 1 + the number of OTHER candidates scoring at least as high as its
match: a tie counts above the match (pessimistic), so a model that scores everything equal gets the
worst rank N, not the best."""

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F

from gcbs_lib.check import require

# scores held at once by `retrieval_ranks` and `knn_accuracy`: 16 MiB of float32
BLOCK_ELEMENTS = 2**22


def ranks(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """1-based rank of each query's match, a LongTensor [Q]: `scores [Q, N]` floating (higher = more
    similar; NaN refused, -inf allowed as a mask), `positive [Q]` the integer column of each query's
    match."""
    require(
        isinstance(scores, torch.Tensor)
        and scores.dim() == 2
        and scores.is_floating_point()
        and scores.shape[1],
        "scores must be a floating 2-D tensor [Q, N], N > 0, got "
        f"{getattr(scores, 'shape', scores)}",
    )
    require(
        isinstance(positive, torch.Tensor)
        and positive.shape == (len(scores),)
        and positive.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8),
        f"positive must be an integer tensor, one entry per query ({len(scores)})",
    )
    require(
        not len(positive) or 0 <= positive.min() <= positive.max() < scores.shape[1],
        f"positive indices must lie in [0, {scores.shape[1]})",
    )
    require(not torch.isnan(scores).any(), "scores hold NaN values")
    match = scores.gather(1, positive.to(scores.device, torch.long)[:, None])
    return (scores >= match).sum(dim=1)  # the match itself counts once: 1 + #{others >= match}


def retrieval_ranks(
    queries: torch.Tensor, pool: torch.Tensor, positive: torch.Tensor, block_size: int | None = None
) -> torch.Tensor:
    """`ranks(queries @ pool.T, positive)`, `block_size` queries at a time (default: about
    BLOCK_ELEMENTS scores): queries [Q, D], pool [N, D] (normalise them for cosines), positive [Q]
    the pool row of each query's match."""
    require(
        queries.dim() == pool.dim() == 2
        and queries.shape[1] == pool.shape[1]
        and len(positive) == len(queries),
        "need queries [Q, D] and pool [N, D] of the same width, positive [Q]; got "
        f"{tuple(queries.shape)}, "
        f"{tuple(pool.shape)}, {len(positive)}",
    )
    size = max(1, BLOCK_ELEMENTS // max(1, len(pool))) if block_size is None else block_size
    require(int(size) == size >= 1, f"block_size must be a positive integer, got {block_size!r}")
    blocks = [slice(i, i + int(size)) for i in range(0, len(queries), int(size))]
    return torch.cat([ranks(queries[b] @ pool.T, positive[b]) for b in blocks])


def mrr(ranks: torch.Tensor | list[int], cutoff: int | None = None) -> float:
    """Mean reciprocal rank; a rank beyond `cutoff` counts 0 (None: no cutoff; UniXcoder's code
    search uses 1000)."""
    r = _checked_ranks(ranks)
    require(
        cutoff is None or int(cutoff) == cutoff >= 1,
        f"cutoff must be a positive integer or None, got {cutoff!r}",
    )
    return float(np.where(r <= (cutoff or np.inf), 1.0 / r, 0.0).mean())


def recall_at(ranks: torch.Tensor | list[int], k: int) -> float:
    """Share of queries whose match ranks in the top `k` (R@K)."""
    r = _checked_ranks(ranks)
    require(int(k) == k >= 1, f"k must be a positive integer, got {k!r}")
    return float((r <= k).mean())


def median_rank(ranks: torch.Tensor | list[int]) -> float:
    """Median rank (MedR); for an even count the mean of the two middle ranks."""
    return float(np.median(_checked_ranks(ranks)))


def _checked_ranks(ranks) -> np.ndarray:
    r = _as_array(ranks)
    require(r.ndim == 1 and len(r), f"ranks must be a non-empty 1-D sequence, got shape {r.shape}")
    require(
        np.isfinite(r).all() and (r >= 1).all() and (r == np.round(r)).all(),
        "ranks must be integers >= 1",
    )
    return r


def spearman(x, y) -> float:
    """Spearman's rank correlation, ties given average ranks: `scipy.stats.spearmanr`, with clear
    errors."""
    x, y = _as_array(x), _as_array(y)
    require(
        x.ndim == 1 and x.shape == y.shape and len(x) >= 2,
        f"x and y must be 1-D, equally long and hold at "
        f"least 2 pairs; got shapes {x.shape}, {y.shape}",
    )
    require(
        np.isfinite(x).all() and np.isfinite(y).all() and np.ptp(x) and np.ptp(y),
        "x and y must be finite (no NaN or inf), and not constant (Spearman's rho is undefined "
        "then)",
    )
    return float(scipy.stats.spearmanr(x, y).statistic)


def _as_array(values) -> np.ndarray:
    """A float64 array of a tensor or a sequence of numbers (numpy says which value is not one)."""
    return np.asarray(
        values.detach().double().cpu().numpy() if isinstance(values, torch.Tensor) else values,
        float,
    )


def knn_accuracy(
    features: torch.Tensor,
    labels: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    k: int = 200,
    temperature: float = 0.1,
    block_size: int | None = None,
) -> float:
    """Share of `features` [Q, D] whose weighted kNN vote over `bank` [N, D] gives their `labels`
    [Q]: the k most cosine-similar bank rows (on equal similarity, the lower index first) each add
    exp(cos/temperature) to their class in `bank_labels` [N]; the top class wins (on a tie, the
    smallest). k=200, temperature=0.1: MoCo's demo."""
    require(
        len(features)
        and torch.isfinite(features).all()
        and torch.isfinite(bank).all()
        and not any(
            y.dtype.is_floating_point or y.dtype == torch.bool or y.min() < 0
            for y in (labels, bank_labels)
        ),
        "no features to score, features or bank not finite, or labels that are no integer class "
        "indices ≥ 0",
    )
    require(1 <= k <= len(bank), f"k must lie in 1..{len(bank)} (the bank's rows), got {k}")
    features, bank = F.normalize(features, dim=1), F.normalize(bank, dim=1)
    classes, block_size = (
        int(max(labels.max(), bank_labels.max())) + 1,
        block_size or BLOCK_ELEMENTS // len(bank) or 1,
    )
    correct = 0
    for start in range(0, len(features), block_size):
        top, index = (features[start : start + block_size] @ bank.T).sort(
            dim=1, descending=True, stable=True
        )
        votes = top.new_zeros(len(top), classes)
        votes.scatter_add_(1, bank_labels[index[:, :k]], (top[:, :k] / temperature).exp())
        correct += (votes.argmax(dim=1) == labels[start : start + block_size]).sum().item()
    return correct / len(features)
