"""Independent random streams named by (seed, epoch, purpose): init, data order, GCBS relabelling,
dropout... Seeds are hashes of all three, since `seed + epoch` would collide (seed 0 at epoch 1 =
seed 1 at epoch 0)."""

import hashlib

import torch

from gcbs_lib.check import require


def stream_seed(seed: int, epoch: int, purpose: str) -> int:
    """A 63-bit seed for the stream `purpose` of run `seed` at `epoch`, unrelated to any other."""
    require(purpose, "a random stream needs a purpose name, e.g. 'shuffle' or 'gcbs-relabel'")
    name = f"{int(seed)}/{int(epoch)}/{purpose}"
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(seed: int, epoch: int, purpose: str) -> torch.Generator:
    """A CPU `torch.Generator` seeded for the stream (seed, epoch, purpose)."""
    return torch.Generator().manual_seed(stream_seed(seed, epoch, purpose))


def fixed_subset(n: int, limit: int | None, purpose: str) -> list[int]:
    """range(n), or a fixed random `limit` (≥ 1) of it, sorted: the same for every seed and arm."""
    require(limit is None or limit >= 1, f"the {purpose} limit must be at least 1, got {limit}")

    if limit is None or limit >= n:
        return list(range(n))
    return sorted(torch.randperm(n, generator=generator(0, 0, purpose))[:limit].tolist())


def one_per_group(groups: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One item of each group drawn uniformly (`groups`: each item's group, 0 … G−1), sorted."""
    # each group keeps its item of lowest random priority: a uniform draw, all groups at once
    priority = torch.randperm(len(groups), generator=generator)
    first = torch.full((int(groups.max()) + 1,), len(groups))
    first = first.scatter_reduce(0, groups, priority, "amin")
    return priority.argsort()[first].sort().values
