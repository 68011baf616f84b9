"""gcbs_lib.distributed in one process: the identities the multi-process tests build on.

`gather_with_grad`'s backward is checked only in `test_distributed_gloo.py`, on purpose: in one
process the sum over ranks has a single term, so a backward that stopped summing would still pass
here.
"""

import pytest
import torch

from gcbs_lib.check import relative_error
from gcbs_lib.distributed import (
    VirtualRanks,
    all_reduce_gradients,
    gather_ragged,
    gather_with_grad,
    rank_difference,
)
from gcbs_lib.launcher import launch


def embeddings(n, dim=6, seed=0):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_gathers_are_the_identity_when_not_distributed():
    x = embeddings(4)
    assert gather_with_grad(x) is x and gather_ragged(x) is x


def test_gradient_helpers_leave_a_single_process_alone():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    all_reduce_gradients([p, p])
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
    assert rank_difference([p, p.grad]) == 0.0


def test_virtual_reduce_scatter_sums_every_ranks_gradient_of_each_rows():
    ranks = VirtualRanks(3)
    pieces = [embeddings(2, seed=r).requires_grad_() for r in range(3)]
    copies = ranks.all_gather(pieces)
    losses = [(copies[r] ** 3).sum() * (r + 1) for r in range(3)]
    received = ranks.reduce_scatter(
        [torch.autograd.grad(loss, copy)[0] for loss, copy in zip(losses, copies)]
    )
    autograd = torch.autograd.grad(
        sum((torch.cat(pieces) ** 3).sum() * (r + 1) for r in range(3)), pieces
    )
    for ours, reference in zip(received, autograd):
        assert relative_error(ours, reference) <= 1e-15


def test_virtual_own_slice_keeps_each_ranks_own_rows_of_its_own_copy():
    ranks = VirtualRanks(2)
    grads = [torch.arange(8.0).view(4, 2) * (r + 1) for r in range(2)]
    assert [g.tolist() for g in ranks.own_slice(grads)] == [[[0, 1], [2, 3]], [[8, 10], [12, 14]]]


def test_virtual_all_reduce_mean_is_the_mean_over_ranks():
    assert VirtualRanks(2).all_reduce_mean(
        [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    ).tolist() == [2, 4]


def test_virtual_shard_splits_tensors_and_dicts_into_equal_rank_pieces():
    ranks = VirtualRanks(2)
    batch = {"input_ids": torch.arange(8).view(4, 2), "note": "kept"}
    shards = ranks.shard(batch)
    assert [s["input_ids"].tolist() for s in shards] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert shards[1]["note"] == "kept"
    with pytest.raises(ValueError, match="equal shards"):
        ranks.shard(torch.zeros(5, 2))


def test_launch_refuses_before_starting_anything_a_function_child_processes_cannot_import():
    def local():
        pass

    for target in (local, lambda: None):
        with pytest.raises(ValueError, match="move it into gcbs_lib"):
            launch(target)
    with pytest.raises(ValueError, match="module:function"):
        launch("gcbs_lib.launcher")
