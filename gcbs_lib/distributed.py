"""Negatives from every rank, and the exact full-batch gradient, under data parallelism (notebook
02): `gather_with_grad`'s backward hands each rank the sum over ranks of its rows' gradient, so with
each rank's share of the loss (`losses.rank_info_nce`) DDP's average is the full-batch gradient.
`VirtualRanks` writes the collectives out in one process (real ranks: `gcbs_lib.launcher`)."""

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcbs_lib.batches import batch_length, slice_batch
from gcbs_lib.check import require

MAX_DIMS = 8  # sizes in gather_with_grad's layout check


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when none is initialised."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _GatherWithGrad(torch.autograd.Function):
    """Forward: all-gather on dim 0. Backward: reduce-scatter (sum over ranks, keep own rows)."""

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
    gradients over ranks and returns this rank's rows; identity when not distributed. Ranks of other
    shapes or dtypes raise ValueError on every rank (an all-gather of MAX_DIMS + 2 int64 checks)."""
    if rank_and_world_size()[1] == 1:
        return x

    # dtype code first
    sizes = [zlib.crc32(str(x.dtype).encode()), x.dim(), *x.shape[:MAX_DIMS]]
    layout = torch.tensor(sizes + [-1] * (MAX_DIMS + 2 - len(sizes)), device=x.device)
    layouts = _everyone(layout)
    if not torch.equal(layouts, layout.expand_as(layouts)):
        raise ValueError(
            f"gather_with_grad: ranks hold different shapes or dtypes (here {tuple(x.shape)} "
            f"{x.dtype}; per rank: dtype code, dims, sizes {layouts.tolist()}; see gather_ragged)"
        )

    return _GatherWithGrad.apply(x)


def gather_ragged(rows: torch.Tensor, main_only: bool = False) -> torch.Tensor | None:
    """`gather_with_grad` for ranks of different row counts (padded to the longest, then dropped);
    main_only: to rank 0 alone (None elsewhere), without gradient, holding W × the longest rows."""
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
    """Average `.grad` over ranks (each parameter once) where no DistributedDataParallel does, e.g.
    a LogitScale in the loss; every rank must hold the same parameters. No-op in one process."""
    _, world_size = rank_and_world_size()
    for p in {id(p): p for p in parameters}.values():
        if world_size > 1 and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


def rank_difference(tensors: Iterable[torch.Tensor]) -> float:
    """The largest difference between ranks in any entry of `tensors` (same sizes and dtypes on all
    ranks): 0.0 if bitwise identical or not distributed; NaN when any rank holds a NaN."""
    if rank_and_world_size()[1] == 1:
        return 0.0

    tensors = [t.detach().reshape(-1) for t in tensors if t.numel()]
    layouts = [None] * dist.get_world_size()
    has_nan = any(bool(t.isnan().any()) for t in tensors)
    dist.all_gather_object(layouts, ([(t.numel(), str(t.dtype)) for t in tensors], has_nan))
    if any(layout != layouts[0][0] for layout, _ in layouts):
        raise ValueError("rank_difference: ranks hold tensors of different sizes or dtypes")

    # MAX and MIN all-reduces may drop a NaN
    if any(has_nan for _, has_nan in layouts):
        return float("nan")

    largest = 0.0
    for tensor in tensors:
        high = tensor.clone()
        low = tensor.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)

        # inf − inf counts as 0
        spread = (high.double() - low.double()).nan_to_num(nan=0.0)
        largest = max(largest, float(spread.max()))
    return largest


@dataclass(frozen=True)
class VirtualRanks:
    """W ranks simulated in one process: a collective is arithmetic over a list, one per rank."""

    world_size: int

    def shard(self, batch):
        """Rank r's rows r·B:(r+1)·B of a global batch (tensor or dict), as a DistributedSampler."""
        n = batch_length(batch)
        w = self.world_size
        require(not n % w, f"a batch of {n} does not split into {w} equal shards")

        return [slice_batch(batch, r * n // w, (r + 1) * n // w) for r in range(w)]

    def all_gather(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each rank's own copy (a separate leaf, for its loss's gradient) of the pieces joined."""
        gathered = torch.cat([p.detach() for p in pieces])
        return [gathered.clone().requires_grad_() for _ in range(self.world_size)]

    def reduce_scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """`gather_with_grad`'s backward: rank r gets the sum over ranks of its rows' gradient."""
        return list(torch.stack(grads).sum(dim=0).chunk(self.world_size))

    def own_slice(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Backward of a gather without gradient (or MIL-NCE's AllGather): rank r keeps its rows."""
        return [grad.chunk(self.world_size)[r] for r, grad in enumerate(grads)]

    def all_reduce_mean(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """What DDP does to parameter gradients: the mean over ranks, identical on every rank."""
        return torch.stack(per_rank).sum(dim=0) / self.world_size
