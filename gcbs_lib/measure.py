"""Peak memory of a step: the CUDA allocator's peak, or on CPU the resident set's rise in a fresh
process, after a warm-up step. On Linux "vmhwm" (reset the kernel's peak-RSS counter via
/proc/self/clear_refs, read VmHWM: exact), elsewhere "sampled_rss" (a thread reads the resident set
every 0.2 ms: it can miss a shorter peak); "sampled_anonymous" samples it without the file-backed
pages (a memory-mapped file read in is cache the kernel can drop, not held memory)."""

import json
import os
import subprocess
import sys
import threading

import psutil
import torch

CLEAR_REFS = "/proc/self/clear_refs"


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
    if method not in ("vmhwm", "sampled_rss", "sampled_anonymous"):
        raise ValueError(
            f"unknown memory method {method!r}: use 'cuda', 'vmhwm', 'sampled_rss' or "
            "'sampled_anonymous'"
        )
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
    """The memory rise of `STEPS[step](**setting)` in a fresh process (`python -m gcbs_lib.measure
    STEP SETTING`), after a small warm-up step."""
    arguments = ["-m", "gcbs_lib.measure", step, json.dumps(setting)]
    return fresh_process_bytes(arguments, f"{step} {setting}")


def contrastive_step(method: str, batch_size: int, chunk_size: int = 16, device: str = "cpu"):
    """Notebook 01's step, as a function: InfoNCE over random query and document texts through a
    TinyTextEncoder (dim 64, 2 layers, 32 tokens), "plain" (one graph over the batch), "gradcache"
    or "encode" (no-grad forwards)."""
    from gcbs_lib.gradcache import cached_loss
    from gcbs_lib.losses import info_nce
    from gcbs_lib.models import TinyTextEncoder, random_token_batch

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
    """Notebook 07's step: MIL-NCE ("both") forward and backward over random clips and `bag_size`
    captions each, its denominator streamed in blocks of `chunk_size` (None: all B×N scores)."""
    from gcbs_lib.losses import mil_nce

    generator = torch.Generator().manual_seed(0)
    video = torch.randn(clips, dim, generator=generator).to(device).requires_grad_()
    text = torch.randn(clips * bag_size, dim, generator=generator).to(device).requires_grad_()
    bags = torch.arange(clips * bag_size, device=device).view(clips, bag_size)
    return lambda: mil_nce(video, text, bags, 0.07, "both", chunk_size).backward()


STEPS = {"contrastive": contrastive_step, "mil_nce": mil_nce_step}
# the warm-up step, so that lazily allocated state is not charged to the measured one
WARM_UP = {"contrastive": {"batch_size": 2, "chunk_size": 2}, "mil_nce": {"clips": 4, "dim": 4}}

if __name__ == "__main__":
    setting = json.loads(sys.argv[2])
    STEPS[sys.argv[1]](**{**setting, **WARM_UP[sys.argv[1]]})()
    step = STEPS[sys.argv[1]](**setting)
    print(memory_rise(step, memory_method(setting.get("device", "cpu"))))
