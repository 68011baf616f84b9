"""Negatives from every rank, and the exact full-batch gradient, under data parallelism (derived in
notebook 02): `gather_with_grad`'s backward hands each rank the sum over ranks of its rows'
gradient, so with each rank's share of the loss (`losses.rank_info_nce`) DDP's average is the
full-batch gradient. `VirtualRanks` writes the collectives out in one process (real ranks:
`gcbs_lib.launcher`)."""

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcbs_lib.check import require
from gcbs_lib.gradcache import batch_length, slice_batch

MAX_DIMS = 8  # sizes in gather_with_grad's layout check


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when torch.distributed is not
    initialised."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _GatherWithGrad(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter (sum the gradient over ranks, keep
    own rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _everyone(x).flatten(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        own = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_single(own, grad.contiguous(), op=dist.ReduceOp.SUM)
        return own


def _everyone(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` [n, ...] (one shape and dtype on every rank), stacked [W, n, ...]."""
    out = t.new_empty((dist.get_world_size() * len(t), *t.shape[1:]))
    dist.all_gather_single(out, t.contiguous())
    return out.view(-1, *t.shape)


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """`[B, ...]` on each rank → `[W·B, ...]`, ranks in order; the backward sums the incoming
    gradients over ranks and returns this rank's rows. Identity when not distributed. Checking that
    all ranks hold one shape (its first MAX_DIMS sizes) and dtype, else a ValueError on every rank,
    costs an all-gather of MAX_DIMS + 2 int64 per rank on x's device and one host sync."""
    if rank_and_world_size()[1] == 1:
        return x
    padding = [-1] * (MAX_DIMS - x.dim())
    code = zlib.crc32(str(x.dtype).encode())
    layout = torch.tensor([code, x.dim(), *x.shape[:MAX_DIMS], *padding], device=x.device)
    layouts = _everyone(layout)
    if not torch.equal(layouts, layout.expand_as(layouts)):
        raise ValueError(
            f"gather_with_grad: ranks hold different shapes or dtypes (here {tuple(x.shape)} "
            f"{x.dtype}; per rank: dtype code, dims, sizes {layouts.tolist()}; see gather_ragged)"
        )
    return _GatherWithGrad.apply(x)


def gather_ragged(rows: torch.Tensor, main_only: bool = False) -> torch.Tensor | None:
    """`gather_with_grad` for ranks holding different numbers of rows (padded to the longest,
    padding dropped). main_only: to rank 0 alone (None elsewhere), without gradient, where it holds
    W times the longest rank's rows, then their concatenation."""
    rank, world_size = rank_and_world_size()
    if world_size == 1:
        return rows
    counts = _everyone(torch.tensor([len(rows)], device=rows.device)).view(-1).tolist()
    padded = torch.cat([rows, rows.new_zeros(max(counts) - len(rows), *rows.shape[1:])])
    parts = [torch.empty_like(padded) for _ in counts] if main_only and rank == 0 else None
    if main_only:
        dist.gather(padded.detach(), parts, dst=0)
    else:
        parts = gather_with_grad(padded).split(len(padded))
    return None if parts is None else torch.cat([p[:c] for p, c in zip(parts, counts)])


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Average `.grad` over ranks for parameters no DistributedDataParallel module reduces (e.g. a
    LogitScale inside the loss), each once however often listed; every rank must hold the same
    gradients. No-op in one process."""
    _, world_size = rank_and_world_size()
    for p in {id(p): p for p in parameters}.values():
        if world_size > 1 and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


def rank_difference(tensors: Iterable[torch.Tensor]) -> float:
    """The largest difference between ranks in any entry of `tensors` (of the same sizes and dtypes
    on every rank): 0.0 means bitwise identical, and always when not distributed; NaN when any rank
    holds a NaN."""
    if rank_and_world_size()[1] == 1:
        return 0.0
    tensors = [t.detach().reshape(-1) for t in tensors if t.numel()]
    layouts = [None] * dist.get_world_size()
    has_nan = any(bool(t.isnan().any()) for t in tensors)
    dist.all_gather_object(layouts, ([(t.numel(), str(t.dtype)) for t in tensors], has_nan))
    if any(layout != layouts[0][0] for layout, _ in layouts):
        raise ValueError("rank_difference: ranks hold tensors of different sizes or dtypes")
    if any(has_nan for _, has_nan in layouts):  # MAX and MIN all-reduces may drop a NaN
        return float("nan")
    largest = 0.0
    for tensor in tensors:
        high = tensor.clone()
        low = tensor.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        # inf − inf: 0
        largest = max(largest, float((high.double() - low.double()).nan_to_num(nan=0.0).max()))
    return largest


@dataclass(frozen=True)
class VirtualRanks:
    """W ranks simulated in one process: each collective is tensor arithmetic over a list with one
    entry per rank."""

    world_size: int

    def shard(self, batch):
        """Rank r's rows r·B:(r+1)·B of a global batch (tensor or tokenizer-style dict), as a
        DistributedSampler."""
        n = batch_length(batch)
        require(
            not n % self.world_size,
            f"a batch of {n} does not split into {self.world_size} equal shards",
        )
        b = n // self.world_size
        return [slice_batch(batch, r * b, (r + 1) * b) for r in range(self.world_size)]

    def all_gather(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's own copy of the concatenated pieces: separate leaves, so each rank's loss
        has its gradient."""
        gathered = torch.cat([p.detach() for p in pieces])
        return [gathered.clone().requires_grad_() for _ in range(self.world_size)]

    def reduce_scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward of `gather_with_grad`: rank r receives the sum over ranks of the gradient of
        its rows."""
        return list(torch.stack(grads).sum(dim=0).chunk(self.world_size))

    def own_slice(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward of a gather without gradient (or MIL-NCE's AllGather): rank r keeps its own
        copy's rows."""
        return [grad.chunk(self.world_size)[r] for r, grad in enumerate(grads)]

    def all_reduce_mean(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """What DDP does to parameter gradients: the mean over ranks, identical on every rank."""
        return torch.stack(per_rank).sum(dim=0) / self.world_size
