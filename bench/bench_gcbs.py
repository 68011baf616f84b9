"""Profile the GCBS permutation: time per stage against N, ours against the published algorithm.

The published minimal GCBS code, with its bugs fixed (functional `normalize` on tensors, row chunks small
enough for `torch.quantile`, no diagonal edges) but its structure kept: the threshold is the mean of per-chunk
`torch.quantile` values, the edge list is built in Python lists, then `reverse_cuthill_mckee`.

    python bench/bench_gcbs.py                                   # N = 5k … 30k, published up to 20k
    python bench/bench_gcbs.py --sizes 2000 5000 --published-max 5000 --data random
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/bench_gcbs.py --distributed

With --distributed every rank computes its share of the similarity rows (gloo), the ranks share histograms and
edge lists, and rank 0 checks that the order equals the single-process one.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.sparse.csgraph import reverse_cuthill_mckee
from torch import nn

from gcbs_lib.gcbs import StageTimes, embed_all, gcbs_order, synthetic_pairs

FEATURES = 128


def published_permutation(z1: torch.Tensor, z2: torch.Tensor, quantile: float) -> tuple[np.ndarray, int, StageTimes]:
    """The published algorithm, bugs fixed, structure kept. Returns (order, directed edge count, stage times)."""
    times, start = StageTimes(), time.perf_counter()
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    n = len(z1)
    chunk = (2**24 - 1) // n  # torch.quantile refuses more than 2^24 elements
    threshold = torch.stack([torch.quantile(z1[s:s + chunk] @ z2.T, quantile) for s in range(0, n, chunk)]).mean()
    times.similarity, start = time.perf_counter() - start, time.perf_counter()
    rows, cols = [], []
    for s in range(0, n, chunk):
        similarity = z1[s:s + chunk] @ z2.T
        similarity[torch.arange(len(similarity)), torch.arange(s, s + len(similarity))] = -float("inf")
        for i, j in (similarity > threshold).nonzero().tolist():
            rows.append(s + i)
            cols.append(j)
    graph = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n))
    times.graph, start = time.perf_counter() - start, time.perf_counter()
    order = reverse_cuthill_mckee(graph)
    times.rcm = time.perf_counter() - start
    return order, len(rows), times


def embedded_pairs(n: int, dim: int, clustered: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Embed n feature pairs with a small MLP, as a sampler would at each epoch start; returns (z1, z2, seconds)."""
    x1, x2 = synthetic_pairs(n, FEATURES, clusters=n // 50 if clustered else 0, seed=seed)
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, dim))
    start = time.perf_counter()
    z1, z2 = embed_all(lambda idx: (encoder(x1[idx]), encoder(x2[idx])), n, model=encoder, progress=False)
    return z1, z2, time.perf_counter() - start


def best_of(repeats: int, run):
    """The run with the smallest total time among `repeats` calls of `run()` (the least disturbed one)."""
    return min((run() for _ in range(repeats)), key=lambda result: result.times.total)


def stage_cells(t: StageTimes, embed: bool = True) -> str:
    """Table cells: (embed,) similarity, graph, rcm, and the permutation's time (all but embed)."""
    cells = f"{t.similarity:7.2f} {t.graph:7.2f} {t.rcm:7.3f} {t.total - t.embed:7.2f}"
    return f"{t.embed:7.2f} {cells}" if embed else cells


def single_process(args: argparse.Namespace) -> None:
    print(f"GCBS permutation, d={args.dim}, q={args.quantile}, threads: {torch.get_num_threads()}; seconds")
    stages = f"{'simil.':>7} {'graph':>7} {'rcm':>7} {'perm.':>7}"
    print("ours | published algorithm, bugs fixed | speed-up = published perm. / our perm. (perm. = all but embed)")
    print(f"{'data':9} {'N':>6} | {'embed':>7} {stages} {'edges/target':>12} | {stages} {'edges/target':>12} | "
          f"{'speed-up':>8}")
    for kind in args.data:
        for n in args.sizes:
            z1, z2, embed_seconds = embedded_pairs(n, args.dim, kind == "clustered")
            target = (1 - args.quantile) * n * (n - 1)
            ours = best_of(args.repeats, lambda: gcbs_order(z1, z2, args.quantile, seed=0))
            ours.times.embed = embed_seconds
            line = f"{kind:9} {n:6d} | {stage_cells(ours.times)} {ours.edges / target:12.3f} |"
            if n <= args.published_max:
                _, edges, published = published_permutation(z1, z2, args.quantile)
                speed_up = published.total / (ours.times.total - embed_seconds)
                line += f" {stage_cells(published, embed=False)} {edges / target:12.3f} | {speed_up:7.1f}x"
            print(line, flush=True)


def distributed(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"GCBS permutation over {world_size} ranks (gloo, threads per rank: {torch.get_num_threads()}), "
              f"d={args.dim}, q={args.quantile}; seconds on rank 0")
        print(f"{'data':9} {'N':>6} | {'simil.':>7} {'graph':>7} {'rcm':>7} {'perm.':>7} | "
              f"{'1 process':>9} | same order")
    for kind in args.data:
        for n in args.sizes:
            z1, z2, _ = embedded_pairs(n, args.dim, kind == "clustered")
            dist.barrier()
            shared = gcbs_order(z1, z2, args.quantile, seed=0, rank=rank, world_size=world_size)
            if rank == 0:
                alone = gcbs_order(z1, z2, args.quantile, seed=0)
                print(f"{kind:9} {n:6d} | {stage_cells(shared.times, embed=False)} | {alone.times.total:9.2f} | "
                      f"{torch.equal(shared.order, alone.order)}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[5000, 10000, 20000, 30000], help="values of N")
    parser.add_argument("--dim", type=int, default=48, help="embedding dimension d")
    parser.add_argument("--quantile", type=float, default=0.999, help="similarity quantile of the graph")
    parser.add_argument("--data", nargs="+", choices=["clustered", "random"], default=["clustered", "random"],
                        help="embeddings to profile: planted clusters and/or isotropic Gaussian")
    parser.add_argument("--published-max", type=int, default=20000,
                        help="largest N at which to time the published algorithm too (0: never)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time our permutation this many times and keep the fastest run")
    parser.add_argument("--distributed", action="store_true",
                        help="run under torch.distributed.run: ranks split the similarity rows")
    args = parser.parse_args()
    if args.distributed:
        distributed(args)
    else:
        single_process(args)


if __name__ == "__main__":
    main()
