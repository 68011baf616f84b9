"""GCBS permutation time against N: the kit's one-pass design against the floor, its former two-pass design and
the published algorithm, in interleaved trials (the machine may be shared: compare ratios, not seconds).

The floor is one pass of the similarity matmul over all N² pairs, in the kit's row blocks (every pair must be
looked at once). The kit: `gcbs_order` (sampled bound, one pass keeping the candidate edges, exact selection,
graph, RCM). Two-pass: the kit before issue 11 (two passes over S histogramming float32 bit patterns for the
exact quantile, a third for the edges), kept here to time it and to check that the kit gives bitwise the same
threshold, graph and order. Published: the paper's minimal code with its bugs fixed (functional `normalize`,
row chunks small enough for `torch.quantile`, no diagonal edges), its structure kept: the mean of per-chunk
`torch.quantile` values as threshold, the edge list in Python lists, then `reverse_cuthill_mckee`.

    python bench/bench_gcbs.py        # the report: N = 10k … 200k, d = 256, q = 0.999, 3 trials (1 from 100k),
                                      # writes docs/bench/gcbs.md (about an hour on 2 shared cores)
    python bench/bench_gcbs.py --sizes 5000 10000 --repeats 5 --markdown ''   # print only
    python bench/bench_gcbs.py --device cuda --markdown docs/bench/gcbs_cuda.md  # similarity work on the GPU
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/bench_gcbs.py --distributed \\
        --sizes 20000 --markdown ''   # ranks split the similarity rows (gloo); rank 0 checks the order

Each trial times every arm once, in an order rotated from trial to trial; a table cell is the median over
trials with the min–max range, and "kit / floor" is the median of the per-trial ratios.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.sparse.csgraph import reverse_cuthill_mckee
from torch import nn

from gcbs_lib.gcbs import (_BINS, _HIGH_IN_VALUE_ORDER, _float32_at_most, _halves, _lerp, _locate, _unit_rows,
                           edges_to_graph, embed_all, gcbs_order, rcm_order, row_blocks, similarity_blocks,
                           synthetic_pairs)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_summary  # noqa: E402  (bench/ is not a package)
from trials import rerun_command, spread, write_section  # noqa: E402

FEATURES = 128
DEFAULT_MARKDOWN = "docs/bench/gcbs.md"


# ------------------------------------------------------------------------------------------- arms

def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_pass(z1: torch.Tensor, z2: torch.Tensor) -> None:
    """One pass of the similarity matmul over all N² pairs, in the kit's row blocks, nothing else."""
    u1, u2 = _unit_rows(z1, z2, device=z1.device)
    for rows in row_blocks(len(u1)):
        u1[rows.start:rows.stop] @ u2.T
    _synchronize(z1.device)


def two_pass_order(z1: torch.Tensor, z2: torch.Tensor, quantile: float, seed: int):
    """The kit's former design: (threshold, directed edge count, graph, order) from three passes over S."""
    n = len(z1)
    m = n * (n - 1)
    position = (m - 1) * quantile
    below = math.floor(position)
    ranks = [n + below, n + min(below + 1, m - 1)]
    high = np.zeros(_BINS, np.int64)
    for _, block in similarity_blocks(z1, z2):
        high += np.bincount(_halves(block)[0], minlength=_BINS)
    located = [_locate(high[_HIGH_IN_VALUE_ORDER], k) for k in ranks]
    targets = sorted({int(_HIGH_IN_VALUE_ORDER[b]) for b, _ in located})
    low = {h: np.zeros(_BINS, np.int64) for h in targets}
    for _, block in similarity_blocks(z1, z2):
        hi, lo = _halves(block)
        for h in targets:
            low[h] += np.bincount(lo[hi == h], minlength=_BINS)
    values = []
    for b, k in located:
        h = int(_HIGH_IN_VALUE_ORDER[b])
        positive = h < _BINS // 2
        l, _ = _locate(low[h] if positive else low[h][::-1], k)
        values.append(float(np.array([(h << 16) | (l if positive else _BINS - 1 - l)], np.uint32).view(np.float32)[0]))
    threshold = _lerp(*values, position - below)
    rows, cols = [], []
    for block_rows, block in similarity_blocks(z1, z2):
        r, c = np.divmod(np.flatnonzero(block > _float32_at_most(threshold)), n)
        rows.append(r + block_rows.start)
        cols.append(c)
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    graph = edges_to_graph(rows, cols, n)
    return threshold, len(rows), graph, rcm_order(graph, seed)


def published_permutation(z1: torch.Tensor, z2: torch.Tensor, quantile: float) -> tuple[np.ndarray, int]:
    """The published algorithm, bugs fixed, structure kept. Returns (order, directed edge count)."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    n = len(z1)
    chunk = (2**24 - 1) // n  # torch.quantile refuses more than 2^24 elements
    threshold = torch.stack([torch.quantile(z1[s:s + chunk] @ z2.T, quantile) for s in range(0, n, chunk)]).mean()
    rows, cols = [], []
    for s in range(0, n, chunk):
        similarity = z1[s:s + chunk] @ z2.T
        similarity[torch.arange(len(similarity)), torch.arange(s, s + len(similarity))] = -float("inf")
        for i, j in (similarity > threshold).nonzero().tolist():
            rows.append(s + i)
            cols.append(j)
    graph = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n))
    return reverse_cuthill_mckee(graph), len(rows)


def embedded_pairs(n: int, dim: int, clustered: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n feature pairs embedded by a small MLP, as a sampler would at each epoch start (clusters of about 50)."""
    x1, x2 = synthetic_pairs(n, FEATURES, clusters=n // 50 if clustered else 0, seed=seed)
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, dim))
    return embed_all(lambda idx: (encoder(x1[idx]), encoder(x2[idx])), n, model=encoder, progress=False)


# ------------------------------------------------------------------------------------- measuring

def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def same_result(kit, reference) -> bool:
    threshold, edges, graph, order = reference
    return (kit.threshold == threshold and kit.edges == edges and (kit.graph != graph).nnz == 0
            and torch.equal(kit.order, order))


def measure(n: int, repeats: int, args: argparse.Namespace, data: str) -> dict:
    """Interleaved trials of every arm that runs at this N; returns the table row's numbers."""
    z1, z2 = (z.to(args.device) for z in embedded_pairs(n, args.dim, data == "clustered"))
    arms = {"floor": lambda: floor_pass(z1, z2), "kit": lambda: gcbs_order(z1, z2, args.quantile, seed=0)}
    on_cpu = z1.device.type == "cpu"  # the former designs run on the CPU only
    if on_cpu and n <= args.two_pass_max:
        arms["two-pass"] = lambda: two_pass_order(z1, z2, args.quantile, seed=0)
    if on_cpu and n <= args.published_max:
        arms["published"] = lambda: published_permutation(z1, z2, args.quantile)
    names, seconds, results = list(arms), {name: [] for name in arms}, {}
    for trial in range(repeats):
        for name in names[trial % len(names):] + names[:trial % len(names)]:
            elapsed, results[name] = timed(arms[name])
            seconds[name].append(elapsed)
    kit = results["kit"]
    row = {"data": data, "n": n, "trials": repeats, "seconds": seconds, "passes": kit.passes,
           "candidates_per_edge": kit.candidates / max(kit.edges, 1),
           "kit_over_floor": [k / f for k, f in zip(seconds["kit"], seconds["floor"])]}
    if "two-pass" in results:
        row["same_as_two_pass"] = same_result(kit, results["two-pass"])
    if "published" in results:
        row["published_edges_per_target"] = results["published"][1] / ((1 - args.quantile) * n * (n - 1))
    return row


def table(rows: list[dict]) -> list[str]:
    """The markdown table of the measured rows."""
    lines = ["| data | N | trials | floor s | kit s | kit / floor | matmul share of kit | two-pass s | published s "
             "| passes | candidates / edge | kit = two-pass |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        s = row["seconds"]
        cell = lambda name: spread(s[name]) if name in s else "–"  # noqa: E731
        share = [f / k for f, k in zip(s["floor"], s["kit"])]
        lines.append(f"| {row['data']} | {row['n']:,} | {row['trials']} | {cell('floor')} | {cell('kit')} | "
                     f"{spread(row['kit_over_floor'])} | {statistics.median(share):.0%} | {cell('two-pass')} | "
                     f"{cell('published')} | {row['passes']} | {row['candidates_per_edge']:.2f} | "
                     f"{row.get('same_as_two_pass', '–')} |")
    return lines


def report(rows: list[dict], args: argparse.Namespace, command: str, machine: str) -> list[str]:
    slow = max(rows, key=lambda r: r["n"])
    fallbacks = sum(r["passes"] > 1 for r in rows)
    return [
        f"## GCBS permutation against N (d = {args.dim}, q = {args.quantile}, {args.device})",
        "",
        f"Machine: {machine}; {torch.get_num_threads()} torch threads.",
        "",
        f"Command: `{command}`",
        "",
        "Seconds as median (min–max) over the interleaved trials of each N. The floor is one pass of the "
        "similarity matmul over all N² pairs in the kit's row blocks; the kit is `gcbs_order` (sampled bound, "
        "one pass keeping the candidate edges, exact selection, graph, RCM); two-pass is the kit before "
        "issue 11; published is the paper's code with its bugs fixed. \"matmul share\" is floor / kit, "
        "\"passes\" the passes over S the kit took (2 means the sampled bound missed), \"kit = two-pass\" "
        "that threshold, edges, graph and order are bitwise equal.",
        "",
        *table(rows),
        "",
        f"Passes beyond the first: {fallbacks} of {len(rows)} runs. At N = {slow['n']:,} the kit takes "
        f"{statistics.median(slow['kit_over_floor']):.2f}× the floor.",
        "",
    ]


# ------------------------------------------------------------------------------- distributed mode

def distributed(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"GCBS permutation over {world_size} ranks (gloo, {torch.get_num_threads()} threads per rank), "
              f"d={args.dim}, q={args.quantile}; seconds on rank 0")
        print(f"{'data':9} {'N':>7} | {'ranks':>7} | {'1 process':>9} | same order | passes")
    for data in args.data:
        for n in args.sizes:
            z1, z2 = embedded_pairs(n, args.dim, data == "clustered")
            dist.barrier()
            elapsed, shared = timed(lambda: gcbs_order(z1, z2, args.quantile, seed=0, rank=rank,
                                                       world_size=world_size))
            if rank == 0:
                alone_seconds, alone = timed(lambda: gcbs_order(z1, z2, args.quantile, seed=0))
                print(f"{data:9} {n:7d} | {elapsed:7.2f} | {alone_seconds:9.2f} | "
                      f"{str(torch.equal(shared.order, alone.order)):10} | {shared.passes}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10000, 20000, 30000, 50000, 100000, 200000],
                        help="values of N")
    parser.add_argument("--dim", type=int, default=256, help="embedding dimension d")
    parser.add_argument("--quantile", type=float, default=0.999, help="similarity quantile of the graph")
    parser.add_argument("--data", nargs="+", choices=["clustered", "random"], default=["clustered"],
                        help="embeddings: planted clusters of about 50 items and/or isotropic Gaussian")
    parser.add_argument("--repeats", type=int, nargs="+",
                        help="interleaved trials per N: one number for every N, or one per N "
                             "(default 3 below N = 100k, 1 from there: a 200k trial pair takes about 25 minutes)")
    parser.add_argument("--two-pass-max", type=int, default=30000,
                        help="largest N at which to time the former two-pass kit and compare results (0: never)")
    parser.add_argument("--published-max", type=int, default=10000,
                        help="largest N at which to time the published algorithm (0: never)")
    parser.add_argument("--device", default="cpu", help="where the embeddings live: cpu or cuda")
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN,
                        help=f"write the report section here (default {DEFAULT_MARKDOWN}; '' to only print)")
    parser.add_argument("--distributed", action="store_true",
                        help="run under torch.distributed.run: ranks split the similarity rows (prints only)")
    args = parser.parse_args()
    args.repeats = args.repeats or [3 if n < 100000 else 1 for n in args.sizes]
    if len(args.repeats) not in (1, len(args.sizes)):
        parser.error(f"give one --repeats value or one per size ({len(args.sizes)})")
    if args.distributed:
        return distributed(args)
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
