"""gcbs_lib.distributed in one process: the identities the multi-process tests build on.

`gather_with_grad`'s backward is checked only in `test_distributed_gloo.py`, on purpose: in one process the
sum over ranks has a single term, so a backward that stopped summing would still pass here. Across 2–4 gloo
ranks, a backward that returns only this rank's slice fails the kit-step, real-vs-virtual, exact-ratio and
reduce-scatter tests there.
"""
import pytest
import torch

from gcbs_lib.check import relative_error
from gcbs_lib.distributed import (VirtualRanks, _target_name, all_reduce_gradients, gather_multi_vector,
                                  gather_with_grad, gradient_rank_difference, rank_info_nce)
from gcbs_lib.losses import info_nce


def embeddings(n, dim=6, seed=0):
    return torch.nn.functional.normalize(torch.randn(n, dim, generator=torch.Generator().manual_seed(seed),
                                                     dtype=torch.float64), dim=-1)


def test_gathers_are_the_identity_when_not_distributed():
    x = embeddings(4)
    vectors, mask = torch.ones(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    assert gather_with_grad(x) is x
    assert gather_multi_vector(vectors, mask) == (vectors, mask)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("hard_negatives", [0, 2])
def test_rank_shares_average_to_the_global_info_nce(world_size, symmetric, hard_negatives):
    queries, docs = embeddings(world_size * 3), embeddings(world_size * 3 * (1 + hard_negatives), seed=1)
    shares = [rank_info_nce(queries, docs, 5.0, symmetric, rank=r, world_size=world_size) for r in range(world_size)]
    assert relative_error(torch.stack(shares).mean(), info_nce(queries, docs, 5.0, symmetric)) <= 1e-14


def test_rank_info_nce_rejects_a_batch_that_does_not_split_over_ranks():
    with pytest.raises(ValueError, match="do not split"):
        rank_info_nce(embeddings(5), embeddings(5), rank=0, world_size=2)


def test_virtual_reduce_scatter_sums_every_ranks_gradient_of_each_rows():
    ranks = VirtualRanks(3)
    pieces = [embeddings(2, seed=r).requires_grad_() for r in range(3)]
    copies = ranks.all_gather(pieces)
    losses = [(copies[r] ** 3).sum() * (r + 1) for r in range(3)]
    received = ranks.reduce_scatter([torch.autograd.grad(loss, copy)[0] for loss, copy in zip(losses, copies)])
    autograd = torch.autograd.grad(sum((torch.cat(pieces) ** 3).sum() * (r + 1) for r in range(3)), pieces)
    for ours, reference in zip(received, autograd):
        assert relative_error(ours, reference) <= 1e-15


def test_virtual_own_slice_keeps_each_ranks_own_rows_of_its_own_copy():
    ranks = VirtualRanks(2)
    grads = [torch.arange(8.0).view(4, 2) * (r + 1) for r in range(2)]
    assert [g.tolist() for g in ranks.own_slice(grads)] == [[[0, 1], [2, 3]], [[8, 10], [12, 14]]]


def test_virtual_shard_splits_tensors_and_dicts_into_equal_rank_pieces():
    ranks = VirtualRanks(2)
    batch = {"input_ids": torch.arange(8).view(4, 2), "note": "kept"}
    shards = ranks.shard(batch)
    assert [s["input_ids"].tolist() for s in shards] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert shards[1]["note"] == "kept"
    with pytest.raises(ValueError, match="equal shards"):
        ranks.shard(torch.zeros(5, 2))


def test_gradient_helpers_leave_a_single_process_alone():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    all_reduce_gradients([p, p])
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
    assert gradient_rank_difference([p]) == 0.0


def test_launch_refuses_functions_child_processes_cannot_import():
    def local():
        pass

    with pytest.raises(ValueError, match="move it into gcbs_lib"):
        _target_name(local)
    with pytest.raises(ValueError, match="module:function"):
        _target_name("gcbs_lib.distributed")
    assert _target_name(rank_info_nce) == "gcbs_lib.distributed:rank_info_nce"
