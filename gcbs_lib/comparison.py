"""Samplers compared on the same seeds (random vs GCBS batches): train each (arm, seed), tabulate, plot."""
import statistics
from dataclasses import asdict
from pathlib import Path

from gcbs_lib.distributed import launch
from gcbs_lib.results import build_table, number, to_markdown
from gcbs_lib.train import load_config, train


def arm_configs(experiment, profile, arms, seeds, overrides=None) -> dict:
    """`{(arm, seed): TrainConfig}`: the profile, then `overrides`, the arm as sampler and the seed; seed-major."""
    return {(arm, seed): load_config(experiment, profile, {**(overrides or {}), "sampler": arm, "seed": seed})
            for seed in seeds for arm in arms}


def run_arms(experiment, profile, arms, seeds, folder, overrides=None, *, nproc=1, backend="gloo") -> dict:
    """`{(arm, seed): summary}` of `train` for each of `arm_configs`: in this process, or on `nproc` ranks of
    `backend` through torchrun (rank 0's summary comes back). Prints one line per run."""
    summaries = {}
    for (arm, seed), config in arm_configs(experiment, profile, arms, seeds, overrides).items():
        output_dir = Path(folder) / f"{arm}-seed{seed}"
        summaries[arm, seed] = summary = train(config, output_dir) if nproc == 1 else launch(
            "gcbs_lib.train:launched", nproc=nproc, backend=backend, echo=False,
            args={"config": asdict(config), "output_dir": str(output_dir)})
        test = ", ".join(f"{k} {v:.4f}" for k, v in summary["test"].items())
        print(f"{arm} seed {seed}: {summary['steps']} steps, best dev at step {summary['best_step']}, test {test}")
    return summaries


def rows_of(summaries: dict) -> list[dict]:
    """Every run's result rows, run after run."""
    return [row for summary in summaries.values() for row in summary["rows"]]


def arms_table(summaries, metric, paper_delta, paper, stand_in="not the paper's data", paper_arm="gcbs") -> dict:
    """Print the table of the runs' test rows (Δ against random paired by seed) and the paper's Δ of `metric`
    for `paper_arm` (None: none reported); return the table lines with a Δ, keyed "arm/metric"."""
    rows = rows_of(summaries)
    if rows[0]["data"] != "paper":
        print(f"data: {rows[0]['data']}, a stand-in, {stand_in}: compare its Δ with the paper's, never its scores\n")
    lines = [line for line in build_table(rows) if line.metric.startswith("test_")]
    print(to_markdown(lines) + f"\npaper Δ {paper_arm}/{metric}: " +
          ("none reported" if paper_delta is None else number(paper_delta, signed=True)) + f" ({paper})")
    return {f"{line.arm}/{line.metric}": line for line in lines if line.delta is not None}


def plot_over_seeds(ax, summaries: dict, arms, records: str, key: str) -> dict[str, list[float]]:
    """Plot each arm's `key` of its `records` averaged over seeds ("dev" by step, "epochs" by epoch); the curves."""
    curves = {}
    for arm in arms:
        runs = [summary[records] for (a, _), summary in summaries.items() if a == arm]
        curves[arm] = [statistics.fmean(r[key] for r in same_point) for same_point in zip(*runs)]
        ax.plot([r["step"] for r in runs[0]] if records == "dev" else range(len(runs[0])), curves[arm], "o-", label=arm)
    ax.set(xlabel="step" if records == "dev" else "epoch")
    ax.legend()
    return curves


def first_gap_no_larger(summaries: dict, arm: str = "gcbs", baseline: str = "random") -> bool:
    """Whether `arm`'s first batches had a loss gap ≤ the baseline's on every seed (only their batches differ)."""
    return all(summary["epochs"][0]["loss_gap"] <= summaries[baseline, seed]["epochs"][0]["loss_gap"] + 1e-6
               for (a, seed), summary in summaries.items() if a == arm)
