"""GCBS permutation time against N: the kit's order and the published one against the floor, in
interleaved trials (the machine may be shared: compare ratios, not seconds).

The floor is one pass of the similarity matmul over all N² pairs, in the kit's row blocks (every
pair must be looked at once). The kit: `gcbs_permutation` (sampled bound, one pass keeping the
candidate edges, exact threshold, graph, RCM). Published: `published_permutation`, the paper's
order index for index (median of the 10-row chunks' quantiles, by selection, in one pass keeping
each block's candidate edges; directed graph, RCM).

    # the report: N = 10k … 200k, d = 256, q = 0.999, 3 trials (1 from 100k), written to
    # docs/bench/gcbs.md (over an hour on 2 shared cores)
    python bench/bench_gcbs.py
    # a smoke run, printed only; N = 30k alone
    python bench/bench_gcbs.py --sizes 2000 --repeats 1 --markdown ''
    python bench/bench_gcbs.py --sizes 30000 --repeats 1 --markdown ''
    # similarity work on the GPU
    python bench/bench_gcbs.py --device cuda --markdown docs/bench/gcbs_cuda.md
    # peak memory: the published order once per N, each in a fresh process (printed only)
    python bench/bench_gcbs.py --peak-rss --sizes 10000 20000 30000 40000

Each trial times every arm once, in an order rotated from trial to trial; a table cell is the median
over trials with the min–max range, and "kit / floor" and "published / floor" are the medians of the
per-trial ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gcbs_lib import gcbs
from gcbs_lib.gcbs import gcbs_permutation, published_permutation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_summary  # noqa: E402  (bench/ is not a package)
from trials import rerun_command, spread, write_section  # noqa: E402

FEATURES = 128
DEFAULT_MARKDOWN = "docs/bench/gcbs.md"


def floor_pass(z1: torch.Tensor, z2: torch.Tensor) -> None:
    """One pass of the similarity matmul over all N² pairs, in the kit's row blocks, nothing
    else."""
    u1, u2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    elements = gcbs.DEVICE_BLOCK_ELEMENTS if u1.is_cuda else gcbs.BLOCK_ELEMENTS
    rows = max(1, elements // len(u1))
    for start in range(0, len(u1), rows):
        u1[start : start + rows] @ u2.T
    if u1.is_cuda:
        torch.cuda.synchronize(u1.device)


def kit(z1: torch.Tensor, z2: torch.Tensor, quantile: float) -> None:
    gcbs_permutation(z1, z2, quantile, seed=0)
    if z1.is_cuda:
        torch.cuda.synchronize(z1.device)


def published(z1: torch.Tensor, z2: torch.Tensor, quantile: float) -> None:
    published_permutation(z1, z2, quantile)
    if z1.is_cuda:
        torch.cuda.synchronize(z1.device)


def embedded_pairs(
    n: int, dim: int, clustered: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """n feature pairs embedded by a small MLP, as a trainer would at each epoch start (clusters of
    about 50): features z1 ~ N(0, I) or around n // 50 random centres (0.5 around each), z2 = z1 +
    0.1·N(0, I)."""
    g = torch.Generator().manual_seed(seed)
    x1 = torch.randn(n, FEATURES, generator=g)
    if clustered:
        centres = torch.randn(n // 50, FEATURES, generator=g)
        x1 = centres[torch.randint(n // 50, (n,), generator=g)] + 0.5 * x1
    x2 = x1 + 0.1 * torch.randn(n, FEATURES, generator=g)
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, dim))
    with torch.no_grad():
        return torch.cat([encoder(x) for x in x1.split(4096)]), torch.cat(
            [encoder(x) for x in x2.split(4096)]
        )


def measure(n: int, repeats: int, args: argparse.Namespace, data: str) -> dict:
    """Interleaved trials of every arm that runs at this N; returns the table row's numbers."""
    z1, z2 = (z.to(args.device) for z in embedded_pairs(n, args.dim, data == "clustered"))
    arms = {"floor": lambda: floor_pass(z1, z2), "kit": lambda: kit(z1, z2, args.quantile)}
    if args.published_max is None or n <= args.published_max:
        arms["published"] = lambda: published(z1, z2, args.quantile)
    names, seconds = list(arms), {name: [] for name in arms}
    for trial in range(repeats):
        for name in names[trial % len(names) :] + names[: trial % len(names)]:
            start = time.perf_counter()
            arms[name]()
            seconds[name].append(time.perf_counter() - start)
    return {
        "data": data,
        "n": n,
        "trials": repeats,
        "seconds": seconds,
        "kit_over_floor": [k / f for k, f in zip(seconds["kit"], seconds["floor"])],
        "published_over_floor": [
            p / f for p, f in zip(seconds.get("published", []), seconds["floor"])
        ],
    }


def peak_rss(n: int, args: argparse.Namespace) -> dict:
    """One published order at this N in this (fresh) process: its seconds, and the process's peak
    resident memory (ru_maxrss) before and after it, in GB."""
    z1, z2 = (z.to(args.device) for z in embedded_pairs(n, args.dim, True))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    published(z1, z2, args.quantile)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"n": n, "seconds": seconds, "before_gb": before / 2**20, "peak_gb": after / 2**20}


def peak_rss_table(args: argparse.Namespace) -> list[str]:
    """Each N measured by `peak_rss` in a fresh subprocess (a process's peak never falls), printed
    as a markdown table row by row."""
    lines = ["| N | published s | peak RSS GB | RSS before the order GB |", "|---:|---:|---:|---:|"]
    print("\n".join(lines))
    for n in args.sizes:
        child = [sys.executable, __file__, "--rss-of", str(n), "--dim", str(args.dim)]
        child += ["--quantile", str(args.quantile), "--device", args.device]
        row = json.loads(subprocess.run(child, capture_output=True, check=True, text=True).stdout)
        lines.append(
            f"| {n:,} | {row['seconds']:.1f} | {row['peak_gb']:.2f} | {row['before_gb']:.2f} |"
        )
        print(lines[-1], flush=True)
    return lines


def table(rows: list[dict]) -> list[str]:
    """The markdown table of the measured rows."""
    lines = [
        "| data | N | trials | floor s | kit s | kit / floor | matmul share of kit | published s "
        "| published / floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = row["seconds"]
        share = statistics.median(f / k for f, k in zip(s["floor"], s["kit"]))
        published, ratio = "–", "–"
        if "published" in s:
            published, ratio = spread(s["published"]), spread(row["published_over_floor"])
        lines.append(
            f"| {row['data']} | {row['n']:,} | {row['trials']} | {spread(s['floor'])} | "
            f"{spread(s['kit'])} | "
            f"{spread(row['kit_over_floor'])} | {share:.0%} | {published} | {ratio} |"
        )
    return lines


def report(rows: list[dict], args: argparse.Namespace, command: str, machine: str) -> list[str]:
    slow = max(rows, key=lambda r: r["n"])
    kit = statistics.median(slow["kit_over_floor"])
    summary = f"At N = {slow['n']:,} the kit takes {kit:.2f}× the floor"
    if slow["published_over_floor"]:
        summary += f", the published order {statistics.median(slow['published_over_floor']):.2f}×"
    return [
        f"## GCBS permutation against N (d = {args.dim}, q = {args.quantile}, {args.device})",
        "",
        f"Machine: {machine}; {torch.get_num_threads()} torch threads.",
        "",
        f"Command: `{command}`",
        "",
        "Seconds as median (min–max) over the interleaved trials of each N. The floor is one pass "
        "of the similarity matmul over all N² pairs in the kit's row blocks; the kit is "
        "`gcbs_permutation` (sampled bound, one pass keeping the candidate edges, exact threshold, "
        "graph, RCM); published is `published_permutation`, the paper's order index for index "
        '(median of the 10-row chunks\' quantiles, one pass, directed graph, RCM). "matmul share" '
        "is floor / kit.",
        "",
        *table(rows),
        "",
        f"{summary}.",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[10000, 20000, 30000, 50000, 100000, 200000],
        help="values of N",
    )
    parser.add_argument("--dim", type=int, default=256, help="embedding dimension d")
    parser.add_argument(
        "--quantile", type=float, default=0.999, help="similarity quantile of the graph"
    )
    parser.add_argument(
        "--data",
        nargs="+",
        choices=["clustered", "random"],
        default=["clustered"],
        help="embeddings: planted clusters of about 50 items and/or isotropic Gaussian",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        nargs="+",
        help="interleaved trials per N: one number for every N, or one per N "
        "(default 3 below N = 100k, 1 from there: a 200k trial pair takes about 10 minutes)",
    )
    parser.add_argument(
        "--published-max",
        type=int,
        help="largest N at which to time the published order (default: every N; 0: never)",
    )
    parser.add_argument("--device", default="cpu", help="where the embeddings live: cpu or cuda")
    parser.add_argument(
        "--markdown",
        default=DEFAULT_MARKDOWN,
        help=f"write the report section here (default {DEFAULT_MARKDOWN}; '' to only print)",
    )
    parser.add_argument(
        "--peak-rss",
        action="store_true",
        help="instead of timed trials: the published order's peak RSS at each N (a process each)",
    )
    parser.add_argument("--rss-of", type=int, help=argparse.SUPPRESS)  # the child of --peak-rss
    args = parser.parse_args()
    if args.rss_of:
        print(json.dumps(peak_rss(args.rss_of, args)))
        return
    if args.peak_rss:
        peak_rss_table(args)
        return
    args.repeats = args.repeats or [3 if n < 100000 else 1 for n in args.sizes]
    if len(args.repeats) not in (1, len(args.sizes)):
        parser.error(f"give one --repeats value or one per size ({len(args.sizes)})")
    rows, repeats = [], dict(zip(args.sizes, args.repeats * len(args.sizes)))
    command = rerun_command("bench/bench_gcbs.py", None)
    machine = machine_summary()  # at the start: the load it started under and the commit it runs
    for data in args.data:
        for n in args.sizes:
            rows.append(measure(n, repeats[n], args, data))
            print("\n".join(table(rows)[:2] + table(rows[-1:])[2:]), flush=True)
            if args.markdown:  # after every N, so that an interrupted run keeps what it measured
                write_section(Path(args.markdown), report(rows, args, command, machine), done=False)
    if args.markdown:
        write_section(Path(args.markdown), report(rows, args, command, machine), done=True)
    print("\n".join(report(rows, args, command, machine)))


if __name__ == "__main__":
    main()
