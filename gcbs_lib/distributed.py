"""Data-parallel contrastive learning with negatives from every rank, and the exact full-batch gradient.

W ranks hold B pairs each. The loss we want is the one a single process would take over all N = W·B pairs,

    L = (1/N) Σ_i ℓ_i = (1/W) Σ_r L_r,      L_r = (1/B) Σ_{i on rank r} ℓ_i,

where ℓ_i scores query i against the documents of every rank. Rank r computes its share L_r on embeddings
gathered with `gather_with_grad`, whose backward hands each rank the sum over ranks of the gradient of its
own rows (a reduce-scatter), so the ranks' backward passes together give Σ_r dL_r/dθ = W · dL/dθ.
DistributedDataParallel then averages over ranks, which divides by W: every rank ends with exactly dL/dθ.
Parameters that DDP does not manage (a learnable logit scale inside the loss) are averaged by
`all_reduce_gradients`; `gradient_rank_difference` (`rank_difference` for any tensors) checks that the ranks
agree after a step.

`VirtualRanks` writes the same collectives out as tensor arithmetic in one process, for teaching. `launch`
runs a function of this package under torchrun (notebooks cannot hand their own functions to child
processes) and returns rank 0's result.
"""
from __future__ import annotations

import codecs
import gc
import importlib
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gcbs_lib.gradcache import batch_length, slice_batch
from gcbs_lib.losses import Scale, docs_per_query


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- gather with gradient -------------------------------------------------------------------------------------

_MAX_DIMS = 8


_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]


def _dtype_code(dtype: torch.dtype) -> int:
    """`dtype`'s index in `_DTYPES`, what ranks exchange to compare dtypes; len(_DTYPES) for any other dtype."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _check_same_shape_and_dtype(x: torch.Tensor, world_size: int) -> None:
    """Exchange shapes and dtypes before gathering, so a mismatch raises the same error on every rank instead of
    hanging or aborting in the collective."""
    shape = list(x.shape[:_MAX_DIMS])
    mine = torch.tensor([x.dim(), _dtype_code(x.dtype), *shape] + [-1] * (_MAX_DIMS - len(shape)), dtype=torch.int64,
                        device=x.device)
    every = mine.new_empty(world_size * mine.numel())
    dist.all_gather_single(every, mine)
    rows = every.view(world_size, -1).tolist()
    shapes = [tuple(row[2:2 + row[0]]) for row in rows]
    dtypes = [str(_DTYPES[row[1]]) if row[1] < len(_DTYPES) else "other" for row in rows]
    if any(row[0] == 0 or row[0] > _MAX_DIMS for row in rows) or "other" in dtypes:
        raise ValueError(f"gather_with_grad needs tensors with 1 to {_MAX_DIMS} dimensions of a standard dtype; "
                         f"ranks hold {shapes}, {dtypes}")
    if len(set(dtypes)) > 1:
        raise ValueError(f"gather_with_grad: ranks hold different dtypes {dtypes}")
    if len(set(shapes)) > 1:
        raise ValueError(f"gather_with_grad: ranks hold different shapes {shapes}; every rank must pass the same "
                         f"shape (drop incomplete last batches, or pad multi-vector outputs with gather_multi_vector)")


class _GatherWithGrad(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter, i.e. sum the gradient over ranks, keep own rows."""

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
    """`[B, ...]` on each rank → `[W·B, ...]`, ranks in order. The backward sums the incoming gradients over
    ranks and returns this rank's rows, so a loss on any rank reaches the encoder that made each row.
    Identity when not distributed; different shapes across ranks raise a ValueError on every rank.
    """
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return x
    _check_same_shape_and_dtype(x, world_size)
    return _GatherWithGrad.apply(x)


def gather_ragged(rows: torch.Tensor) -> torch.Tensor:
    """`gather_with_grad` for ranks holding different numbers of rows: pad to the longest, gather, drop the
    padding (its gradient is zero). Identity when not distributed."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return rows
    counts = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], device=rows.device))
    counts = [int(c) for c in counts]
    padded = F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, max(counts) - rows.shape[0]))
    keep = torch.cat([torch.arange(c, device=rows.device) + r * max(counts) for r, c in enumerate(counts)])
    return gather_with_grad(padded)[keep]


def gather_multi_vector(vectors: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ColBERT-style outputs `(vectors [B, L, D], mask [B, L])` whose token length L differs across ranks:
    pad both to the longest L (padded tokens masked out), then `gather_with_grad` them."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return vectors, mask
    longest = torch.tensor(vectors.shape[1], device=vectors.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    missing = int(longest) - vectors.shape[1]
    vectors = F.pad(vectors, (0, 0, 0, missing))
    mask = torch.cat([mask, mask.new_zeros(mask.shape[0], missing)], dim=1)
    return gather_with_grad(vectors), gather_with_grad(mask)


def rank_info_nce(all_queries: torch.Tensor, all_docs: torch.Tensor, scale: Scale = 20.0, symmetric: bool = False,
                  rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    """L_r, rank r's share of the global InfoNCE over gathered embeddings: its B queries against all W·B·(1+k)
    documents (and, symmetric, its B positive documents against all W·B queries). The mean of L_r over ranks
    is `losses.info_nce(all_queries, all_docs, scale, symmetric)`. Rank and world size default to this process's.
    """
    current_rank, current_world = rank_and_world_size()
    rank = current_rank if rank is None else rank
    world_size = current_world if world_size is None else world_size
    if all_queries.shape[0] % world_size:
        raise ValueError(f"{all_queries.shape[0]} gathered queries do not split over {world_size} ranks")
    group = docs_per_query(all_queries.shape[0], all_docs.shape[0])
    b = all_queries.shape[0] // world_size
    own = torch.arange(rank * b, (rank + 1) * b, device=all_queries.device)
    s = scale() if callable(scale) else scale
    loss = F.cross_entropy(all_queries[own] @ all_docs.T * s, own * group)
    if symmetric:
        loss = (loss + F.cross_entropy(all_docs[own * group] @ all_queries.T * s, own)) / 2
    return loss


# ---- gradients outside DDP, and a sync check ----------------------------------------------------------------

def all_reduce_gradients(parameters: Iterable[nn.Parameter]) -> None:
    """Average `.grad` over ranks for parameters no DistributedDataParallel module reduces (e.g. a LogitScale
    inside the loss); each parameter once, however often it is listed. No-op when not distributed."""
    _, world_size = rank_and_world_size()
    unique = list({id(p): p for p in parameters}.values())
    if world_size == 1 or not unique:
        return
    present = torch.tensor([p.grad is not None for p in unique], dtype=torch.int64, device=unique[0].device)
    dist.all_reduce(present)
    if ((present != 0) & (present != world_size)).any():
        raise ValueError("all_reduce_gradients: some parameters have a gradient on some ranks only")
    grads = [p.grad for p in unique if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat)
        flat /= world_size
        for grad, part in zip(same, flat.split([g.numel() for g in same])):
            grad.copy_(part.view_as(grad))


RANK_DIFFERENCE_BUCKET = 2**24  # entries `rank_difference` compares at a time


def rank_difference(tensors: Iterable[torch.Tensor], bucket_size: int = RANK_DIFFERENCE_BUCKET) -> float:
    """The largest difference between ranks in any entry of `tensors` (the same sizes and dtypes on every rank);
    0.0 means bitwise identical on every rank, and always when not distributed; NaN when any rank holds a NaN
    (MAX/MIN all-reduces may drop it). Entries are compared at most `bucket_size` at a time, in their own dtype
    (only a bucket's difference is taken in float64), so the check needs a few buckets of memory whatever the size
    of the model."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be at least 1, got {bucket_size}")
    _, world_size = rank_and_world_size()
    tensors = [t.detach().reshape(-1) for t in tensors]
    if world_size == 1:
        return 0.0
    device = tensors[0].device if tensors else torch.device("cpu")
    buckets = _buckets(tensors, bucket_size)
    (total,), (fewest,) = _over_ranks([sum(t.numel() for t in tensors)], device)
    if total != fewest:
        raise ValueError(f"ranks hold different sizes (between {fewest} and {total} entries)")
    largest = 0.0
    for bucket in buckets:  # equal totals: ranks cut differently meet a differing layout before any runs out
        high = torch.cat(bucket)
        layout = [_dtype_code(high.dtype), high.numel(), int(high.isnan().sum())]
        high_layout, low_layout = _over_ranks(layout, device)
        if high_layout[:2] != low_layout[:2]:
            raise ValueError(f"ranks hold tensors of different dtypes or sizes ({total} entries in all)")
        if high_layout[2]:  # every rank sees the count, so every rank returns here
            return math.nan
        high = high.view(torch.uint8) if high.dtype == torch.bool else high
        low = high.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        spread = high.to(torch.float64)
        spread -= low
        spread.masked_fill_(spread.isnan(), 0.0)  # inf − inf: the same infinity on every rank
        largest = max(largest, float(spread.max()))
    return largest


def _buckets(tensors: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """The flat `tensors`, in order, cut into buckets of pieces (views) of one dtype and at most `size` entries."""
    buckets, filled = [], size
    for tensor in tensors:
        start = 0
        while start < tensor.numel():
            if filled == size or buckets[-1][0].dtype != tensor.dtype:
                buckets.append([])
                filled = 0
            piece = tensor[start:start + size - filled]
            buckets[-1].append(piece)
            filled += piece.numel()
            start += piece.numel()
    return buckets


def _over_ranks(values: list[int], device: torch.device) -> tuple[list[int], list[int]]:
    """The largest and the smallest of each of `values` over ranks (one all-reduce)."""
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both[:len(values)].tolist(), (-both[len(values):]).tolist()


def gradient_rank_difference(parameters: Iterable[nn.Parameter]) -> float:
    """The largest difference between ranks in any gradient entry of `parameters` (those with a `.grad`); 0.0
    means bitwise identical on every rank. Call it after `backward()` in any training loop; 0.0 when not distributed."""
    return rank_difference(p.grad for p in parameters if p.grad is not None)


# ---- virtual ranks: the collectives written out in one process ------------------------------------------------

class VirtualRanks:
    """W data-parallel ranks simulated in one process. Each collective is plain tensor arithmetic over a list
    with one entry per rank, so a notebook can show what real ranks compute before launching them."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size

    def shard(self, batch):
        """Rank r's rows r·B:(r+1)·B of a global batch (tensor or tokenizer-style dict), as a DistributedSampler."""
        n = batch_length(batch)
        if n % self.world_size:
            raise ValueError(f"a batch of {n} does not split into {self.world_size} equal shards")
        b = n // self.world_size
        return [slice_batch(batch, r * b, (r + 1) * b) for r in range(self.world_size)]

    def all_gather(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's own copy of the concatenated pieces: separate leaves, so each rank's loss has its own
        gradient."""
        gathered = torch.cat([p.detach() for p in pieces])
        return [gathered.clone().requires_grad_() for _ in range(self.world_size)]

    def reduce_scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward of `gather_with_grad`: rank r receives the sum over ranks of the gradient of its rows."""
        return list(torch.stack(grads).sum(dim=0).chunk(self.world_size))

    def own_slice(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward of a gather without gradient (or MIL-NCE's AllGather): rank r keeps only its own copy's rows."""
        return [grad.chunk(self.world_size)[r] for r, grad in enumerate(grads)]

    def all_reduce_mean(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """What DDP does to parameter gradients: the mean over ranks, identical on every rank."""
        return torch.stack(per_rank).sum(dim=0) / self.world_size


# ---- launcher: torchrun as a subprocess ------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """A launched job failed or timed out. `rank` is the first rank that raised (None if unknown), `returncode`
    torchrun's exit status (None after a timeout), `output` everything the ranks printed."""

    def __init__(self, message: str, rank: int | None, returncode: int | None, output: str):
        super().__init__(message)
        self.rank, self.returncode, self.output = rank, returncode, output


def launch(target: str | Callable, *, nproc: int = 2, backend: str = "gloo", args: dict | None = None,
           timeout: float = 600.0, nnodes: int = 1, rdzv_endpoint: str | None = None, rdzv_id: str = "gcbs",
           echo: bool = True) -> Any:
    """Run `target(**args)` on `nproc` processes with `python -m torch.distributed.run` and return rank 0's result.

    `target` is a function importable by child processes, given as "module:function" or as the function itself
    (functions defined in a notebook are not importable: put them in gcbs_lib). Each rank joins the default
    process group (`backend`: "gloo" on CPU, "nccl" on GPUs, one GPU per rank) before the call. The result must
    be JSON-serialisable (tensors become lists). The ranks' output is echoed live; a rank that raises, or a job
    still running after `timeout` seconds, raises `LaunchError` with the failing rank's traceback, after every
    process of the job has been stopped.

    Multi-node: run the same call on every node with `nnodes=N, rdzv_endpoint="host:port"` (the same endpoint
    and `rdzv_id` everywhere; torchrun's c10d rendezvous then assigns node ranks). The node that hosts global
    rank 0 gets the result; the others get None.
    """
    target = _target_name(target)
    if nnodes == 1 and rdzv_endpoint is None:
        rendezvous = ["--standalone"]
    elif rdzv_endpoint is None:
        raise ValueError("a multi-node launch needs rdzv_endpoint='host:port' (the same on every node)")
    else:
        rendezvous = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                      f"--rdzv-id={rdzv_id}"]
    with tempfile.TemporaryDirectory(prefix="gcbs-launch-") as workdir:
        work = Path(workdir)
        (work / "launch.json").write_text(json.dumps({"args": args or {}, "backend": backend, "timeout": timeout}))
        command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}",
                   "--max-restarts=0", "-m", "gcbs_lib.distributed", target, workdir]
        job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_child_environment(),
                               start_new_session=True)
        try:
            output, finished = _stream(job, time.monotonic() + timeout, sys.stdout if echo else None)
        finally:
            _stop_job(job)
        if not finished:
            raise LaunchError(f"{target} on {nproc} processes did not finish within {timeout:g} s; every process "
                              f"of the job was stopped. Last output:\n{_tail(output)}", None, None, output)
        if job.returncode != 0:
            rank, trace = _first_failure(work)
            where = f"rank {rank}" if rank is not None else "the job"
            raise LaunchError(f"{where} of {target} failed (exit code {job.returncode}):\n{trace or _tail(output)}",
                              rank, job.returncode, output)
        result = work / "result.json"
        return json.loads(result.read_text()) if result.exists() else None


def _target_name(target: str | Callable) -> str:
    if isinstance(target, str):
        module, _, function = target.partition(":")
        if not module or not function:
            raise ValueError(f"target must look like 'module:function', got {target!r}")
        return target
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if module in (None, "__main__") or "<" in name:
        raise ValueError(f"{name or target!r} is defined in a notebook, a script or a function, so torchrun's child "
                         f"processes cannot import it: move it into gcbs_lib")
    return f"{module}:{name}"


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, set here so it does not print a banner about it
    env["PYTHONUNBUFFERED"] = "1"  # ranks' output arrives as it is printed
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _stream(job: subprocess.Popen, deadline: float, echo) -> tuple[str, bool]:
    """Copy the job's output to `echo` as it arrives; (all output, whether the job ended before the deadline)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd, parts = job.stdout.fileno(), []
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:  # every process of the job closed its output
            try:
                job.wait(timeout=max(deadline - time.monotonic(), 0.01))
                return "".join(parts), True
            except subprocess.TimeoutExpired:
                break
        parts.append(decoder.decode(data))
        if echo is not None:
            echo.write(parts[-1])
            echo.flush()
    return "".join(parts), False


def _stop_job(job: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop torchrun and every process it started (workers run in their own sessions), politely then by force."""
    if job.poll() is not None:  # torchrun has exited, and it waits for its workers before it does
        job.stdout.close()
        return
    processes = [psutil.Process(job.pid)]
    try:
        processes += processes[0].children(recursive=True)
    except psutil.NoSuchProcess:  # it exited just now (a zombie counts as gone)
        pass
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    job.wait()
    job.stdout.close()


def _first_failure(work: Path) -> tuple[int | None, str | None]:
    """The rank whose traceback was written first, and that traceback."""
    errors = sorted(work.glob("error-rank*.txt"), key=lambda p: p.stat().st_mtime_ns)
    if not errors:
        return None, None
    return int(errors[0].stem.removeprefix("error-rank")), errors[0].read_text()


def _tail(output: str, lines: int = 40) -> str:
    return "\n".join(output.splitlines()[-lines:])


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"a launched function must return JSON-serialisable values, got {type(value).__name__}")


def _run_rank(target: str, workdir: str) -> None:
    """One rank of a `launch`: join the process group, call the target, rank 0 writes the result as JSON."""
    work = Path(workdir)
    spec = json.loads((work / "launch.json").read_text())
    rank = int(os.environ["RANK"])
    try:
        module, _, name = target.partition(":")
        function = importlib.import_module(module)
        for attribute in name.split("."):
            function = getattr(function, attribute)
        if spec["backend"] == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(spec["backend"], timeout=timedelta(seconds=spec["timeout"]))
        result = function(**spec["args"])
        if rank == 0:
            (work / "result.json").write_text(json.dumps(result, default=_jsonable))
        gc.collect()  # free DDP reducers (held in reference cycles) while their process group still exists
        dist.barrier()  # no rank tears down its group while another still talks to it
    except BaseException:
        (work / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    _run_rank(*sys.argv[1:])
