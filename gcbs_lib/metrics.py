"""Retrieval and correlation metrics: ranks, MRR, R@K, median rank, Spearman, and MoCo's weighted
kNN vote. A query's rank is 1 + the number of OTHER candidates scoring at least as high as its
match: a tie counts above the match (pessimistic), so a model that scores everything equal gets the
worst rank N, not the best."""

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F

from gcbs_lib.check import require

# scores held at once by `retrieval_ranks` and `knn_predict`: 16 MiB of float32
BLOCK_ELEMENTS = 2**22
INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def ranks(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """1-based rank of each query's match, a LongTensor [Q]: `scores [Q, N]` floating (higher: more
    similar; NaN refused, -inf a mask), `positive [Q]` the integer column of each query's match."""
    matrix = isinstance(scores, torch.Tensor) and scores.dim() == 2
    require(matrix, f"scores must be a 2-D tensor [Q, N], got {getattr(scores, 'shape', scores)}")
    require(scores.is_floating_point(), f"scores must be floating, got {scores.dtype}")
    require(scores.shape[1] > 0, "scores must have N > 0 columns")
    integer = isinstance(positive, torch.Tensor) and positive.dtype in INTEGERS
    require(integer, "positive must be an integer tensor")
    one_each = positive.shape == (len(scores),)
    require(one_each, f"positive must hold one entry per query ({len(scores)})")
    inside = not len(positive) or 0 <= positive.min() <= positive.max() < scores.shape[1]
    require(inside, f"positive indices must lie in [0, {scores.shape[1]})")
    # an inf times 0 makes a NaN
    require(not torch.isnan(scores).any(), "scores hold NaN values")
    match = scores.gather(1, positive.to(scores.device, torch.long)[:, None])
    return (scores >= match).sum(dim=1)  # the match itself counts once: 1 + #{others >= match}


def retrieval_ranks(
    queries: torch.Tensor, pool: torch.Tensor, positive: torch.Tensor
) -> torch.Tensor:
    """`ranks(queries @ pool.T, positive)`, a block of queries at a time (about BLOCK_ELEMENTS
    scores): queries [Q, D], pool [N, D] (unit rows: cosines), positive [Q] the matches' pool
    rows. `ranks` checks each block; the whole `positive` is one per query."""
    require(
        queries.dim() == pool.dim() == 2 and queries.shape[1] == pool.shape[1],
        f"need queries [Q, D] and pool [N, D] of the same width, got {tuple(queries.shape)}, "
        f"{tuple(pool.shape)}",
    )
    require(queries.is_floating_point(), f"queries must be floating, got {queries.dtype}")
    require(len(pool) > 0, "the pool is empty")
    one_each = len(positive) == len(queries)
    require(one_each, f"positive must hold one entry per query ({len(queries)})")
    size = max(1, BLOCK_ELEMENTS // len(pool))
    blocks = [slice(i, i + size) for i in range(0, len(queries), size)]
    return torch.cat([ranks(queries[b] @ pool.T, positive[b]) for b in blocks])


def mrr(ranks: torch.Tensor | list[int], cutoff: int | None = None) -> float:
    """Mean reciprocal rank; a rank beyond `cutoff` counts 0 (UniXcoder's code search: 1000)."""
    r = _checked_ranks(ranks)
    valid = cutoff is None or int(cutoff) == cutoff >= 1
    require(valid, f"cutoff must be a positive integer or None, got {cutoff!r}")
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
    require(np.isfinite(r).all() and (r == np.round(r)).all(), "ranks must be integers")
    require((r >= 1).all(), f"ranks must be >= 1, got {r.min():g}")
    return r


def spearman(x, y) -> float:
    """Spearman's rank correlation, ties given average ranks (`scipy.stats.spearmanr`'s, without
    its overhead: the bootstrap computes thousands)."""
    x = _as_array(x)
    y = _as_array(y)
    require(x.ndim == y.ndim == 1, f"x and y must be 1-D, got shapes {x.shape}, {y.shape}")
    require(len(x) == len(y), f"x and y must be equally long, got {len(x)} and {len(y)}")
    require(len(x) >= 2, f"x and y must hold at least 2 pairs, got {len(x)}")
    require(np.isfinite(x).all() and np.isfinite(y).all(), "x and y must be finite (no NaN or inf)")
    require(np.ptp(x) and np.ptp(y), "x or y is constant: Spearman's rho is undefined")
    # 1-based ranks, tied values given their average rank
    rx = scipy.stats.rankdata(x)
    ry = scipy.stats.rankdata(y)
    rx -= rx.mean()
    ry -= ry.mean()
    return float(rx @ ry / np.sqrt((rx @ rx) * (ry @ ry)))


def _as_array(values) -> np.ndarray:
    """A float64 array of a tensor or a sequence of numbers (numpy says which value is not one)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().double().cpu().numpy()
    return np.asarray(values, float)


def knn_predict(
    features: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    k: int = 200,
    temperature: float = 0.1,
) -> torch.Tensor:
    """The class of each of `features` [Q, D] by a weighted kNN vote over `bank` [N, D]: the k most
    cosine-similar bank rows (ties: lower index first) each add exp(cos/temperature) to their class
    in `bank_labels` [N]; the top class wins (ties: the smallest). MoCo's demo."""
    require(len(features) > 0, "no features to score")
    require(torch.isfinite(features).all(), "features are not finite")
    require(torch.isfinite(bank).all(), "the bank is not finite")
    integer = not bank_labels.dtype.is_floating_point and bank_labels.dtype != torch.bool
    require(integer, f"bank_labels must be integer class indices, got {bank_labels.dtype}")
    lowest = bank_labels.min()
    require(lowest >= 0, f"bank_labels must be class indices ≥ 0, got {lowest}")
    require(1 <= k <= len(bank), f"k must lie in 1..{len(bank)} (the bank's rows), got {k}")
    features = F.normalize(features, dim=1)
    bank = F.normalize(bank, dim=1)
    classes = int(bank_labels.max()) + 1
    block_size = BLOCK_ELEMENTS // len(bank) or 1
    predicted = []
    for start in range(0, len(features), block_size):
        scores = features[start : start + block_size] @ bank.T
        top, index = scores.sort(dim=1, descending=True, stable=True)
        votes = top.new_zeros(len(top), classes)
        votes.scatter_add_(1, bank_labels[index[:, :k]], (top[:, :k] / temperature).exp())
        predicted.append(votes.argmax(dim=1))
    return torch.cat(predicted)
