"""Timing helpers shared by the bench scripts: interleaved trials, a process CPU-time clock, 'median
(min–max)'.

On a shared machine the arms of one trial run back to back, in an order rotated from trial to trial,
and ratios are taken within a trial, so load that comes and goes hits every arm alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
CLOCK_TEXT = {
    "wall": "wall time",
    "process": "CPU time of the process (steady under other load; with one thread it is the "
    "step's work)",
}


def data_script(name: str):
    """The module of `data_scripts/<name>.py` (a folder of scripts, not a package), loaded from its
    file."""
    path = Path(__file__).resolve().parents[1] / "data_scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interleaved_trials(
    steps: dict[str, Callable[[], None]],
    trials: int,
    clock: Callable[[], float],
    seed: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds per step of each arm over `trials` rounds; the arms of a round run back to back,
    starting each round at the next arm, each step from the same seed. One untimed warm-up step per
    arm first."""
    names = list(steps)
    for name in names:
        steps[name]()
    times = {name: [] for name in names}
    for trial in range(trials):
        for name in names[trial % len(names) :] + names[: trial % len(names)]:
            torch.manual_seed(seed)
            sync()
            start = clock()
            steps[name]()
            sync()
            times[name].append(clock() - start)
    return times


def spread(values: list[float], digits: int = 2) -> str:
    """'median (min–max)' of a list of numbers."""
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}–{max(values):.{digits}f})"
    )


def ratios(times: dict[str, list[float]], a: str, b: str) -> list[float]:
    """Per-trial ratios a / b."""
    return [x / y for x, y in zip(times[a], times[b])]


def add_run_arguments(parser: argparse.ArgumentParser, out: Path) -> None:
    """The options every bench script shares: torch threads, clock, seed, a quick check run, the
    output file."""
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall time, or the process's CPU time (steadier on a shared machine; use one thread)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes and 2 trials, to check the script runs"
    )
    parser.add_argument("--out", type=Path, default=out)


def rerun_command(script: str, argv: list[str] | None) -> str:
    """The command line that reruns this measurement, for the section's 'Rerun:' line."""
    return shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def write_section(out: Path, lines: list[str], done: bool) -> None:
    """Write a section, marked incomplete until `done`: scripts rewrite it after every row, so a
    stopped run leaves the rows it finished. The last line written so far goes to stderr as
    progress."""
    status = (
        []
        if done
        else ["**Incomplete run**: it stopped (or is still running) after the rows above.", ""]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([*lines, *status]))
    print(
        next((line for line in reversed(lines) if line.startswith("|")), ""),
        file=sys.stderr,
        flush=True,
    )
