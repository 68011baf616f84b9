"""Timing helpers shared by the bench scripts: interleaved trials, a process CPU-time clock, 'median (min–max)'.

On a shared machine the arms of one trial run back to back, in an order rotated from trial to trial, and ratios
are taken within a trial, so load that comes and goes hits every arm alike.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
CLOCK_TEXT = {"wall": "wall time",
              "process": "CPU time of the process (steady under other load; with one thread it is the step's work)"}


def interleaved_trials(steps: dict[str, Callable[[], None]], trials: int, clock: Callable[[], float],
                       seed: int, sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds per step of each arm over `trials` rounds; the arms of a round run back to back, starting each
    round at the next arm, each step from the same seed. One untimed warm-up step per arm first."""
    names = list(steps)
    for name in names:
        steps[name]()
    times = {name: [] for name in names}
    for trial in range(trials):
        for name in names[trial % len(names):] + names[:trial % len(names)]:
            torch.manual_seed(seed)
            sync()
            start = clock()
            steps[name]()
            sync()
            times[name].append(clock() - start)
    return times


def spread(values: list[float], digits: int = 2) -> str:
    """'median (min–max)' of a list of numbers."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def ratios(times: dict[str, list[float]], a: str, b: str) -> list[float]:
    """Per-trial ratios a / b."""
    return [x / y for x, y in zip(times[a], times[b])]
