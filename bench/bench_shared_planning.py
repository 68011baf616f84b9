"""Rank 0's planning time when the ranks share the scan of S, at 1, 2 and 4 ranks.

    python bench/bench_shared_planning.py               # → docs/bench/shared_planning.md
    python bench/bench_shared_planning.py --quick --out /tmp/planning.md   # does it run?

Under GCBS on W ranks every rank holds the epoch's N embedding pairs and calls
`gcbs.published_graph(..., shared=True)`: it scans its share of S's 10-row chunks, the ranks agree
on the threshold (the median of every chunk's quantile), and rank 0 receives the edges and orders
them (`graph_order`, scipy's RCM). Here W gloo ranks run on this machine's cores, one torch thread
each, and each is timed by its own CPU time (`time.process_time`), so ranks that share a core are
timed as if each had its own: the slowest rank's scan, rank 0's scan and its RCM. Clustered
planted pairs (N / 50 centres), 64 dimensions, q = 0.999.
"""

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from gcbs_lib import gcbs
from gcbs_lib.launcher import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import ROOT, machine_summary  # noqa: E402  (bench/ is not a package)
from trials import add_run_arguments, rerun_command, write_section  # noqa: E402


def planted_pairs(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n pairs around n / 50 random centres, the second of each pair a noisy copy of the first."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(max(1, n // 50), dim, generator=g)
    z1 = centres[torch.randint(len(centres), (n,), generator=g)] + 0.5 * torch.randn(
        n, dim, generator=g
    )
    return z1, z1 + 0.1 * torch.randn(n, dim, generator=g)


def plan_seconds(n: int, dim: int, quantile: float, seed: int) -> dict:
    """The CPU seconds of every rank's share of the scan and of rank 0's RCM, and the edges (on
    rank 0; {} elsewhere)."""
    z1, z2 = planted_pairs(n, dim, seed)
    started = time.process_time()
    graph = gcbs.published_graph(z1, z2, quantile, shared=True)
    scanned = time.process_time() - started
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, scanned)
    if graph is None:
        return {}
    started = time.process_time()
    gcbs.graph_order(graph)
    return {"scans": everyone, "rcm": time.process_time() - started, "edges": graph.nnz}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, nargs="+", default=[10_000, 40_000], help="N")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="W")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--quantile", type=float, default=0.999)
    add_run_arguments(parser, ROOT / "docs" / "bench" / "shared_planning.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.items = [500]
    started, machine = datetime.now(timezone.utc), machine_summary()
    lines = [
        "## GCBS planning shared by the ranks (`bench/bench_shared_planning.py`)",
        "",
        f"Rerun: `{rerun_command('bench/bench_shared_planning.py', argv)}`",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC: {machine}. CPU seconds of each rank (one torch "
        f"thread a rank): the published graph of N clustered pairs ({args.dim} dimensions, q = "
        f"{args.quantile}) scanned by W gloo ranks, its edges ordered by RCM on rank 0.",
        "",
        "| N | ranks W | edges | slowest rank's scan s | rank 0's scan s | rank 0's RCM s |"
        " rank 0's planning s |",
        "|---:" * 7 + "|",
    ]
    target = "bench_shared_planning:plan_seconds"
    for n in args.items:
        for ranks in args.ranks:
            setting = {"n": n, "dim": args.dim, "quantile": args.quantile, "seed": args.seed}
            found = launch(target, nproc=ranks, echo=False, args=setting)
            scans, rcm = found["scans"], found["rcm"]
            lines.append(
                f"| {n:,} | {ranks} | {found['edges']:,} | {max(scans):.2f} | {scans[0]:.2f} | "
                f"{rcm:.2f} | {scans[0] + rcm:.2f} |"
            )
            write_section(args.out, lines, done=False)
    lines += [
        "",
        "The scan of S is O(N²) and splits across the ranks; RCM on the edge list stays on rank 0 "
        "(O(edges)).",
        "",
    ]
    write_section(args.out, lines, done=True)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
