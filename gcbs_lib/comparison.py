"""Samplers compared on the same seeds (random vs GCBS batches): score the start, train each (arm,
seed), tabulate with a verdict, plot."""

import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import matplotlib.pyplot as plt
import scipy.stats
from matplotlib.ticker import MaxNLocator

from gcbs_lib import results, verdict
from gcbs_lib.check import require
from gcbs_lib.launcher import launch
from gcbs_lib.rows import read_outputs, read_rows, record
from gcbs_lib.train import Trainer, load_config, train


def arm_configs(experiment, profile, arms, seeds, overrides=None) -> dict:
    """`{(arm, seed): TrainConfig}`, seed-major: the profile, `overrides`, the arm, the seed.
    `arms`: samplers, or `{arm: settings}` for arms that differ in more than their sampler, e.g.
    `{"random+mask": {"sampler": "random", "mask_same_group": True}}` (the rows' arm: the name)."""
    named = arms if isinstance(arms, dict) else {arm: {"sampler": arm} for arm in arms}
    return {
        (arm, seed): load_config(
            experiment, profile, {**(overrides or {}), "arm": arm, **settings, "seed": seed}
        )
        for seed in seeds
        for arm, settings in named.items()
    }


def run_arms(
    experiment,
    profile,
    arms,
    seeds,
    folder,
    overrides=None,
    *,
    nproc=1,
    backend="gloo",
    devices=None,
) -> dict:
    """`{(arm, seed): summary}` of `run_arm` for each of `arm_configs`, the first of each seed
    scoring its start: in turn in this process (or each on `nproc` ranks); or, with more than one
    of `devices` (single-process runs only), side by side: the k-th run on devices[k % n] in that
    device's own process, its start scored there too, so this process holds no GPU the runs use.
    Prints each run's lines in that order, once it and the runs before it are done."""
    require(devices is None or nproc == 1, "devices: single-process runs (DDP's ranks have theirs)")
    require(devices != [], "devices: name at least one, e.g. ['cuda:0', 'cuda:1']")
    gpus = [device for device in devices or () if device != "cpu"]
    require(len(set(gpus)) == len(gpus), f"devices {devices}: a GPU named twice")

    # run_arm's config, folder, start (seed-major: each seed's first run) and baseline, in order
    jobs = []
    for (arm, seed), config in arm_configs(experiment, profile, arms, seeds, overrides).items():
        first = arm == list(arms)[0]
        jobs.append((config, Path(folder) / f"{arm}-seed{seed}", first, seed == seeds[0]))

    if devices is None or len(devices) == 1:
        results = (run_arm(*job, nproc=nproc, backend=backend) for job in jobs)
    else:
        results = on_devices(jobs, devices)

    summaries = {}
    for result, lines in results:
        print(*lines, sep="\n")
        summaries |= result
    return summaries


def score_start(config, output_dir, baseline=False) -> tuple[dict, list]:
    """The untrained model's test rows and outputs (what training is measured against) as
    `("start", seed)` and, if `baseline` and the experiment has one, the trivial scorer's as
    `("baseline-<name>", seed)`: the summaries, and a line for each."""
    trainer = Trainer(replace(config, sampler="random", arm="start"), output_dir)
    rows, outputs = trainer.score()
    summaries = {("start", config.seed): {"rows": rows, "outputs": {"best": outputs}}}
    lines = [f"start seed {config.seed}: untrained, test {scores_text(rows)}"]
    trivial = trainer.experiment.baseline() if baseline else None
    if trivial is not None:
        name, outputs = trivial
        scored = trainer.result_rows(trainer.experiment.scores(outputs), "test_")
        rows = [{**row, "arm": f"baseline-{name}"} for row in scored]
        summaries[f"baseline-{name}", config.seed] = {"rows": rows, "outputs": {"best": outputs}}
        lines.append(f"trivial baseline {name}: test {scores_text(rows)}")
    return summaries, lines


def run_arm(config, output_dir, start=False, baseline=False, *, nproc=1, backend="gloo") -> tuple:
    """`train` in this process, or on `nproc` ranks of `backend` by torchrun (rank 0's summary comes
    back); before it, if `start`, `score_start` (for ranks, in a process of its own: this one then
    holds no GPU that the ranks use). Returns the summaries and a line for each."""
    summaries = {}
    lines = []
    if start and nproc == 1:
        summaries, lines = score_start(config, output_dir, baseline)
    elif start:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            summaries, lines = pool.submit(score_start, config, output_dir, baseline).result()

    if nproc == 1:
        summary = train(config, output_dir)
    else:
        args = {"config": asdict(config), "output_dir": str(output_dir)}
        ranks = dict(nproc=nproc, backend=backend, timeout=config.collective_timeout)
        summary = launch("gcbs_lib.train:launched", echo=False, args=args, **ranks)

    arm = config.arm or config.sampler
    summaries[arm, config.seed] = summary
    steps = f"{summary['steps']} steps, best dev at step {summary['best_step']}"
    lines.append(f"{arm} seed {config.seed}: {steps}, test {scores_text(summary['rows'])}")
    return summaries, lines


def on_devices(jobs: list[tuple], devices: list[str]):
    """`run_arm`'s results for `jobs` (config, arguments) in their order, as they come: the k-th
    with its config's device devices[k % n], in that device's one process (spawned)."""
    spawn = multiprocessing.get_context("spawn")
    pools = [ProcessPoolExecutor(1, mp_context=spawn) for _ in devices]

    try:
        futures = []
        for k, (config, *more) in enumerate(jobs):
            placed = replace(config, device=devices[k % len(devices)])
            futures.append(pools[k % len(devices)].submit(run_arm, placed, *more))
        yield from (future.result() for future in futures)
    finally:  # after a failure: the runs not started yet never start
        for pool in pools:
            pool.shutdown(cancel_futures=True)


def scores_text(rows: list[dict]) -> str:
    """The test rows' scores, as "mrr 0.2338, recall@1 0.1475"."""
    tested = [row for row in rows if row["metric"].startswith("test_")]
    return ", ".join(f"{row['metric'][5:]} {row['value']:.4f}" for row in tested)


def committed_plan(notebook: str, experiment: str, metric: str, budget_minutes: float = 90) -> dict:
    """The next run's plan from the committed `cpu` run of `notebook` (results/), its sd of the
    paired Δ of GCBS on `metric` and its seconds per seed (the notebook's whole time, from
    provenance): the 95 % half-width t·sd/√n of Δ for n = 2 … 12 seeds, printed with the time of
    each; returns {n: half-width}."""
    name = f"{notebook}.cpu.json"
    lines = results.build_table(read_rows(results.COMMITTED / name))
    paired = next(
        x for x in lines if (x.experiment, x.metric, x.arm) == (experiment, metric, "gcbs")
    )

    made = results.provenance()[name]
    sd = statistics.stdev(paired.differences)
    seeds = len(paired.differences)
    seconds = made["seconds"] / seeds
    print(f"committed run at {made['commit']}: s_Δ = {sd:.4g} over {seeds} seeds,")
    print(f"{seconds:.0f} s a seed on {made['cores']} cores; the next run's seeds:")

    # t(0.975, n − 1)·sd/√n: the half-width of the 95 % t-interval of a mean of n values
    half = {n: float(scipy.stats.t.ppf(0.975, n - 1)) * sd / n**0.5 for n in range(2, 13)}
    for n, h in half.items():
        minutes = n * seconds / 60
        over = "" if minutes <= budget_minutes else " (over budget)"
        print(f"n = {n:2d} seeds: Δ ± {h:.4f}, {minutes:4.0f} min{over}")
    return half


def committed_run(notebook: str, metric: str) -> tuple[dict, list[dict], list[dict]] | None:
    """The committed `cpu` run of `notebook` (results/): its table lines of `metric` {"arm/metric":
    line}, each printed with its best-dev Δ, interval and verdict; its rows; its per-item output
    records. None, said with the command that makes it, where none is committed."""
    found = results.COMMITTED / f"{notebook}.cpu.json"
    if not found.exists():
        command = f"python -m gcbs_lib.reproduce --profile cpu --only {notebook[:2]}"
        print(f"no committed cpu run yet: {command}")
        return None
    rows = read_rows(found)
    records = read_outputs(found)
    lines = {}
    for line in results.build_table(rows, "", records):
        if line.metric == metric:
            interval = (
                "no interval" if line.best is None else "[{:+.4f}, {:+.4f}]".format(*line.best)
            )
            print(f"{line.arm:>17}: Δ {line.delta:+.4f} {interval}: {line.verdict}")
            lines[f"{line.arm}/{metric}"] = line
    return lines, rows, records


def rows_of(summaries: dict) -> list[dict]:
    """Every run's result rows, run after run."""
    return [row for summary in summaries.values() for row in summary["rows"]]


def outputs_of(summaries: dict) -> list[dict]:
    """Every run's per-item test outputs: records {experiment, arm, seed, checkpoint, outputs}."""
    return [
        {**{k: summary["rows"][0][k] for k in ("experiment", "arm", "seed")}, "checkpoint": name}
        | {"outputs": outputs}
        for summary in summaries.values()
        for name, outputs in summary["outputs"].items()
    ]


def record_runs(summaries: dict, notebook: str) -> list[dict]:
    """Every run's result rows, recorded with their per-item test outputs as `notebook`'s (under
    the runner; elsewhere nothing is written)."""
    rows = rows_of(summaries)
    record(rows, notebook, outputs_of(summaries))
    return rows


class MarkdownTable(str):
    """Markdown text that Jupyter renders as a table and a console prints as it is."""

    _repr_markdown_ = __repr__ = str.__str__


def arms_table(summaries, stand_in="not the paper's data") -> dict:
    """Show the table of the runs' test rows (start, random, each arm, Δ vs random paired by seed
    at best dev and at the last step with their 95 % intervals, the paper's Δ, the gated verdict,
    the epoch-0 diagnostics) and random's gain over the start; return its lines with a Δ, keyed
    "arm/metric"."""
    from IPython.display import display

    rows = rows_of(summaries)
    if rows[0]["data"] != "paper":
        print(
            f"data: {rows[0]['data']}, a stand-in, {stand_in}: compare its Δ with the paper's, "
            "never its scores"
        )
    if rows[0]["profile"] == "ci":
        print("ci profile, a smoke test: these numbers mean nothing about GCBS")

    lines = results.build_table(rows, outputs=outputs_of(summaries))
    lines = [line for line in lines if line.metric.startswith("test_")]
    display(MarkdownTable(results.to_markdown(lines)))

    # one per metric
    moved = {line.metric[5:]: line for line in lines if line.start and line.random}
    gains = [
        f"{m} {line.random.mean - line.start.mean:+.4f} ({line.random.sd or 0:.4f})"
        for m, line in moved.items()
    ]
    if gains:
        print(f"training moved the model, random − start (sd over seeds): {', '.join(gains)}")

    return {f"{line.arm}/{line.metric}": line for line in lines if line.delta is not None}


def plot_over_seeds(ax, summaries: dict, arms, records: str, key: str) -> dict[str, list[float]]:
    """Plot each arm's `key` of its `records` ("dev" by step, "epochs" by epoch): the mean over
    seeds and a band of ± 1 sd; return the means."""
    curves = {}
    for arm in arms:
        runs = [summary[records] for (a, _), summary in summaries.items() if a == arm]
        points = [results.summarize([r[key] for r in same_point]) for same_point in zip(*runs)]
        curves[arm] = [p.mean for p in points]
        x = [r["step"] for r in runs[0]] if records == "dev" else range(len(runs[0]))
        ax.plot(x, curves[arm], "o-", ms=3, label=arm)
        low = [p.mean - (p.sd or 0) for p in points]
        high = [p.mean + (p.sd or 0) for p in points]
        ax.fill_between(x, low, high, alpha=0.2)

    ax.set(xlabel="step" if records == "dev" else "epoch")
    ax.legend()
    return curves


def plot_comparison(summaries: dict, arms, key: str, lines, title: str, labels=None) -> None:
    """One comparison in three panels: each arm's dev `key` by step and the loss gap of its batches
    by epoch (mean ± 1 sd over seeds; the gaps printed too), and the test Δ of `lines` with their
    95 % intervals (seeds × test-item clusters) beside the paper's Δ (×), labelled `labels`."""
    _, (dev, gap, deltas) = plt.subplots(1, 3, figsize=(14, 3.5), width_ratios=(3, 3, 2))

    plot_over_seeds(dev, summaries, arms, "dev", key)
    dev.set(ylabel=f"dev {key} (mean ± 1 sd)", title=title)

    width = max(map(len, arms))
    for arm, gaps in plot_over_seeds(gap, summaries, arms, "epochs", "loss_gap").items():
        print(f"{arm:>{width}} loss gap per epoch: " + "  ".join(f"{g:.4f}" for g in gaps))
    gap.set(ylabel="loss gap (nats)", title="L_Global − L_Train of the planned batches")
    gap.xaxis.set_major_locator(MaxNLocator(integer=True))

    for y, line in enumerate(lines):
        low, high = line.best or (line.delta, line.delta)
        xerr = [[line.delta - low], [high - line.delta]]
        deltas.errorbar(line.delta, y, xerr=xerr, fmt="ok", capsize=4)
        if line.paper and line.paper.deltas:
            deltas.plot(line.paper.deltas, [y] * len(line.paper.deltas), "x", color="C3", ms=9)
    deltas.axvline(0, color="grey", lw=0.8)
    deltas.set_yticks(range(len(lines)), labels or [f"{line.arm}/{line.metric}" for line in lines])
    deltas.set(
        xlabel="95 % CI, seeds × test clusters (× the paper's Δ)", ylim=(-0.7, len(lines) - 0.3)
    )
    deltas.set_title(f"{lines[0].metric}: Δ vs random")

    plt.tight_layout()
    plt.show()


MASK_CONTRASTS = {  # name: (arms summed, arms subtracted), paired by seed
    "I": (("gcbs+mask", "random"), ("random+mask", "gcbs")),  # does the mask change GCBS's Δ?
    "gcbs+mask − random+mask": (("gcbs+mask",), ("random+mask",)),
}


def contrasts(experiment: str, metric: str, records: list[dict], named: dict) -> dict:
    """{(name, checkpoint): (Δ, low, high)} of test `metric` (e.g. "mrr") for each contrast of
    `named`, {name: (arms summed, arms subtracted)} paired by seed, whose arms ran; at best-dev
    checkpoints and the last step, from per-item output records (`outputs_of`, or a committed
    outputs file's). One bootstrap draws the seeds and test items for every contrast alike."""
    measured = {}
    for checkpoint in ("best", "last"):
        runs = {}
        for found in records:
            if found["checkpoint"] == checkpoint:
                runs.setdefault(found["arm"], {})[found["seed"]] = found["outputs"]
        ran = {name: pair for name, pair in named.items() if set(sum(pair, ())) <= set(runs)}
        if not ran:
            continue
        used = {arm: runs[arm] for pair in ran.values() for arm in sum(pair, ())}
        intervals = verdict.bootstrap(experiment, used, list(ran.values()))
        for name, pair in ran.items():
            measured[name, checkpoint] = intervals[pair][metric]
    return measured


def show_contrasts(measured: dict) -> None:
    """Print each contrast of `contrasts` with its interval and whether it is resolved."""
    for (name, checkpoint), (value, low, high) in measured.items():
        call = "not resolved"
        if low > 0 or high < 0:
            call = f"{'above' if low > 0 else 'below'} 0, resolved"
        print(f"{name:>24} at {checkpoint:>4}: {value:+.4f} [{low:+.4f}, {high:+.4f}]: {call}")


def regime_of(rows: list[dict]) -> dict:
    """{arm: {diagnostic: mean over seeds and epochs}} of result rows (their "name@epochN")."""
    values = {}
    for row in rows:
        name, at, _ = row["metric"].partition("@epoch")
        if at:
            values.setdefault(row["arm"], {}).setdefault(name, []).append(row["value"])
    means = {}
    for arm, found in values.items():
        means[arm] = {diagnostic: statistics.mean(v) for diagnostic, v in found.items()}
    return means


def plot_regime(lines: dict, rows: list[dict], metric: str, title: str) -> None:
    """Print each arm's diagnostics (`regime_of`); draw the Δ of `metric` (best dev, 95 %) of each
    arm of the regime sweep in `lines` ("arm/metric": line) and the loss gap of its batches
    against its k / B."""
    diagnostics = regime_of(rows)
    size = load_config(rows[0]["experiment"], rows[0]["profile"]).batch_size
    _, (delta_axis, gap_axis) = plt.subplots(1, 2, figsize=(11, 3.2))
    for arm, found in diagnostics.items():
        print(f"{arm:>17}: " + "  ".join(f"{k} {v:.3f}" for k, v in sorted(found.items())))
        line = lines.get(f"{arm}/{metric}")
        if line is None or not _in_regime_sweep(arm):
            continue
        x = found["neighbours"] / size
        marker = "s" if arm == "gcbs" else "o"  # index ties: a square
        error = None  # a line without per-item outputs has no interval
        if line.best is not None:
            error = [[line.delta - line.best[0]], [line.best[1] - line.delta]]
        delta_axis.errorbar(x, line.delta, error, fmt=marker)
        delta_axis.annotate(arm, (x, line.delta), fontsize=7)
        gap_axis.plot(x, found["loss_gap"], marker, color="C0")
    delta_axis.axhline(0, color="grey", lw=0.8)
    gap_axis.axhline(diagnostics["random"]["loss_gap"], color="grey", ls="--", label="random")
    delta_axis.set(xscale="log", xlabel="k / B", ylabel=f"Δ {metric} vs random", title=title)
    gap_axis.set(xscale="log", xlabel="k / B", ylabel="loss gap, mean of the epochs (nats)")
    gap_axis.legend()
    plt.tight_layout()


def _in_regime_sweep(arm: str) -> bool:
    """Whether `arm` is one of the regime sweep's: GCBS at the published q ("gcbs", index ties;
    "gcbs-random-ties") or at k neighbours an item ("gcbs-k…", random ties)."""
    return arm in ("gcbs", "gcbs-random-ties") or arm.startswith("gcbs-k")


READING = {True: "holds", False: "does not hold", None: "not measurable here"}


def regime_readings(lines: dict, metric: str) -> dict[str, tuple[bool | None, bool | None]]:
    """The regime sweep's pre-registered readings, each at best dev and at the last step, from the
    gated calls of `lines` ({"arm/metric": table line}) on `metric`:
    - the regime decides the sign: among gcbs-random-ties and the gcbs-k… arms, one Δ is resolved
      above 0 and another below 0;
    - GCBS needs its regime: a gcbs-k… Δ is resolved above 0, gcbs-random-ties' is not;
    - storage-order ties change the call: gcbs and gcbs-random-ties are called differently.
    True or False where the calls decide it; None (`READING`: not measurable here) where an arm it
    compares has no call (failed the gate) and the others leave it open."""
    for arm in ("gcbs", "gcbs-random-ties"):
        require(f"{arm}/{metric}" in lines, f"the regime sweep needs arm {arm!r} on {metric}")
    wider = [
        line.arm
        for line in lines.values()
        if line.metric == metric and line.arm.startswith("gcbs-k")
    ]
    readings = {
        "the regime decides the sign": [],
        "GCBS needs its regime": [],
        "storage-order ties change the call": [],
    }
    for at in (0, 1):  # the best-dev checkpoint, the last step
        index_ties = verdict.call_sign(lines[f"gcbs/{metric}"].calls[at])
        published = verdict.call_sign(lines[f"gcbs-random-ties/{metric}"].calls[at])
        wider_signs = [verdict.call_sign(lines[f"{arm}/{metric}"].calls[at]) for arm in wider]
        signs = {published, *wider_signs}
        readings["the regime decides the sign"].append(_known({1, -1} <= signs, None in signs))
        needs = 1 in wider_signs and published in (0, -1)
        open_arms = published is None or (None in wider_signs and published != 1)
        readings["GCBS needs its regime"].append(_known(needs, open_arms))
        both = None not in (index_ties, published)
        ties = both and index_ties != published
        readings["storage-order ties change the call"].append(_known(ties, not both))
    return {reading: tuple(held) for reading, held in readings.items()}


def better_readings(line) -> tuple[bool | None, ...]:
    """Whether `line`'s arm is resolved better than random, at each checkpoint of its calls (best
    dev, last step): None (`READING`: not measurable here) where it has no call."""
    signs = [verdict.call_sign(call) for call in line.calls]
    return tuple(_known(sign == 1, sign is None) for sign in signs)


def _known(holds: bool, open_arms: bool) -> bool | None:
    """A reading: True where the calls show it, else None where arms without a call leave it open,
    else False."""
    if holds:
        return True
    return None if open_arms else False


def first_gap_no_larger(summaries: dict, arm: str = "gcbs", baseline: str = "random") -> bool:
    """Whether `arm`'s first batches had a loss gap ≤ the baseline's on every seed."""
    return all(
        summary["epochs"][0]["loss_gap"]
        <= summaries[baseline, seed]["epochs"][0]["loss_gap"] + 1e-6
        for (a, seed), summary in summaries.items()
        if a == arm
    )
