"""The loss gap of each comparison's first epoch, planned from the untrained start model: the
trainer's random order, the published GCBS order (the trainer's `gcbs` arm) and the kit's own
variant, on the `cpu` profile of every experiment.

The epoch is planned by the trainer itself: `Trainer(config, tmpdir)` loads the data and builds
the start model (seeded by the trainer's `init` stream of the run seed), and its `_plan_epoch`
embeds the epoch's items (all, or one per group drawn as the trainer draws them) with
`pair_embeddings` in eval mode. Its `_sample` is wrapped to keep those embeddings, and each order is
then read into batches as `_sample` reads them (`gcbs.consecutive_batches` with the duplicate keys
of the planned items):

  random     `torch.randperm(N, generator=seeding.generator(seed, 0, "shuffle"))` (`_sample`, arm
             `random`)
  published  `gcbs.published_permutation(z1, z2, gcbs_quantile)` (`_sample`, arm `gcbs`)
  kit        `gcbs.gcbs_permutation(z1, z2, gcbs_quantile, seed=seed)` (the kit's variant)

and scored as the trainer logs it: `gcbs.loss_gap(z1[rows], z2[rows], arange(len(rows)),
batch_size, τ)` with rows = batches.reshape(-1) and τ = 1 / scale. The random gap is checked
against the `loss_gap` that `_plan_epoch` itself logged. "s" is the time of the order and its
batches (the trainer's `sampler_seconds`), not of the loss gap; "embed s" is the embedding pass.
The trainer's dev evaluation before the first plan is skipped: it does not change the plan.

    # the report: every experiment, seeds 0 and 1, written to docs/bench/first_epoch_gap.md
    # (builds missing stand-ins first: mlm-bert ≈ 15-30 min on 2 cores; milnce needs
    # `apt-get install python3.11-doc`, moco `apt-get install dataset-fashion-mnist`)
    python bench/bench_first_epoch_gap.py
    python bench/report.py                   # then stitch docs/benchmarks.md
    # one experiment, one seed, printed only
    python bench/bench_first_epoch_gap.py --experiments codesearch --seeds 0 --markdown ''
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from gcbs_lib import gcbs
from gcbs_lib.train import Trainer, load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_summary  # noqa: E402  (bench/ is not a package)
from trials import rerun_command, write_section  # noqa: E402

EXPERIMENTS = ["codesearch", "milnce", "moco", "simcse", "promcse"]  # cheapest first
DEFAULT_MARKDOWN = "docs/bench/first_epoch_gap.md"
ORDERS = ("random", "published", "kit")


def planned_batches(trainer: Trainer, z1, z2, items: torch.Tensor, order: str) -> torch.Tensor:
    """The epoch's batches [steps, B] (positions in `items`) of `order`, read as `_sample` reads
    them: the trainer's own `_sample` for its arms (random, gcbs = published), the same cut for the
    kit's variant."""
    config = trainer.config
    if order != "kit":
        sampler = config.sampler
        config.sampler = "gcbs" if order == "published" else "random"
        try:
            return trainer._sample(z1, z2, items)[0]["batches"]
        finally:
            config.sampler = sampler
    keys = trainer.train_set.duplicate_keys
    if keys is not None and len(items) < trainer.train_set.size:  # a sampled epoch, as `_sample`
        keys = [keys[i] for i in items.tolist()]
    permutation = gcbs.gcbs_permutation(z1, z2, config.gcbs_quantile, seed=config.seed)
    return gcbs.consecutive_batches(permutation, config.batch_size, keys)


def first_epoch(experiment: str, seed: int, profile: str) -> dict:
    """Plan epoch 0 of `experiment`'s `profile` at `seed` with the trainer, then the loss gap and
    seconds of each order."""
    config = load_config(experiment, profile, {"seed": seed, "sampler": "random"})
    config.log_loss_gap = True  # the trainer's own random gap, to check ours against
    config.progress = False
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        trainer = Trainer(config, folder)  # data, start model (init stream of `seed`)
        built = time.perf_counter()
        kept = {}
        sample = trainer._sample

        def keep(z1, z2, items):
            kept.update(z1=z1, z2=z2, items=items)
            return sample(z1, z2, items)

        trainer._sample = keep
        trainer.run.resume(trainer.stateful, trainer.total_steps, trainer.world_size)  # as `fit`
        trainer._plan_epoch()
        logged = trainer.run.records("epoch")[-1]
        trainer._sample = sample
        z1, z2, items = kept["z1"], kept["z2"], kept["items"]
        tau = 1 / trainer._scale()
        row = dict(experiment=experiment, seed=seed, n=len(items), batch=config.batch_size)
        row.update(tau=tau, steps=trainer.steps_per_epoch, setup_s=built - start)
        row.update(embed_s=logged["embed_seconds"], logged_random_gap=logged["loss_gap"])
        for order in ORDERS:
            begin = time.perf_counter()
            batches = planned_batches(trainer, z1, z2, items, order)
            row[f"{order}_s"] = time.perf_counter() - begin
            rows = batches.reshape(-1)
            gap = gcbs.loss_gap(z1[rows], z2[rows], torch.arange(len(rows)), config.batch_size, tau)
            row[f"{order}_gap"] = gap
        row["model"] = trainer.experiment.model_name
        row["data"] = trainer.experiment.data_name
    return row


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| experiment | seed | N | batch | τ | gap random | gap published | gap kit | published − "
        "random | ln(steps) | random s | published s | kit s | embed s | data | model |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['experiment']} | {r['seed']} | {r['n']:,} | {r['batch']} | {r['tau']:g} | "
            f"{r['random_gap']:.5f} | {r['published_gap']:.5f} | {r['kit_gap']:.5f} | "
            f"{r['published_gap'] - r['random_gap']:+.5f} | {math.log(r['steps']):.5f} | "
            f"{r['random_s']:.3f} | "
            f"{r['published_s']:.2f} | {r['kit_s']:.2f} | {r['embed_s']:.1f} | {r['data']} | "
            f"{r['model']} |"
        )
    return lines


def report(
    rows: list[dict], failed: list[str], profile: str, command: str, machine: str
) -> list[str]:
    checks = [abs(r["random_gap"] - r["logged_random_gap"]) for r in rows]
    check = (
        f"The random gaps equal the `loss_gap` the trainer logged for the same plan (largest "
        f"difference {max(checks):.1e})."
        if checks
        else ""
    )
    return [
        f"## First-epoch loss gap of the `{profile}` profiles: random, published, kit variant",
        "",
        f"Machine: {machine}; {torch.get_num_threads()} torch threads.",
        "",
        f"Command: `{command}`",
        "",
        "Epoch 0 of each comparison planned by the trainer from the untrained start model (its "
        "`_plan_epoch`: the epoch's items, all or one per group, embedded by "
        "`pair_embeddings` in eval mode), then read into the batches of three orders as the "
        "trainer's `_sample` reads them (`consecutive_batches` with the duplicate keys): the "
        'trainer\'s seeded random order (stream "shuffle" of epoch 0), the published GCBS order '
        "(`published_permutation`, the `gcbs` arm) and the kit's variant (`gcbs_permutation`, "
        "seed = run seed). The gap is L^Global − L^Train of the planned batches at τ = 1 / scale "
        "(`loss_gap`, exactly as the trainer logs it; in nats, ≥ 0, lower is closer to the global "
        "loss).",
        "",
        "Seconds: the order and its batches (the trainer's `sampler_seconds`); embed s: "
        "the embedding pass. The seed sets the random order, the kit variant's relabelling and "
        "the start model where it is randomly initialised. ln(steps) = ln(N'/B), N' = steps × B "
        "the items in full batches: the gap of any order when all similarities are equal, what "
        "an untrained encoder that maps every input alike comes close to.",
        "",
        *table(rows),
        "",
        check,
        "",
        *([f"Not measured: {'; '.join(failed)}.", ""] if failed else []),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--experiments",
        nargs="+",
        choices=EXPERIMENTS,
        default=EXPERIMENTS,
        help="experiments, measured in the order given (default: all, cheapest first)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="run seeds")
    parser.add_argument(
        "--profile", default="cpu", help="config profile of gcbs_lib/configs/<name>.yaml"
    )
    parser.add_argument(
        "--keep-going",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report an experiment whose data or model cannot be built and go on (default)",
    )
    parser.add_argument(
        "--markdown",
        default=DEFAULT_MARKDOWN,
        help=f"write the report section here (default {DEFAULT_MARKDOWN}; '' to only print)",
    )
    args = parser.parse_args()
    command = rerun_command("bench/bench_first_epoch_gap.py", None)
    machine = machine_summary()  # at the start: the load it started under and the commit it runs
    rows, failed = [], []
    for experiment in args.experiments:
        for seed in args.seeds:
            try:
                rows.append(first_epoch(experiment, seed, args.profile))
            except Exception as error:  # noqa: BLE001  (a stand-in that cannot be built here)
                if not args.keep_going:
                    raise
                failed.append(f"{experiment} seed {seed} ({type(error).__name__}: {error})")
                print(f"FAILED {failed[-1]}", file=sys.stderr, flush=True)
                continue
            print("\n".join(table(rows)[:2] + table(rows[-1:])[2:]), flush=True)
            if args.markdown:  # after every row, so that an interrupted run keeps what it measured
                lines = report(rows, failed, args.profile, command, machine)
                write_section(Path(args.markdown), lines, done=False)
    lines = report(rows, failed, args.profile, command, machine)
    if args.markdown:
        write_section(Path(args.markdown), lines, done=True)
    print("\n".join(lines))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
