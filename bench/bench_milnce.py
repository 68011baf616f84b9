"""MIL-NCE costs: the streamed (chunked) loss against the full-matrix one, and the memory-mapped bag
arrays against reading the caption files every step.

    python bench/bench_milnce.py                                    # both tables →
    docs/bench/milnce.md python bench/bench_milnce.py --threads 1 --clock process        # on a
    shared, loaded machine python bench/bench_milnce.py --quick --out /tmp/milnce.md       # tiny
    sizes: does it run? python bench/bench_milnce.py --device cuda --videos 0 --out
    docs/bench/milnce_cuda.md   # the loss on a GPU

Table 1, the loss: B clips with disjoint bags of K captions (N = B·K captions), L2-normalised random
embeddings of width d, τ = 0.07, both forms ("v2t", "both"). One step = `mil_nce` forward and
backward into the two embedding matrices. Times over interleaved trials of the full-matrix loss and
the chunked one at each chunk size. Peak memory: the rise over one step in a fresh process (this
script with `--probe`, measuring with `gcbs_lib.measure.memory_rise`: peak resident set on CPU, the
allocator's peak on CUDA). Exactness in float32: the largest |Δℓ_i| over the clips between chunked
and full, and ‖g_chunked − g_full‖ / ‖g_full‖ over both embedding gradients, next to the float32
full loss's own distance from float64 (its round-off).

Table 2, the data: planted videos written in the real formats by `data_scripts/howto100m_planted.py`
(per-video `.npy` features at 1 and 1.5 rows/s, per-video caption csv files, caption.json) in a
temporary folder, and the training bags built from them once. One step = a batch of B clips drawn at
random (a new batch each trial, the same for every arm): their bags, exclusions, caption texts and
clip features, from
  cache      rows of the memory-mapped bag arrays, features pooled from the memory-mapped video
  files (what
             `MilNce.collate` reads before tokenising);
  csv        each of the batch's videos' `<video_id>.csv` parsed and `.npy` features read, then the
  bag grown,
             the overlapping captions listed and the features pooled per clip, as a loader without
             the cache does every step (the official MIL-NCE loader reads a caption csv per clip);
  in memory  the same, the captions parsed once from caption.json and held (only the features read
  per step).
"same as cache" checks that the arm gives the cache's bags, exclusions and features, bitwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gcbs_lib.check import relative_error
from gcbs_lib.data.howto100m import (
    MIN_TIME,
    FeatureStore,
    build_bags,
    clip_features,
    features_of,
    nearest_bag,
    open_arrays,
    plain_captions,
    read_captions,
    read_csv_captions,
    save_arrays,
    widen,
)
from gcbs_lib.losses import mil_nce
from gcbs_lib.measure import fresh_process_bytes, memory_method, memory_rise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import ROOT, machine_summary  # noqa: E402  (bench/ is not a package)
from trials import (
    CLOCK_TEXT,
    CLOCKS,
    add_run_arguments,
    data_script,
    interleaved_trials,
    ratios,  # noqa: E402
    rerun_command,
    spread,
    write_section,
)

planted = data_script("howto100m_planted")

TEMPERATURE = 0.07
FORMS = ("v2t", "both")
# issue 11: at N = 16k the chunked loss needs at most a quarter of the full one's peak memory
GOAL = 0.25


# ------------------------------------------------------------------------------------------- 1. the
# loss


def loss_inputs(
    clips: int, k: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 unit-norm clip [B, d] and caption [B·K, d] embeddings, and disjoint bags of K: `[B,
    K]`."""
    g = torch.Generator().manual_seed(seed)
    video = F.normalize(torch.randn(clips, dim, generator=g, dtype=torch.float64), dim=1)
    text = F.normalize(torch.randn(clips * k, dim, generator=g, dtype=torch.float64), dim=1)
    return video, text, torch.arange(clips * k).view(clips, k)


def loss_step(video, text, bags, form: str, chunk: int | None):
    """One forward and backward of `mil_nce` into fresh gradients of (copies of) the embeddings."""
    video, text = video.detach().clone().requires_grad_(), text.detach().clone().requires_grad_()

    def step() -> None:
        video.grad = text.grad = None
        mil_nce(video, text, bags, TEMPERATURE, form, chunk).backward()

    return step


def loss_peak_memory(settings: list[dict], device: str) -> list[int]:
    """Peak bytes of one `mil_nce` forward and backward above its inputs per setting {"clips",
    "bag_size", "dim", "chunk_size", "direction"}: the CUDA allocator's peak, or on CPU that of a
    fresh process (`--probe`)."""
    if device.startswith("cuda"):
        return [memory_rise(probe_step(setting, device), "cuda") for setting in settings]
    return [
        fresh_process_bytes([__file__, "--probe", json.dumps(setting)], setting)
        for setting in settings
    ]


def probe_step(setting: dict, device: str):
    """The step a memory probe measures: random float32 inputs of the setting, disjoint bags."""
    video, text, bags = loss_inputs(setting["clips"], setting["bag_size"], setting["dim"], 0)
    video, text, bags = video.float().to(device), text.float().to(device), bags.to(device)
    return loss_step(video, text, bags, setting["direction"], setting["chunk_size"])


def probe(setting: dict) -> None:
    """The fresh process behind `loss_peak_memory` on CPU: a tiny warm-up step, then the setting's
    peak."""
    probe_step({"clips": 4, "bag_size": 2, "dim": 4, "chunk_size": 2, "direction": "both"}, "cpu")()
    print(memory_rise(probe_step(setting, "cpu"), memory_method("cpu")))


def per_clip_losses_and_gradient(video, text, bags, form: str, chunk: int | None):
    """(ℓ_i `[B]`, the flat gradient of the mean over both embeddings), in the inputs' dtype."""
    video, text = video.detach().clone().requires_grad_(), text.detach().clone().requires_grad_()
    losses = mil_nce(video, text, bags, TEMPERATURE, form, chunk, reduction="none")
    losses.mean().backward()
    return losses.detach(), torch.cat([video.grad.reshape(-1), text.grad.reshape(-1)])


def exactness(inputs, form: str, chunks: list[int], device: str) -> dict:
    """max |Δℓ_i| and gradient relative difference of each chunked float32 loss against the full
    float32 one, and of the full float32 loss against float64 (its round-off)."""
    video, text, bags = (x.to(device) for x in inputs)
    exact = per_clip_losses_and_gradient(video, text, bags, form, None)
    single = [x.float() for x in (video, text)] + [bags]
    full = per_clip_losses_and_gradient(*single, form, None)
    out = {
        "rounding": (
            (full[0].double() - exact[0]).abs().max().item(),
            relative_error(full[1], exact[1]),
        )
    }
    for chunk in chunks:
        chunked = per_clip_losses_and_gradient(*single, form, chunk)
        out[chunk] = (
            (chunked[0] - full[0]).abs().max().item(),
            relative_error(chunked[1], full[1]),
        )
    return out


def loss_rows(args, clock, sync, lines: list[str], on_row) -> list[dict]:
    """Table 1, appended to `lines`; `on_row()` after each (form, N). Returns the rows' medians."""
    lines += [
        f"### 1. Chunked against full-matrix MIL-NCE (K = {args.bag_size}, d = {args.dim}, τ = "
        f"{TEMPERATURE}, "
        f"{args.device})",
        "",
        "| form | N (B × K) | chunk | full s | chunked s | chunked / full | full MiB | chunked MiB "
        "| chunked / full memory | max \\|Δℓ\\| | gradient rel. diff "
        "| full fp32 vs fp64: max \\|Δℓ\\|, grad |",
        "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    summary = []
    for form in args.forms:
        for clips in args.clips:
            n = clips * args.bag_size
            inputs = loss_inputs(clips, args.bag_size, args.dim, args.seed)
            single = [
                x.to(args.device, torch.float32) if x.is_floating_point() else x.to(args.device)
                for x in inputs
            ]
            arms = {"full": None, **{f"chunk {c}": c for c in args.chunks}}
            steps = {name: loss_step(*single, form, chunk) for name, chunk in arms.items()}
            times = interleaved_trials(steps, args.trials, clock, args.seed, sync)
            settings = [
                {
                    "clips": clips,
                    "bag_size": args.bag_size,
                    "dim": args.dim,
                    "chunk_size": chunk,
                    "direction": form,
                }
                for chunk in arms.values()
            ]
            probes = [loss_peak_memory(settings, args.device) for _ in range(args.memory_repeats)]
            peaks = dict(zip(arms, map(statistics.median, zip(*probes))))
            errors = exactness(inputs, form, args.chunks, args.device)
            rounding = errors["rounding"]
            for name, chunk in list(arms.items())[1:]:
                speed, memory = ratios(times, name, "full"), peaks[name] / peaks["full"]
                lines.append(
                    f"| {form} | {n:,} ({clips} × {args.bag_size}) | {chunk} | "
                    f"{spread(times['full'], 3)} | "
                    f"{spread(times[name], 3)} | {spread(speed)} | {peaks['full'] / 2**20:.1f} | "
                    f"{peaks[name] / 2**20:.1f} | {memory:.0%} | {errors[chunk][0]:.1e} | "
                    f"{errors[chunk][1]:.1e} | {rounding[0]:.1e}, {rounding[1]:.1e} |"
                )
                summary.append(
                    {
                        "form": form,
                        "n": n,
                        "chunk": chunk,
                        "time": statistics.median(speed),
                        "memory": memory,
                        "loss": errors[chunk][0],
                        "grad": errors[chunk][1],
                    }
                )
            on_row()
    lines += ["", loss_verdict(summary)]
    return summary


def loss_verdict(summary: list[dict]) -> str:
    """One sentence on the largest N: each chunked arm's share of the full loss's peak memory and
    time."""
    n = max(row["n"] for row in summary)
    largest = [row for row in summary if row["n"] == n]
    parts = "; ".join(
        f"{r['form']} chunk {r['chunk']}: {r['memory']:.0%} of the full loss's peak memory at "
        f"{r['time']:.2f}× its time"
        for r in largest
    )
    met = sorted(
        {r["chunk"] for r in largest} - {r["chunk"] for r in largest if r["memory"] > GOAL}
    )
    goal = (
        f"chunk {' and '.join(map(str, met))} meets the goal (≤ {GOAL:.0%}) in every form"
        if met
        else f"no chunk meets the goal (≤ {GOAL:.0%}) in every form"
    )
    return f"At N = {n:,}: {parts}. {goal[0].upper()}{goal[1:]}."


# ------------------------------------------------------------------------------------------- 2. the
# data


def clip_without_cache(entry: dict, streams: dict | None, anchor: int, k: int, min_time: float):
    """What a loader without the cache does for one clip (anchored at caption `anchor` of its
    video): widen its window, grow its bag, list the overlapping captions outside it, pool its
    features if `streams` are given. Caption numbers are positions in the video."""
    start, end = np.asarray(entry["start"]), np.asarray(entry["end"])
    s, e = widen(start[anchor], end[anchor], min_time)
    first = nearest_bag(start, end, anchor, k)
    bag = list(range(first, first + min(k, len(start))))
    exclude = [j for j in np.flatnonzero((start < e) & (end > s)).tolist() if j not in bag]
    features = None if streams is None else clip_features(streams, np.array([(s, e)]))[0][0]
    return bag, exclude, [entry["text"][j] for j in bag], features


class BagSources:
    """Planted videos in the real formats under a folder, their bag arrays, and the three ways to
    make a batch."""

    def __init__(self, folder: Path, args):
        self.k, self.folder = args.bag_size, folder
        config = planted.PlantedConfig(videos=args.videos, dim=args.feature_dim, seed=args.seed)
        started = time.perf_counter()
        planted.write_planted(folder, config, caption_format="csv")
        self.write_seconds = time.perf_counter() - started
        self.captions = read_captions(folder / "captions")
        planted.write_captions(self.captions, folder / "caption.json", "json")
        started = time.perf_counter()
        self.cache_path = save_arrays(
            build_bags(self.captions, FeatureStore(folder), self.k), folder / "bags"
        )
        self.build_seconds = time.perf_counter() - started
        started = time.perf_counter()
        self.held = read_captions(folder / "caption.json")
        self.parse_seconds = time.perf_counter() - started
        self.bags, self.store = open_arrays(self.cache_path), FeatureStore(folder)
        counts = [len(self.captions[str(v)]["start"]) for v in self.bags["video_ids"]]
        first_caption = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.video_of = self.bags["video_ids"][self.bags["clip_video"]]
        self.offset = first_caption[self.bags["clip_video"]]
        self.local_anchor = self.bags["anchor"] - self.offset

    def __len__(self) -> int:
        return len(self.bags["clip_video"])

    def from_cache(self, clips: np.ndarray, features: bool):
        bag_idx, exclude_idx = (
            np.array(self.bags["bag_idx"][clips]),
            np.array(self.bags["exclude_idx"][clips]),
        )
        texts = [t.decode() for t in self.bags["caption_text"][np.unique(bag_idx[bag_idx >= 0])]]
        return (
            bag_idx,
            exclude_idx,
            texts,
            features_of(self.store, self.bags, clips) if features else None,
        )

    def from_files(self, clips: np.ndarray, held: bool, features: bool):
        """Per clip (bag, exclusions, texts, features or None) from the caption csv files, or the
        held captions."""
        videos = {str(v) for v in self.video_of[clips]}
        folder = self.folder / "captions"
        entries = (
            {v: self.held[v] for v in videos}
            if held
            else {v: plain_captions(v, read_csv_captions(folder / f"{v}.csv")) for v in videos}
        )
        streams = {v: self.store.load(v) if features else None for v in videos}
        return [
            clip_without_cache(
                entries[str(self.video_of[m])],
                streams[str(self.video_of[m])],
                int(self.local_anchor[m]),
                self.k,
                MIN_TIME,
            )
            for m in clips
        ]

    def same_as_cache(self, clips: np.ndarray, made: list) -> bool:
        """Whether per-clip results equal the cache's rows (caption numbers made global),
        bitwise."""
        bag_idx, exclude_idx, _, features = self.from_cache(clips, features=True)
        for row, offset, (bag, exclude, texts, feature) in zip(
            range(len(clips)), self.offset[clips], made
        ):
            if (
                bag_idx[row][bag_idx[row] >= 0].tolist() != [offset + j for j in bag]
                or sorted(exclude_idx[row][exclude_idx[row] >= 0].tolist())
                != sorted(offset + j for j in exclude)
                or texts
                != [t.decode() for t in self.bags["caption_text"][bag_idx[row][bag_idx[row] >= 0]]]
                or (feature is not None and not np.array_equal(features[row], feature))
            ):
                return False
        return True


DATA_ARMS = {"cache": {}, "csv": {"held": False}, "in memory": {"held": True}}


def data_rows(args, clock, lines: list[str]) -> dict:
    """Table 2, appended to `lines`. Returns the median ratios to the cache."""
    with tempfile.TemporaryDirectory(prefix="bench-milnce-") as folder:
        sources = BagSources(Path(folder), args)
        rng = np.random.default_rng(args.seed)
        batches = [
            rng.choice(len(sources), args.batch, replace=False) for _ in range(args.data_trials + 1)
        ]
        makers = {
            (name, features): partial(sources.from_files, **options, features=features)
            if options
            else partial(sources.from_cache, features=features)
            for name, options in DATA_ARMS.items()
            for features in (False, True)
        }
        same = {
            arm: all(sources.same_as_cache(c, makers[arm](c)) for c in batches)
            for arm in makers
            if arm[0] != "cache"
        }
        queues = {arm: iter(batches) for arm in makers}
        steps = {arm: (lambda arm=arm: makers[arm](next(queues[arm]))) for arm in makers}
        times = interleaved_trials(steps, args.data_trials, clock, args.seed)
        size = sum(p.stat().st_size for p in sources.cache_path.glob("*.npy")) / 2**20
        bags = sources.bags
        lines += [
            f"### 2. Bag cache against caption files ({len(bags['video_ids']):,} planted videos, "
            f"{len(bags['caption_text']):,} captions, {len(sources):,} clips, K = {args.bag_size}, "
            f"{args.feature_dim}-wide features per stream)",
            "",
            f"One step makes the bags, exclusions and caption texts of {args.batch} random clips "
            '("bags"), '
            'and with them the clip features ("+ features"). Files are in the page cache (warm). '
            "Once per "
            f"data set: writing the planted files took {sources.write_seconds:.1f} s, building "
            "the cache "
            f"{sources.build_seconds:.1f} s ({size:.0f} MiB of `.npy` index arrays), parsing "
            "caption.json "
            f"{sources.parse_seconds:.2f} s (wall times).",
            "",
            "| source | bags ms per step | bags / cache | + features ms per step | + features / "
            "cache "
            "| same as cache |",
            "|---|---|---|---|---|---|",
        ]
        summary = {}
        for name in DATA_ARMS:
            cells = []
            for features in (False, True):
                to_cache = ratios(times, (name, features), ("cache", features))
                summary[(name, features)] = statistics.median(to_cache)
                cells += [
                    spread([1000 * t for t in times[(name, features)]], 1),
                    spread(to_cache, 1),
                ]
            check = "–" if name == "cache" else same[(name, False)] and same[(name, True)]
            lines.append(f"| {name} | {' | '.join(cells)} | {check} |")
        lines += [
            "",
            f"Per step, the csv files take {summary[('csv', False)]:.0f}× the cache's time for "
            "the bags "
            f"and {summary[('csv', True)]:.0f}× with the features (median of per-trial ratios).",
        ]
    return summary


# ------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--clips",
        type=int,
        nargs="*",
        default=[200, 800, 3200],
        help="clips B per step in table 1; N = B·K captions (none: skip table 1)",
    )
    parser.add_argument("--bag-size", type=int, default=5, help="captions K per bag (both tables)")
    parser.add_argument("--dim", type=int, default=512, help="embedding width d of table 1")
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[1024, 4096], help="chunk sizes of table 1"
    )
    parser.add_argument(
        "--forms", nargs="+", choices=FORMS, default=list(FORMS), help="loss forms of table 1"
    )
    parser.add_argument(
        "--trials", type=int, default=3, help="interleaved timed trials per cell of table 1"
    )
    parser.add_argument(
        "--memory-repeats",
        type=int,
        default=3,
        help="fresh-process memory probes per cell of table 1 (the median is reported)",
    )
    parser.add_argument(
        "--videos", type=int, default=2000, help="planted videos of table 2 (0: skip table 2)"
    )
    parser.add_argument(
        "--feature-dim", type=int, default=2048, help="feature width per stream (real: 2048)"
    )
    parser.add_argument("--batch", type=int, default=512, help="clips per step in table 2")
    parser.add_argument(
        "--data-trials", type=int, default=10, help="interleaved timed trials of table 2"
    )
    parser.add_argument(
        "--device", default="cpu", help="where table 1's loss runs (table 2 reads files on the CPU)"
    )
    add_run_arguments(parser, ROOT / "docs" / "bench" / "milnce.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.clips, args.chunks, args.dim, args.trials, args.memory_repeats = (
            [16, 64],
            [32],
            32,
            2,
            1,
        )
        args.videos, args.feature_dim, args.batch, args.data_trials = 40, 16, 32, 2
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        return probe(json.loads(argv[1]))
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = rerun_command("bench/bench_milnce.py", argv)
    started, machine = datetime.now(timezone.utc), machine_summary()
    clock = CLOCKS[args.clock]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    header = [
        "## MIL-NCE (`bench/bench_milnce.py`)",
        "",
        f"Rerun: `{command.strip()}`",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC: {machine}. {torch.get_num_threads()} torch "
        "thread(s); clock: "
        f"{CLOCK_TEXT[args.clock]}; median (min–max) over {args.trials} (table 1) and "
        f"{args.data_trials} "
        f"(table 2) interleaved trials.",
        "",
    ]
    table1, table2 = [], []
    notes = [
        "Table 1: peak memory is the rise over one step (forward and backward) in a fresh "
        "process per probe, "
        f"above the inputs, median of {args.memory_repeats} probes; it includes the two embedding "
        "gradients "
        "and the gathered bag rows, which every form needs (N·d floats each). The chunked loss "
        "streams blocks of "
        "chunk × chunk scores; its differences from the full loss are float32 round-off, of the "
        "size of the "
        "full loss's own distance from float64. Where one block covers all B clips and N "
        "captions, the chunked "
        "loss does the full one's arithmetic (Δ = 0) and saves no memory; at small N the "
        "N·d-sized tensors "
        "dominate both arms' peaks.",
        "",
    ]

    def write(done: bool) -> None:
        body = [
            *table1,
            *([""] if table1 else []),
            *(notes if table1 else []),
            *table2,
            *([""] if table2 else []),
        ]
        write_section(args.out, [*header, *body], done)

    loss_summary = (
        loss_rows(args, clock, sync, table1, lambda: write(done=False)) if args.clips else []
    )
    data_summary = data_rows(args, clock, table2) if args.videos else {}
    write(done=True)
    for row in loss_summary:
        print(row)
    for (name, features), ratio in data_summary.items():
        print(f"{name}{' + features' if features else ''} / cache: {ratio:.1f}")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
