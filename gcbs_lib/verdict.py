"""The verdict protocol, v2 (the README's results section states it; `python -m gcbs_lib.results
verify` recomputes it) from per-item test outputs (`experiments.Outputs`): a paired bootstrap over
seeds and clusters of test items with a small-sample t check on its seed part, the chance band of a
permutation null, the gate on interval bounds for both arms, and the verdict. Draws are seeded, so
every committed interval recomputes."""

import statistics

import numpy as np
import scipy.stats

from gcbs_lib import experiments
from gcbs_lib.check import require

DRAWS = 1000  # bootstrap resamples
NULL_DRAWS = 200  # permutations of the chance band
MARGIN = 3  # the chance band's margin, in sd
NAMES = {"gcbs": "GCBS"}  # an arm's name in a verdict


def resampled(outputs: experiments.Outputs, picks: dict[str, np.ndarray]) -> experiments.Outputs:
    """`outputs` with each task's items `picks[task]` (indices, repeats allowed), as arrays, less
    the clusters (no metric reads them)."""
    return {
        task: {name: np.asarray(v)[picks[task]] for name, v in arrays.items() if name != "cluster"}
        for task, arrays in outputs.items()
    }


def cluster_members(arrays: dict[str, list]) -> np.ndarray:
    """[items, k]: the clusters of each test item, numbered 0 … C−1: its "cluster" (an id, or a
    list of ids: a Lee pair's two documents), else one cluster per item."""
    clusters = arrays.get("cluster", range(len(next(iter(arrays.values())))))
    number = {}
    ids = [tuple(c) if isinstance(c, list | tuple) else (c,) for c in clusters]
    return np.array([[number.setdefault(i, len(number)) for i in item] for item in ids])


def drawn_items(members: np.ndarray, generator) -> np.ndarray:
    """The item indices of one draw: C clusters drawn with replacement, each item taken as often
    as the product of its clusters' draws, so a cluster's items stay together (a pair of
    documents: as often as it occurs among the drawn documents' pairs)."""
    count = int(members.max()) + 1
    draws = np.bincount(generator.integers(0, count, count), minlength=count)
    return np.repeat(np.arange(len(members)), draws[members].prod(axis=1))


def bootstrap(experiment: str, runs: dict, pairs: list[tuple[str, str]], draws=DRAWS) -> dict:
    """Δ = mean over seeds of (a − b) and its 95 % interval, for each (a, b) of `pairs` and every
    metric: {(a, b): {metric: (Δ, low, high)}}; a side may be a tuple of names, their scores summed,
    for a contrast such as the interaction (g+m − r+m) − (g − r) = ((g+m, r), (r+m, g)).
    `runs`: {name: {seed: Outputs}}, every name on the same seeds but a baseline's one run, which
    stands for every seed. Each draw resamples the seeds (paired) and, within each task, the
    clusters of test items (the same for every run). The interval is the wider of the draws'
    percentile interval and `welch_t`'s, whose seed part has n − 1 degrees of freedom (a percentile
    bootstrap over 4–6 seeds is too narrow)."""
    scores = experiments.get(experiment).scores
    sides = {side: side if isinstance(side, tuple) else (side,) for pair in pairs for side in pair}
    first = runs[sides[pairs[0][0]][0]]
    members = {task: cluster_members(arrays) for task, arrays in first[min(first)].items()}
    every = {task: np.arange(len(m)) for task, m in members.items()}
    runs = {name: [resampled(o, every) for _, o in sorted(r.items())] for name, r in runs.items()}
    metrics = list(scores(runs[sides[pairs[0][0]][0]][0]))

    def scored(picks: dict) -> dict:
        """{name: [seeds, metrics]} on the items `picks`."""
        return {
            name: np.array([list(scores(resampled(o, picks)).values()) for o in by_seed])
            for name, by_seed in runs.items()
        }

    generator = np.random.default_rng(0)
    full = scored(every)
    spread = {key: [] for key in pairs}
    items = {key: [] for key in pairs}
    for _ in range(draws):
        drawn = generator.choice(len(first), len(first))
        values = scored({task: drawn_items(m, generator) for task, m in members.items()})
        for a, b in pairs:
            difference = contrast(values, sides[a], sides[b])
            spread[a, b].append(difference[drawn].mean(axis=0))
            items[a, b].append(difference.mean(axis=0))
    intervals = {}
    for a, b in pairs:
        boot = np.percentile(spread[a, b], [2.5, 97.5], axis=0).T
        difference = contrast(full, sides[a], sides[b])
        t = [welch_t(d, v) for d, v in zip(difference.T, np.var(items[a, b], axis=0))]
        wider = [max(p, q or p, key=lambda bounds: bounds[1] - bounds[0]) for p, q in zip(boot, t)]
        deltas = difference.mean(axis=0)
        intervals[a, b] = {m: (d, *map(float, w)) for m, d, w in zip(metrics, deltas, wider)}
    return intervals


def contrast(values: dict, plus: tuple, minus: tuple) -> np.ndarray:
    """[seeds, metrics]: the scores of the names `plus` summed, less those of `minus`."""
    return sum(values[name] for name in plus) - sum(values[name] for name in minus)


def welch_t(per_seed: np.ndarray, item_variance: float) -> tuple[float, float] | None:
    """The 95 % t-interval of the mean of `per_seed` differences whose variance adds the seeds'
    s²/n and the test items' `item_variance` (the draws' spread with the seeds held), its degrees
    of freedom by Satterthwaite: n − 1 when the seeds' part dominates, ∞ when the items' does;
    None below two seeds."""
    n = len(per_seed)
    if n < 2:
        return None
    seed_part = np.var(per_seed, ddof=1) / n
    total = seed_part + item_variance
    freedom = (n - 1) * total**2 / seed_part**2 if seed_part > 0 else np.inf
    half = scipy.stats.t.ppf(0.975, freedom) * np.sqrt(total)
    return float(np.mean(per_seed) - half), float(np.mean(per_seed) + half)


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


def sign_of(metric: str) -> int:
    """−1 where lower is better (median rank), else 1."""
    return -1 if metric.endswith("median_rank") else 1


def within_chance(name: str, metric: str, mean: float, band: tuple) -> list[str]:
    """["<name> within chance (…)"] if `mean` does not clear the chance band (mean, sd) by
    `MARGIN` sd in the metric's better direction, else []."""
    chance = band[0] + sign_of(metric) * MARGIN * band[1]
    if sign_of(metric) * (mean - chance) > 0:
        return []
    return [f"{name} within chance ({band[0]:.3g} ± {MARGIN}·{band[1]:.2g})"]


def arm_gate(name: str, metric: str, gains: dict, minimum: float = 0.0) -> list[str]:
    """Why arm `name` shows no learning here (empty: it does): the lower bound of its gain over
    the start, or over the trivial baseline, not above 0 (above `minimum` for the start, where a
    profile pre-registers one). `gains`: {"the start" | "the trivial baseline": (Δ, low, high) or
    None}; a negative gain is said as negative."""
    reasons = []
    for what, (delta, low, high) in [(w, g) for w, g in gains.items() if g]:
        sign = sign_of(metric)
        gain = sign * delta
        bound = min(sign * low, sign * high)
        floor = minimum if what == "the start" else 0.0
        if bound <= floor:
            status = "negative" if gain < 0 else f"not above {floor:g}"
            interval = f"{delta:+.3g} [{low:+.3g}, {high:+.3g}]"
            reasons.append(f"{name}'s gain over {what} {status}: {interval}")
    return reasons


def called(arm: str, metric: str, low: float, high: float) -> str:
    """ "GCBS better" (the interval above 0; below 0 where lower is better), "GCBS worse", or
    "not resolved"."""
    gain = sorted((sign_of(metric) * low, sign_of(metric) * high))
    name = NAMES.get(arm, arm)
    if gain[0] > 0:
        return f"{name} better"
    if gain[1] < 0:
        return f"{name} worse"
    return "not resolved"


def call_sign(call: str) -> int | None:
    """The sign of a `called` call: 1 better, −1 worse, 0 not resolved; None for no call (""),
    where the gate failed."""
    if not call:
        return None
    last_word = call.rsplit(" ", 1)[-1]
    known = call == "not resolved" or last_word in ("better", "worse")
    require(known, f"not a call of `called` (better, worse, not resolved): {call!r}")
    return {"better": 1, "worse": -1}.get(last_word, 0)


def verdict(arm: str, metric: str, best: tuple, last: tuple | None, reasons: dict) -> str:
    """The verdict on the best-dev checkpoint's interval `best` and the last step's `last`:
    "depends on checkpoint selection" where they differ; "not measurable here" where the start
    failed the gate or both arms did (`reasons`: {"start" | arm name: [why]}); an arm's failed
    gate is said beside a verdict the other arm's passed gate allows."""
    failed = [why for whys in reasons.values() for why in whys]
    arms = [name for name in reasons if name != "start"]
    if reasons.get("start") or all(reasons[name] for name in arms):
        return "not measurable here: " + "; ".join(failed)
    said = called(arm, metric, *best)
    at_last = said if last is None else called(arm, metric, *last)
    if at_last != said:
        said = f"depends on checkpoint selection (best dev: {said}; last step: {at_last})"
    return f"{said} ({'; '.join(failed)})" if failed else said
