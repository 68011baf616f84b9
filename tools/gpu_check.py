"""The prepared GPU check (issue 18): ten checks of the kit on one device, one markdown table,
exit 1 on a failure.

    .venv/bin/python tools/gpu_check.py                        # a lent GPU, a few minutes (≤ 10)
    .venv/bin/python tools/gpu_check.py --device cpu --quick   # the same checks, CPU-sized

dropout: GradCache's dropout replay against one full graph, fp32 and fp64; bf16: the same under bf16
autocast; gcbs: the published GCBS order on the device equals the CPU's, and its time against one
pass of S's matmul; precision: trainer steps (GradCache chunks) under the `precision` setting, bf16
autocast and fp16 autocast with its GradScaler, against the same steps in fp32; gradients: the
gradients an fp16 step's optimizer takes (unscaled, clipped), plain and through GradCache, against
float64; resume: a training run killed after a checkpoint and rerun ends with the uninterrupted
run's model; minilm: notebook 04's recipe (UniXcoder lengths, batch 64) with the packaged MiniLM on
the stand-in; trainer: the trainer with `sampler=gcbs` and the loader's workers on 2 ranks of the
device's backend against one process; nccl: an
all_reduce on one rank (gloo on the CPU); ddp: notebook 07's gradient check (DDP heads through
GradCache, the loss over embeddings gathered from every rank) on 2 ranks of the device's backend
(NCCL needs 2 GPUs; on one it runs 1 rank), against one process. Result "note": not bitwise, within
what nondeterministic device kernels explain; "info": reported, not judged.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from gcbs_lib import experiments, gcbs, seeding
from gcbs_lib.check import compare, relative_error, tolerance
from gcbs_lib.experiments.milnce import gradient_check
from gcbs_lib.gradcache import cached_loss, encode_in_chunks
from gcbs_lib.launcher import launch
from gcbs_lib.losses import info_nce
from gcbs_lib.models import TinyTextEncoder, random_token_batch
from gcbs_lib.train import Trainer, load_checkpoint, load_config, train

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_gcbs import embedded_pairs, floor_pass  # noqa: E402  (bench/ is not a package: GCBS's data and floor)

ROOT = Path(__file__).resolve().parents[1]
CHECKS = (
    "dropout",
    "bf16",
    "gcbs",
    "precision",
    "gradients",
    "resume",
    "minilm",
    "nccl",
    "ddp",
    "trainer",
)


def replay_gradients(device: str, dtype: torch.dtype, autocast: bool = False) -> tuple[list, list]:
    """Parameter gradients of InfoNCE over a dropout encoder: through `cached_loss`, and through one
    full graph (`encode_in_chunks`) from the same RNG state; both under bf16 autocast when
    `autocast`."""
    torch.manual_seed(0)
    model = TinyTextEncoder(dim=64, heads=4, layers=2, max_length=32, dropout=0.1).to(device, dtype)
    tokens = torch.Generator().manual_seed(1)
    batches = [
        {k: v.to(device) for k, v in random_token_batch(64, 32, generator=tokens).items()}
        for _ in range(2)
    ]

    def gradients(loss_of_batches):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2)  # the dropout masks' stream, the same for both
        with torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = loss_of_batches()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ours = gradients(lambda: cached_loss(info_nce, model, batches, chunk_size=16))
    return ours, gradients(lambda: info_nce(*[encode_in_chunks(model, b, 16) for b in batches]))


def check_dropout(args) -> list:
    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        pairs = [compare(name, a, b) for a, b in zip(*replay_gradients(args.device, dtype))]
        error, limit = max(c.rel_err for c in pairs), tolerance(dtype)
        bitwise = all(c.exact for c in pairs)
        measured = "bitwise" if bitwise else f"max rel. err {error:.1e} (not bitwise)"
        rows.append(
            (
                f"dropout replay {name}: cached_loss = full graph",
                "pass" if error <= limit else "FAIL",
                measured,
                f"bitwise, else ≤ {limit:g}",
            )
        )
    return rows


def check_bf16(args) -> list:
    """Norm-wise over all gradients; the full graph adds each Linear weight's gradient over the
    chunks in bf16 (through autocast's one cached cast), so the fp32 gradients say which of the two
    is nearer the truth. The limit is the full graph's own error against fp32: the two bf16 results
    may differ by bf16's rounding, not more (on 2 CPU cores, 8 seeds: 3.2e-3 to 3.5e-3 against
    5.9e-3 to 7.3e-3, so 0.47 to 0.55 of the limit; a fixed 4e-3 left 12 %)."""
    whole = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    ours, full = map(whole, replay_gradients(args.device, torch.float32, autocast=True))
    truth = whole(replay_gradients(args.device, torch.float32)[1])
    error, limit = relative_error(ours, full), relative_error(full, truth)
    return [
        (
            "bf16 autocast replay: cached_loss = full graph",
            "pass" if error <= limit else "FAIL",
            f"rel. err {error:.1e} (vs fp32: cached_loss {relative_error(ours, truth):.1e})",
            f"≤ the full graph's own rel. err vs fp32, {limit:.1e}",
        )
    ]


def timed(function, device: str) -> float:
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


# N of the CPU reference of GCBS's order: 0.6 GB of host memory (bench_gcbs --peak-rss), so it
# fits a one-GPU box; the device's time and rank 0's planning peak are measured at PLANNING_N
REFERENCE_N = 40_000
PLANNING_N = 200_000


def check_gcbs(args) -> list:
    n, device = 5_000 if args.quick else REFERENCE_N, args.device
    z1, z2 = embedded_pairs(n, 256, clustered=True)
    d1, d2 = z1.to(device), z2.to(device)
    gcbs.published_permutation(d1[:2000], d2[:2000])  # warm-up: kernels, handles
    on_device = gcbs.published_permutation(d1, d2)
    on_cpu = gcbs.published_permutation(z1, z2)
    differ = (on_device != on_cpu).double().mean().item()
    if differ == 0:
        equal = ("pass", "equal permutations")
    # a similarity at the threshold rounded the other way moves RCM's order: compare what the orders
    # achieve
    else:
        gaps = [gcbs.loss_gap(d1, d2, order, 64, 0.05) for order in (on_device, on_cpu)]
        close = abs(gaps[0] - gaps[1]) <= 0.01 * abs(gaps[1])
        equal = (
            "note" if close else "FAIL",
            f"{differ:.1%} of positions differ; loss gap {gaps[0]:.4f} vs {gaps[1]:.4f}",
        )
    rows = [
        (f"GCBS N = {n:,}, d = 256: {device} = cpu", *equal, "equal, else loss gaps within 1 %")
    ]
    return rows + planning_rows(args)


def planning_rows(args) -> list:
    """Reported, not judged: the published order's time on the device against one matmul pass
    over S (the graph and RCM run on the CPU whatever the device), and on CUDA the peak of device
    memory it adds, rank 0's planning peak at that N."""
    n, device = 5_000 if args.quick else PLANNING_N, args.device
    d1, d2 = (z.to(device) for z in embedded_pairs(n, 256, clustered=True))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if device == "cuda" else 0
    seconds = timed(lambda: gcbs.published_permutation(d1, d2), device)
    peak = (torch.cuda.max_memory_allocated() - held) / 2**30 if device == "cuda" else 0.0
    floor = min(timed(lambda: floor_pass(d1, d2), device) for _ in range(2))
    rows = [
        (
            f"GCBS N = {n:,}: time on {device} / one matmul pass over S",
            "info",
            f"{seconds:.2f} s / {floor:.3f} s = {seconds / floor:.1f}×",
            "reported (graph and RCM run on the CPU)",
        )
    ]
    if device == "cuda":
        rows.append(
            (
                f"GCBS N = {n:,}, d = 256: planning peak on the GPU",
                "info",
                f"{peak:.2f} GiB",
                "reported",
            )
        )
    return rows


def step_records(folder) -> list[dict]:
    """The step records a training run logged in `folder`'s metrics.jsonl."""
    lines = Path(folder, "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def check_precision(args) -> list:
    """The ci code-search run, 4 steps with GradCache chunks of 8, in fp32, bf16 and fp16 on the
    device: finite losses, a step taken, and the first step's loss (same parameters, same batch)
    within 10× the autocast dtype's tolerance of fp32's. fp16's skipped steps (its GradScaler
    starts at 2^16, so early overflows are expected) and final scale are reported."""
    settings = {"device": args.device, "max_steps": "4", "chunk_size": "8", "progress": "false"}
    steps, scaler = {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-precision-") as tmp:
        for precision in ("fp32", "bf16", "fp16"):
            folder = Path(tmp, precision)
            train(load_config("codesearch", "ci", {**settings, "precision": precision}), folder)
            steps[precision] = step_records(folder)
            scaler[precision] = load_checkpoint(folder / "checkpoint.pt")["scaler"]
    reference = steps["fp32"][0]["loss"]
    rows = []
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        losses = [r["loss"] for r in steps[precision]]
        skipped = sum(not math.isfinite(r["grad_norm"]) for r in steps[precision])
        error, limit = abs(losses[0] - reference) / abs(reference), 10 * tolerance(dtype)
        good = all(map(math.isfinite, losses)) and len(losses) == 4 and skipped < 4
        measured = (
            f"step-1 loss rel. err {error:.1e} vs fp32; losses {losses[0]:.4f} → {losses[-1]:.4f}"
        )
        if precision == "fp16":
            measured += f"; {skipped} of 4 steps skipped, loss scale {scaler['fp16']['scale']:g}"
        rows.append(
            (
                f"trainer, precision {precision}: 4 steps, GradCache chunks of 8",
                "pass" if good and error <= limit else "FAIL",
                measured,
                f"finite, a step taken; step-1 loss ≤ {limit:g}",
            )
        )
    return rows


# ‖fp16 − reference‖ / ‖reference‖ of a trainer step's gradients, measured on 2 CPU cores: 1.0e-3 to
# 1.9e-3 against fp32 (tests/test_train_precision.py); a scaler factor left in measures ≈ 1
FP16_GRADIENTS = 5e-3


def taken_gradients(config, folder) -> tuple[torch.Tensor, float]:
    """The gradients (every parameter's, one vector) of a new trainer's first optimizer step on the
    first 16 pairs, as the optimizer takes them, and the step's logged gradient norm. A step the
    fp16 scaler skips changes nothing, so the same batch is retried at the halved scale."""
    trainer = Trainer(config, folder)
    taken = []

    def record(optimizer, args, kwargs):
        taken.append(torch.cat([p.grad.flatten() for p in trainer.parameters]))

    trainer.optimizer.register_step_pre_hook(record)
    batch = trainer.experiment.collate(list(range(16)))
    for _ in range(8):  # the scale starts at 2^16: the ci encoder overflows there once
        torch.manual_seed(0)
        grad_norm = trainer._train_step(batch)["grad_norm"]
        if taken:
            return taken[0], grad_norm
    raise AssertionError("the fp16 scaler skipped 8 steps in a row")


def check_gradients(args) -> list:
    """The gradients an fp16 step takes (autocast, GradScaler, unscaled and clipped to 0.01) on the
    ci code-search run, plain and through GradCache chunks of 4, against the same step with float64
    parameters (no dropout; float64 is not cast by autocast nor rounded by TF32)."""
    settings = {"device": args.device, "dropout": "0.0", "clip_norm": "0.01", "progress": "false"}
    runs = {"float64": {"dtype": "float64"}, "fp16": {"precision": "fp16"}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-gradients-") as tmp:
        for chunk_size in ("none", "4"):
            taken = {}
            for name, run in runs.items():
                config = load_config(
                    "codesearch", "ci", {**settings, **run, "chunk_size": chunk_size}
                )
                taken[name] = taken_gradients(config, Path(tmp, f"{name}-{chunk_size}"))
            error = relative_error(taken["fp16"][0], taken["float64"][0])
            norm = abs(taken["fp16"][1] / taken["float64"][1] - 1)
            way = "plain backward" if chunk_size == "none" else "GradCache chunks of 4"
            rows.append(
                (
                    f"trainer gradients, fp16 + GradScaler, clipped: {way} = float64",
                    "pass" if max(error, norm) <= FP16_GRADIENTS else "FAIL",
                    f"rel. err {error:.1e}; logged grad norm {norm:.1e}",
                    f"≤ {FP16_GRADIENTS:g}",
                )
            )
    return rows


def train_run(output_dir: Path, profile: str, settings: list[str], popen: bool = False):
    """`python -m gcbs_lib.train` on codesearch: finished (its last stdout line, JSON), or started
    (`popen`)."""
    command = [
        sys.executable,
        "-m",
        "gcbs_lib.train",
        "--experiment",
        "codesearch",
        "--profile",
        profile,
        "--output-dir",
        str(output_dir),
        *[part for s in settings for part in ("--set", s)],
    ]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if popen:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_resume(args) -> list:
    """In fp32 and in fp16 (its GradScaler's state restored too)."""
    return [row for precision in ("fp32", "fp16") for row in resumed(args, precision)]


def resumed(args, precision: str) -> list:
    settings = [f"device={args.device}", "max_steps=6", "checkpoint_every=2", "progress=false"]
    settings.append(f"precision={precision}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-resume-") as tmp:
        whole, cut = Path(tmp, "whole"), Path(tmp, "cut")
        train_run(whole, "ci", settings)
        run = train_run(cut, "ci", settings, popen=True)
        while run.poll() is None and not (cut / "checkpoint.pt").exists():
            time.sleep(0.002)
        run.send_signal(signal.SIGKILL)
        run.wait()
        killed_at = (
            load_checkpoint(cut / "checkpoint.pt")["step"]
            if (cut / "checkpoint.pt").exists()
            else None
        )
        if killed_at not in (2, 4):
            return [
                (
                    f"resume after SIGKILL, {precision}",
                    "FAIL",
                    f"not killed after step 2 or 4 (checkpoint step {killed_at})",
                    "bitwise",
                )
            ]
        train_run(cut, "ci", settings)
        ends = [load_checkpoint(folder / "checkpoint.pt") for folder in (whole, cut)]
    assert (
        ends[0]["step"] == ends[1]["step"] == 6
        and ends[0]["model"].keys() == ends[1]["model"].keys()
    )
    pairs = [(ends[0]["model"][k], ends[1]["model"][k]) for k in ends[0]["model"]]
    diff = max((a.double() - b.double()).abs().max().item() for a, b in pairs)
    name = f"resume after SIGKILL at step {killed_at} of 6, {precision}: model = uninterrupted"
    if all(torch.equal(a, b) for a, b in pairs):
        return [(name, "pass", "bitwise", "bitwise")]
    if args.device == "cuda" and diff <= 1e-5:
        return [
            (
                name,
                "note",
                f"max |Δ| {diff:.1e}: not bitwise (CUDA kernels may not be deterministic)",
                "bitwise (CUDA: ≤ 1e-5)",
            )
        ]
    return [
        (
            name,
            "FAIL",
            f"max |Δ| {diff:.1e}",
            "bitwise" + (" (CUDA: ≤ 1e-5)" if args.device == "cuda" else ""),
        )
    ]


def check_minilm(args) -> list:
    """Notebook 04's recipe: UniXcoder's lengths and batch, MiniLM on the stand-in (its cpu
    profile), 300 steps."""
    settings = {
        "device": args.device,
        "batch_size": "64",
        "query_length": "128",
        "code_length": "256",
        # 16 steps an epoch
        "max_steps": "300",
        "epochs": "19",
        "eval_every": "100",
        "progress": "false",
    }
    if args.quick:  # a smoke run: three steps, short texts, a small training set and few queries
        settings |= {
            "max_steps": "3",
            "epochs": "1",
            "train_limit": "192",
            "eval_limit": "32",
            "query_length": "32",
            "code_length": "64",
        }
    config = load_config("codesearch", "cpu", settings)
    experiment = experiments.get("codesearch")(
        config.options, seed=config.seed, device=torch.device(args.device)
    )
    experiment.load_data()
    # as the trainer builds its model
    torch.manual_seed(seeding.stream_seed(config.seed, 0, "init"))
    with torch.no_grad():
        model = experiment.build_model().to(args.device).eval()
        start = experiment.scores(experiment.evaluate(model, "test"))["mrr"]
    del experiment
    with tempfile.TemporaryDirectory(prefix="gpu-check-minilm-") as tmp:
        summary = train_run(Path(tmp), "cpu", [f"{k}={v}" for k, v in settings.items()])
        steps = step_records(tmp)
    trained, rate = summary["test"]["mrr"], len(steps) / sum(r["seconds"] for r in steps)
    finite = (
        math.isfinite(start) and math.isfinite(trained) and len(steps) == int(settings["max_steps"])
    )
    measured = (
        f"test MRR {start:.4f} → {trained:.4f} (best step {summary['best_step']}); "
        f"{rate:.2f} steps/s"
    )
    return [
        (
            f"MiniLM, batch 64, lengths {settings['query_length']}/{settings['code_length']}, "
            f"{len(steps)} steps",
            "pass" if finite else "FAIL",
            measured,
            "finite, all steps",
        )
    ]


def all_reduce_ones(device: str) -> float:
    """A launched rank's all_reduce of ones(4) on its device: 4 × world size."""
    import torch.distributed as dist

    ones = torch.ones(4, device=f"cuda:{os.environ['LOCAL_RANK']}" if device == "cuda" else "cpu")
    dist.all_reduce(ones)
    return ones.sum().item()


def check_nccl(args) -> list:
    backend = "nccl" if args.device == "cuda" else "gloo"
    total = launch(
        f"{Path(__file__).stem}:all_reduce_ones",
        nproc=1,
        backend=backend,
        args={"device": args.device},
        timeout=120,
        echo=False,
    )
    return [
        (
            f"{backend}, world size 1: all_reduce",
            "pass" if total == 4.0 else "FAIL",
            f"sum of all_reduce(ones(4)) = {total:g}",
            "4",
        )
    ]


def check_ddp(args) -> list:
    backend = "nccl" if args.device == "cuda" else "gloo"
    ranks = 2 if args.device == "cpu" or torch.cuda.device_count() > 1 else 1
    with tempfile.TemporaryDirectory() as folder:
        tiny = load_config("milnce", "gradient-check", {"data_dir": folder})
        options = asdict(tiny.options)
        single = gradient_check(options, batch_size=16, device=args.device)
        check = {"options": options, "batch_size": 16, "chunk_size": 3}
        ranked = launch(gradient_check, nproc=ranks, backend=backend, args=check, echo=False)
    error = relative_error(torch.tensor(ranked["grad"]), torch.tensor(single["grad"]))
    within = error <= 1e-12 and ranked["rank_difference"] == 0.0
    return [
        (
            f"{backend}, {ranks} rank(s): notebook 07's DDP gradient check = 1 process",
            "pass" if within else "FAIL",
            f"rel. err {error:.1e}, rank difference {ranked['rank_difference']:g}",
            "≤ 1e-12, 0",
        )
    ]


def check_trainer(args) -> list:
    """The trainer on the device's backend, `sampler=gcbs`: the ci code-search run in float64
    without dropout on 2 ranks (NCCL needs 2 GPUs; on one it runs 1 rank) with two loader workers
    (pinned batches, copies that do not block) and a sync check every step (ranks that differ stop
    the run), against one process collating in itself at the same global batch: the losses agree
    to rounding (tests/test_train's 1e-9 on the CPU; on CUDA 1e-6, for nondeterministic kernels)."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    ranks = 2 if args.device == "cpu" or torch.cuda.device_count() > 1 else 1
    settings = {
        "device": args.device,
        "sampler": "gcbs",
        "max_steps": 4,
        "dtype": "float64",
        "dropout": 0.0,
        "loader_workers": 2,
        "sync_check_every": 1,
        "progress": False,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-trainer-") as tmp:
        config = load_config("codesearch", "ci", settings)
        train(replace(config, loader_workers=0), Path(tmp, "one"))
        launched = {"config": asdict(config), "output_dir": str(Path(tmp, "ranks"))}
        launch("gcbs_lib.train:launched", nproc=ranks, backend=backend, args=launched, echo=False)
        losses = [[r["loss"] for r in step_records(Path(tmp, name))] for name in ("one", "ranks")]
    error = max((abs(a - b) / abs(b) for a, b in zip(*losses)), default=math.inf)
    limit = 1e-9 if args.device == "cpu" else 1e-6
    synced = "ranks in sync, " if ranks > 1 else ""
    return [
        (
            f"trainer, {backend}, {ranks} rank(s), sampler gcbs, 2 loader workers = 1 process",
            "pass" if len(losses[1]) == 4 and error <= limit else "FAIL",
            f"{len(losses[1])} of 4 steps, {synced}loss rel. err {error:.1e}",
            f"4 steps, ≤ {limit:g}",
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CPU-sized: GCBS at N = 5k, 3 MiniLM steps on short texts",
    )
    parser.add_argument(
        "--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="run only these checks"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --device cpu (add --quick for a smoke run)")
    # launch's ranks import all_reduce_ones from here
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    table, began = [], time.perf_counter()
    for name in args.only:
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            rows = globals()[f"check_{name}"](args)
        except Exception as error:  # a check that crashes fails; the others still run
            last_line = (str(error).strip().splitlines() or [""])[-1]
            rows = [(name, "FAIL", f"{type(error).__name__}: {last_line}".replace("|", "/"), "")]
        table += [
            (check, result, f"{measured}; {time.perf_counter() - start:.0f} s", limit)
            for check, result, measured, limit in rows
        ]
    where = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"cpu, {torch.get_num_threads()} threads"
    )
    print("| check | result | measured | limit |\n|---|---|---|---|")
    print("\n".join(f"| {' | '.join(row)} |" for row in table))
    print(
        f"\n{where}, torch {torch.__version__}{', --quick' if args.quick else ''}: "
        f"{time.perf_counter() - began:.0f} s in all"
    )
    return int(any(row[1] == "FAIL" for row in table))


if __name__ == "__main__":
    sys.exit(main())
