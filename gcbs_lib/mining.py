"""Hard-negative mining: for each training pair, one document the current model ranks high but that is not its match.

With anchors z1 and documents z2 of the N training pairs (unit rows), item i's candidates are the documents j
ranked by S_ij = <z1_i, z2_j>, leaving out j = i, every item of i's own batch (already its in-batch negative,
and a copy of a positive in the batch would be a false negative for that positive's query) and every item
sharing i's duplicate key (an identical query or code: a false negative). The very top ranks are still often
unlabelled matches, so the first `skip` ranks are passed over too; the negative is drawn uniformly from ranks
skip … top_k−1 (0-based) with a seeded generator. Scores are computed a block of rows at a time, never as the
whole N×N matrix.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F

BLOCK_ELEMENTS = 2**22  # scores held at once


def mine_hard_negatives(z1: torch.Tensor, z2: torch.Tensor, batches: torch.Tensor, *, top_k: int = 30,
                        skip: int = 3, keys: Sequence[Hashable] | None = None,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """One mined negative per planned item: a LongTensor shaped like `batches`, entry [s, j] the document
    mined for item `batches[s, j]` (see the module docstring for the rule).

    z1, z2: `[N, d]` embeddings of the pairs' two sides; batches: `[steps, B]` item indices, each at most once;
    keys: optional duplicate keys, one per item. Raises ValueError when some item has no candidate left.
    """
    if z1.dim() != 2 or z1.shape != z2.shape or z1.numel() == 0:
        raise ValueError(f"z1 and z2 must be non-empty [N, d] tensors of one shape, got {tuple(z1.shape)}, "
                         f"{tuple(z2.shape)}")
    if not (torch.isfinite(z1).all() and torch.isfinite(z2).all()):
        raise ValueError("the embeddings hold NaN or inf values")
    n = len(z1)
    if not 0 <= skip < top_k:
        raise ValueError(f"need 0 ≤ skip < top_k, got skip={skip}, top_k={top_k}")
    if keys is not None and len(keys) != n:
        raise ValueError(f"{len(keys)} keys for {n} items")
    items = torch.as_tensor(batches, dtype=torch.long).reshape(-1)
    if items.numel() == 0 or items.min() < 0 or items.max() >= n or len(items.unique()) != len(items):
        raise ValueError(f"batches must hold distinct item indices in [0, {n})")
    batch_of = torch.full((n,), -1, dtype=torch.long)
    batch_of[items] = torch.arange(len(items)) // batches.shape[-1]
    key_ids = _key_ids(keys, n)
    z1, z2 = (F.normalize(z.detach().float().cpu(), dim=1) for z in (z1, z2))
    k = min(top_k, n)
    draws = torch.rand(len(items), generator=generator)
    negatives = torch.empty(len(items), dtype=torch.long)
    block = max(1, BLOCK_ELEMENTS // n)
    for start in range(0, len(items), block):
        rows = items[start:start + block]
        scores = z1[rows] @ z2.T
        excluded = (batch_of[None, :] == batch_of[rows, None]) | (key_ids[None, :] == key_ids[rows, None])
        values, columns = scores.masked_fill(excluded, float("-inf")).topk(k, dim=1)
        available = torch.isfinite(values[:, skip:]).sum(dim=1)
        if (available == 0).any():
            item = int(rows[(available == 0).nonzero()[0, 0]])
            raise ValueError(f"item {item} has no candidate beyond rank {skip} once its batch and duplicates are "
                             f"left out: too few items ({n}) for this batch size and top_k")
        pick = skip + (draws[start:start + len(rows)] * available).long().clamp(max=available - 1)
        negatives[start:start + len(rows)] = columns.gather(1, pick[:, None]).squeeze(1)
    return negatives.view_as(torch.as_tensor(batches))


def _key_ids(keys: Sequence[Hashable] | None, n: int) -> torch.Tensor:
    """An integer id per item, equal for equal keys (every item its own id without keys)."""
    if keys is None:
        return torch.arange(n)
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in keys], dtype=torch.long)
