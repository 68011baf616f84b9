"""The verdict protocol (DESIGN.md) from per-item test outputs (`experiments.Outputs`): a paired
hierarchical bootstrap over seeds and test items, the chance band of a permutation null, the gate
and the verdict. Draws are seeded, so `results verify` recomputes every committed interval."""

import statistics

import numpy as np

from gcbs_lib import experiments

DRAWS = 1000  # bootstrap resamples
NULL_DRAWS = 200  # permutations of the chance band
MARGIN = 3  # the gate's margins, in sd


def resampled(outputs: experiments.Outputs, picks: dict[str, np.ndarray]) -> experiments.Outputs:
    """`outputs` with each task's items `picks[task]` (indices, repeats allowed)."""
    return {
        task: {name: np.asarray(values)[picks[task]] for name, values in arrays.items()}
        for task, arrays in outputs.items()
    }


def bootstrap(
    experiment: str, arm: dict, random: dict, draws: int = DRAWS
) -> dict[str, tuple[float, float]]:
    """The 95 % percentile interval of Δ = mean over seeds of (arm − random), for every metric,
    from `draws` that resample the seeds both ran (paired) and, within each task, the test items
    (the same items for every run of a draw); `arm`, `random`: {seed: Outputs}."""
    scores = experiments.get(experiment).scores
    seeds = sorted(set(arm) & set(random))
    sizes = {task: len(next(iter(a.values()))) for task, a in arm[seeds[0]].items()}
    generator = np.random.default_rng(0)
    deltas = []
    for _ in range(draws):
        drawn = generator.choice(seeds, len(seeds))
        picks = {task: generator.integers(0, n, n) for task, n in sizes.items()}
        difference = {}
        for seed in set(drawn.tolist()):
            ours, theirs = (scores(resampled(runs[seed], picks)) for runs in (arm, random))
            difference[seed] = {metric: ours[metric] - theirs[metric] for metric in ours}
        metrics = difference[drawn[0]]
        deltas.append({m: statistics.fmean(difference[s][m] for s in drawn) for m in metrics})
    return {
        metric: tuple(float(x) for x in np.percentile([d[metric] for d in deltas], [2.5, 97.5]))
        for metric in deltas[0]
    }


def null_outputs(outputs: experiments.Outputs, generator) -> experiments.Outputs:
    """`outputs` under the null of no learning: gold shuffled across items; a retrieval query's
    match drawn at random among its candidates, so its rank is uniform."""
    null = {}
    for task, arrays in outputs.items():
        null[task] = dict(arrays)
        if "gold" in arrays:
            null[task]["gold"] = generator.permutation(arrays["gold"])
        else:
            null[task]["rank"] = generator.integers(1, np.asarray(arrays["candidates"]) + 1)
    return null


def chance_band(experiment: str, outputs: experiments.Outputs) -> dict[str, tuple[float, float]]:
    """Each metric's mean and sd over `NULL_DRAWS` draws of `null_outputs`."""
    scores = experiments.get(experiment).scores
    generator = np.random.default_rng(0)
    nulls = [scores(null_outputs(outputs, generator)) for _ in range(NULL_DRAWS)]
    return {
        m: (statistics.fmean(n[m] for n in nulls), statistics.stdev(n[m] for n in nulls))
        for m in nulls[0]
    }


def gate(metric: str, start, random, band: tuple, baseline: float | None, scratch=False) -> list:
    """Why this comparison cannot measure anything (empty: it can): `start`, `random`: Summaries of
    the untrained model and the random arm, `band`: the chance band's (mean, sd), `baseline`: the
    trivial scorer's value or None; a `scratch` start (a random init) is not held to chance."""
    sign = -1 if metric.endswith("median_rank") else 1  # lower is better
    chance = band[0] + sign * MARGIN * band[1]
    reasons = []
    for name, summary in (("the start", None if scratch else start), ("random", random)):
        if summary and sign * (summary.mean - chance) <= 0:
            reasons.append(f"{name} within chance ({band[0]:.3g} ± {MARGIN}·{band[1]:.2g})")
    if baseline is not None and sign * (random.mean - baseline) <= 0:
        reasons.append(f"random not above the trivial baseline ({baseline:.3g})")
    if start and sign * (random.mean - start.mean) <= MARGIN * (random.sd or float("inf")):
        reasons.append(f"random's gain over the start under {MARGIN} seed sd")
    return reasons


def called(arm: str, metric: str, low: float, high: float) -> str:
    """ "GCBS better" (the interval above 0; below 0 where lower is better), "GCBS worse", or
    "not resolved"."""
    gain = sorted((-high, -low) if metric.endswith("median_rank") else (low, high))
    name = {"gcbs": "GCBS"}.get(arm, arm)
    if gain[0] > 0:
        return f"{name} better"
    if gain[1] < 0:
        return f"{name} worse"
    return "not resolved"


def verdict(arm: str, metric: str, best: tuple, last: tuple | None, reasons: list[str]) -> str:
    """The verdict on the best-dev checkpoint's bootstrap interval `best` and the last step's
    `last`: "depends on checkpoint selection" where they differ; "not measurable here" where the
    gate gave `reasons`."""
    if reasons:
        return "not measurable here: " + "; ".join(reasons)
    said = called(arm, metric, *best)
    at_last = said if last is None else called(arm, metric, *last)
    if at_last != said:
        return f"depends on checkpoint selection (best dev: {said}; last step: {at_last})"
    return said
