"""Global Contrastive Batch Sampling (GCBS): batches that hold each other's hard negatives.

Sachidananda, Yang and Zhu (ICML 2023) reorder the training set at each epoch start. With N positive pairs
embedded as z1 (anchors) and z2 (positives), unit rows, and the cosine similarities S = z1 z2ᵀ:

1. keep the pairs (i, j), i ≠ j, whose S_ij is above the q-quantile of the N(N−1) off-diagonal similarities
   as an undirected graph (the diagonal holds the positive pairs: they are no edges);
2. order the items by reverse Cuthill–McKee (RCM), which keeps the graph's bandwidth small, so both ends of an
   edge land close together in the order, hence mostly in one batch;
3. cut the order into batches and shuffle the batch order.

S is computed in row blocks and never held whole, on the embeddings' device: blocks of `BLOCK_ELEMENTS` entries
on the CPU, sized to the free memory on a GPU. Step 1 takes one pass over S: a row sample bounds the quantile
from below, the pass keeps the entries above that bound (the candidate edges), and an exact selection among
them gives the threshold (no sort of S, no `torch.quantile`). Under `torch.distributed` every rank computes its
own row blocks and the ranks share counts, histograms and edge lists.
`loss_gap`, `topk_batch_share` and `bandwidth` measure what an order achieves.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Literal, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.sparse.csgraph import reverse_cuthill_mckee
from torch import nn
from torch.utils.data import Sampler
from tqdm import tqdm

from gcbs_lib.seeding import generator, stream_seed

BLOCK_ELEMENTS = 2**22  # similarity entries held at once on the CPU: 16 MiB of float32
DEVICE_BYTES_PER_ENTRY, DEVICE_MAX_ELEMENTS = 8, 2**30  # GPU blocks: bytes per entry budgeted, largest block
SAMPLE_ROWS = 256  # rows of S sampled to bound the quantile from below before the pass
CONFIDENCE = 6.0  # margin of that bound, in standard errors of the sample's estimate

LastBatch = Literal["drop", "pad"]


# ------------------------------------------------------------------------------------------- inputs

def _check_pairs(z1: torch.Tensor, z2: torch.Tensor) -> int:
    """Check a pair of embedding matrices [N, d] (same shape, not empty, finite) and return N."""
    for name, z in (("z1", z1), ("z2", z2)):
        if not isinstance(z, torch.Tensor) or z.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [N, d], got {getattr(z, 'shape', type(z))}")
    if z1.shape != z2.shape:
        raise ValueError(f"z1 and z2 must have the same shape, got {tuple(z1.shape)} and {tuple(z2.shape)}")
    if z1.device != z2.device:
        raise ValueError(f"z1 and z2 must be on the same device, got {z1.device} and {z2.device}")
    if z1.numel() == 0:
        raise ValueError(f"empty embeddings: shape {tuple(z1.shape)}")
    for name, z in (("z1", z1), ("z2", z2)):
        if not _all_finite(z):
            raise ValueError(f"{name} holds NaN or inf values")
    return len(z1)


def _all_finite(z: torch.Tensor) -> bool:
    """Whether every entry of z is finite (on the CPU numpy checks float32 several times faster than torch)."""
    if z.device.type == "cpu" and z.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(z.detach().numpy()).all())
    return bool(torch.isfinite(z).all())


def _unit_rows(z1: torch.Tensor, z2: torch.Tensor, dtype=torch.float32,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Checked embeddings with unit rows, in `dtype`, on `device`."""
    _check_pairs(z1, z2)
    return tuple(F.normalize(z.detach().to(device, dtype), dim=1).contiguous() for z in (z1, z2))


def _check_quantile(quantile: float) -> None:
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must lie in (0, 1), got {quantile}")


def _check_last_batch(last_batch: str) -> None:
    if last_batch not in ("drop", "pad"):
        raise ValueError(f"last_batch must be 'drop' or 'pad', got {last_batch!r}")


def _check_batch_size(batch_size: int, n: int) -> None:
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be between 1 and N = {n} (N smaller than a batch?), got {batch_size}")


# ------------------------------------------------------------------------------- similarity blocks

def _block_rows(n: int, device: torch.device, world_size: int) -> int:
    """Rows per similarity block: `BLOCK_ELEMENTS` entries on the CPU; on a GPU as many as a quarter of its free
    memory holds at `DEVICE_BYTES_PER_ENTRY` (the block, its masks, its kept indices), the fewest over the ranks."""
    if device.type != "cuda":
        return max(1, BLOCK_ELEMENTS // n)
    free, _ = torch.cuda.mem_get_info(device)
    rows = max(1, min(free // 4 // DEVICE_BYTES_PER_ENTRY, DEVICE_MAX_ELEMENTS) // n)
    return int(_all_reduce(np.array([rows]), world_size, dist.ReduceOp.MIN)[0])


def row_blocks(n: int, rank: int = 0, world_size: int = 1, rows: int | None = None) -> list[range]:
    """This rank's contiguous share of the row blocks (`rows` each, default `BLOCK_ELEMENTS // n`) of an n×n matrix.

    The blocks lie on one grid whatever the world size, so every entry comes out of the same matrix product
    in one process or in many: the similarities, hence the graph and the order, are bitwise the same.
    """
    rows = rows or max(1, BLOCK_ELEMENTS // n)
    starts = range(0, n, rows)
    per_rank = math.ceil(len(starts) / world_size)
    return [range(s, min(s + rows, n)) for s in starts[rank * per_rank:(rank + 1) * per_rank]]


def _blocks(u1: torch.Tensor, u2: torch.Tensor, rank: int, world_size: int) -> Iterator[tuple[range, torch.Tensor]]:
    """(rows, S[rows]) for this rank's row blocks of unit rows u1, u2, on their device: float32, diagonal −inf."""
    for rows in row_blocks(len(u1), rank, world_size, _block_rows(len(u1), u1.device, world_size)):
        block = u1[rows.start:rows.stop] @ u2.T
        block.diagonal(rows.start).fill_(-math.inf)
        yield rows, block


def similarity_blocks(z1, z2, rank: int = 0, world_size: int = 1) -> Iterator[tuple[range, np.ndarray]]:
    """Yield (rows, S[rows]) for this rank's row blocks: cosine similarities in float32, diagonal set to −inf."""
    for rows, block in _blocks(*_unit_rows(z1, z2, device=z1.device), rank, world_size):
        yield rows, block.cpu().numpy()


def _all_reduce(values: np.ndarray, world_size: int, op=dist.ReduceOp.SUM) -> np.ndarray:
    """`values` reduced over the ranks of the default process group (as is in one process; on the GPU for NCCL)."""
    if world_size == 1:
        return values
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op)
    return tensor.cpu().numpy()


def _in_range(block: torch.Tensor, lo: float, below: float) -> tuple[np.ndarray, np.ndarray]:
    """Flat (row-major) indices and values, on the CPU, of the block's entries s with lo ≤ s < below."""
    if block.is_cuda:
        flat = ((block >= lo) & (block < below)).view(-1).nonzero().squeeze(1)
        return flat.cpu().numpy(), block.view(-1)[flat].cpu().numpy()
    values = block.numpy().ravel()
    keep = values >= lo
    if below < math.inf:
        keep &= values < below
    flat = np.flatnonzero(keep)
    return flat, values[flat]


def _similarities_in(u1, u2, lo: float, below: float, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One pass over this rank's row blocks: the entries lo ≤ S_ij < below, as flat indices i·N + j in row-major
    order and float32 values (lo and below are float32 numbers or ±inf, so the comparisons are exact)."""
    n = len(u1)
    flats, values = [np.zeros(0, np.int64)], [np.zeros(0, np.float32)]
    for rows, block in _blocks(u1, u2, rank, world_size):
        flat, value = _in_range(block, lo, below)
        flats.append(flat + rows.start * n)
        values.append(value)
    return np.concatenate(flats), np.concatenate(values)


# ------------------------------------------------------------- exact quantile in one pass over S
# A row sample gives a lower bound `lo` on the threshold that holds with overwhelming probability. One pass over
# S keeps every entry ≥ lo: these are the candidate edges, and the exact order statistics lie among them, since
# the number of entries below lo is known (N² minus the kept ones, over all ranks). A radix selection on the
# candidates' float32 bit patterns finds them: a float32 is two uint16 halves, the high one holding sign,
# exponent and 7 mantissa bits, and sorting floats is sorting (high, low) pairs, both orders reversed for
# negative numbers. So a 65,536-bin histogram of the high halves finds the bin of the k-th smallest value, and
# one of the low halves inside that bin finds the value. If the bound missed (never seen so far), a further
# pass keeps the entries between a lower bound and the previous one; `GCBSOrder.passes` counts the passes.

_HIGH = 1 if np.little_endian else 0
_BINS = 1 << 16
_HIGH_IN_VALUE_ORDER = np.concatenate([np.arange(_BINS - 1, _BINS // 2 - 1, -1), np.arange(_BINS // 2)])


def _halves(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pairs = values.view(np.uint16).reshape(-1, 2)
    return pairs[:, _HIGH], pairs[:, 1 - _HIGH]


def _locate(counts: np.ndarray, k: int) -> tuple[int, int]:
    """The bin holding the k-th smallest (0-based) of histogrammed values, and k's rank inside that bin."""
    cumulative = np.cumsum(counts)
    b = int(np.searchsorted(cumulative, k, side="right"))
    return b, k - int(cumulative[b - 1] if b else 0)


def _order_statistics(values: np.ndarray, ranks: Sequence[int], world_size: int) -> list[float]:
    """Exact values of the given 0-based ranks among the float32 `values` of all ranks together."""
    high_half, low_half = _halves(values)
    high = _all_reduce(np.bincount(high_half, minlength=_BINS), world_size)[_HIGH_IN_VALUE_ORDER]
    found = []
    for b, k in [_locate(high, k) for k in ranks]:
        h = int(_HIGH_IN_VALUE_ORDER[b])
        low = _all_reduce(np.bincount(low_half[high_half == h], minlength=_BINS), world_size)
        positive = h < _BINS // 2
        l, _ = _locate(low if positive else low[::-1], k)
        bits = np.array([(h << 16) | (l if positive else _BINS - 1 - l)], np.uint32)
        found.append(float(bits.view(np.float32)[0]))
    return found


def _sample_bound(sample: np.ndarray, n: int, need: int, confidence: float) -> float:
    """The largest sampled value x for which the estimated count of entries ≥ x in all of S exceeds `need` by
    `confidence` standard errors (plus `confidence`·√need), or −inf. `sample`: r full rows of S, flattened.

    The estimate is N times the mean count per sampled row; its standard error is finite-population corrected,
    so a sample of every row has none. The √need term covers rounding differences between the sample's matrix
    product and the pass's.
    """
    size, r = sample.size, sample.size // n
    scale = n * math.sqrt(max(0.0, 1 - r / n) / r)
    expected = max(1.0, need * r / n)  # sample entries ≥ the threshold, on average
    k = min(size, 2 * math.ceil(expected) + 64)
    while True:
        top = np.argpartition(sample, size - k)[size - k:]
        top = top[np.argsort(sample[top], kind="stable")[::-1]]
        negated, owners = -sample[top], top // n  # negated values ascend
        for p in np.unique(np.geomspace(expected, k, 64).astype(np.int64)):
            x = -negated[p - 1]
            if x == -math.inf:
                break
            counts = np.bincount(owners[:np.searchsorted(negated, -x, side="right")], minlength=r)
            if n * counts.mean() - confidence * (scale * counts.std(ddof=1) + math.sqrt(need)) >= need:
                return float(x)
        if k == size:
            return -math.inf
        k = min(size, 4 * k)


def _lower_bounds(u1, u2, need: int, world_size: int) -> Iterator[float]:
    """Decreasing lower bounds (float32 numbers, then −inf) on the value that `need` entries of S reach or exceed.

    From `SAMPLE_ROWS` random rows of S: the first bound keeps `CONFIDENCE` standard errors of margin, each next
    one 4× more. The smallest over the ranks, so that all ranks pass over S alike.
    """
    n = len(u1)
    rng = np.random.default_rng(stream_seed(0, 0, "gcbs-quantile-sample"))
    rows = torch.from_numpy(np.sort(rng.choice(n, min(n, SAMPLE_ROWS), replace=False))).to(u1.device)
    sample = u1[rows] @ u2.T
    sample[torch.arange(len(rows), device=u1.device), rows] = -math.inf
    sample = sample.cpu().numpy().ravel()
    previous = math.inf
    for confidence in (CONFIDENCE, 4 * CONFIDENCE, 16 * CONFIDENCE):
        bound = float(_all_reduce(np.array([_sample_bound(sample, n, need, confidence)]), world_size,
                                  dist.ReduceOp.MIN)[0])
        if bound < previous:
            yield bound
            previous = bound
    if previous > -math.inf:
        yield -math.inf


def _lerp(a: float, b: float, t: float) -> float:
    """Interpolate between neighbours a ≤ b from the nearer end, as numpy's quantile does."""
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


@dataclass
class _Candidates:
    """This rank's entries of S at or above a lower bound of the threshold (flat indices i·N + j, row-major, and
    values), the exact threshold, and the passes over S it took."""

    flat: np.ndarray
    values: np.ndarray
    threshold: float
    passes: int


def _quantile_pass(z1, z2, quantile: float, rank: int, world_size: int) -> _Candidates:
    """The exact off-diagonal `quantile` of S and the candidate edges, in one pass over S (see above)."""
    _check_quantile(quantile)
    u1, u2 = _unit_rows(z1, z2, device=z1.device)
    n = len(u1)
    if n < 2:
        raise ValueError(f"need at least 2 items for an off-diagonal similarity, got N = {n}")
    m = n * (n - 1)
    position = (m - 1) * quantile
    below = math.floor(position)
    ranks = [n + below, n + min(below + 1, m - 1)]  # the N diagonal −inf entries come first
    need = n * n - ranks[0]
    flats, values, passes, upper = [], [], 0, math.inf
    for lo in _lower_bounds(u1, u2, need, world_size):
        flat, value = _similarities_in(u1, u2, lo, upper, rank, world_size)
        flats.append(flat)
        values.append(value)
        passes, upper = passes + 1, lo
        kept = int(_all_reduce(np.array([sum(len(v) for v in values)]), world_size)[0])
        if kept >= need:
            break
    flat, value = np.concatenate(flats), np.concatenate(values)
    if passes > 1:  # back to row-major order
        order = np.argsort(flat, kind="stable")
        flat, value = flat[order], value[order]
    a, b = _order_statistics(value, [r - (n * n - kept) for r in ranks], world_size)
    return _Candidates(flat, value, _lerp(a, b, position - below), passes)


def offdiagonal_quantile(z1, z2, quantile: float, *, rank: int = 0, world_size: int = 1) -> float:
    """Exact `quantile` of the N(N−1) off-diagonal cosine similarities, by numpy's default rule.

    numpy's 'linear' method (Hyndman–Fan type 7): sort the M values as float32 x_0 ≤ … ≤ x_{M−1}, take the
    position h = (M−1)·q and interpolate between x_⌊h⌋ and x_⌊h⌋+1 in float64, so the result equals
    `np.quantile(offdiagonal.astype(np.float64), q)`. One pass over S in row blocks (see above); with
    world_size > 1 (torch.distributed initialised) every rank passes over its own row blocks, the ranks share
    counts and histograms, and every rank gets the same value.
    """
    return _quantile_pass(z1, z2, quantile, rank, world_size).threshold


# ------------------------------------------------------------------------------------------ graph

def _float32_at_most(x: float) -> np.float32:
    """The largest float32 ≤ x: for float32 s, `s > it` holds exactly when s > x."""
    y = np.float32(x)
    return np.nextafter(y, np.float32(-np.inf)) if y > x else y


def _above(flat: np.ndarray, values: np.ndarray, threshold: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The (rows, columns) of the entries whose value lies above `threshold`."""
    return np.divmod(flat[values > _float32_at_most(threshold)], n)


def _top_columns(block: np.ndarray, k: int) -> np.ndarray:
    """Each row's k most similar columns (in no particular order)."""
    return np.argpartition(block, -k, axis=1)[:, -k:]


def graph_rows(z1, z2, *, threshold: float | None = None, top_k: int | None = None,
               rank: int = 0, world_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """This rank's edges (rows, columns) of the similarity graph, from its row blocks of S.

    Give exactly one rule: `threshold` keeps S_ij > threshold; `top_k` keeps each row's k most similar columns
    (the graph for large N: k·N edges whatever the spread of S). The diagonal is never an edge. The edge lists
    of all ranks together make the graph: gather them and pass them to `edges_to_graph`.
    """
    if (threshold is None) == (top_k is None):
        raise ValueError("give exactly one of threshold and top_k")
    u1, u2 = _unit_rows(z1, z2, device=z1.device)
    n = len(u1)
    if threshold is not None:
        lo = float(np.nextafter(_float32_at_most(threshold), np.float32(np.inf)))  # s > threshold ⇔ s ≥ lo
        return _above(*_similarities_in(u1, u2, lo, math.inf, rank, world_size), threshold, n)
    if not 1 <= top_k < n:
        raise ValueError(f"top_k must be between 1 and N − 1 = {n - 1}, got {top_k}")
    rows, cols = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for block_rows, block in _blocks(u1, u2, rank, world_size):
        rows.append(np.repeat(np.arange(len(block_rows)), top_k) + block_rows.start)
        cols.append(_top_columns(block.cpu().numpy(), top_k).ravel())
    return np.concatenate(rows), np.concatenate(cols)


def edges_to_graph(rows: np.ndarray, cols: np.ndarray, n: int) -> sp.csr_matrix:
    """The undirected graph of an off-diagonal edge list: a symmetric n×n boolean CSR matrix."""
    directed = sp.csr_matrix((np.ones(len(rows), bool), (rows, cols)), shape=(n, n))
    return (directed + directed.T).tocsr()


def _gather_edges(rows: np.ndarray, cols: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's edge lists, concatenated in rank order, on every rank (as is in one process)."""
    if world_size == 1:
        return rows, cols
    parts = [None] * world_size
    dist.all_gather_object(parts, (rows, cols))
    return np.concatenate([r for r, _ in parts]), np.concatenate([c for _, c in parts])


def rcm_order(graph: sp.csr_matrix, seed: int | None = None) -> torch.Tensor:
    """The reverse Cuthill–McKee order of a symmetric graph, after a seeded random relabelling of its nodes.

    RCM breaks ties by node index and puts isolated nodes last: without the relabelling the isolated nodes,
    and the visiting order inside each component, would follow the data's index order at every epoch.
    """
    relabel = np.random.default_rng(seed).permutation(graph.shape[0])
    order = reverse_cuthill_mckee(graph[relabel][:, relabel].tocsr(), symmetric_mode=True)
    return torch.from_numpy(relabel[order].astype(np.int64))


# -------------------------------------------------------------------------------------- the order

@dataclass
class StageTimes:
    """Seconds spent in each stage of one GCBS epoch start: 'similarity' is the pass over S that finds the
    threshold and the candidate edges, 'graph' keeps the edges and builds the sparse graph."""

    embed: float = 0.0
    similarity: float = 0.0
    graph: float = 0.0
    rcm: float = 0.0

    @property
    def total(self) -> float:
        return self.embed + self.similarity + self.graph + self.rcm


@dataclass
class GCBSOrder:
    """A GCBS order with what produced it: the undirected graph, the threshold (None in top-k mode), the
    number of directed edges (row i, column j) kept before symmetrising, the stage times, the passes over S
    (1 unless the sampled bound missed) and the candidate entries the pass kept (all ranks together)."""

    order: torch.Tensor
    graph: sp.csr_matrix
    threshold: float | None
    edges: int
    times: StageTimes = field(default_factory=StageTimes)
    passes: int = 1
    candidates: int = 0


class _Stopwatch:
    """Seconds between successive `lap()` calls."""

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


def gcbs_order(z1, z2, quantile: float = 0.999, seed: int | None = None, *, top_k: int | None = None,
               rank: int = 0, world_size: int = 1) -> GCBSOrder:
    """The GCBS order of N pairs, with its graph, threshold and stage times (see `gcbs_permutation`).

    `top_k` switches to the top-k-per-row graph (for large N); `quantile` is then unused. With world_size > 1
    (torch.distributed initialised, every rank holding the same z1, z2 and seed) each rank computes its own
    row blocks, the ranks share counts, histograms and edge lists, and every rank returns the single-process
    order. Embeddings on a GPU keep the similarity work there.
    """
    if world_size > 1 and seed is None:
        raise ValueError("give a seed with world_size > 1, so that every rank relabels the graph alike")
    clock, times = _Stopwatch(), StageTimes()
    if top_k is None:
        found = _quantile_pass(z1, z2, quantile, rank, world_size)
        threshold, passes = found.threshold, found.passes
        candidates = int(_all_reduce(np.array([len(found.values)]), world_size)[0])
        times.similarity = clock.lap()
        rows, cols = _above(found.flat, found.values, threshold, len(z1))
    else:
        threshold, passes, candidates = None, 1, 0
        rows, cols = graph_rows(z1, z2, top_k=top_k, rank=rank, world_size=world_size)
        times.similarity = clock.lap()
    rows, cols = _gather_edges(rows, cols, world_size)
    graph = edges_to_graph(rows, cols, len(z1))
    times.graph = clock.lap()
    order = rcm_order(graph, seed)
    times.rcm = clock.lap()
    return GCBSOrder(order, graph, threshold, len(rows), times, passes, candidates)


def gcbs_permutation(z1, z2, quantile: float = 0.999, seed: int | None = None) -> torch.Tensor:
    """The GCBS permutation of N pairs: RCM order of the off-diagonal similarity graph above `quantile`.

    z1, z2: [N, d] embeddings of the two sides of each pair (normalised here). Edges: S_ij above the exact
    off-diagonal quantile, i ≠ j. Returns a LongTensor permutation of range(N) after the seeded relabelling,
    not yet cut into batches (`cut_batches` and `GCBSBatchSampler` cut it and shuffle the batch order).
    """
    return gcbs_order(z1, z2, quantile, seed).order


# ------------------------------------------------------------------------------------------ batches

def _batch_sizes(n: int, batch_size: int) -> list[int]:
    """Sizes of the consecutive batches of n items: batch_size each, the last one maybe shorter."""
    return [min(batch_size, n - start) for start in range(0, n, batch_size)]


def _gale_ryser_slack(keys_with_count: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """slack[t−1] = Σ_keys min(count, t) − (the t largest sizes, summed), for t = 1 … len(sizes).

    `keys_with_count[c]` is the number of keys with c items. By the Gale–Ryser theorem the items fit batches
    of these sizes, one item per key and batch, exactly when no slack is negative.
    """
    t = np.arange(1, len(sizes) + 1)
    counts = np.arange(len(keys_with_count))[:, None]
    capacity = (keys_with_count[:, None] * np.minimum(counts, t)).sum(axis=0)
    return capacity - np.cumsum(sorted(sizes, reverse=True))


def _fill(size: int, queue: deque, keys: Sequence[Hashable], left: Counter, slack: np.ndarray) -> list[int]:
    """Take `size` items with distinct keys from the front of `queue`, in order, passing over any item whose key
    is in the batch already or would leave the later batches unfillable (a key with c items left uses up one
    slack at every t ≥ c). Passed-over items go back to the front of the queue, in order."""
    batch, seen, passed = [], set(), []
    while len(batch) < size:
        i = queue.popleft()
        key = keys[i]
        if key in seen or (slack[left[key] - 1:] < 1).any():
            passed.append(i)
        else:
            batch.append(i)
            seen.add(key)
            slack[left[key] - 1:] -= 1
    queue.extendleft(reversed(passed))
    return batch


def separate_duplicates(order: torch.Tensor, keys: Sequence[Hashable], batch_size: int) -> torch.Tensor:
    """Reorder so that no batch (consecutive block of `batch_size`) holds two items with the same key.

    Identical texts embed alike, so RCM puts them side by side, and in one batch they are false negatives.
    Batches are filled in order from the front of the order; an item waits for a later batch only when its key
    is already in the batch or taking it now would leave the later batches unfillable (checked with the
    Gale–Ryser condition, so the filling never gets stuck). Raises ValueError when no such order exists.
    """
    order = [int(i) for i in order]
    sizes = _batch_sizes(len(order), batch_size)
    left = Counter(keys[i] for i in order)
    keys_with_count = np.bincount(list(left.values()))
    if (_gale_ryser_slack(keys_with_count, sizes) < 0).any():
        raise ValueError(f"no order of these keys has distinct keys in every batch of {batch_size} "
                         f"(a key occurs up to {max(left.values())} times, in {len(sizes)} batches)")
    queue, result = deque(order), []
    for b, size in enumerate(sizes):
        batch = _fill(size, queue, keys, left, _gale_ryser_slack(keys_with_count, sizes[b + 1:]))
        for key in (keys[i] for i in batch):
            keys_with_count[left[key]] -= 1
            keys_with_count[left[key] - 1] += 1
            left[key] -= 1
        result += batch
    return torch.tensor(result, dtype=torch.long)


def _pad(batch: list[int], items: list[int], batch_size: int, keys: Sequence[Hashable] | None) -> list[int]:
    """Fill a short batch with the first items of the order that it does not hold (nor their keys)."""
    key = (lambda i: i) if keys is None else keys.__getitem__
    batch, seen = list(batch), {key(i) for i in batch}
    for i in items:
        if len(batch) == batch_size:
            return batch
        if key(i) not in seen:
            batch.append(i)
            seen.add(key(i))
    raise ValueError(f"too few distinct keys to pad the last batch to {batch_size}")


def cut_batches(order: torch.Tensor, batch_size: int, last_batch: LastBatch,
                keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Cut an order into consecutive batches of `batch_size` (with distinct keys per batch if `keys` is given).

    A shorter last batch is dropped (`last_batch="drop"`) or filled up (`"pad"`) with the first items of the
    order that it does not hold yet; there is no default, so the choice stays visible.
    """
    _check_last_batch(last_batch)
    _check_batch_size(batch_size, len(order))
    if keys is not None:
        order = separate_duplicates(order, keys, batch_size)
    items = [int(i) for i in order]
    batches = [items[start:start + batch_size] for start in range(0, len(items), batch_size)]
    if len(batches[-1]) < batch_size:
        batches[-1:] = [] if last_batch == "drop" else [_pad(batches[-1], items, batch_size, keys)]
    return batches


def embed_all(embed: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], num_items: int,
              batch_size: int = 1024, model: nn.Module | None = None,
              progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed items 0 … num_items−1 with `embed(indices) -> (z1, z2)`, batch by batch, without gradients.

    `model`, if given, is in eval mode meanwhile (no dropout) and gets its previous mode back afterwards.
    """
    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    try:
        with torch.no_grad():
            chunks = torch.arange(num_items).split(batch_size)
            parts = [embed(idx) for idx in tqdm(chunks, desc="GCBS embed", disable=not progress)]
    finally:
        if model is not None:
            model.train(was_training)
    return torch.cat([z1 for z1, _ in parts]), torch.cat([z2 for _, z2 in parts])


def _in_process_group(world_size: int) -> bool:
    """Whether torch.distributed runs with this world size, so the ranks can share the GCBS work."""
    return world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


class GCBSBatchSampler(Sampler[list[int]]):
    """A DataLoader `batch_sampler` whose batches hold each other's hard negatives, re-ordered every epoch.

    Each `iter()` (one epoch) embeds all items with `embed(indices) -> (z1, z2)` (see `embed_all`), computes
    the GCBS order, keeps duplicate `keys` apart, cuts global batches of `batch_size`, drops or pads the last
    one (`last_batch`), shuffles the batch order and yields this rank's contiguous slice of each global batch:
    `batch_size // world_size` indices. The relabelling and the shuffle draw from the streams
    `stream_seed(seed, epoch, RELABEL_STREAM)` and `(..., SHUFFLE_STREAM)`, so no (seed, epoch) pair repeats
    another's batches. Call `set_epoch` before each epoch, as with DistributedSampler. Under torch.distributed
    the ranks share the similarity work (`gcbs_order`).

    After an epoch has started: `last` is its `GCBSOrder` (`times.embed` included), `batches` its global
    batches in the order trained, `embeddings` the (z1, z2) they were ordered by, and `loss_gap(temperature)`
    the gap of exactly those batches.
    """

    RELABEL_STREAM, SHUFFLE_STREAM = "gcbs-relabel", "gcbs-batch-shuffle"

    def __init__(self, embed: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], num_items: int,
                 batch_size: int, last_batch: LastBatch, *, quantile: float = 0.999, top_k: int | None = None,
                 keys: Sequence[Hashable] | None = None, model: nn.Module | None = None,
                 embed_batch_size: int = 1024, seed: int = 0, rank: int = 0, world_size: int = 1,
                 progress: bool = True):
        _check_batch_size(batch_size, num_items)
        _check_quantile(quantile)
        _check_last_batch(last_batch)
        if batch_size % world_size:
            raise ValueError(f"the global batch_size {batch_size} must divide by world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if keys is not None and len(keys) != num_items:
            raise ValueError(f"{len(keys)} keys for {num_items} items")
        self.embed, self.num_items, self.batch_size, self.last_batch = embed, num_items, batch_size, last_batch
        self.quantile, self.top_k, self.keys, self.model = quantile, top_k, keys, model
        self.embed_batch_size, self.seed, self.rank, self.world_size = embed_batch_size, seed, rank, world_size
        self.progress, self.epoch = progress, 0
        self.last, self.batches, self.embeddings = None, [], None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        batches = self.num_items / self.batch_size
        return math.ceil(batches) if self.last_batch == "pad" else math.floor(batches)

    def __iter__(self) -> Iterator[list[int]]:
        clock = _Stopwatch()
        z1, z2 = embed_all(self.embed, self.num_items, self.embed_batch_size, self.model, self.progress)
        embed_time = clock.lap()
        shared = _in_process_group(self.world_size)
        relabel = stream_seed(self.seed, self.epoch, self.RELABEL_STREAM)
        self.last = gcbs_order(z1, z2, self.quantile, relabel, top_k=self.top_k,
                               rank=self.rank if shared else 0, world_size=self.world_size if shared else 1)
        self.last.times.embed = embed_time
        batches = cut_batches(self.last.order, self.batch_size, self.last_batch, self.keys)
        shuffle = torch.randperm(len(batches), generator=generator(self.seed, self.epoch, self.SHUFFLE_STREAM))
        self.batches, self.embeddings = [batches[b] for b in shuffle.tolist()], (z1, z2)
        part = self.batch_size // self.world_size
        for batch in self.batches:
            yield batch[self.rank * part:(self.rank + 1) * part]

    def loss_gap(self, temperature: float) -> float:
        """The exact loss gap of the latest epoch's global batches, as trained (see `batches_loss_gap`)."""
        if self.embeddings is None:
            raise RuntimeError("no epoch has started yet: iterate over the sampler first")
        return batches_loss_gap(*self.embeddings, self.batches, temperature)


# -------------------------------------------------------------------------------------- diagnostics

def batch_ids(order, n: int, batch_size: int) -> torch.Tensor:
    """batch_of[i]: the batch of item i when the permutation `order` of range(n) is cut into `batch_size`."""
    order = torch.as_tensor(order, dtype=torch.long)
    if not torch.equal(order.sort().values, torch.arange(n)):
        raise ValueError(f"order must be a permutation of range({n})")
    _check_batch_size(batch_size, n)
    batch_of = torch.empty(n, dtype=torch.long)
    batch_of[order] = torch.arange(n) // batch_size
    return batch_of


def loss_gap(z1, z2, order, batch_size: int, temperature: float) -> float:
    """Exact L^Global − L^Train of InfoNCE over the batches that `order` makes (consecutive, last maybe shorter).

    With cosine similarities S = ẑ1ẑ2ᵀ and B(i) the batch of item i, the positive terms cancel:
        gap = (1/N) Σ_i [ log Σ_j e^{S_ij/τ} − log Σ_{j∈B(i)} e^{S_ij/τ} ]  ≥ 0.
    Computed in float64, a few batches at a time (`batches_loss_gap`).
    """
    order = torch.as_tensor(order, dtype=torch.long)
    batch_ids(order, _check_pairs(z1, z2), batch_size)  # checks the permutation and the batch size
    return batches_loss_gap(z1, z2, [b.tolist() for b in order.split(batch_size)], temperature)


def batches_loss_gap(z1, z2, batches: Sequence[Sequence[int]], temperature: float) -> float:
    """Exact L^Global − L^Train of InfoNCE over the given batches: the gap of the batches actually trained on.

    The mean over every (batch b, item i ∈ b) of log Σ_j e^{S_ij/τ} − log Σ_{j∈b} e^{S_ij/τ}: items left out
    (a dropped last batch) do not count, items in two batches (a padded last batch) count twice. The items of
    a batch must be distinct. Float64, in row chunks of about `BLOCK_ELEMENTS` similarities.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    z1, z2 = _unit_rows(z1, z2, torch.float64)
    n = len(z1)
    batches = [torch.as_tensor(b, dtype=torch.long).reshape(-1) for b in batches]
    if not batches or min(len(b) for b in batches) == 0:
        raise ValueError("need at least one batch, and no empty batch")
    if any(b.min() < 0 or b.max() >= n for b in batches):
        raise ValueError(f"batch indices must lie in [0, {n})")
    if any(len(b.unique()) != len(b) for b in batches):
        raise ValueError("an item occurs twice in one batch")
    total = 0.0
    for chunk in _group(batches, max(1, BLOCK_ELEMENTS // n)):
        members = torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True, padding_value=-1)
        members = members.repeat_interleave(torch.tensor([len(b) for b in chunk]), dim=0)  # row i: i's batch
        logits = z1[torch.cat(chunk)] @ z2.T / temperature
        in_batch = logits.gather(1, members.clamp(min=0)).masked_fill(members < 0, -math.inf)
        total += (logits.logsumexp(1) - in_batch.logsumexp(1)).sum().item()
    return total / sum(len(b) for b in batches)


def _group(batches: list[torch.Tensor], rows: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of batches holding at most `rows` items together (or a single larger batch)."""
    run, size = [], 0
    for batch in batches:
        if run and size + len(batch) > rows:
            yield run
            run, size = [], 0
        run.append(batch)
        size += len(batch)
    yield run


def topk_batch_share(z1, z2, order, batch_size: int, k: int = 10) -> float:
    """The share of each item's k most similar other items (by S_ij, j ≠ i) that land in its own batch.

    A random order gives about (batch_size − 1)/(N − 1); GCBS aims far higher.
    """
    n = _check_pairs(z1, z2)
    if not 1 <= k < n:
        raise ValueError(f"k must be between 1 and N − 1 = {n - 1}, got {k}")
    batch_of = batch_ids(order, n, batch_size).numpy()
    hits = 0
    for rows, block in similarity_blocks(z1, z2):
        hits += int((batch_of[_top_columns(block, k)] == batch_of[rows.start:rows.stop, None]).sum())
    return hits / (n * k)


def bandwidth(graph: sp.spmatrix, order) -> int:
    """The graph's bandwidth under an order: the largest distance in the order between the ends of an edge."""
    position = np.empty(graph.shape[0], np.int64)
    position[np.asarray(order)] = np.arange(graph.shape[0])
    edges = graph.tocoo()
    return int(np.abs(position[edges.row] - position[edges.col]).max(initial=0))


def synthetic_pairs(n: int, dim: int, clusters: int = 0, spread: float = 0.5, noise: float = 0.1,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Profiling embeddings: n pairs z1 ~ N(0, I) (clusters=0), or around `clusters` random N(0, I) centres
    with `spread` around each; z2 = z1 + `noise`·N(0, I). The random and clustered inputs of the GCBS profile."""
    generator = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, dim, generator=generator)
    if clusters:
        centres = torch.randn(clusters, dim, generator=generator)
        z1 = centres[torch.randint(clusters, (n,), generator=generator)] + spread * z1
    return z1, z1 + noise * torch.randn(n, dim, generator=generator)
