"""MIL-NCE's memory against the number of videos: what one training run holds once its data is
built.

    python bench/bench_milnce_scale.py                               # → docs/bench/milnce_scale.md
    python bench/bench_milnce_scale.py --quick --out /tmp/scale.md   # tiny sizes: does it run?

Planted videos in HowTo100M's real formats (per-video `.npy` features at 1 and 1.5 rows/s,
caption.json, `data_scripts/howto100m_planted.py`) at growing counts; the `milnce` experiment
(source howto100m, its `data_dir` the planted folder) builds its bag arrays once (timed). Then, in a
fresh process per cell, the peak memory above the imports (`gcbs_lib.measure.memory_rise`) of what a
run does each time it starts and steps: memory-map the bag arrays, build the model, collate one
training batch, score dev. Scoring dev keeps a fixed subset of `eval_clips` clips (the setting that
bounds memory: the paper profile's is 20,000), or every dev clip (`eval_clips` none), whose score
matrix grows with the square of the videos. Two measures: the whole resident set, which counts the
pages of memory-mapped feature files read in (cache the kernel can drop, growing with the videos the
batch and the dev subset touch), and its anonymous part (`sampled_anonymous`): the memory a run
holds.
"""

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from gcbs_lib.experiments.milnce import MilNce
from gcbs_lib.gcbs import published_permutation
from gcbs_lib.measure import fresh_process_bytes, memory_method, memory_rise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import ROOT, machine_summary  # noqa: E402  (bench/ is not a package)
from trials import add_run_arguments, data_script, rerun_command, write_section  # noqa: E402

planted = data_script("howto100m_planted")


def experiment(setting: dict) -> MilNce:
    options = MilNce.Options(
        source="howto100m",
        data_dir=setting["folder"],
        bag_size=setting["bag_size"],
        eval_clips=setting["eval_clips"],
    )
    return MilNce(options, seed=0, device="cpu")


def one_start(setting: dict) -> None:
    """Open the built data, build the model, collate a training batch, score dev, or with
    `plan_clips` plan a GCBS epoch of that many clips as rank 0 does (embed them, the published
    order): what the probe measures."""
    milnce = experiment(setting)
    size = milnce.load_data().size
    model = milnce.build_model().eval()
    with torch.no_grad():
        if setting.get("plan_clips"):
            items = torch.randperm(size, generator=torch.Generator().manual_seed(0))
            z1, z2 = milnce.pair_embeddings(model, items[: setting["plan_clips"]])
            published_permutation(z1, z2)
            return
        milnce.collate(
            np.random.default_rng(0)
            .choice(size, min(size, setting["batch"]), replace=False)
            .tolist()
        )
        milnce.evaluate(model, "dev")


def probe(setting: dict) -> None:
    """The fresh process behind each cell: prints the peak bytes of `one_start` above the
    imports."""
    print(memory_rise(lambda: one_start(setting), setting["method"]))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        return probe(json.loads(argv[1]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--videos", type=int, nargs="+", default=[500, 2000, 8000], help="planted video counts"
    )
    parser.add_argument(
        "--eval-clips",
        type=int,
        default=500,
        help="the bounded arm's dev subset (≤ the fewest dev clips)",
    )
    parser.add_argument(
        "--feature-dim", type=int, default=256, help="feature width per stream (real: 2048)"
    )
    parser.add_argument("--bag-size", type=int, default=4, help="captions K per bag")
    parser.add_argument(
        "--plan-clips", type=int, default=2000, help="clips of the GCBS epoch planned"
    )
    parser.add_argument(
        "--batch", type=int, default=256, help="clips in the collated training batch"
    )
    add_run_arguments(parser, ROOT / "docs" / "bench" / "milnce_scale.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.videos, args.eval_clips, args.feature_dim, args.batch = [20, 40], 50, 16, 32
        args.plan_clips = 100
    started, machine = datetime.now(timezone.utc), machine_summary()
    lines = [
        "## MIL-NCE memory against the number of videos (`bench/bench_milnce_scale.py`)",
        "",
        f"Rerun: `{rerun_command('bench/bench_milnce_scale.py', argv)}`",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC: {machine}. Peak resident memory "
        f"({memory_method('cpu')}) above "
        "the imports, in a fresh process per cell: memory-map the bag arrays, build the model, "
        "collate "
        f"{args.batch} clips, score dev (K = {args.bag_size}, {args.feature_dim}-wide features "
        "per stream).",
        "",
        "| videos | training clips | dev clips | bag arrays MiB | build s | eval_clips "
        f"{args.eval_clips:,}: resident "
        "MiB | anonymous MiB | every dev clip: resident MiB | anonymous MiB | GCBS plan of "
        f"{args.plan_clips:,} clips: anonymous MiB |",
        "|---:" * 10 + "|",
    ]
    peaks = []
    with tempfile.TemporaryDirectory(prefix="bench-milnce-scale-") as folder:
        for videos in args.videos:
            root = Path(folder) / f"v{videos}"
            planted.write_planted(
                root, planted.PlantedConfig(videos=videos, dim=args.feature_dim, seed=args.seed)
            )
            setting = {"folder": str(root), "bag_size": args.bag_size, "batch": args.batch}
            built = time.perf_counter()
            milnce = experiment({**setting, "eval_clips": None})
            clips = milnce.load_data().size
            built = time.perf_counter() - built
            bags = (
                sum(p.stat().st_size for p in root.glob(f"bags-k{args.bag_size}/**/*.npy")) / 2**20
            )
            cells = [
                fresh_process_bytes(
                    [__file__, "--probe", json.dumps({**setting, "eval_clips": e, "method": m})],
                    (e, m),
                )
                / 2**20
                for e in (args.eval_clips, None)
                for m in (memory_method("cpu"), "sampled_anonymous")
            ]
            plan = {**setting, "eval_clips": None, "method": "sampled_anonymous"}
            plan["plan_clips"] = args.plan_clips
            cells.append(fresh_process_bytes([__file__, "--probe", json.dumps(plan)], plan) / 2**20)
            peaks.append((cells[1], cells[3], cells[4]))
            lines.append(
                f"| {videos:,} | {clips:,} | {len(milnce.eval_sets['dev']['clip_video']):,} | "
                f"{bags:.1f} | "
                f"{built:.1f} | " + " | ".join(f"{c:.1f}" for c in cells) + " |"
            )
            write_section(args.out, lines, done=False)
    lines += [
        "",
        f"At {args.videos[-1] / args.videos[0]:.0f}× the videos, the anonymous peak is "
        f"{peaks[-1][0] / peaks[0][0]:.2f}× the smallest count's with eval_clips "
        f"{args.eval_clips:,}, and "
        f"{peaks[-1][1] / peaks[0][1]:.1f}× when every dev clip is scored; a GCBS plan "
        f"of {args.plan_clips:,} clips (rank 0's embeddings and the published "
        f"order) peaks at {peaks[-1][2] / peaks[0][2]:.2f}× the smallest count's.",
        "",
    ]
    write_section(args.out, lines, done=True)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
