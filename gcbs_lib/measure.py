"""What a training step costs: its peak memory and its time, for plain full-batch training vs GradCache.

Memory on CUDA is the allocator's own count (`torch.cuda.max_memory_allocated` above what was allocated
before the step). On CPU there is no allocator peak to read, so the step runs once in a fresh Python process,
after a tiny warm-up step (lazily allocated state), and we report how far the resident set rose above its
value before the step, read one of two ways (`memory_method` says which applies, `MEMORY_METHODS` describes them):

- `vmhwm` (Linux): reset the kernel's peak-RSS counter (`/proc/self/clear_refs`), run the step, read the
  peak resident set (`VmHWM`). Exact.
- `sampled_rss` (macOS, Windows, Linux without a writable clear_refs): a thread reads the resident set
  (psutil) every 0.2 ms during the step. Portable; it can miss a peak shorter than the interval.

`ru_maxrss` would not do: it carries the parent's peak across fork and exec.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial

import psutil
import torch

from gcbs_lib.gradcache import cached_loss
from gcbs_lib.losses import info_nce
from gcbs_lib.models import TinyTextEncoder, random_token_batch


@dataclass(frozen=True)
class StepConfig:
    """One contrastive training step of a TinyTextEncoder on random query/document texts."""

    method: str  # "plain" (one graph over the batch), "gradcache", or "encode" (no-grad forward only)
    batch_size: int
    chunk_size: int = 16
    length: int = 32
    dim: int = 64
    layers: int = 2
    heads: int = 4
    vocab_size: int = 1000
    device: str = "cpu"
    seed: int = 0


def prepare_step(config: StepConfig):
    """Build the encoder and a batch, and return a function that runs one forward + backward."""
    if config.method not in ("plain", "gradcache", "encode"):
        raise ValueError(f"method must be 'plain', 'gradcache' or 'encode', got {config.method!r}")
    torch.manual_seed(config.seed)
    encoder = TinyTextEncoder(config.vocab_size, config.dim, config.heads, config.layers, config.length).to(config.device)
    generator = torch.Generator().manual_seed(config.seed)
    batches = [{k: v.to(config.device) for k, v in random_token_batch(config.batch_size, config.length,
                                                                      config.vocab_size, generator).items()}
               for _ in range(2)]
    loss_fn = partial(info_nce, scale=20.0)

    def step() -> None:
        encoder.zero_grad(set_to_none=True)
        if config.method == "encode":
            with torch.no_grad():
                [encoder(batch) for batch in batches]
            return
        if config.method == "plain":
            loss = loss_fn(*[encoder(batch) for batch in batches])
        else:
            loss = cached_loss(loss_fn, encoder, batches, config.chunk_size)
        loss.backward()

    return step


MEMORY_METHODS = {
    "cuda": "CUDA allocator peak (torch.cuda.max_memory_allocated) above the memory allocated before the step",
    "vmhwm": "peak resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set before "
             "the step, in a fresh process",
    "sampled_rss": "resident set sampled every 0.2 ms (psutil), its peak above the value before the step, in a "
                   "fresh process (can miss peaks shorter than the interval)",
}
_CLEAR_REFS = "/proc/self/clear_refs"
_SAMPLE_SECONDS = 2e-4


def memory_method(device: str) -> str:
    """The way `peak_step_memory` measures on `device` here: "cuda", "vmhwm" or "sampled_rss"."""
    if device.startswith("cuda"):
        return "cuda"
    return "vmhwm" if os.access(_CLEAR_REFS, os.W_OK) else "sampled_rss"


def _process_memory(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident) in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _vmhwm_rise(run) -> int:
    with open(_CLEAR_REFS, "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS counter to the current RSS
    baseline = _process_memory("VmRSS")
    run()
    return _process_memory("VmHWM") - baseline


def _sampled_rss_rise(run) -> int:
    process, done = psutil.Process(), threading.Event()
    baseline = process.memory_info().rss
    peak = baseline

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(_SAMPLE_SECONDS)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run()
    finally:
        done.set()
        watcher.join()
    return max(peak, process.memory_info().rss) - baseline


def memory_rise(run, method: str) -> int:
    """Bytes `run()` needs above what was in memory before it, measured in this process by `method` (one of
    `MEMORY_METHODS`; "vmhwm" and "sampled_rss" are only meaningful in a fresh process)."""
    if method == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    rises = {"vmhwm": _vmhwm_rise, "sampled_rss": _sampled_rss_rise}
    if method not in rises:
        raise ValueError(f"unknown memory method {method!r}; use one of {list(MEMORY_METHODS)}")
    return rises[method](run)


def peak_step_memory(config: StepConfig, method: str | None = None) -> int:
    """Bytes a step needs above what was in memory before it, measured by `method` (default
    `memory_method(config.device)`; see `MEMORY_METHODS`)."""
    method = memory_method(config.device) if method is None else method
    if method not in MEMORY_METHODS or (method == "cuda") != config.device.startswith("cuda"):
        raise ValueError(f"method {method!r} does not measure device {config.device!r}; "
                         f"use one of {list(MEMORY_METHODS)} that does")
    if method == "cuda":
        return memory_rise(prepare_step(config), method)
    return fresh_process_bytes(["-m", "gcbs_lib.measure", json.dumps(asdict(config)), method], config)


def fresh_process_bytes(arguments: list[str], what, timeout: float = 600) -> int:
    """Run `python <arguments>` in a fresh process (nothing resident from earlier work) and return the integer
    it prints last: how memory probes measure one setting on the CPU. A failing probe raises, naming `what`."""
    result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"memory probe failed for {what}:\n{result.stderr[-3000:]}")
    return int(result.stdout.split()[-1])


def step_seconds(config: StepConfig, repeats: int = 5) -> float:
    """Best-of-`repeats` wall time of one step, after one warm-up step (the minimum is the least noisy)."""
    step = prepare_step(config)
    sync = torch.cuda.synchronize if config.device.startswith("cuda") else (lambda: None)
    step()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":  # the fresh process behind peak_step_memory on CPU
    config, method = StepConfig(**json.loads(sys.argv[1])), sys.argv[2]
    run = prepare_step(config)
    prepare_step(StepConfig(**{**asdict(config), "batch_size": 2}))()  # warm up lazy initialisation
    print(memory_rise(run, method))
