"""Arms compared in one run on the same seeds (random vs GCBS batches): train them, average them, tabulate them.

`run_arms` trains one `gcbs_lib.train` run per (arm, seed), each in its own folder, so a finished run is loaded
from its checkpoint instead of retrained (the same arguments resume). `mean_over_seeds` averages a logged
quantity (dev scores, epoch loss gaps) across seeds, and `arms_table` prints the test rows as the kit's
results table (mean ± sd over seeds, Δ against the "random" arm paired by seed) next to the paper's Δ, and
`first_gap_no_larger` checks that an arm's first batches were no easier than the baseline's.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from gcbs_lib.results import build_table, to_markdown
from gcbs_lib.train import load_config, train


def run_arms(experiment: str, profile: str, arms: Sequence[str], seeds: Sequence[int], folder: str | Path,
             overrides: dict | None = None) -> dict[tuple[str, int], dict]:
    """`{(arm, seed): summary}` of `train` for every arm (a sampler name) on every seed, run in
    `folder/<arm>-seed<seed>`; prints one line per run."""
    summaries = {}
    for arm in arms:
        for seed in seeds:
            config = load_config(experiment, profile, {**(overrides or {}), "sampler": arm, "seed": seed})
            summary = summaries[arm, seed] = train(config, Path(folder) / f"{arm}-seed{seed}")
            print(f"{arm:>7} seed {seed}: {summary['steps']} steps, best dev at step {summary['best_step']}, "
                  + ", ".join(f"test {k} {v:.4f}" for k, v in list(summary["test"].items())[:1]))
    return summaries


def mean_over_seeds(summaries: dict, arm: str, records: str, key: str) -> list[float]:
    """`key` of each of `arm`'s `records` ("dev": evaluations, "epochs": epoch starts), averaged over its seeds."""
    runs = [summary[records] for (a, _), summary in summaries.items() if a == arm]
    return [statistics.fmean(r[key] for r in same_point) for same_point in zip(*runs)]


def arms_table(summaries: dict, metric: str, paper_delta: float, paper: str,
               stand_in: str = "not the paper's data") -> dict[str, float]:
    """Print the markdown table of every run's test rows and the measured Δ of `metric` next to the paper's;
    return each non-baseline arm's Δ per test metric (keys "arm/metric"). `stand_in` says, under the table's
    data line, what a stand-in is not."""
    rows = [row for summary in summaries.values() for row in summary["rows"]]
    lines = [line for line in build_table([(rows, "")]) if line.metric.startswith("test_")]
    data = rows[0]["data"]
    if data != "paper":
        print(f"data: {data}, a stand-in, {stand_in}: compare its Δ with the paper's, never its scores\n")
    print(to_markdown(lines))
    deltas = {f"{line.arm}/{line.metric}": line.delta for line in lines if line.delta is not None}
    for key, value in deltas.items():
        if key.endswith("/" + metric):
            print(f"measured Δ {key}: {value:+.4f}   paper: {paper_delta:+.4f} ({paper})")
    return deltas


def first_gap_no_larger(summaries: dict, arm: str = "gcbs", baseline: str = "random") -> bool:
    """Whether `arm`'s batches had a loss gap at most the baseline's at the first epoch start of every seed (both
    arms of a seed embed with the same initial model then, so only the batches differ)."""
    seeds = sorted({seed for a, seed in summaries if a == arm})
    return all(summaries[arm, s]["epochs"][0]["loss_gap"] <= summaries[baseline, s]["epochs"][0]["loss_gap"] + 1e-6
               for s in seeds)
