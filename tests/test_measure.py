"""Specification of the memory probes: the rise of the resident set over a step, by either CPU
measure."""

import time

import numpy as np
import pytest
import torch

from gcbs_lib import measure
from gcbs_lib.measure import memory_method, memory_rise, step_bytes

MiB = 2**20


def held(make):
    """A step that makes its memory and holds it 0.2 s, so that the sampler (a thread that needs the
    GIL and a core on a busy machine) sees the peak."""

    def step() -> None:
        made = make()
        time.sleep(0.2)
        del made

    return step


@pytest.mark.parametrize("method", ["vmhwm", "sampled_rss"])
def test_a_step_that_fills_256_mib_rises_by_about_256_mib(method):
    if method == "vmhwm" and memory_method("cpu") != "vmhwm":
        pytest.skip("no writable /proc/self/clear_refs here")
    rise = memory_rise(held(lambda: torch.ones(64 * MiB)), method)  # 64 Mi float32
    assert 240 * MiB < rise < 300 * MiB


@pytest.mark.parametrize("method, counted", [("sampled_rss", True), ("sampled_anonymous", False)])
def test_a_memory_mapped_file_read_in_counts_in_the_resident_set_but_not_in_the_anonymous_one(
    tmp_path, method, counted
):
    np.ones(32 * MiB, dtype=np.float32).tofile(tmp_path / "ones")  # 128 MiB on disk

    def read() -> np.ndarray:
        mapped = np.memmap(tmp_path / "ones", dtype=np.float32, mode="r")
        mapped.sum()
        return mapped

    rise = memory_rise(held(read), method)
    assert (rise > 100 * MiB) == counted and rise < 160 * MiB


def probe(method, batch_size):
    """The memory rise of one `contrastive_step`, measured in a fresh process as notebook 01 does on
    CPU."""
    setting = {"method": method, "batch_size": batch_size, "chunk_size": 16}
    return step_bytes("contrastive", setting) / MiB


def test_plain_memory_grows_with_the_batch_and_gradcache_stays_small():
    peak = {(m, b): probe(m, b) for m, b in [("plain", 16), ("plain", 128), ("gradcache", 128)]}
    assert peak["plain", 128] > 4 * peak["plain", 16]
    assert peak["plain", 128] > 5 * peak["gradcache", 128]


def test_without_a_writable_clear_refs_the_cpu_measure_is_the_portable_sampler(monkeypatch):
    monkeypatch.setattr(measure, "CLEAR_REFS", "/nonexistent/clear_refs")
    assert memory_method("cpu") == "sampled_rss"
    assert memory_method("cuda:0") == "cuda"
    with pytest.raises(ValueError, match="unknown memory method 'rss'"):
        memory_rise(lambda: None, "rss")
