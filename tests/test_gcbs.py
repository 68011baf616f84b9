"""Specification of GCBS: the published order, the kit's exact similarity threshold and RCM
permutation, the epoch's batches, the loss gap."""

import statistics
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components, maximum_flow, reverse_cuthill_mckee

from gcbs_lib import gcbs
from gcbs_lib.gcbs import (
    consecutive_batches,
    gcbs_permutation,
    loss_gap,
    published_permutation,
    same_group_pairs,
)
from gcbs_lib.launcher import launch

BATCH, TAU = 32, 0.05


def pairs(n, dim, clusters=0, spread=0.5, noise=0.1, seed=0):
    """n pairs z1 ~ N(0, I) (or around `clusters` random centres, `spread` around each), z2 = z1 +
    noise."""
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, dim, generator=g)
    if clusters:
        z1 = (
            torch.randn(clusters, dim, generator=g)[torch.randint(clusters, (n,), generator=g)]
            + spread * z1
        )
    return z1, z1 + noise * torch.randn(n, dim, generator=g)


def tied_pairs(n, dim, seed=0):
    """A third of the items coincide (many equal similarities), and the positives point the other
    way."""
    z1 = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    z1[: n // 3] = z1[0]
    return z1, -z1


def reference(z1, z2, quantile, seed):
    """The GCBS threshold and order written plainly: S whole (float32, from the library's row
    blocks, as BLAS rounding may depend on the block), numpy's quantile of its off-diagonal entries
    in float64, the entries above it as edges in either direction, RCM of the graph relabelled by
    the seeded permutation."""
    u1, u2 = (F.normalize(z.float(), dim=1) for z in (z1, z2))
    n = len(u1)
    rows = max(1, gcbs.BLOCK_ELEMENTS // n)
    similarity = torch.cat([u1[s : s + rows] @ u2.T for s in range(0, n, rows)]).numpy()
    off_diagonal = ~np.eye(n, dtype=bool)
    threshold = np.quantile(similarity[off_diagonal].astype(np.float64), quantile)
    edges = (similarity > threshold) & off_diagonal
    relabel = np.random.default_rng(seed).permutation(n)
    graph = csr_matrix((edges | edges.T)[np.ix_(relabel, relabel)])
    order = relabel[reverse_cuthill_mckee(graph, symmetric_mode=True)]
    return threshold, edges | edges.T, torch.from_numpy(order.astype(np.int64))


def library_threshold(z1, z2, quantile):
    return gcbs._threshold_and_candidates(*gcbs.unit_rows(z1, z2), quantile)[0]


DATA_SETS = {  # name: (z1, z2, quantile)
    "clustered": (*pairs(2000, 16, clusters=40, seed=1), 0.999),
    "isotropic": (*pairs(1500, 32, seed=2), 0.995),
    "tight clusters, low q": (*pairs(700, 8, clusters=5, spread=0.05, seed=3), 0.25),
    "ties and negatives": (*tied_pairs(400, 4), 0.97),
    "positives most similar": (*pairs(800, 16, noise=0.01, seed=4), 0.99),
    "three items": (*pairs(3, 4, seed=5), 0.5),
}


# ----------------------------------------------------------------------------- published order


def literal_published(z1, z2, quantile):
    """The published minimal code written out: S whole, torch.quantile of each 10-row chunk in a
    Python loop (0-d float32 tensors), statistics.median of that list, the csr matrix of S above
    it, scipy's RCM."""
    x, y = (F.normalize(z.float(), dim=1) for z in (z1, z2))
    similarity = x @ y.T
    quantiles = [torch.quantile(similarity[i : i + 10], quantile) for i in range(0, len(x), 10)]
    threshold = statistics.median(quantiles)
    order = reverse_cuthill_mckee(csr_matrix((similarity > threshold).numpy()))
    return torch.from_numpy(order.astype(np.int64))


def duplicated_pairs(n, dim, seed=0):
    """Every item thrice (equal rows, equal similarities), positives equal to anchors."""
    z1 = torch.randn(n // 3 + 1, dim, generator=torch.Generator().manual_seed(seed)).repeat(3, 1)
    return z1[:n], z1[:n].clone()


def tight_cluster_first(n, dim, seed=0):
    """60 nearly equal items first: the chunk quantiles of their rows lie above the threshold."""
    z1, z2 = pairs(n, dim, seed=seed)
    z1[:60] = z1[0] + 0.01 * z1[:60]
    z2[:60] = z1[:60]
    return z1, z2


def one_chunk_away(n, dim, seed=0):
    """Items in the positive orthant but the last 10, which point away from all: a chunk quantile
    far below the others."""
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, dim, generator=g).abs()
    z2 = z1 + 0.3 * torch.randn(n, dim, generator=g).abs()
    z1[-10:] = -1.0
    return z1, z2


PUBLISHED_SETS = {  # name: (z1, z2, quantile)
    "isotropic": (*pairs(1000, 32, seed=2), 0.999),
    "planted clusters": (*pairs(1500, 16, clusters=30, seed=1), 0.99),
    "N not a multiple of 10": (*pairs(1203, 8, clusters=12, seed=6), 0.95),
    "an even number of chunks": (*pairs(40, 4, seed=7), 0.7),
    "N below 10": (*pairs(7, 4, seed=8), 0.5),
    "one item": (*pairs(1, 4, seed=9), 0.999),
    "ties and negatives": (*tied_pairs(400, 4), 0.97),
    "duplicated rows": (*duplicated_pairs(301, 6), 0.9),
    "low quantile": (*pairs(300, 8, clusters=5, spread=0.05, seed=3), 0.25),
    "quantile 0": (*pairs(90, 8, seed=10), 0.0),
    "quantile 1": (*pairs(95, 8, seed=11), 1.0),
    "tight cluster first": (*tight_cluster_first(800, 16), 0.99),
    "one chunk away": (*one_chunk_away(800, 16), 0.99),
}


@pytest.mark.parametrize("name", PUBLISHED_SETS)
def test_published_permutation_equals_the_published_code_index_for_index(name):
    z1, z2, quantile = PUBLISHED_SETS[name]
    order = published_permutation(z1, z2, quantile)
    assert order.dtype == torch.long and torch.equal(order, literal_published(z1, z2, quantile))
    assert torch.equal(order.sort().values, torch.arange(len(z1)))


@pytest.mark.parametrize("n, seed", [(1000, 1), (2000, 0), (990, 1), (1010, 1)])
def test_the_threshold_is_statistics_median_of_the_chunk_quantiles_at_even_and_odd_counts(n, seed):
    """100 or 200 chunks: the mean of the two middle quantiles, which moves edges here (the lower
    middle one, Tensor.median's, would not give the published graph); 99 or 101: the middle one."""
    z1, z2 = pairs(n, 16, clusters=n // 50, seed=seed)
    x, y = (F.normalize(z, dim=1) for z in (z1, z2))
    similarity = x @ y.T
    quantiles = [torch.quantile(similarity[i : i + 10], 0.999) for i in range(0, n, 10)]
    median, lower = statistics.median(quantiles), torch.stack(quantiles).median()
    graph = gcbs.published_graph(z1, z2, 0.999).toarray()
    assert np.array_equal(graph, (similarity > median).numpy())
    even = len(quantiles) % 2 == 0
    assert np.array_equal(graph, (similarity > lower).numpy()) != even
    assert torch.equal(published_permutation(z1, z2, 0.999), literal_published(z1, z2, 0.999))


def test_the_graph_is_built_and_ordered_in_at_most_46_bytes_of_host_memory_an_edge():
    """Node numbers in int32 pairs, never int64 flat indices i·N + j (53 and 50 bytes an edge here:
    the flat indices, their quotient and remainder, and int64 labels). Host memory as numpy and
    scipy report it to tracemalloc; N = 5,000 at q = 0.98, about 500,000 edges."""
    z1, z2 = pairs(5000, 32, clusters=200)
    tracemalloc.start()
    try:
        graph = gcbs.published_graph(z1, z2, 0.98)
        building = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        gcbs.graph_order(graph, relabel=np.random.default_rng(0).permutation(5000))
        ordering = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert graph.nnz > 400_000
    assert building <= 46 * graph.nnz and ordering <= 46 * graph.nnz


def graph_on_a_rank(n: int, quantile: float, block_elements: int) -> list | None:
    """Rank 0's shared published graph of `pairs(n, 16, clusters)` as (rows, cols) lists, each rank
    scanning its chunks in blocks of `block_elements` similarities; None on the other ranks."""
    gcbs.BLOCK_ELEMENTS = block_elements  # in this launched process only
    z1, z2 = pairs(n, 16, clusters=n // 50, seed=1)
    graph = gcbs.published_graph(z1, z2, quantile, shared=True)
    return None if graph is None else [a.tolist() for a in graph.nonzero()]


@pytest.mark.parametrize("nproc, n", [(2, 1010), (3, 997)])
def test_ranks_that_share_the_scan_of_s_give_rank_0_the_one_process_graph(nproc, n):
    """Each rank scans its share of the 10-row chunks (here in blocks of 40 rows); the ranks agree
    on the median of every chunk's quantile; rank 0 receives every edge: the same graph, edge for
    edge, as one process (N not a multiple of 10 included)."""
    z1, z2 = pairs(n, 16, clusters=n // 50, seed=1)
    one = gcbs.published_graph(z1, z2, 0.99)
    args = {"n": n, "quantile": 0.99, "block_elements": 40 * n}
    shared = launch(f"{__name__}:graph_on_a_rank", nproc=nproc, echo=False, args=args)
    assert shared == [a.tolist() for a in one.nonzero()] and one.nnz > n


@pytest.mark.parametrize(
    "name", ["planted clusters", "N not a multiple of 10", "ties and negatives"]
)
def test_published_permutation_in_blocks_of_few_rows_is_unchanged(name, monkeypatch):
    z1, z2, quantile = PUBLISHED_SETS[name]
    expected = literal_published(z1, z2, quantile)
    for elements in (1, 20 * len(z1) + 5, 70 * len(z1)):  # blocks of 10, 20 and 70 rows
        monkeypatch.setattr(gcbs, "BLOCK_ELEMENTS", elements)
        assert torch.equal(published_permutation(z1, z2, quantile), expected)


@pytest.mark.parametrize("name", ["tight cluster first", "one chunk away"])
def test_a_block_whose_bound_misses_or_keeps_too_many_is_computed_again(name, monkeypatch):
    z1, z2, quantile = PUBLISHED_SETS[name]
    calls, at_least = [], gcbs._at_least

    def counted(block, bound):
        calls.append(bound)
        return at_least(block, bound)

    monkeypatch.setattr(gcbs, "_at_least", counted)
    monkeypatch.setattr(gcbs, "BLOCK_ELEMENTS", 50 * len(z1))  # 16 blocks of 50 rows
    assert torch.equal(published_permutation(z1, z2, quantile), literal_published(z1, z2, quantile))
    assert len(calls) == 17  # one block twice


@pytest.mark.parametrize(
    "m, quantile", [(10, 0.999), (51, 0.123), (37, 0.5), (1000, 0.37), (4001, 0.999), (3, 0.0)]
)
def test_chunk_quantiles_equal_torch_quantile_bitwise(m, quantile):
    chunks = torch.randn(25, m, generator=torch.Generator().manual_seed(m))
    chunks[5] = chunks[5].round()  # ties
    # the rank's fraction (torch's lerp weight) lies below 0.5, above it, or is 0
    expected = torch.stack([torch.quantile(row, quantile) for row in chunks])
    assert torch.equal(gcbs._chunk_quantiles(chunks, quantile), expected)


@pytest.mark.parametrize("quantile", [1.5, -0.1, float("nan")])
def test_published_permutation_refuses_a_quantile_outside_the_unit_interval(quantile):
    with pytest.raises(ValueError, match="quantile must lie in"):
        published_permutation(torch.randn(10, 4), torch.randn(10, 4), quantile)


# ------------------------------------------------------------------ the graph and its controls


def graph_of(edges, n):
    """A boolean csr graph [n, n] holding the directed `edges` (i, j)."""
    rows, cols = zip(*edges)
    return csr_matrix((np.ones(len(edges), bool), (rows, cols)), shape=(n, n))


def rcm_input(graph, monkeypatch, relabel):
    """The graph `graph_order` hands to scipy's RCM, and the order it returns."""
    seen = []

    def kept(matrix):
        seen.append(matrix)
        return reverse_cuthill_mckee(matrix)

    monkeypatch.setattr(gcbs, "reverse_cuthill_mckee", kept)
    order = gcbs.graph_order(graph, relabel)
    return seen[0], order


def test_the_diagnostics_count_off_diagonal_edges_per_item_and_items_without_one():
    # 0 → 1, 1 → 0 and 2 → 1: three edges; 3 and 4 only have self-loops
    graph = graph_of([(0, 1), (1, 0), (2, 1), (0, 0), (3, 3), (4, 4)], 5)
    assert gcbs.graph_diagnostics(graph) == {"edges_per_item": 3 / 5, "isolated_share": 2 / 5}


def test_pruned_graphs_hold_no_same_group_edge_and_every_other_edge():
    z1, z2, quantile = PUBLISHED_SETS["planted clusters"]
    graph = gcbs.published_graph(z1, z2, quantile)
    groups = [f"file {i // 7}" for i in range(len(z1))]  # stored group by group
    pruned = gcbs.without_group_edges(graph, groups)
    rows, cols = graph.nonzero()
    same = np.array([groups[i] == groups[j] and i != j for i, j in zip(rows, cols)])
    assert same.sum() > 100  # the planted clusters hold near-copies stored side by side
    kept = set(zip(*pruned.nonzero()))
    assert kept == set(zip(rows[~same], cols[~same]))
    with pytest.raises(ValueError, match="groups for"):
        gcbs.without_group_edges(graph, groups + ["one too many"])


def test_random_ties_relabel_the_graph_and_keep_each_component_together(monkeypatch):
    z1, z2, quantile = PUBLISHED_SETS["isotropic"]
    graph = gcbs.published_graph(z1, z2, quantile)
    relabel = np.random.default_rng(0).permutation(len(z1))
    relabelled, order = rcm_input(graph, monkeypatch, relabel)
    # node p is item relabel[p]: the same edges under new names
    assert set(zip(*relabel[np.array(relabelled.nonzero())])) == set(zip(*graph.nonzero()))
    published = gcbs.graph_order(graph)
    assert not torch.equal(order, published) and torch.equal(
        order.sort().values, published.sort().values
    )
    _, component = connected_components(graph, connection="weak")
    for ordered in (order, published):
        runs = component[ordered.numpy()]
        assert (np.diff(runs) != 0).sum() == component.max()  # each component in one run


def test_random_ties_leave_the_order_of_a_graph_without_ties_unchanged():
    """RCM breaks ties only between nodes of equal degree. In this graph every degree differs
    (scipy counts a self-loop twice: 1, 2, 4, 3, 6), so any relabelling gives the same order; with
    two isolated items added (a tie), relabellings give other orders."""
    edges = [(4, 0), (4, 1), (4, 2), (4, 3), (3, 1), (3, 2), (2, 2), (4, 4)]
    untied = graph_of(edges + [(j, i) for i, j in edges], 5)
    tied = graph_of(edges + [(j, i) for i, j in edges], 7)
    orders = {name: set() for name in ("untied", "tied")}
    for seed in range(20):
        for name, graph in (("untied", untied), ("tied", tied)):
            relabel = np.random.default_rng(seed).permutation(graph.shape[0])
            orders[name].add(tuple(gcbs.graph_order(graph, relabel=relabel).tolist()))
    assert orders["untied"] == {tuple(gcbs.graph_order(untied).tolist())}
    assert len(orders["tied"]) > 1


# ------------------------------------------------------------------------- threshold and order


@pytest.mark.parametrize("name", DATA_SETS)
def test_threshold_and_order_equal_the_plain_full_matrix_reference(name):
    z1, z2, quantile = DATA_SETS[name]
    threshold, _, order = reference(z1, z2, quantile, seed=5)
    assert library_threshold(z1, z2, quantile) == threshold
    assert torch.equal(gcbs_permutation(z1, z2, quantile, seed=5), order)


@pytest.mark.parametrize(
    "n, quantile, clusters", [(2, 0.5, 0), (37, 0.1, 0), (500, 0.999, 5), (1500, 0.5, 0)]
)
def test_threshold_equals_numpys_linear_quantile_of_the_off_diagonal_similarities(
    n, quantile, clusters
):
    z1, z2 = pairs(n, 8, clusters=clusters, seed=n)
    assert library_threshold(z1, z2, quantile) == reference(z1, z2, quantile, seed=0)[0]


@pytest.mark.parametrize("name", ["clustered", "tight clusters, low q", "ties and negatives"])
def test_many_small_blocks_and_a_missed_sample_bound_change_nothing(name, monkeypatch):
    z1, z2, quantile = DATA_SETS[name]
    # a few rows per block: the held candidates are trimmed
    monkeypatch.setattr(gcbs, "BLOCK_ELEMENTS", 2**12)
    threshold, _, order = reference(z1, z2, quantile, seed=5)
    assert torch.equal(gcbs_permutation(z1, z2, quantile, seed=5), order)
    # above every similarity: a second pass
    monkeypatch.setattr(gcbs, "_sample_bound", lambda u1, u2, keep: 1.5)
    assert library_threshold(z1, z2, quantile) == threshold
    assert torch.equal(gcbs_permutation(z1, z2, quantile, seed=5), order)


def test_the_edges_are_the_quantile_share_of_pairs_and_the_pass_keeps_few_candidates_beyond_them():
    z1, z2, quantile = DATA_SETS["clustered"]
    threshold, _, values = gcbs._threshold_and_candidates(*gcbs.unit_rows(z1, z2), quantile)
    directed, expected = int((values > threshold).sum()), (1 - quantile) * 2000 * 1999
    assert abs(directed - expected) <= 0.01 * expected
    assert directed <= len(values) <= 3 * directed


def test_permutation_orders_every_item_once_and_follows_the_seed():
    z1, z2 = pairs(500, 16, clusters=10)
    order = gcbs_permutation(z1, z2, quantile=0.99, seed=1)
    assert order.dtype == torch.long and torch.equal(order.sort().values, torch.arange(500))
    assert torch.equal(order, gcbs_permutation(z1, z2, quantile=0.99, seed=1))
    assert not torch.equal(order, gcbs_permutation(z1, z2, quantile=0.99, seed=2))


def test_isolated_items_are_neither_in_index_order_nor_the_same_from_seed_to_seed():
    z1, z2 = pairs(400, 16, clusters=4, spread=0.1)
    # nothing similar: no edge
    loners = torch.randn(200, 16, generator=torch.Generator().manual_seed(1))
    z1, z2 = torch.cat([z1, loners]), torch.cat([z2, loners])
    isolated = set(np.flatnonzero(~reference(z1, z2, 0.99, seed=0)[1].any(axis=1)).tolist())
    assert len(isolated) > 50
    sequences = [
        [i for i in gcbs_permutation(z1, z2, 0.99, seed).tolist() if i in isolated]
        for seed in (0, 1)
    ]
    assert sequences[0] != sorted(sequences[0]) and sequences[0] != sequences[1]


def test_on_planted_clusters_gcbs_batches_have_a_smaller_loss_gap_than_random_ones():
    z1, z2 = pairs(2048, 32, clusters=64)
    shuffled = torch.randperm(2048, generator=torch.Generator().manual_seed(0))
    ordered = gcbs_permutation(z1, z2, quantile=0.99, seed=0)
    assert loss_gap(z1, z2, ordered, BATCH, TAU) < 0.5 * loss_gap(z1, z2, shuffled, BATCH, TAU)


# ----------------------------------------------------------------------------------- batches


def test_batches_are_the_order_cut_the_last_short_one_dropped():
    order = published_permutation(*pairs(210, 8, clusters=6), 0.98)
    batches = consecutive_batches(order, 20)
    assert batches.dtype == torch.long and torch.equal(batches, order[:200].view(10, 20))


def keyed(z1, z2, batch_size, quantile, keys=None):
    """The trainer's GCBS batches: the published order cut with the duplicate keys."""
    return consecutive_batches(published_permutation(z1, z2, quantile), batch_size, keys)


def test_equal_keys_never_share_a_batch():
    # every text occurs 2 or 3 times, and its copies embed identically
    keys = [i % 120 for i in range(300)]
    z1, z2 = (z[torch.tensor(keys)] for z in pairs(300, 16, clusters=5))
    batches = keyed(z1, z2, 20, 0.99, keys)
    assert batches.shape == (15, 20) and len(batches.unique()) == 300
    assert all(len({keys[i] for i in batch}) == 20 for batch in batches.tolist())
    together = keyed(z1, z2, 20, 0.99)
    # without keys they would meet
    assert any(len({keys[i] for i in batch}) < 20 for batch in together.tolist())


def test_copies_of_one_key_at_the_end_of_the_order_still_get_one_batch_each():
    keys = list(range(56)) + ["same"] * 8  # 8 batches of 8: one copy for each
    z1, z2 = pairs(64, 4)
    z1[56:], z2[56:] = z1[56], z2[56]  # identical copies: RCM puts them side by side
    batches = keyed(z1, z2, 8, 0.9, keys)
    assert len(batches.unique()) == 64 and all(
        len({keys[i] for i in b}) == 8 for b in batches.tolist()
    )


def one_key_per_batch_exists(keys, batch_size):
    """Independent check by maximum flow: source → key (its count) → batch (1 per key) → sink (batch
    size)."""
    distinct, batches = sorted(set(keys)), len(keys) // batch_size
    k = len(distinct)
    capacity = np.zeros((k + batches + 2, k + batches + 2), np.int32)
    capacity[0, 1 : k + 1] = [keys.count(key) for key in distinct]
    capacity[1 : k + 1, k + 1 : k + batches + 1] = 1
    capacity[k + 1 : k + batches + 1, -1] = batch_size
    return maximum_flow(csr_matrix(capacity), 0, k + batches + 1).flow_value == batches * batch_size


def test_keys_are_kept_apart_exactly_when_some_choice_of_batches_allows_it():
    rng, outcomes = np.random.default_rng(0), set()
    for trial in range(150):
        batch_size, n = int(rng.integers(2, 7)), int(rng.integers(7, 30))
        keys = rng.integers(0, int(rng.integers(2, n + 1)), n).tolist()
        z1, z2 = pairs(n, 4, seed=trial)
        try:
            batches = keyed(z1, z2, batch_size, 0.5, keys)
            assert len(batches.unique()) == batches.numel() == n // batch_size * batch_size
            assert all(len({keys[i] for i in b}) == batch_size for b in batches.tolist())
            separated = True
        except ValueError as error:
            assert "cannot be filled" in str(error)
            separated = False
        assert separated == one_key_per_batch_exists(keys, batch_size)
        outcomes.add(separated)
    assert outcomes == {True, False}


def test_keys_must_be_one_per_item():
    with pytest.raises(ValueError, match="63 keys for 64 items"):
        keyed(*pairs(64, 4), 8, 0.9, list(range(63)))


# ---------------------------------------------------------------------------------- loss gap


def test_loss_gap_equals_global_minus_in_batch_cross_entropy_in_float64():
    z1, z2 = pairs(50, 6, clusters=3, seed=3)
    # the last batch: 2
    order, batch_size = torch.randperm(50, generator=torch.Generator().manual_seed(0)), 8
    logits = F.normalize(z1.double(), dim=1) @ F.normalize(z2.double(), dim=1).T / TAU
    global_loss = F.cross_entropy(logits, torch.arange(50), reduction="sum")
    train_loss = sum(
        F.cross_entropy(logits[b][:, b], torch.arange(len(b)), reduction="sum")
        for b in order.split(batch_size)
    )
    assert loss_gap(z1, z2, order, batch_size, TAU) == pytest.approx(
        float(global_loss - train_loss) / 50, rel=1e-12
    )
    assert loss_gap(z1, z2, order, 50, TAU) == pytest.approx(0, abs=1e-12)


def test_loss_gap_of_planned_batches_is_the_gap_over_their_items(monkeypatch):
    z1, z2 = pairs(210, 8, clusters=6)
    batches = keyed(z1, z2, 20, 0.98)
    items = batches.flatten()
    logits = F.normalize(z1[items].double(), dim=1) @ F.normalize(z2[items].double(), dim=1).T / TAU
    terms = [
        logits[i].logsumexp(0) - logits[i, b].logsumexp(0)
        for b in torch.arange(200).view(10, 20)
        for i in b
    ]
    gap = loss_gap(z1[items], z2[items], torch.arange(200), 20, TAU)
    assert gap == pytest.approx(float(torch.stack(terms).mean()), rel=1e-12)
    monkeypatch.setattr(gcbs, "BLOCK_ELEMENTS", 1)  # one row at a time
    assert loss_gap(z1[items], z2[items], torch.arange(200), 20, TAU) == pytest.approx(
        gap, rel=1e-12
    )


def test_loss_gap_with_a_reference_sample_estimates_the_rest_of_the_epoch_from_it():
    """3 batches of 20 of 210 items: L^Global of their items sums the other 150 items exactly when
    the reference is all of them; a reference of 50 of them counts each 150 / 50 times."""
    z1, z2 = pairs(210, 8, clusters=6)
    logits = F.normalize(z1.double(), dim=1) @ F.normalize(z2.double(), dim=1).T / TAU
    batches = torch.arange(60).view(3, 20)
    in_batch = torch.cat([logits[b][:, b].logsumexp(1) for b in batches])
    everything = logits[:60].logsumexp(1)
    weighted = torch.cat([logits[:60, :60], logits[:60, 60:110] + np.log(3)], 1).logsumexp(1)

    measured = (z1[:60], z2[:60], torch.arange(60), 20, TAU)
    exact = loss_gap(*measured, reference=(z2[60:], 150))
    assert exact == pytest.approx(float((everything - in_batch).mean()), rel=1e-12)
    estimate = loss_gap(*measured, reference=(z2[60:110], 150))
    assert estimate == pytest.approx(float((weighted - in_batch).mean()), rel=1e-12)


def test_the_loss_gaps_of_a_split_of_the_rows_add_up_to_the_gap():
    """Each rank's share of the items (`rows`) gives its terms over N: the parts of a split, an
    empty part among them, add up to the gap, exact or estimated from a reference sample."""
    z1, z2 = pairs(210, 8, clusters=6)
    order = torch.randperm(210, generator=torch.Generator().manual_seed(1))
    for reference in (None, (z2[:50], 150)):
        whole = loss_gap(z1, z2, order, 20, TAU, reference)
        split = (range(0, 0), range(0, 71), range(71, 140), range(140, 210))
        parts = [loss_gap(z1, z2, order, 20, TAU, reference, rows) for rows in split]
        assert sum(parts) == pytest.approx(whole, rel=1e-12) and min(parts[1:]) > 0


@pytest.mark.parametrize("rows", [range(5, 11), range(-1, 4), range(0, 10, 2)])
def test_loss_gap_refuses_rows_that_are_not_a_range_of_its_items(rows):
    with pytest.raises(ValueError, match=r"rows: a range in range\(10\)"):
        loss_gap(torch.randn(10, 4), torch.randn(10, 4), torch.arange(10), 5, TAU, rows=rows)


def test_loss_gap_sums_its_blocks_on_the_device_to_the_float64_sum_of_the_blocks(monkeypatch):
    """Bitwise the sum, in Python floats, of each block's float64 sum (the value before the sum
    moved onto the device), in one block and in blocks of 7 rows."""
    z1, z2 = pairs(210, 8, clusters=6)
    order = torch.randperm(210, generator=torch.Generator().manual_seed(1))
    u1, u2 = (F.normalize(z.double(), dim=1) for z in (z1, z2))
    batch_of = order.argsort() // 20
    for elements in (gcbs.BLOCK_ELEMENTS, 7 * 210):
        monkeypatch.setattr(gcbs, "BLOCK_ELEMENTS", elements)
        total = 0.0
        for start in range(0, 210, elements // 210):
            logits = u1[start : start + elements // 210] @ u2.T / TAU
            outside = batch_of[start : start + elements // 210, None] != batch_of[None, :]
            inside = logits.masked_fill(outside, -torch.inf).logsumexp(1)
            total += (logits.logsumexp(1) - inside).sum().item()
        assert loss_gap(z1, z2, order, 20, TAU) == total / 210


def test_blocks_of_similarities_are_sized_for_the_device_they_are_computed_on():
    assert gcbs._block_elements(torch.device("cpu")) == gcbs.BLOCK_ELEMENTS == 2**22
    assert gcbs._block_elements(torch.device("cuda", 1)) == gcbs.DEVICE_BLOCK_ELEMENTS == 2**27


# -------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "z1, z2, message",
    [
        (torch.randn(10, 4), torch.randn(9, 4), "same shape"),
        (torch.randn(0, 4), torch.randn(0, 4), "empty"),
        (torch.randn(10), torch.randn(10), "2-D"),
        (np.zeros((10, 4)), np.zeros((10, 4)), "2-D"),
        (torch.full((10, 4), float("nan")), torch.randn(10, 4), "NaN"),
        (
            torch.randn(10, 4),
            torch.randn(10, 4).index_fill_(0, torch.tensor([3]), float("inf")),
            "NaN or inf",
        ),
        (torch.randn(1, 4), torch.randn(1, 4), "at least 2 items"),
    ],
)
def test_bad_embeddings_give_clear_errors(z1, z2, message):
    with pytest.raises(ValueError, match=message):
        gcbs_permutation(z1, z2)
    if message != "at least 2 items":
        with pytest.raises(ValueError, match=message):
            loss_gap(z1, z2, torch.arange(len(z1)), 1, TAU)


@pytest.mark.parametrize("quantile", [0.0, 1.0, 1.5, -0.1])
def test_quantile_outside_the_open_unit_interval_is_refused(quantile):
    with pytest.raises(ValueError, match="quantile must lie in"):
        gcbs_permutation(torch.randn(10, 4), torch.randn(10, 4), quantile)


@pytest.mark.parametrize(
    "order, batch_size, temperature, message",
    [
        (torch.arange(10), 16, TAU, "N smaller than a batch"),
        (torch.arange(10), 0, TAU, "batch_size must be an int in"),
        (torch.arange(10), 5.0, TAU, "batch_size must be an int in"),
        (torch.zeros(10, dtype=torch.long), 5, TAU, "permutation"),
        (torch.arange(10) + 0.3, 5, TAU, "order must hold integer indices"),
        (torch.arange(9), 5, TAU, "permutation"),
        (torch.arange(10), 5, 0.0, "temperature must be positive"),
    ],
)
def test_loss_gap_refuses_bad_orders_batch_sizes_and_temperatures(
    order, batch_size, temperature, message
):
    with pytest.raises(ValueError, match=message):
        loss_gap(torch.randn(10, 4), torch.randn(10, 4), order, batch_size, temperature)


def test_batches_larger_than_the_data_are_refused():
    with pytest.raises(ValueError, match="N smaller than a batch"):
        keyed(torch.randn(10, 4), torch.randn(10, 4), 11, 0.9)


def test_the_published_order_is_computed_without_tf32_and_leaves_the_setting_as_it_was(monkeypatch):
    seen = []
    quantiles = gcbs._chunk_quantiles

    def recording(chunks, quantile):
        seen.append(torch.get_float32_matmul_precision())
        return quantiles(chunks, quantile)

    monkeypatch.setattr(gcbs, "_chunk_quantiles", recording)
    z1, z2 = torch.randn(2, 50, 8, generator=torch.Generator().manual_seed(0))
    torch.set_float32_matmul_precision("high")  # what a trainer on CUDA sets for TF32
    try:
        gcbs.published_permutation(z1, z2)
        assert set(seen) == {"highest"} and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")


def test_same_group_pairs_is_the_share_of_in_batch_pairs_that_share_a_group():
    batches = torch.tensor([[0, 1, 2], [3, 4, 5]])
    # batch 0: items 0, 1 share "a" (1 pair of 3); batch 1: all three share "b" (3 of 3)
    groups = ["a", "a", "c", "b", "b", "b"]
    assert same_group_pairs(batches, groups) == pytest.approx(4 / 6)
    assert same_group_pairs(batches, range(6)) == 0.0
