"""Retrieval, correlation and representation metrics: ranks, MRR, R@K, median rank, Spearman, kNN accuracy.

Retrieval. Each query q has one matching candidate, the column `positive[q]` of a score matrix `[Q, N]`
(higher = more similar). Its rank is 1 + the number of OTHER candidates scoring at least as high: a candidate
that ties the match counts above it (pessimistic), so a model that scores everything equal gets the worst
rank N, not the best. From the ranks:

  MRR     mean of 1/rank, a rank beyond `cutoff` counting 0 (UniXcoder's code search uses cutoff 1000);
  R@K     the share of queries whose match is in the top K;
  MedR    the median rank.

`retrieval_ranks` gives the same ranks from query and pool embeddings without holding the `[Q, N]` matrix:
it scores a block of queries against the whole pool at a time.

Correlation. Spearman's rho is Pearson's correlation of the two rank vectors, tied values sharing the average
of the ranks they span (as `scipy.stats.spearmanr` does). STS benchmarks report it against human scores.

Representations. `knn_accuracy` is the weighted k-nearest-neighbour monitor of the MoCo CIFAR demo: each test
feature votes among its k most cosine-similar training features, each neighbour adding e^{cos/τ} to its class.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

BLOCK_ELEMENTS = 2**22  # scores held at once by `retrieval_ranks`: 16 MiB of float32


# ------------------------------------------------------------------------------------------- retrieval

def ranks(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """1-based rank of each query's match: 1 + #{other candidates scoring >= the match}.

    scores    [Q, N] floating, row q = query q against the N candidates (NaN refused; -inf allowed as a mask)
    positive  [Q] integer, the column of each query's match
    Returns a LongTensor [Q] on the device of `scores`.
    """
    positive = _check_retrieval(scores, positive)
    match = scores.gather(1, positive[:, None])
    # The match itself satisfies `>=`, so the count is already 1 + #{others >= match}.
    return (scores >= match).sum(dim=1)


def retrieval_ranks(queries: torch.Tensor, pool: torch.Tensor, positive: torch.Tensor,
                    block_size: int | None = None) -> torch.Tensor:
    """`ranks(queries @ pool.T, positive)` computed `block_size` queries at a time.

    queries [Q, D] and pool [N, D] are embeddings (L2-normalise them first for cosine scores); positive [Q]
    is the pool row of each query's match. The default `block_size` keeps about `BLOCK_ELEMENTS` scores in
    memory. Each query's match score is read from the same matrix product as its competitors, so a pool
    duplicate of the match ties it exactly and counts above it.
    """
    for name, x in (("queries", queries), ("pool", pool)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [rows, D], got {getattr(x, 'shape', type(x))}")
    if queries.shape[1] != pool.shape[1]:
        raise ValueError(f"queries and pool must have the same width D, got {tuple(queries.shape)} "
                         f"and {tuple(pool.shape)}")
    if block_size is None:
        block_size = max(1, BLOCK_ELEMENTS // max(1, len(pool)))
    if int(block_size) != block_size or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    block_size = int(block_size)
    if not (isinstance(positive, torch.Tensor) and positive.dim() == 1 and len(positive) == len(queries)):
        raise ValueError(f"positive must be a 1-D tensor with one entry per query ({len(queries)}), "
                         f"got {getattr(positive, 'shape', type(positive))}")
    return torch.cat([ranks(queries[i:i + block_size] @ pool.T, positive[i:i + block_size])
                      for i in range(0, len(queries), block_size)])


def mrr(ranks: torch.Tensor | Sequence[int], cutoff: int | None = None) -> float:
    """Mean reciprocal rank; a rank beyond `cutoff` contributes 0 (None: no cutoff)."""
    r = _check_ranks(ranks)
    if cutoff is not None and (int(cutoff) != cutoff or cutoff < 1):
        raise ValueError(f"cutoff must be a positive integer or None, got {cutoff!r}")
    reciprocal = 1.0 / r
    if cutoff is not None:
        reciprocal[r > cutoff] = 0.0
    return float(reciprocal.mean())


def recall_at(ranks: torch.Tensor | Sequence[int], k: int) -> float:
    """Share of queries whose match ranks in the top `k` (R@K)."""
    r = _check_ranks(ranks)
    if int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return float((r <= k).mean())


def median_rank(ranks: torch.Tensor | Sequence[int]) -> float:
    """Median rank (MedR); for an even count the mean of the two middle ranks."""
    return float(np.median(_check_ranks(ranks)))


def _check_retrieval(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Validate a score matrix and its match columns; return `positive` as a long tensor on scores' device."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a floating 2-D tensor [Q, N], got "
                         f"{getattr(scores, 'dtype', type(scores))} {getattr(scores, 'shape', '')}")
    if scores.shape[1] == 0:
        raise ValueError("scores has no candidates (N = 0)")
    if not isinstance(positive, torch.Tensor) or positive.dim() != 1 or len(positive) != len(scores):
        raise ValueError(f"positive must be a 1-D tensor with one entry per query ({len(scores)}), "
                         f"got {getattr(positive, 'shape', type(positive))}")
    if positive.is_floating_point() or positive.is_complex() or positive.dtype == torch.bool:
        raise ValueError(f"positive must hold integer column indices, got {positive.dtype}")
    if len(positive) and (positive.min() < 0 or positive.max() >= scores.shape[1]):
        raise ValueError(f"positive indices must lie in [0, {scores.shape[1]}), got range "
                         f"[{int(positive.min())}, {int(positive.max())}]")
    if torch.isnan(scores).any():
        raise ValueError("scores hold NaN values")
    return positive.to(scores.device, torch.long)


def _check_ranks(ranks) -> np.ndarray:
    """Ranks as a float64 array: non-empty, integers >= 1."""
    r = _as_array(ranks, "ranks")
    if r.ndim != 1 or len(r) == 0:
        raise ValueError(f"ranks must be a non-empty 1-D sequence, got shape {r.shape}")
    if not (np.isfinite(r).all() and (r >= 1).all() and (r == np.round(r)).all()):
        raise ValueError("ranks must be integers >= 1 (1 = best)")
    return r


# ------------------------------------------------------------------------------------------- correlation

def spearman(x, y) -> float:
    """Spearman's rank correlation of two equally long sequences, ties given average ranks."""
    x, y = _as_array(x, "x"), _as_array(y, "y")
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must be 1-D and equally long, got shapes {x.shape} and {y.shape}")
    if len(x) < 2:
        raise ValueError(f"Spearman's rho needs at least 2 pairs, got {len(x)}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite (no NaN or inf)")
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = np.sqrt((rx @ rx) * (ry @ ry))
    if denominator == 0:
        raise ValueError("Spearman's rho is undefined when x or y is constant")
    return float(np.clip((rx @ ry) / denominator, -1.0, 1.0))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks; a run of equal values shares the mean of the positions it covers."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts_run = np.r_[True, ordered[1:] != ordered[:-1]]
    run = np.cumsum(starts_run) - 1                     # run id of each sorted position
    first = np.flatnonzero(starts_run)                  # 0-based first position of each run
    last = np.r_[first[1:], len(values)]                # one past its last position
    average = (first + 1 + last) / 2.0                  # mean of the 1-based positions first+1 .. last
    result = np.empty(len(values))
    result[order] = average[run]
    return result


def _as_array(values, name: str) -> np.ndarray:
    """A float64 numpy copy of a tensor, array or sequence."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    try:
        return np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be numeric: {error}") from None


# ------------------------------------------------------------------------------------------- representations

def knn_accuracy(features: torch.Tensor, labels: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor,
                 k: int = 200, temperature: float = 0.1, block_size: int | None = None) -> float:
    """Share of `features` [Q, D] whose weighted kNN vote over `bank` [N, D] gives their `labels` [Q].

    Features are L2-normalised here, so similarities are cosines. Query q takes its k most similar bank rows
    (among equal similarities, the lower bank index first), each adds exp(cos/temperature) to the score of its
    label in `bank_labels` [N], and the predicted class is the highest-scoring one (on a tie, the smallest
    label). k=200, temperature=0.1 as in the MoCo CIFAR-10 demo. `block_size` queries are scored at a time.
    """
    if features.dim() != 2 or bank.dim() != 2 or features.shape[1] != bank.shape[1]:
        raise ValueError(f"features [Q, D] and bank [N, D] must share D, got {tuple(features.shape)} and "
                         f"{tuple(bank.shape)}")
    if not len(features):
        raise ValueError("no features to score: an accuracy over no queries is undefined")
    if labels.shape != (len(features),) or bank_labels.shape != (len(bank),):
        raise ValueError("labels and bank_labels need one entry per row of features and bank")
    if any(y.dtype.is_floating_point or y.dtype == torch.bool or (len(y) and y.min() < 0)
           for y in (labels, bank_labels)):
        raise ValueError(f"labels and bank_labels must be integer class indices ≥ 0 (dtypes {labels.dtype}, "
                         f"{bank_labels.dtype})")
    if not (torch.isfinite(features).all() and torch.isfinite(bank).all()):
        raise ValueError("features and bank must be finite (no NaN or inf)")
    if not 1 <= k <= len(bank):
        raise ValueError(f"k must lie in 1..{len(bank)} (the bank's rows), got {k}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    features, bank = torch.nn.functional.normalize(features, dim=1), torch.nn.functional.normalize(bank, dim=1)
    classes = int(max(labels.max(), bank_labels.max())) + 1
    block_size = block_size or max(1, BLOCK_ELEMENTS // len(bank))
    correct = 0
    for start in range(0, len(features), block_size):
        similarity = features[start:start + block_size] @ bank.T
        top, index = similarity.sort(dim=1, descending=True, stable=True)
        votes = torch.zeros(len(similarity), classes, dtype=similarity.dtype, device=similarity.device)
        votes.scatter_add_(1, bank_labels[index[:, :k]], (top[:, :k] / temperature).exp())
        correct += (votes.argmax(dim=1) == labels[start:start + block_size]).sum().item()
    return correct / len(features)
