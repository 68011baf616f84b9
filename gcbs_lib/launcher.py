"""Real ranks on one machine: `launch` runs a function on N local processes through
torch.distributed's `elastic_launch` (torchrun's engine), each in a process group, and returns rank
0's result; a rank that fails stops the job with its traceback."""

import gc
import importlib
import math
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gcbs_lib.check import as_type, require

# Seconds a rank waits in a collective (for rank 0's planning, dev evaluation, test scoring) before
# the job fails: ≈ 4× the longest such wait expected at a paper profile's size, rank 0 planning an
# epoch of SimCSE's 1M sentences (up to ≈ 8 min: issue 42 estimated 2–4 min at MIL-NCE's 730k
# clips, and the N² pass grows (1M / 730k)² ≈ 1.9×); a hung rank holds the GPUs 30 min, not 3 h.
COLLECTIVE_TIMEOUT = 1800


class LaunchError(RuntimeError):
    """A launched job failed: `rank` failed first; the message holds its traceback."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def collective_timeout(seconds: float | None = None) -> timedelta:
    """How long a rank waits in a collective before the job fails: `seconds` (e.g. the config
    key `collective_timeout`), else the environment's GCBS_COLLECTIVE_TIMEOUT, else
    COLLECTIVE_TIMEOUT."""
    text = os.environ.get("GCBS_COLLECTIVE_TIMEOUT")
    if seconds is None and text is not None:
        seconds = as_type(text, float, f"GCBS_COLLECTIVE_TIMEOUT must be seconds, got {text!r}")
    seconds = COLLECTIVE_TIMEOUT if seconds is None else seconds
    positive = isinstance(seconds, (int, float)) and 0 < seconds < math.inf
    require(positive, f"a collective timeout must be positive seconds, got {seconds!r}")
    return timedelta(seconds=seconds)


def launch(target, *, nproc=2, backend="gloo", args=None, timeout=None, echo=True):
    """Rank 0's `target(**args)` of `nproc` local ranks, each in a process group of `backend`
    ("gloo"; "nccl": one GPU per rank). `target`: a module-level function or "module:function" that
    child processes can import (put a notebook's in gcbs_lib). `timeout`: seconds a rank may wait
    in a collective, a hung rank failing the job (None: `collective_timeout()`'s); `echo`: print
    the ranks' output live."""
    timeout = collective_timeout(timeout)
    if isinstance(target, str):
        module, _, name = target.partition(":")
        require(name, f"target must look like 'module:function', got {target!r}")
        target = getattr(importlib.import_module(module), name)
    importable = target.__module__ != "__main__" and target.__qualname__.isidentifier()
    require(importable, f"child ranks cannot import {target.__qualname__}: move it into gcbs_lib")
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    handlers = {s: signal.getsignal(s) for s in signals}
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
            files = {r: f.error_file for r, f in error.failures.items()}
            failed_at = {r: os.path.getmtime(f) for r, f in files.items() if os.path.isfile(f)}
            rank = min(failed_at, key=failed_at.get) if failed_at else min(error.failures)
            cause = error.failures[rank].message  # the error file's, or a signal
            cause = cause["extraInfo"]["py_callstack"] if isinstance(cause, dict) else cause
            message = f"rank {rank} of {target.__qualname__} failed:\n{cause}"
            raise LaunchError(message, rank) from None
        finally:
            if threading.current_thread() is threading.main_thread():  # the launcher replaced them
                for number, handler in handlers.items():
                    signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _run_rank(target: Callable, args: dict, backend: str, timeout: timedelta):
    """One rank of a `launch`: join the process group, call the target, leave the group together."""
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun's default: one thread per rank
        torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timeout)
    result = target(**args)  # a rank that raises exits holding its group: its error file first
    gc.collect()  # free DDP reducers (held in reference cycles) while their group still exists
    dist.barrier()  # no rank tears down its group while another still talks to it
    dist.destroy_process_group()
    return result
