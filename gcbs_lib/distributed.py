"""Negatives from every rank, and the exact full-batch gradient, under data parallelism (derived in
notebook 02): `gather_with_grad`'s backward hands each rank the sum over ranks of its rows'
gradient, so with each rank's share of the loss (`losses.rank_info_nce`) DDP's average is the
full-batch gradient. `VirtualRanks` writes the collectives out in one process; `launch` runs a
function on local ranks."""

import gc
import importlib
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gcbs_lib.check import require
from gcbs_lib.gradcache import batch_length, slice_batch


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when torch.distributed is not
    initialised."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _GatherWithGrad(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter (sum the gradient over ranks, keep
    own rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gathered = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(gathered, x.contiguous())
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        own = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_single(own, grad.contiguous(), op=dist.ReduceOp.SUM)
        return own


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """`[B, ...]` on each rank → `[W·B, ...]`, ranks in order; the backward sums the incoming
    gradients over ranks and returns this rank's rows. Identity when not distributed; different
    shapes or dtypes raise on every rank."""
    if rank_and_world_size()[1] == 1:
        return x
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, (tuple(x.shape), str(x.dtype)))
    if len(set(layouts)) > 1:
        raise ValueError(
            f"gather_with_grad: ranks hold different shapes or dtypes {layouts} (see gather_ragged)"
        )
    return _GatherWithGrad.apply(x)


def gather_ragged(rows: torch.Tensor) -> torch.Tensor:
    """`gather_with_grad` for ranks holding different numbers of rows (padded to the longest,
    padding dropped)."""
    if rank_and_world_size()[1] == 1:
        return rows
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, rows.shape[0])
    longest = max(counts)
    keep = torch.cat(
        [torch.arange(c, device=rows.device) + r * longest for r, c in enumerate(counts)]
    )
    return gather_with_grad(
        torch.cat([rows, rows.new_zeros(longest - rows.shape[0], *rows.shape[1:])])
    )[keep]


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
    tensors, layouts = (
        [t.detach().reshape(-1) for t in tensors if t.numel()],
        [None] * dist.get_world_size(),
    )
    dist.all_gather_object(
        layouts,
        ([(t.numel(), str(t.dtype)) for t in tensors], any(bool(t.isnan().any()) for t in tensors)),
    )
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


class LaunchError(RuntimeError):
    """A launched job failed: `rank` is the rank that failed first; the message holds its
    traceback."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def launch(
    target: str | Callable,
    *,
    nproc: int = 2,
    backend: str = "gloo",
    args: dict | None = None,
    timeout: float | None = None,
    echo: bool = True,
):
    """`target(**args)` on `nproc` local ranks started by torch.distributed's `elastic_launch`
    (torchrun's engine), each in a process group of `backend` ("gloo"; "nccl": one GPU per rank):
    rank 0's return value. `target`: a module-level function or "module:function" that child
    processes can import (put a notebook's in gcbs_lib). `timeout`: seconds a rank may wait in a
    collective (None: torch's default, 30 minutes, so a hung rank fails the job rather than holding
    the node); `echo`: print the ranks' output live. A rank that raises stops the
    job: LaunchError names it, with its traceback."""
    if isinstance(target, str):
        module, _, name = target.partition(":")
        require(name, f"target must look like 'module:function', got {target!r}")
        target = getattr(importlib.import_module(module), name)
    require(
        target.__module__ != "__main__" and target.__qualname__.isidentifier(),
        f"child processes cannot import "
        f"{target.__qualname__} (a notebook's, a script's or a local function): move it into "
        "gcbs_lib",
    )
    handlers = {
        s: signal.getsignal(s)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    }
    with tempfile.TemporaryDirectory(prefix="gcbs-launch-") as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id="gcbs",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            log_line_prefix_template="[rank ${rank}] ",
            logs_specs=DefaultLogsSpecs(logs, redirects=Std.ALL, tee=Std.ALL if echo else Std.NONE),
        )
        try:
            return elastic_launch(config, _run_rank)(target, args or {}, backend, timeout)[0]
        except ChildFailedError as error:
            # {rank: ProcessFailure}; the first error file written names the cause
            failures = error.failures
            written = {
                r: os.path.getmtime(f.error_file)
                for r, f in failures.items()
                if os.path.isfile(f.error_file)
            }
            rank = min(written, key=written.get) if written else min(failures)
            # the error file's {..., "extraInfo": {"py_callstack"}}, or a signal
            message = failures[rank].message
            message = message["extraInfo"]["py_callstack"] if isinstance(message, dict) else message
            raise LaunchError(
                f"rank {rank} of {target.__qualname__} failed:\n{message}", rank
            ) from None
        finally:
            if threading.current_thread() is threading.main_thread():  # the launcher replaced them
                for number, handler in handlers.items():
                    signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _run_rank(target: Callable, args: dict, backend: str, timeout: float | None):
    """One rank of a `launch`: join the process group, call the target, leave the group together."""
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun's default: one thread per rank
        torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    limit = timedelta(seconds=timeout) if timeout else dist.default_pg_timeout
    dist.init_process_group(backend, timeout=limit)
    # a rank that raises exits holding its group, so its error file is written first
    result = target(**args)
    # free DDP reducers (held in reference cycles) while their process group still exists
    gc.collect()
    dist.barrier()  # no rank tears down its group while another still talks to it
    dist.destroy_process_group()
    return result
