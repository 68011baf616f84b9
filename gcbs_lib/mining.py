"""Hard-negative mining: per planned item, a document the current model ranks high, not its match.

Item i's candidates are the documents j ranked by S_ij = <ẑ1_i, ẑ2_j>, without i's own batch
(in-batch negatives already, i included) and items sharing i's duplicate key (false negatives). The
top ranks are still often unlabelled matches, so the negative is drawn uniformly from ranks skip …
top_k−1 (0-based) with `generator` (CPU). S is computed a block of rows at a time, on z's device."""

import torch

from gcbs_lib.check import require
from gcbs_lib.gcbs import BLOCK_ELEMENTS, DEVICE_BLOCK_ELEMENTS, unit_rows


def mine_hard_negatives(z1, z2, batches, *, top_k=30, skip=3, keys=None, generator=None):
    """A LongTensor shaped like `batches` [steps, B] (distinct item indices): entry [s, j] is the
    document mined for item batches[s, j]. keys: optional duplicate keys, one per item."""

    # checked: non-empty [N, d] of one shape, finite
    z1, z2 = unit_rows(z1, z2)
    n = len(z1)
    batches = torch.as_tensor(batches, dtype=torch.long)
    items = batches.reshape(-1)
    require(0 <= skip < top_k, f"need 0 ≤ skip < top_k, got skip={skip}, top_k={top_k}")
    key_of = torch.arange(n)
    if keys is not None:
        require(len(keys) == n, f"{len(keys)} keys for {n} items")

        # an integer per distinct key
        ids = {}
        key_of = torch.tensor([ids.setdefault(k, len(ids)) for k in list(keys)])
    distinct = len(items.unique()) == len(items) > 0
    valid = distinct and 0 <= items.min() <= items.max() < n
    require(valid, f"batches must hold distinct item indices in [0, {n})")
    batch_of = torch.full((n,), -1, dtype=torch.long)
    batch_of[items] = torch.arange(len(items)) // batches.shape[-1]
    draws = torch.rand(len(items), generator=generator)
    negatives = torch.empty_like(items)
    batch_of, key_of, draws = (t.to(z1.device) for t in (batch_of, key_of, draws))
    block = max(1, (DEVICE_BLOCK_ELEMENTS if z1.is_cuda else BLOCK_ELEMENTS) // n)
    for start in range(0, len(items), block):
        rows = items[start : start + block].to(z1.device)
        excluded = (batch_of[rows, None] == batch_of) | (key_of[rows, None] == key_of)
        scores = (z1[rows] @ z2.T).masked_fill(excluded, -torch.inf)
        values, columns = scores.topk(min(top_k, n), dim=1)
        available = torch.isfinite(values[:, skip:]).sum(dim=1)
        if (available == 0).any():
            raise ValueError(
                f"item {int(rows[available == 0][0])} has no candidate beyond rank {skip} once "
                f"its batch and duplicates are left out: too few items ({n}) for this batch size "
                "and top_k"
            )
        pick = skip + (draws[start : start + len(rows)] * available).long().clamp(max=available - 1)
        negatives[start : start + len(rows)] = columns.gather(1, pick[:, None]).squeeze(1).cpu()
    return negatives.view_as(batches)
