"""A batch as the kit passes one to an encoder: a tensor, or a dict whose tensor entries (all
equally long on dim 0) are sliced together while its other entries pass through unchanged. GradCache
cuts a batch into chunks with these, and `distributed.VirtualRanks` into each rank's shard."""

from collections.abc import Mapping
from typing import Any

import torch

from gcbs_lib.check import require


def batch_length(batch: torch.Tensor | Mapping[str, Any]) -> int:
    """Rows of a batch: a tensor, or a dict whose tensor entries (all equally long) are sliced."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0

    kind = type(batch).__name__
    if not isinstance(batch, Mapping):
        raise TypeError(f"a branch's batch must be a tensor or a dict of tensors, got {kind}")
    lengths = {k: v.shape[:1] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    one = len(set(lengths.values())) == 1 and () not in lengths.values()
    require(one, f"a dict batch needs tensor entries all of the same length on dim 0: {lengths}")
    return next(iter(lengths.values()))[0]


def slice_batch(batch: torch.Tensor | Mapping[str, Any], start: int, stop: int):
    """Rows start:stop of a batch; non-tensor dict entries pass through unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    return {k: v[start:stop] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
