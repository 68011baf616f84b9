"""Real ranks on one machine: `launch` runs a function on N local processes through
torch.distributed's `elastic_launch` (torchrun's engine), each in a process group, and returns rank
0's result; a rank that fails stops the job with its traceback."""

import gc
import importlib
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

from gcbs_lib.check import require

COLLECTIVE_TIMEOUT = 3 * 3600  # seconds a rank may wait in a collective (rank 0 planning, dev)


class LaunchError(RuntimeError):
    """A launched job failed: `rank` failed first; the message holds its traceback."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def launch(target, *, nproc=2, backend="gloo", args=None, timeout=COLLECTIVE_TIMEOUT, echo=True):
    """Rank 0's `target(**args)` of `nproc` local ranks, each in a process group of `backend`
    ("gloo"; "nccl": one GPU per rank). `target`: a module-level function or "module:function" that
    child processes can import (put a notebook's in gcbs_lib). `timeout`: seconds a rank may wait
    in a collective (a hung rank fails the job); `echo`: print the ranks' output live."""
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


def _run_rank(target: Callable, args: dict, backend: str, timeout: float):
    """One rank of a `launch`: join the process group, call the target, leave the group together."""
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun's default: one thread per rank
        torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    result = target(**args)  # a rank that raises exits holding its group: its error file first
    gc.collect()  # free DDP reducers (held in reference cycles) while their group still exists
    dist.barrier()  # no rank tears down its group while another still talks to it
    dist.destroy_process_group()
    return result
