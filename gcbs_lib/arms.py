"""Arms compared in one run on the same seeds (random vs GCBS batches): train them, average them, tabulate them.

`arm_configs` gives every (arm, seed) its training config, seed-major, and `run_arms` trains one
`gcbs_lib.train` run per config, each in its own folder (in this process, or on `nproc` ranks with torchrun), so
a finished run is loaded from its checkpoint instead of retrained (the same arguments resume). `rows_of`
collects every run's result rows, `mean_over_seeds` averages a logged quantity (dev scores, epoch loss gaps)
across seeds (`plot_over_seeds` draws it per arm), `arms_table` prints the test rows as the kit's results table
(mean ± sd over seeds, Δ against the "random" arm paired by seed) with the paper's Δ beside its arm, and
`first_gap_no_larger` checks that an arm's first batches were no easier than the baseline's.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gcbs_lib.distributed import launch
from gcbs_lib.results import TableLine, build_table, number, to_markdown
from gcbs_lib.train import TrainConfig, load_config, train

LAUNCH_TIMEOUT = 24 * 3600.0  # seconds one torchrun run may take before it is stopped


def arm_configs(experiment: str, profile: str, arms: Sequence[str], seeds: Sequence[int],
                overrides: dict | None = None) -> dict[tuple[str, int], TrainConfig]:
    """`{(arm, seed): config}`: the profile plus `overrides`, with the arm as sampler and the seed; seed-major, so
    runs taken in this order compare every arm on each seed they finish."""
    return {(arm, seed): load_config(experiment, profile, {**(overrides or {}), "sampler": arm, "seed": seed})
            for seed in seeds for arm in arms}


def run_arms(experiment: str, profile: str, arms: Sequence[str], seeds: Sequence[int], folder: str | Path,
             overrides: dict | None = None, *, nproc: int = 1, backend: str = "gloo") -> dict[tuple[str, int], dict]:
    """`{(arm, seed): summary}` of `train` for each of `arm_configs`, in that order, run in
    `folder/<arm>-seed<seed>`: in this process, or with `nproc` > 1 on that many ranks of `backend` through
    torchrun (rank 0's summary comes back). Prints one line per run."""
    summaries = {}
    width = max(map(len, arms))
    for (arm, seed), config in arm_configs(experiment, profile, arms, seeds, overrides).items():
        output_dir = Path(folder) / f"{arm}-seed{seed}"
        if nproc == 1:
            summary = train(config, output_dir)
        else:
            summary = launch("gcbs_lib.train:launched", nproc=nproc, backend=backend, echo=False,
                             args={"config": asdict(config), "output_dir": str(output_dir)}, timeout=LAUNCH_TIMEOUT)
        summaries[arm, seed] = summary
        print(f"{arm:>{width}} seed {seed}: {summary['steps']} steps, best dev at step {summary['best_step']}, "
              + ", ".join(f"test {k} {v:.4f}" for k, v in list(summary["test"].items())[:1]))
    return summaries


def rows_of(summaries: dict) -> list[dict]:
    """Every run's result rows, run after run."""
    return [row for summary in summaries.values() for row in summary["rows"]]


def mean_over_seeds(summaries: dict, arm: str, records: str, key: str) -> list[float]:
    """`key` of each of `arm`'s `records` ("dev": evaluations, "epochs": epoch starts), averaged over its seeds."""
    runs = [summary[records] for (a, _), summary in summaries.items() if a == arm]
    return [statistics.fmean(r[key] for r in same_point) for same_point in zip(*runs)]


def arms_table(summaries: dict, metric: str, paper_delta: float | None, paper: str,
               stand_in: str = "not the paper's data", paper_arm: str = "gcbs") -> dict[str, TableLine]:
    """Print the markdown table of every run's test rows and the measured Δ of `metric` of each arm, the paper's
    beside `paper_arm`'s and "—" beside the others (`paper_delta` None: "none reported" beside all); return each
    non-baseline arm's table line per test metric (keys "arm/metric"; `.delta` ± `.delta_sd` over the seeds it
    shares with the baseline). `stand_in` says, under the table's data line, what a stand-in is not."""
    rows = rows_of(summaries)
    lines = [line for line in build_table([(rows, "")]) if line.metric.startswith("test_")]
    data = rows[0]["data"]
    if data != "paper":
        print(f"data: {data}, a stand-in, {stand_in}: compare its Δ with the paper's, never its scores\n")
    print(to_markdown(lines))
    deltas = {f"{line.arm}/{line.metric}": line for line in lines if line.delta is not None}
    for key, line in deltas.items():
        if line.metric == metric:
            if line.arm != paper_arm and paper_delta is not None:
                reported = f"— (reported for {paper_arm} only)"
            else:
                reported = "none reported" if paper_delta is None else f"{paper_delta:+.4f}"
                reported += f" ({paper})"
            print(f"measured Δ {key}: {number(line.delta, line.mean, signed=True)}   paper: {reported}")
    return deltas


def plot_over_seeds(ax, summaries: dict, arms: Sequence[str], records: str, key: str) -> dict[str, list[float]]:
    """Draw each arm's `key` averaged over seeds on `ax` (`records` "dev" against the step, "epochs" against the
    epoch) with a legend; return the curves by arm."""
    curves = {}
    for arm in arms:
        curves[arm] = mean_over_seeds(summaries, arm, records, key)
        first = next(summary for (a, _), summary in summaries.items() if a == arm)
        x = [r["step"] for r in first[records]] if records == "dev" else range(len(curves[arm]))
        ax.plot(x, curves[arm], marker="o", label=arm)
    ax.set(xlabel="step" if records == "dev" else "epoch")
    ax.legend()
    return curves


def first_gap_no_larger(summaries: dict, arm: str = "gcbs", baseline: str = "random") -> bool:
    """Whether `arm`'s batches had a loss gap at most the baseline's at the first epoch start of every seed (both
    arms of a seed embed with the same initial model then, so only the batches differ)."""
    seeds = sorted({seed for a, seed in summaries if a == arm})
    return all(summaries[arm, s]["epochs"][0]["loss_gap"] <= summaries[baseline, s]["epochs"][0]["loss_gap"] + 1e-6
               for s in seeds)
