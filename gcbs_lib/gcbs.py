"""Global Contrastive Batch Sampling (GCBS): batches that hold each other's hard negatives.

Sachidananda, Yang and Zhu (ICML 2023) reorder the training set at each epoch start. With N pairs
embedded as z1, z2 (unit rows) and S = z1 z2ᵀ, the pairs (i, j) whose S_ij lies above a threshold
are the edges of a graph, and reverse Cuthill–McKee (RCM) orders the items so that both ends of an
edge land close together, hence mostly in one batch. Two orders, S taken in row blocks, never whole:

- `published_permutation`: the paper's minimal code, index for index (threshold: `statistics.median`
  of the quantiles of S's 10-row chunks, diagonal included; directed edges), the RCM order of
  `published_graph`; the trainer's controls: `without_group_edges` deletes same-group edges,
  `graph_order` orders a graph by RCM (its ties at random with `relabel`); `graph_diagnostics`
  says how many edges a graph has;
- `gcbs_permutation`, the kit's variant: the exact quantile of the off-diagonal S_ij (a sampled
  lower bound, one pass keeping the candidates), undirected edges, nodes relabelled at random.
`consecutive_batches` cuts an order into batches; `loss_gap` measures what an order achieves."""

import contextlib
import math
import statistics
from collections import deque
from typing import Hashable, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from scipy.sparse.csgraph import reverse_cuthill_mckee

from gcbs_lib.check import require
from gcbs_lib.distributed import gather_ragged, rank_and_world_size

BLOCK_ELEMENTS = 2**22  # similarities per block on the CPU: 16 MiB of float32
DEVICE_BLOCK_ELEMENTS = 2**27  # on a GPU: 512 MiB of float32
SAMPLE_ROWS = 256  # rows of S sampled for the lower bound on the threshold
NO_BOUND = -2.0  # below every cosine similarity
# a node's number in the edge lists: N < 2³¹ (an N × N scan of more would never end)
NODE = np.int32


def unit_rows(z1, z2, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """z1, z2 [N, d] checked (same shape and device, not empty, finite), as unit rows in `dtype`."""
    for name, z in (("z1", z1), ("z2", z2)):
        require(
            isinstance(z, torch.Tensor) and z.dim() == 2,
            f"{name} must be a 2-D tensor [N, d], got {getattr(z, 'shape', type(z))}",
        )
    require(
        z1.shape == z2.shape and z1.device == z2.device,
        f"z1 and z2 must have the same shape and device, got "
        f"{tuple(z1.shape)} on {z1.device} and {tuple(z2.shape)} on {z2.device}",
    )
    require(z1.numel(), f"empty embeddings: shape {tuple(z1.shape)}")

    u1, u2 = (F.normalize(z.detach().to(dtype), dim=1) for z in (z1, z2))
    # NaN/inf → a NaN row
    require(torch.isfinite(u1.sum() + u2.sum()), "the embeddings hold NaN or inf values")
    return u1, u2


def _check_batch_size(batch_size: int, n: int) -> None:
    require(
        isinstance(batch_size, int) and 1 <= batch_size <= n,
        f"batch_size must be an int in [1, N = {n}] (N smaller than a batch?), got {batch_size!r}",
    )


def _block_elements(device: torch.device) -> int:
    """Similarities held at once on `device`."""
    return DEVICE_BLOCK_ELEMENTS if device.type == "cuda" else BLOCK_ELEMENTS


def _blocks(u1: torch.Tensor, u2: torch.Tensor, keep_diagonal: bool = False, multiple: int = 1):
    """(first row, S[rows]) for consecutive blocks of S = u1 u2ᵀ of a `multiple` of rows (bar the
    last), float32 on the embeddings' device, the diagonal −inf unless kept; each block is
    overwritten by the next (copy what outlives it)."""
    n = len(u1)
    rows = max(multiple, _block_elements(u1.device) // len(u2) // multiple * multiple)

    # one buffer for every block: blocks freed one by one would stay pinned in the C heap by the
    # small arrays a pass keeps after each of them (5 GB at N = 40k instead of 0.5)
    buffer = u1.new_empty(min(rows, n), len(u2))

    for start in range(0, n, rows):
        block = torch.matmul(u1[start : start + rows], u2.T, out=buffer[: min(rows, n - start)])
        if not keep_diagonal:
            block.diagonal(start).fill_(-math.inf)
        yield start, block


def _at_least(block: torch.Tensor, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Flat row-major indices and values (numpy arrays) of the block's entries ≥ bound (float32)."""
    if block.is_cuda:
        flat = (block.view(-1) >= bound).nonzero().squeeze(1)
        return flat.cpu().numpy(), block.view(-1)[flat].cpu().numpy()

    # numpy on the CPU: torch's nonzero made the published order 1.2× slower at N = 20k
    values = block.numpy().ravel()
    flat = np.flatnonzero(values >= bound)
    return flat, values[flat]


def _sample_bound(u1: torch.Tensor, u2: torch.Tensor, keep: int) -> float:
    """A lower bound, most likely, on the keep-th largest off-diagonal S_ij: in SAMPLE_ROWS random
    rows (or all N), the value that twice the expected number of sampled entries reaches."""
    n = len(u1)
    r = min(n, SAMPLE_ROWS)
    rows = torch.from_numpy(np.random.default_rng(0).choice(n, r, replace=False)).to(u1.device)
    sample = u1[rows] @ u2.T
    sample[torch.arange(r, device=u1.device), rows] = -math.inf
    sample = sample.view(-1)

    # twice the entries expected above the keep-th largest, and a margin for small samples
    k = min(r * (n - 1), 2 * math.ceil(keep * r / n) + 64)
    # numpy's partition on the CPU: torch's topk there copies the sample into 16-byte pairs
    return float(
        sample.topk(k).values[-1] if sample.is_cuda else np.partition(sample.numpy(), -k)[-k]
    )


def _candidates(
    u1: torch.Tensor, u2: torch.Tensor, bound: float, keep: int
) -> tuple[np.ndarray, np.ndarray]:
    """One pass over S: flat indices i·N + j and values of the off-diagonal entries ≥ bound. Past
    2·keep held entries, the bound rises to the keep-th largest of them: memory stays O(keep)."""
    n = len(u1)
    flats = []
    values = []
    held = 0
    for start, block in _blocks(u1, u2):
        flat, value = _at_least(block, bound)
        flats.append(flat + start * n)
        values.append(value)
        held += len(value)
        if held > 2 * keep:
            flat = np.concatenate(flats)
            value = np.concatenate(values)
            bound = float(np.partition(value, len(value) - keep)[len(value) - keep])
            kept = value >= bound
            flats = [flat[kept]]
            values = [value[kept]]
            held = int(kept.sum())
    return np.concatenate(flats), np.concatenate(values)


def _threshold_and_candidates(u1, u2, quantile: float) -> tuple[float, np.ndarray, np.ndarray]:
    """The exact off-diagonal quantile of S (numpy's linear rule on the float32 values in float64)
    and the candidate entries (flat indices and values) among which the edges lie."""
    m = len(u1) * (len(u1) - 1)
    position = (m - 1) * quantile
    low = math.floor(position)
    high = min(low + 1, m - 1)
    # x_low is the keep-th largest value
    keep = m - low
    for bound in (_sample_bound(u1, u2, keep), NO_BOUND):
        flat, values = _candidates(u1, u2, bound, keep)

        # entries left out: all smaller than the kept ones
        below = m - len(values)
        if below <= low:
            break
    pair = np.partition(values, [low - below, high - below])[[low - below, high - below]]
    return float(np.quantile(pair.astype(np.float64), position - low)), flat, values


def gcbs_permutation(z1, z2, quantile: float = 0.999, seed: int | None = None) -> torch.Tensor:
    """The kit's GCBS permutation of N pairs (z1, z2: [N, d]), a LongTensor: the RCM order of the
    graph of off-diagonal S_ij above their `quantile`. The nodes are relabelled at random (`seed`)
    first: RCM breaks ties by node index and puts isolated nodes last, in the data's order."""
    require(0 < quantile < 1, f"quantile must lie in (0, 1), got {quantile}")
    u1, u2 = unit_rows(z1, z2)
    n = len(u1)
    require(n >= 2, f"need at least 2 items for an off-diagonal similarity, got N = {n}")
    threshold, flat, values = _threshold_and_candidates(u1, u2, quantile)
    rows, cols = np.divmod(flat[values > np.float64(threshold)], n)
    directed = sp.csr_matrix((np.ones(len(rows), bool), (rows, cols)), shape=(n, n))
    return graph_order(directed, relabel=np.random.default_rng(seed).permutation(n))


def _chunk_quantiles(chunks: torch.Tensor, quantile: float) -> torch.Tensor:
    """torch.quantile(row, quantile) of each row of `chunks`, bitwise: torch's float32 rank, the
    order statistics at its floor and ceiling (the last of the m − floor largest, by topk), lerp."""
    m = chunks.shape[1]
    rank = torch.tensor(quantile, dtype=torch.float32) * (m - 1)
    low = int(rank)
    high = int(rank.ceil())

    # column j: the order statistic m − 1 − j
    top = chunks.topk(m - low, dim=1).values
    weight = (rank - low).to(chunks.device).expand(len(top))
    return top[:, m - 1 - low].lerp(top[:, m - 1 - high], weight)


@contextlib.contextmanager
def _full_float32():
    """float32 matmuls without TF32: which S_ij clear the threshold depends on their rounding."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


@_full_float32()
def published_graph(z1, z2, quantile: float = 0.999, shared: bool = False) -> sp.csr_matrix | None:
    """The graph of the published order: the boolean csr matrix [N, N] of the S_ij, diagonal
    included, above `statistics.median([torch.quantile(S[i : i + 10], quantile) for i in
    range(0, N, 10)])`. The chunk quantiles are 0-d float32 tensors, so their median is the middle
    one, or for an even count (a+b)/2 of the two middle ones in float32 (not the lower one, which
    `Tensor.median` gives). One pass over S: each block keeps its S_ij at or above its lowest chunk
    quantile, or is computed again should that bound exceed the threshold (or keep too many).
    `shared`: called by every rank of the process group, each holding all of z1 and z2; each rank
    scans its share of the 10-row chunks, all take the median of every rank's chunk quantiles,
    and rank 0 alone receives the edges and returns the graph (the others None)."""
    require(0 <= quantile <= 1, f"quantile must lie in [0, 1], got {quantile}")
    u1, u2 = unit_rows(z1, z2)
    n = len(u1)

    rank, world_size = rank_and_world_size() if shared else (0, 1)
    chunks = torch.arange(0, n, 10).tensor_split(world_size)[rank]
    first = int(chunks[0]) if len(chunks) else n

    quantiles = [u1.new_empty(0)]
    kept = []
    edges = [np.empty((0, 2), NODE)]  # (row, column) pairs

    # blocks of whole 10-row chunks, the diagonal kept as in the published code
    for start, block in _blocks(u1[first : first + 10 * len(chunks)], u2, True, 10):
        start += first
        whole = len(block) // 10 * 10
        parts = [block[:whole].reshape(-1, 10 * n), block[whole:].reshape(1, -1)]
        quantiles.append(torch.cat([_chunk_quantiles(p, quantile) for p in parts if p.numel()]))
        bound = float(quantiles[-1].min())
        flat, values = _at_least(block, bound)
        if len(values) > 4 * (1 - quantile) * block.numel() + 10 * n:
            # too many entries at this bound: computed again once the threshold is known
            flat = None
            values = None
            bound = math.inf
        kept.append((start, len(block), bound, flat, values))

    quantiles = torch.cat(quantiles)
    if shared:  # every rank's chunk quantiles: one threshold on every rank
        quantiles = gather_ragged(quantiles)

    # the README's own median of 0-d float32 tensors (sorted first: the sort then scans them once)
    median = statistics.median(quantiles.sort().values.cpu().unbind())
    threshold = np.float32(median.item())

    for start, length, bound, flat, values in kept:
        if bound > threshold:
            flat, values = _at_least(u1[start : start + length] @ u2.T, threshold)
        rows, cols = np.divmod(flat[values > threshold], n)
        edges.append(np.stack([rows + start, cols], 1).astype(NODE))

    edges = torch.from_numpy(np.concatenate(edges))
    if shared:  # every rank's edges, to rank 0 alone
        edges = gather_ragged(edges.to(u1.device), main_only=True)
        if edges is None:
            return None

    rows, cols = edges.cpu().numpy().T
    return sp.csr_matrix((np.ones(len(rows), bool), (rows, cols)), shape=(n, n))


def published_permutation(z1, z2, quantile: float = 0.999) -> torch.Tensor:
    """The published order, index for index: `reverse_cuthill_mckee` (default symmetric_mode) of
    `published_graph(z1, z2, quantile)`, a LongTensor permutation of N."""
    return graph_order(published_graph(z1, z2, quantile))


def without_group_edges(graph: sp.csr_matrix, groups: Sequence[Hashable]) -> sp.csr_matrix:
    """`graph` [N, N] less its off-diagonal edges within a group (`groups`: one code per item),
    the trainer's `gcbs_prune_groups`."""
    require(len(groups) == graph.shape[0], f"{len(groups)} groups for {graph.shape[0]} items")
    rows, cols = graph.nonzero()
    codes = _codes(groups)
    apart = (codes[rows] != codes[cols]) | (rows == cols)
    edges = (np.ones(int(apart.sum()), bool), (rows[apart], cols[apart]))
    return sp.csr_matrix(edges, shape=graph.shape)


def graph_order(graph: sp.csr_matrix, relabel=None) -> torch.Tensor:
    """scipy's RCM order (default symmetric_mode) of `graph` [N, N]. With `relabel` (a permutation:
    node p is item relabel[p]), RCM orders the relabelled graph, so that its ties (broken by node
    index) fall at random rather than in the data's storage order; the order is of the items."""
    rows, cols = graph.nonzero()
    relabel = np.arange(graph.shape[0]) if relabel is None else np.asarray(relabel)
    label = np.argsort(relabel).astype(NODE)
    edges = (np.ones(len(rows), bool), (label[rows], label[cols]))
    order = reverse_cuthill_mckee(sp.csr_matrix(edges, shape=graph.shape))
    return torch.from_numpy(relabel[order].astype(np.int64))


def graph_diagnostics(graph: sp.csr_matrix) -> dict[str, float]:
    """`edges_per_item`, the off-diagonal edges (directed, as S_ij > threshold counts them) per
    item, and `isolated_share`, the share of items with no off-diagonal edge either way."""
    n = graph.shape[0]
    rows, cols = graph.nonzero()
    off = rows != cols
    linked = np.union1d(rows[off], cols[off])
    return {"edges_per_item": int(off.sum()) / n, "isolated_share": 1 - len(linked) / n}


def _cut(order: list[int], batch_size: int, keys: Sequence[Hashable] | None) -> list[list[int]]:
    """The N // batch_size consecutive batches of an order. With keys, an item whose key the batch
    holds already waits (keeping its place in the order) for the next batch; should the order run
    out before a batch is full (copies of one key at its end), a waiting item trades places with an
    item of an earlier batch."""
    if keys is None:
        starts = range(0, len(order) - batch_size + 1, batch_size)
        return [order[s : s + batch_size] for s in starts]

    queue = deque(order)
    batches = []
    for b in range(len(order) // batch_size):
        batch = []
        seen = set()
        waiting = []
        while len(batch) < batch_size and queue:
            i = queue.popleft()
            (waiting if keys[i] in seen else batch).append(i)
            seen.add(keys[i])

        while len(batch) < batch_size:
            item = _trade(waiting, batches, seen, keys)
            require(
                item is not None,
                f"batch {b} of {len(order) // batch_size} cannot be filled with {batch_size} "
                f"distinct keys: too many items share a key for this batch size",
            )
            batch.append(item)
            seen.add(keys[item])

        # waiting items go back to the front, keeping their places in the order
        queue.extendleft(reversed(waiting))
        batches.append(batch)
    return batches


def _trade(
    waiting: list[int], batches: list[list[int]], seen: set, keys: Sequence[Hashable]
) -> int | None:
    """Put a waiting item into an earlier batch that lacks its key, in place of an item whose key is
    not in `seen`, and return that item (None when no such trade exists)."""
    for w, i in enumerate(waiting):
        for earlier in batches:
            if keys[i] not in {keys[j] for j in earlier}:
                for p, j in enumerate(earlier):
                    if keys[j] not in seen:
                        earlier[p] = waiting.pop(w)
                        return j
    return None


def consecutive_batches(order, batch_size: int, keys=None) -> torch.Tensor:
    """An order read sequentially into its N // batch_size full batches, the short last one dropped:
    a LongTensor [steps, batch_size]. With `keys` (duplicate texts: false negatives of each other),
    no two items of one key share a batch. Every arm of a comparison cuts its order so."""
    order = torch.as_tensor(order).tolist()
    _check_batch_size(batch_size, len(order))
    if keys is not None:
        keys = keys.tolist() if hasattr(keys, "tolist") else list(keys)
        require(len(keys) == len(order), f"{len(keys)} keys for {len(order)} items")

    return torch.tensor(_cut(order, batch_size, keys), dtype=torch.long)


def _codes(groups: Sequence[Hashable]) -> np.ndarray:
    """Each item's group as a number (0, 1, … in order of first appearance)."""
    number = {group: i for i, group in enumerate(dict.fromkeys(groups))}
    return np.array([number[group] for group in groups], dtype=np.int64)


def same_group_pairs(batches: torch.Tensor, groups: Sequence[Hashable]) -> float:
    """The share of in-batch pairs (i ≠ j in one row of `batches` [S, B]) whose items share a group,
    `groups[k]` being item k's (a class, a video, a source module: a proxy for false negatives)."""
    codes = torch.from_numpy(_codes(groups))[batches]
    same = sum(int((row[:, None] == row[None, :]).sum()) - len(row) for row in codes)
    return same / (codes.shape[0] * codes.shape[1] * (codes.shape[1] - 1))


def loss_gap(
    z1, z2, order, batch_size: int, temperature: float, reference=None, rows=None
) -> float:
    """Exact L^Global − L^Train of InfoNCE over the consecutive batches of `order` (the last maybe
    shorter). With S = ẑ1ẑ2ᵀ and B(i) the batch of item i, the positive terms cancel:
        gap = (1/N) Σ_i [ log Σ_j e^{S_ij/τ} − log Σ_{j∈B(i)} e^{S_ij/τ} ]  ≥ 0.
    Float64, in row blocks. For planned batches [steps, B] of items: loss_gap(z1[items], z2[items],
    torch.arange(len(items)), B, τ) with items = batches.flatten().

    `reference` = (r2, count): the gap of these batches within a larger epoch, whose `count` other
    items are represented by the z2 rows r2 of a uniform sample of them. L^Global's sum over those
    items is estimated as count / len(r2) times the sum over r2; every term over the batches' own
    items stays exact, so each item's estimate is never below its in-batch term.

    `rows` (a range of items, default all N): only their terms, still divided by N, so that the
    parts of a split of range(N), one per rank, add up to the gap."""
    require(temperature > 0, f"temperature must be positive, got {temperature}")
    u1, u2 = unit_rows(z1, z2, torch.float64)
    n = len(u1)
    _check_batch_size(batch_size, n)
    rows = range(n) if rows is None else rows
    require(rows.step == 1 and 0 <= rows.start <= rows.stop <= n, f"rows: a range in range({n})")

    order = torch.as_tensor(order)
    require(not order.is_floating_point(), f"order must hold integer indices, got {order.dtype}")
    order = order.long().to(u1.device)
    items = torch.arange(n, device=u1.device)
    permutation = order.shape == (n,) and torch.equal(order.sort().values, items)
    require(permutation, f"order must be a permutation of range({n})")

    # item i stands at place argsort[i] of the order
    batch_of = order.argsort() // batch_size
    columns = u2
    log_weights = 0.0
    if reference is not None:  # sampled columns, each standing for count / len(r2) items
        sample, count = reference
        require(len(sample) and count > 0, "reference: a sample of rows and a count above 0")
        sample = unit_rows(sample, sample, torch.float64)[0]
        columns = torch.cat([u2, sample])
        log_weights = columns.new_zeros(len(columns))
        log_weights[n:] = math.log(count / len(sample))
    total = u1.new_zeros(())
    block = max(1, _block_elements(u1.device) // len(columns))

    # summed on the device: one host sync
    for start in range(rows.start, rows.stop, block):
        span = slice(start, min(start + block, rows.stop))
        logits = u1[span] @ columns.T / temperature + log_weights
        # the in-batch term: over the batches' own columns (the sampled ones are in no batch)
        outside = batch_of[span, None] != batch_of[None, :]
        inside = logits[:, :n].masked_fill(outside, -math.inf).logsumexp(1)
        total += (logits.logsumexp(1) - inside).sum()
    return total.item() / n
