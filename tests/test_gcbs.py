"""Specification of GCBS: the similarity graph, its RCM order, the batch sampler and the diagnostics."""
import os
import socket

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow, reverse_cuthill_mckee
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from gcbs_lib import gcbs
from gcbs_lib.gcbs import (GCBSBatchSampler, bandwidth, batches_loss_gap, cut_batches, edges_to_graph, gcbs_order,
                           gcbs_permutation, graph_rows, loss_gap, offdiagonal_quantile, separate_duplicates,
                           similarity_blocks, synthetic_pairs, topk_batch_share)
from gcbs_lib.seeding import generator, stream_seed

BATCH, TAU = 32, 0.05


def offdiagonal_values(z1, z2):
    """All off-diagonal cosine similarities in float32 (one plain product, diagonal removed), as float64."""
    similarity = F.normalize(z1.float(), dim=1) @ F.normalize(z2.float(), dim=1).T
    return similarity[~torch.eye(len(z1), dtype=torch.bool)].numpy().astype(np.float64)


def random_order(n, seed=0):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


class PairEncoder(nn.Module):
    """A linear encoder with dropout over fixed pair features; `embed(indices)` returns both sides."""

    def __init__(self, n=200, dim=16, seed=0):
        super().__init__()
        self.x1, self.x2 = synthetic_pairs(n, dim, clusters=8, seed=seed)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.proj, self.dropout = nn.Linear(dim, dim), nn.Dropout(0.5)
        self.modes_seen = []

    def embed(self, idx):
        self.modes_seen.append((self.training, torch.is_grad_enabled()))
        return self.dropout(self.proj(self.x1[idx])), self.dropout(self.proj(self.x2[idx]))


def make_sampler(encoder, **overrides):
    options = dict(embed=encoder.embed, num_items=len(encoder.x1), batch_size=20, last_batch="drop",
                   quantile=0.98, model=encoder, embed_batch_size=64, seed=0, progress=False)
    return GCBSBatchSampler(**{**options, **overrides})


# ------------------------------------------------------------------------------- the permutation

def test_permutation_orders_every_item_once_and_follows_the_seed():
    z1, z2 = synthetic_pairs(500, 16, clusters=10)
    order = gcbs_permutation(z1, z2, quantile=0.99, seed=1)
    assert order.dtype == torch.long
    assert torch.equal(order.sort().values, torch.arange(500))
    assert torch.equal(order, gcbs_permutation(z1, z2, quantile=0.99, seed=1))
    assert not torch.equal(order, gcbs_permutation(z1, z2, quantile=0.99, seed=2))


def reference_order(z1, z2, quantile, seed):
    """The GCBS order as the kit computed it before the one-pass design, written plainly: the whole similarity
    matrix from the same row blocks of 2^22 entries, numpy's quantile of its off-diagonal entries, the entries
    above it as edges, RCM after the seeded relabelling. Returns (threshold, directed edge count, graph, order)."""
    u1, u2 = (F.normalize(z.float(), dim=1) for z in (z1, z2))
    n = len(u1)
    rows = max(1, 2**22 // n)
    similarity = torch.cat([u1[s:s + rows] @ u2.T for s in range(0, n, rows)]).numpy().astype(np.float64)
    np.fill_diagonal(similarity, np.nan)
    threshold = np.quantile(similarity[~np.isnan(similarity)], quantile)
    directed = csr_matrix(np.nan_to_num(similarity, nan=-np.inf) > threshold)
    graph = (directed + directed.T).tocsr()
    relabel = np.random.default_rng(seed).permutation(n)
    order = relabel[reverse_cuthill_mckee(graph[relabel][:, relabel].tocsr(), symmetric_mode=True)]
    return threshold, directed.nnz, graph, torch.from_numpy(order.astype(np.int64))


def tied_pairs(n, dim, seed=0):
    """A third of the items coincide (many equal similarities), and the positives point the other way."""
    z1 = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    z1[:n // 3] = z1[0]
    return z1, -z1


DATA_SETS = {  # name: (z1, z2, quantile)
    "clustered, 3 blocks": (*synthetic_pairs(3000, 16, clusters=40, seed=1), 0.999),
    "isotropic": (*synthetic_pairs(1500, 32, seed=2), 0.995),
    "tight clusters, low q": (*synthetic_pairs(700, 8, clusters=5, spread=0.05, seed=3), 0.25),
    "ties and negatives": (*tied_pairs(400, 4), 0.97),
    "three items": (*synthetic_pairs(3, 4, seed=4), 0.5),
}


def same_graph(a, b):
    return a.shape == b.shape and (a != b).nnz == 0


@pytest.mark.parametrize("name", DATA_SETS)
def test_one_pass_gives_the_threshold_graph_and_order_of_the_full_matrix_reference(name):
    z1, z2, quantile = DATA_SETS[name]
    threshold, edges, graph, order = reference_order(z1, z2, quantile, seed=5)
    result = gcbs_order(z1, z2, quantile, seed=5)
    assert result.threshold == threshold and result.edges == edges
    assert same_graph(result.graph, graph)
    assert torch.equal(result.order, order)
    assert result.passes == 1


def bound_above(threshold):
    """A `_sample_bound` whose first (most confident) bound lies above `threshold`, so that the first pass misses."""
    bound = gcbs._sample_bound
    return lambda sample, n, need, confidence: (float(np.float32(threshold + 0.01)) if confidence == gcbs.CONFIDENCE
                                                else bound(sample, n, need, confidence))


def test_a_missed_sample_bound_costs_a_second_pass_and_changes_nothing(monkeypatch):
    z1, z2, quantile = DATA_SETS["clustered, 3 blocks"]
    threshold, _, graph, order = reference_order(z1, z2, quantile, seed=5)
    monkeypatch.setattr(gcbs, "_sample_bound", bound_above(threshold))
    result = gcbs_order(z1, z2, quantile, seed=5)
    assert result.passes == 2 and result.candidates > result.edges
    assert result.threshold == threshold and same_graph(result.graph, graph) and torch.equal(result.order, order)


def test_the_pass_keeps_few_candidates_beyond_the_edges():
    z1, z2, quantile = DATA_SETS["clustered, 3 blocks"]
    result = gcbs_order(z1, z2, quantile, seed=0)
    assert result.edges <= result.candidates <= 3 * result.edges  # 6 standard errors of a 256-row sample


def test_positive_pairs_on_the_diagonal_are_never_edges():
    z1, z2 = synthetic_pairs(800, 16, noise=0.01)  # each item's most similar column is its own positive
    graph = gcbs_order(z1, z2, quantile=0.99, seed=0).graph
    assert graph.diagonal().sum() == 0
    assert graph.nnz > 0


@pytest.mark.parametrize("quantile", [0.9, 0.99, 0.999])
def test_edge_count_is_within_one_percent_of_the_quantile_share_of_off_diagonal_pairs(quantile):
    n = 2000
    z1, z2 = synthetic_pairs(n, 16, clusters=20)
    rows, cols = graph_rows(z1, z2, threshold=offdiagonal_quantile(z1, z2, quantile))
    expected = (1 - quantile) * n * (n - 1)
    assert abs(len(rows) - expected) <= 0.01 * expected
    assert not np.any(rows == cols)


@pytest.mark.parametrize("n, quantile, clusters", [(2, 0.5, 0), (37, 0.1, 0), (500, 0.999, 5), (1500, 0.5, 0),
                                                   (4096, 0.999, 40), (4096, 0.25, 0)])
def test_exact_quantile_equals_numpys_linear_quantile(n, quantile, clusters):
    z1, z2 = synthetic_pairs(n, 8, clusters=clusters, seed=n)
    assert offdiagonal_quantile(z1, z2, quantile) == np.quantile(offdiagonal_values(z1, z2), quantile)


def test_exact_quantile_handles_negative_and_tied_similarities():
    z1 = torch.randn(300, 4, generator=torch.Generator().manual_seed(0))
    z1[:100] = z1[0]  # a third of the items coincide: many equal similarities
    values = offdiagonal_values(z1, -z1)
    for quantile in (0.05, 0.5, 0.97):
        assert offdiagonal_quantile(z1, -z1, quantile) == np.quantile(values, quantile)


def test_library_similarities_are_the_cosine_similarities():
    z1, z2 = synthetic_pairs(300, 8)
    full = (F.normalize(z1, dim=1) @ F.normalize(z2, dim=1).T).fill_diagonal_(0).numpy()
    blocks = np.concatenate([np.nan_to_num(b, neginf=0.0) for _, b in similarity_blocks(z1, z2)])
    assert np.allclose(blocks, full, atol=1e-6)


def test_top_k_graph_keeps_each_rows_k_most_similar_other_items():
    z1, z2 = synthetic_pairs(300, 8, clusters=6)
    rows, cols = graph_rows(z1, z2, top_k=4)
    assert np.array_equal(np.bincount(rows, minlength=300), np.full(300, 4))
    similarity = (F.normalize(z1, dim=1) @ F.normalize(z2, dim=1).T).fill_diagonal_(-2)
    expected = similarity.topk(4, dim=1).indices.sort(dim=1).values.numpy()
    assert np.array_equal(np.sort(cols.reshape(300, 4), axis=1), expected)
    order = gcbs_order(z1, z2, top_k=4, seed=0)
    assert order.threshold is None and order.graph.diagonal().sum() == 0


def test_isolated_nodes_are_neither_in_index_order_nor_always_at_the_end_of_the_epoch():
    z1, z2 = synthetic_pairs(400, 16, clusters=4, spread=0.1)
    loners = torch.randn(200, 16, generator=torch.Generator().manual_seed(1))  # nothing similar: no edge
    z1, z2 = torch.cat([z1, loners]), torch.cat([z2, loners])
    isolated = set(np.flatnonzero(gcbs_order(z1, z2, 0.99, seed=0).graph.getnnz(axis=1) == 0).tolist())
    assert len(isolated) > 50
    sequences = [[i for i in gcbs_permutation(z1, z2, 0.99, seed).tolist() if i in isolated] for seed in (0, 1)]
    assert sequences[0] != sorted(sequences[0]) and sequences[0] != sequences[1]
    sampler = GCBSBatchSampler(lambda idx: (z1[idx], z2[idx]), 600, 50, "drop", quantile=0.99, progress=False)
    epoch = sum(sampler, [])
    assert not set(epoch[-len(isolated):]) <= isolated


def test_bandwidth_is_the_largest_order_distance_across_an_edge():
    path = edges_to_graph(np.arange(9), np.arange(1, 10), 10)  # 0 - 1 - … - 9
    assert bandwidth(path, np.arange(10)) == 1
    assert bandwidth(path, np.r_[0:10:2, 1:10:2]) == 5


# ------------------------------------------------------------------------------- the diagnostics

def test_loss_gap_equals_global_minus_in_batch_cross_entropy():
    z1, z2 = synthetic_pairs(50, 6, clusters=3, seed=3)
    order, batch_size = random_order(50), 8  # the last batch holds 2 items
    logits = F.normalize(z1.double(), dim=1) @ F.normalize(z2.double(), dim=1).T / TAU
    global_loss = F.cross_entropy(logits, torch.arange(50), reduction="sum")
    train_loss = sum(F.cross_entropy(logits[b][:, b], torch.arange(len(b)), reduction="sum")
                     for b in order.split(batch_size))
    gap = loss_gap(z1, z2, order, batch_size, TAU)
    assert gap == pytest.approx(float(global_loss - train_loss) / 50, rel=1e-12)
    assert loss_gap(z1, z2, order, 50, TAU) == pytest.approx(0, abs=1e-12)


def test_on_planted_clusters_gcbs_lowers_the_loss_gap_and_multiplies_the_in_batch_topk_share():
    z1, z2 = synthetic_pairs(2048, 32, clusters=64)
    gcbs, shuffled = gcbs_permutation(z1, z2, quantile=0.99, seed=0), random_order(2048)
    assert loss_gap(z1, z2, gcbs, BATCH, TAU) < 0.5 * loss_gap(z1, z2, shuffled, BATCH, TAU)
    assert topk_batch_share(z1, z2, gcbs, BATCH, k=5) > 5 * topk_batch_share(z1, z2, shuffled, BATCH, k=5)


# ------------------------------------------------------------------------------------- batches

def test_duplicates_never_share_a_batch_when_keys_are_given():
    z1, z2 = synthetic_pairs(300, 16, clusters=5)
    keys = [i % 120 for i in range(300)]  # every text occurs 2 or 3 times
    z1, z2 = z1[torch.tensor(keys)], z2[torch.tensor(keys)]  # identical texts embed identically
    sampler = GCBSBatchSampler(lambda idx: (z1[idx], z2[idx]), 300, 20, "pad", quantile=0.99, keys=keys,
                               progress=False)
    batches = list(sampler)
    assert all(len({keys[i] for i in batch}) == 20 for batch in batches)
    assert set(i for b in batches for i in b) == set(range(300))
    assert max(sum(keys[i] == keys[j] for i in b for j in b if i < j)
               for b in cut_batches(sampler.last.order, 20, "pad")) > 0  # without keys they would meet


def test_a_key_with_a_copy_for_every_batch_still_gets_one_per_batch():
    keys = list(range(56)) + ["same"] * 8  # 8 batches of 8; the 8 copies come last in the order
    order = separate_duplicates(torch.arange(64), keys, 8)
    assert torch.equal(order.sort().values, torch.arange(64))
    assert all(len({keys[i] for i in batch}) == 8 for batch in order.view(8, 8).tolist())


def test_a_key_with_more_copies_than_batches_cannot_be_separated():
    with pytest.raises(ValueError, match="no order of these keys has distinct keys in every batch"):
        separate_duplicates(torch.arange(64), list(range(55)) + ["same"] * 9, 8)


def one_key_per_batch_exists(keys, batch_size):
    """Independent check by maximum flow: source → key (its count) → batch (1 per key) → sink (batch size)."""
    distinct, sizes = sorted(set(keys)), [min(batch_size, len(keys) - s) for s in range(0, len(keys), batch_size)]
    k, b = len(distinct), len(sizes)
    capacity = np.zeros((k + b + 2, k + b + 2), np.int32)
    capacity[0, 1:k + 1] = [keys.count(key) for key in distinct]
    capacity[1:k + 1, k + 1:k + b + 1] = 1
    capacity[k + 1:k + b + 1, -1] = sizes
    return maximum_flow(csr_matrix(capacity), 0, k + b + 1).flow_value == len(keys)


def test_duplicates_are_separated_exactly_when_some_order_allows_it():
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(150):
        batch_size, n = int(rng.integers(2, 7)), int(rng.integers(4, 30))
        keys = rng.integers(0, int(rng.integers(2, n + 1)), n).tolist()
        try:
            order = separate_duplicates(torch.from_numpy(rng.permutation(n)), keys, batch_size)
            assert all(len({keys[i] for i in b}) == len(b) for b in order.split(batch_size))
            separated = True
        except ValueError:
            separated = False
        assert separated == one_key_per_batch_exists(keys, batch_size)
        outcomes.add(separated)
    assert outcomes == {True, False}


def test_last_batch_is_dropped_or_padded_as_asked():
    order = random_order(50)
    dropped, padded = cut_batches(order, 16, "drop"), cut_batches(order, 16, "pad")
    assert [len(b) for b in dropped] == [16, 16, 16] and sum(dropped, []) == order[:48].tolist()
    assert [len(b) for b in padded] == [16] * 4 and len(set(padded[-1])) == 16
    assert padded[-1] == order[48:].tolist() + order[:14].tolist()


def test_ddp_rank_slices_are_contiguous_and_together_make_the_global_batch():
    encoder = PairEncoder()
    single = list(make_sampler(encoder, batch_size=24))
    ranks = [list(make_sampler(encoder, batch_size=24, rank=r, world_size=4)) for r in range(4)]
    assert all(len(s) == 6 for batches in ranks for s in batches)
    assert [sum(parts, []) for parts in zip(*ranks)] == single


def test_sampler_recomputes_the_order_at_each_epoch_in_eval_mode_without_grad():
    encoder = PairEncoder()
    sampler = make_sampler(encoder)
    first = list(sampler)
    with torch.no_grad():
        encoder.proj.weight.copy_(torch.randn(16, 16))  # training moved the embeddings
    second = list(sampler)
    assert len(encoder.modes_seen) == 2 * 4  # 200 items in 4 embedding batches, every epoch
    assert set(encoder.modes_seen) == {(False, False)} and encoder.training
    assert first != second and len(first) == len(sampler) == 10


def test_sampler_is_deterministic_for_a_seed_and_shuffles_batches_per_epoch():
    runs = {}
    for seed, epoch in [(0, 0), (0, 0), (0, 1), (1, 0)]:
        sampler = make_sampler(PairEncoder(), seed=seed)
        sampler.set_epoch(epoch)
        runs.setdefault((seed, epoch), []).append(list(sampler))
    assert runs[(0, 0)][0] == runs[(0, 0)][1]
    assert runs[(0, 1)][0] != runs[(0, 0)][0] and runs[(1, 0)][0] != runs[(0, 0)][0]


def test_sampler_streams_of_seed_0_epoch_1_and_seed_1_epoch_0_do_not_collide():
    encoder = PairEncoder()  # fixed weights: only the seeds and epochs differ between the runs
    runs = {}
    for seed, epoch in [(0, 1), (1, 0)]:
        sampler = make_sampler(encoder, seed=seed)
        sampler.set_epoch(epoch)
        runs[(seed, epoch)] = (list(sampler), sampler.last.order)
    assert runs[(0, 1)][0] != runs[(1, 0)][0]
    assert not torch.equal(runs[(0, 1)][1], runs[(1, 0)][1])


def test_sampler_draws_relabelling_and_shuffle_from_named_streams():
    encoder = PairEncoder()
    sampler = make_sampler(encoder, seed=3)
    sampler.set_epoch(2)
    batches = list(sampler)
    z1, z2 = sampler.embeddings
    order = gcbs_permutation(z1, z2, quantile=0.98, seed=stream_seed(3, 2, "gcbs-relabel"))
    assert torch.equal(sampler.last.order, order)
    cut = cut_batches(order, 20, "drop")
    shuffle = torch.randperm(len(cut), generator=generator(3, 2, "gcbs-batch-shuffle"))
    assert batches == sampler.batches == [cut[b] for b in shuffle.tolist()]


def brute_force_gap(z1, z2, batches):
    """Mean over trained (batch, item) of the global minus the in-batch log-partition, full float64 matrix."""
    logits = F.normalize(z1.double(), dim=1) @ F.normalize(z2.double(), dim=1).T / TAU
    terms = [logits[i].logsumexp(0) - logits[i, b].logsumexp(0) for b in batches for i in b]
    return float(torch.stack(terms).mean())


@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_sampler_loss_gap_is_the_gap_of_the_batches_actually_trained_on(last_batch):
    encoder = PairEncoder(n=210)  # 210 = 10 batches of 20 and 10 left over: dropped or padded
    keys = [i % 150 for i in range(210)]
    sampler = make_sampler(encoder, last_batch=last_batch, keys=keys)
    with pytest.raises(RuntimeError, match="no epoch has started"):
        sampler.loss_gap(TAU)
    batches = list(sampler)
    assert len(batches) == (10 if last_batch == "drop" else 11)
    z1, z2 = sampler.embeddings
    assert sampler.loss_gap(TAU) == pytest.approx(brute_force_gap(z1, z2, batches), rel=1e-12)


def test_batch_loss_gap_refuses_repeated_out_of_range_and_empty_batches():
    z1, z2 = synthetic_pairs(10, 4)
    for batches, message in [([[0, 1, 1]], "twice"), ([[0, 10]], "must lie in"), ([[0], []], "empty"),
                             ([], "at least one")]:
        with pytest.raises(ValueError, match=message):
            batches_loss_gap(z1, z2, batches, TAU)


def test_sampler_records_stage_times_and_shows_progress_only_when_asked(capsys):
    encoder = PairEncoder()
    sampler = make_sampler(encoder)
    list(sampler)
    assert capsys.readouterr().err == ""
    times = sampler.last.times
    assert min(times.embed, times.similarity, times.graph, times.rcm) > 0
    list(make_sampler(encoder, progress=True))
    assert "GCBS embed" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("z1, z2, message", [
    (torch.randn(10, 4), torch.randn(9, 4), "same shape"),
    (torch.randn(0, 4), torch.randn(0, 4), "empty"),
    (torch.randn(10), torch.randn(10), "2-D"),
    (torch.full((10, 4), float("nan")), torch.randn(10, 4), "NaN"),
    (torch.randn(10, 4), torch.randn(10, 4).index_fill_(0, torch.tensor([3]), float("inf")), "NaN or inf"),
    (torch.randn(1, 4), torch.randn(1, 4), "at least 2 items"),
])
def test_bad_embeddings_give_clear_errors(z1, z2, message):
    with pytest.raises(ValueError, match=message):
        gcbs_permutation(z1, z2)


@pytest.mark.parametrize("quantile", [0.0, 1.0, 1.5, -0.1])
def test_quantile_outside_the_open_unit_interval_is_refused(quantile):
    with pytest.raises(ValueError, match="quantile must lie in"):
        gcbs_permutation(torch.randn(10, 4), torch.randn(10, 4), quantile)


def test_batches_larger_than_the_data_and_bad_batch_options_are_refused():
    z1, z2 = torch.randn(10, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="N smaller than a batch"):
        loss_gap(z1, z2, torch.arange(10), 16, TAU)
    with pytest.raises(ValueError, match="N smaller than a batch"):
        cut_batches(torch.arange(10), 16, "drop")
    with pytest.raises(ValueError, match="permutation"):
        topk_batch_share(z1, z2, torch.zeros(10, dtype=torch.long), 5, k=3)
    with pytest.raises(ValueError, match="'drop' or 'pad'"):
        cut_batches(torch.arange(10), 4, "keep")
    with pytest.raises(ValueError, match="must divide by world_size"):
        make_sampler(PairEncoder(), batch_size=30, world_size=4)
    with pytest.raises(ValueError, match="N smaller than a batch"):
        make_sampler(PairEncoder(), batch_size=201)


# ------------------------------------------------------------------------ multi-process (gloo)

def _distributed_worker(rank, world_size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    z1, z2 = synthetic_pairs(3000, 16, clusters=40)
    found = gcbs_order(z1, z2, quantile=0.995, seed=7, rank=rank, world_size=world_size)
    gcbs._sample_bound = bound_above(found.threshold)  # a spawned process: the first pass now misses
    missed = gcbs_order(z1, z2, quantile=0.995, seed=7, rank=rank, world_size=world_size)
    slices = list(make_sampler(PairEncoder(), batch_size=24, rank=rank, world_size=world_size))
    orders = {name: {"order": r.order, "threshold": r.threshold, "passes": r.passes, "edges": r.edges,
                     "indices": torch.from_numpy(r.graph.indices), "indptr": torch.from_numpy(r.graph.indptr)}
              for name, r in [("found", found), ("missed", missed)]}
    torch.save({"orders": orders, "slices": slices}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ranks_sharing_the_similarity_rows_reproduce_the_reference_graph_order_and_batches(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_distributed_worker, args=(2, port, str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    threshold, edges, graph, order = reference_order(*synthetic_pairs(3000, 16, clusters=40), 0.995, seed=7)
    for result in results:
        for name, passes in [("found", 1), ("missed", 2)]:
            got = result["orders"][name]
            shared_graph = csr_matrix((np.ones(len(got["indices"]), bool), got["indices"].numpy(),
                                       got["indptr"].numpy()), shape=graph.shape)
            assert got["threshold"] == threshold and got["edges"] == edges and got["passes"] == passes
            assert same_graph(shared_graph, graph) and torch.equal(got["order"], order)
    single_batches = list(make_sampler(PairEncoder(), batch_size=24))
    assert [a + b for a, b in zip(results[0]["slices"], results[1]["slices"])] == single_batches
