"""Peak memory of a step after a warm-up step: the CUDA allocator's peak, or on CPU the resident
set's rise in a fresh process: "vmhwm" on Linux (VmHWM, reset via /proc/self/clear_refs: exact),
else "sampled_rss" (read every 0.2 ms: it can miss a shorter peak); "sampled_anonymous" samples it
without file-backed pages (cache the kernel can drop)."""

import json
import os
import subprocess
import sys
import threading

import psutil
import torch

from gcbs_lib.check import require
from gcbs_lib.gradcache import cached_loss
from gcbs_lib.losses import info_nce, mil_nce
from gcbs_lib.models import TinyTextEncoder, random_token_batch

CLEAR_REFS = "/proc/self/clear_refs"
METHODS = ("cuda", "vmhwm", "sampled_rss", "sampled_anonymous")  # see the module docstring


def memory_method(device: str) -> str:
    """How `memory_rise` measures on `device` here: "cuda", "vmhwm" or "sampled_rss"."""
    if str(device).startswith("cuda"):
        return "cuda"
    return "vmhwm" if os.access(CLEAR_REFS, os.W_OK) else "sampled_rss"


def memory_rise(run, method: str) -> int:
    """Bytes `run()` needs above what was in memory before, by `method` (see `memory_method`)."""
    if method == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    require(method in METHODS, f"unknown memory method {method!r}: use one of {METHODS}")
    process = psutil.Process()
    done = threading.Event()

    def resident() -> int:
        memory = process.memory_info()
        return memory.rss - (memory.shared if method == "sampled_anonymous" else 0)

    before = peak = resident()
    if method == "vmhwm":
        with open(CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")  # the peak-RSS counter restarts from the current RSS
        run()
        with open("/proc/self/status") as status:
            peak_kib = next(line for line in status if line.startswith("VmHWM:")).split()[1]
        return int(peak_kib) * 1024 - before

    def watch() -> None:
        nonlocal peak
        while not done.wait(2e-4):
            peak = max(peak, resident())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run()
    finally:
        done.set()
        watcher.join()
    return max(peak, resident()) - before


def fresh_process_bytes(arguments: list[str], what, timeout: float = 600) -> int:
    """The last integer a fresh `python <arguments>` prints; a failed probe raises naming `what`."""
    command = [sys.executable, *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"memory probe failed for {what}:\n{result.stderr[-3000:]}")
    return int(result.stdout.split()[-1])


def step_bytes(step: str, setting: dict) -> int:
    """`STEPS[step](**setting)`'s memory rise in a fresh `python -m gcbs_lib.measure`, warmed up."""
    arguments = ["-m", "gcbs_lib.measure", step, json.dumps(setting)]
    return fresh_process_bytes(arguments, f"{step} {setting}")


def contrastive_step(method: str, batch_size: int, chunk_size: int = 16, device: str = "cpu"):
    """Notebook 01's step: InfoNCE over random texts through a TinyTextEncoder (dim 64, 2 layers, 32
    tokens), `method` "plain" (one graph), "gradcache" or "encode" (no-grad forwards)."""
    torch.manual_seed(0)
    encoder = TinyTextEncoder(1000, 64, 4, 2, 32).to(device)
    generator = torch.Generator().manual_seed(0)
    batches = [random_token_batch(batch_size, 32, 1000, generator) for _ in "qd"]
    batches = [{k: v.to(device) for k, v in batch.items()} for batch in batches]

    def step() -> None:
        encoder.zero_grad(set_to_none=True)
        if method == "gradcache":
            cached_loss(info_nce, encoder, batches, chunk_size).backward()
        elif method == "plain":
            info_nce(*[encoder(batch) for batch in batches]).backward()
        else:
            with torch.no_grad():
                [encoder(batch) for batch in batches]

    return step


def mil_nce_step(clips: int, bag_size: int, dim: int, chunk_size: int | None, device="cpu"):
    """Notebook 07's step: MIL-NCE ("both") over random clips, `bag_size` captions each, its
    denominator streamed in blocks of `chunk_size` (None: all B×N scores)."""
    generator = torch.Generator().manual_seed(0)
    video = torch.randn(clips, dim, generator=generator).to(device).requires_grad_()
    text = torch.randn(clips * bag_size, dim, generator=generator).to(device).requires_grad_()
    bags = torch.arange(clips * bag_size, device=device).view(clips, bag_size)
    return lambda: mil_nce(video, text, bags, 0.07, "both", chunk_size).backward()


STEPS = {"contrastive": contrastive_step, "mil_nce": mil_nce_step}
WARM_UP = {"contrastive": {"batch_size": 2, "chunk_size": 2}, "mil_nce": {"clips": 4, "dim": 4}}

if __name__ == "__main__":
    setting = json.loads(sys.argv[2])
    STEPS[sys.argv[1]](**{**setting, **WARM_UP[sys.argv[1]]})()
    step = STEPS[sys.argv[1]](**setting)
    print(memory_rise(step, memory_method(setting.get("device", "cpu"))))
