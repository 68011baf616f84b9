"""Specification of the step probes: peak memory of one training step on CPU, by either measure."""
import pytest

from gcbs_lib import measure
from gcbs_lib.measure import MEMORY_METHODS, StepConfig, memory_method, peak_step_memory

MiB = 2**20


def test_the_portable_measure_sees_plain_memory_grow_with_the_batch_and_gradcache_stay_small():
    """`sampled_rss` is what macOS and Windows use; the notebook's own run checks `vmhwm` on Linux."""
    peak = {(m, b): peak_step_memory(StepConfig(m, b, chunk_size=16), "sampled_rss") / MiB
            for m, b in [("plain", 16), ("plain", 128), ("gradcache", 128)]}
    assert peak["plain", 128] > 4 * peak["plain", 16]
    assert peak["plain", 128] > 5 * peak["gradcache", 128]


def test_without_a_writable_clear_refs_the_cpu_measure_is_the_portable_sampler(monkeypatch):
    monkeypatch.setattr(measure, "_CLEAR_REFS", "/nonexistent/clear_refs")
    assert memory_method("cpu") == "sampled_rss"
    assert memory_method("cuda:0") == "cuda"
    assert set(MEMORY_METHODS) == {"cuda", "vmhwm", "sampled_rss"}


@pytest.mark.parametrize("method, device", [("cuda", "cpu"), ("vmhwm", "cuda"), ("rss", "cpu")])
def test_a_method_that_cannot_measure_the_device_is_refused(method, device):
    with pytest.raises(ValueError, match="does not measure device"):
        peak_step_memory(StepConfig("plain", 4, device=device), method)
