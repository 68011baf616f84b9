"""What a training step costs: its peak memory and its time, for plain full-batch training vs GradCache.

Memory on CUDA is the allocator's own count (`torch.cuda.max_memory_allocated` above what was allocated
before the step). On CPU there is no allocator peak to read, so the step runs once in a fresh Python process:
after a tiny warm-up step we reset the kernel's peak-RSS counter (`/proc/self/clear_refs`), run the step, and
report how far the peak resident set (`VmHWM`) rose above the resident set before the step (`VmRSS`).
Linux only; `ru_maxrss` would not do, since it carries the parent's peak across fork and exec.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial

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


def _process_memory(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident) in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_step_memory(config: StepConfig) -> int:
    """Bytes a step needs above what was in memory before it (see the module docstring for how)."""
    if config.device.startswith("cuda"):
        step = prepare_step(config)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    result = subprocess.run([sys.executable, "-m", "gcbs_lib.measure", json.dumps(asdict(config))],
                            capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise RuntimeError(f"memory probe failed for {config}:\n{result.stderr}")
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
    config = StepConfig(**json.loads(sys.argv[1]))
    run = prepare_step(config)
    prepare_step(StepConfig(**{**asdict(config), "batch_size": 2}))()  # warm up lazy initialisation
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS counter to the current RSS
    baseline = _process_memory("VmRSS")
    run()
    print(_process_memory("VmHWM") - baseline)
