"""GradCache: the exact gradient of a contrastive loss over a batch larger than memory allows.

A contrastive loss couples every pair of the batch, so it does not split into independent chunks. Its
gradient, however, factorises through the embeddings z = f_θ(x) (Gao et al., 2021):

    dL/dθ = Σ_i (∂L/∂z_i) · (∂z_i/∂θ)

1. Encode the batch chunk by chunk without a graph; keep the embeddings z and each chunk's RNG state.
2. Compute L on the cached z and back-propagate it to the embeddings: g_i = ∂L/∂z_i (no encoder graph needed).
3. Re-encode each chunk with a graph, under its saved RNG state (the same dropout masks) and the autocast
   policy of step 1, and back-propagate the surrogate Σ_i <z_i, g_i>: its gradient is Σ_i g_i · ∂z_i/∂θ.

`cached_loss` makes steps 1 and 3 the forward and backward of one autograd Function, and step 2 the loss
built on that Function's outputs. The caller's `loss.backward()` therefore runs steps 2 and 3, so scaling,
gradient accumulation, parameters inside the loss (a learnable logit scale) and `torch.no_grad()` behave
exactly as with the full-batch loss. Every memory peak is one chunk's graph, never the batch's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import get_device_states, set_device_states


class RandContext:
    """Capture the CPU RNG and the RNG of the devices holding `tensors` now; replay them on enter.

    Entering forks the RNG (like `torch.random.fork_rng`), so on exit the generators are back where they
    were before entering: a replay leaves the random stream untouched.
    """

    def __init__(self, *tensors: torch.Tensor):
        self.cpu_state = torch.get_rng_state()
        self.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), "cuda")
        self.devices, self.device_states = get_device_states(*tensors)
        self._fork = None

    def __enter__(self) -> "RandContext":
        self._fork = torch.random.fork_rng(devices=self.devices, device_type=self.device_type)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        set_device_states(self.devices, self.device_states, device_type=self.device_type)
        return self

    def __exit__(self, *exc) -> None:
        self._fork.__exit__(*exc)
        self._fork = None


# ---- batches: a tensor, or a dict whose tensor entries are sliced on dim 0 ------------------------------------

def batch_length(batch: torch.Tensor | Mapping[str, Any]) -> int:
    """Rows in a batch; a dict's tensor entries must agree."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    lengths = {key: value.shape[0] for key, value in batch.items() if isinstance(value, torch.Tensor)}
    if not lengths:
        raise ValueError("a dict batch needs at least one tensor entry")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"tensor entries of a batch have different lengths: {lengths}")
    return next(iter(lengths.values()))


def slice_batch(batch: torch.Tensor | Mapping[str, Any], start: int, stop: int):
    """Rows start:stop of a batch; non-tensor dict entries pass through unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    return {key: value[start:stop] if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _tensors_of(batch) -> list[torch.Tensor]:
    return [batch] if isinstance(batch, torch.Tensor) else [v for v in batch.values() if isinstance(v, torch.Tensor)]


# ---- encoder outputs: a tensor, or tuples/lists/dicts of tensors (e.g. ColBERT vectors and mask) --------------

def _flatten(output) -> tuple[list[torch.Tensor], Any]:
    """Leaves of a nested output in a fixed order, and the structure to rebuild it."""
    if isinstance(output, torch.Tensor):
        return [output], None
    if isinstance(output, Mapping):
        keys = list(output)
        parts = [_flatten(output[k]) for k in keys]
        return [leaf for leaves, _ in parts for leaf in leaves], (dict, keys, [(len(l), s) for l, s in parts])
    if isinstance(output, (tuple, list)):
        parts = [_flatten(o) for o in output]
        return [leaf for leaves, _ in parts for leaf in leaves], (type(output), None, [(len(l), s) for l, s in parts])
    raise TypeError(f"encoder outputs must be tensors or tuples/lists/dicts of tensors, got {type(output).__name__}")


def _unflatten(leaves: Sequence[torch.Tensor], spec):
    if spec is None:
        return leaves[0]
    kind, keys, parts = spec
    items, start = [], 0
    for count, sub_spec in parts:
        items.append(_unflatten(leaves[start:start + count], sub_spec))
        start += count
    return dict(zip(keys, items)) if kind is dict else kind(items)


def _ambient_autocast() -> list[tuple[str, torch.dtype]]:
    """The autocast policies in force now, to re-enter when chunks are replayed inside backward."""
    return [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]


@dataclass
class _Chunk:
    """One chunk of one branch: what step 3 needs to replay it."""

    branch: int
    encoder: Callable
    inputs: Any
    rows: slice
    rng: RandContext


@dataclass
class _Cache:
    """Everything one `cached_loss` call remembers between its forward (step 1) and backward (step 3)."""

    chunks: list[_Chunk]
    leaf_branches: list[int]  # the branch of each flat output, in order
    autocast: list[tuple[str, torch.dtype]]


class _CachedEncoding(torch.autograd.Function):
    """Forward = step 1 (no-graph chunked encoding); backward = step 3 (replay each chunk, push g_i through it)."""

    @staticmethod
    def forward(ctx, cache: _Cache, anchor: torch.Tensor, *flat_outputs: torch.Tensor):
        ctx.cache = cache
        outputs = tuple(t.view_as(t) for t in flat_outputs)
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        cache, ctx.cache = ctx.cache, None
        grads_by_branch: dict[int, list[torch.Tensor]] = {}
        for branch, grad in zip(cache.leaf_branches, grads):
            grads_by_branch.setdefault(branch, []).append(grad)
        _replay(cache, grads_by_branch)
        return (None, None) + (None,) * len(grads)


def _is_ddp(encoder) -> bool:
    return isinstance(encoder, DistributedDataParallel)


def _replay(cache: _Cache, grads_by_branch: dict[int, list[torch.Tensor]]) -> None:
    """Step 3: re-encode every chunk with a graph and back-propagate its slice of ∂L/∂z.

    A DistributedDataParallel encoder replays under `no_sync()` except its last chunk, whose backward runs
    the step's single gradient all-reduce over everything accumulated.
    """
    last_use = {id(c.encoder): k for k, c in enumerate(cache.chunks)}
    for k, chunk in enumerate(cache.chunks):
        sync = not _is_ddp(chunk.encoder) or last_use[id(chunk.encoder)] == k
        with contextlib.ExitStack() as stack:
            if not sync:
                stack.enter_context(chunk.encoder.no_sync())
            stack.enter_context(chunk.rng)
            for device, dtype in cache.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(torch.enable_grad())
            leaves, _ = _flatten(chunk.encoder(chunk.inputs))
            pairs = [(leaf, grad[chunk.rows]) for leaf, grad in zip(leaves, grads_by_branch[chunk.branch])
                     if leaf.is_floating_point() and leaf.requires_grad]
            if pairs:
                torch.autograd.backward(*zip(*pairs))


def _encoders_per_branch(encoders, branches: int) -> list[Callable]:
    if isinstance(encoders, (list, tuple, nn.ModuleList)):
        if len(encoders) != branches:
            raise ValueError(f"{len(encoders)} encoders for {branches} branches: give one per branch or one shared")
        return list(encoders)
    return [encoders] * branches


def _encode_without_graph(encoder, batch, chunk_size: int, branch: int) -> tuple[list[_Chunk], list[torch.Tensor], Any]:
    """Step 1 for one branch: encode chunk by chunk under no_grad, saving each chunk's RNG state."""
    n = batch_length(batch)
    if n == 0:
        raise ValueError(f"branch {branch} is an empty batch")
    chunks, outputs, spec = [], [], None
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        inputs = slice_batch(batch, rows.start, rows.stop)
        rng = RandContext(*_tensors_of(inputs))
        with torch.no_grad():
            leaves, spec = _flatten(encoder(inputs))
        for leaf in leaves:
            if leaf.is_floating_point() and not torch.isfinite(leaf).all():
                raise FloatingPointError(f"branch {branch}, rows {rows.start}:{rows.stop}: "
                                         f"the encoder produced NaN or inf embeddings")
        chunks.append(_Chunk(branch, encoder, inputs, rows, rng))
        outputs.append(leaves)
    return chunks, [torch.cat(parts) for parts in zip(*outputs)], spec


def cached_loss(loss_fn: Callable[..., torch.Tensor], encoders, batches: Sequence, chunk_size: int) -> torch.Tensor:
    """The loss `loss_fn(*[encoder(batch) for each branch])`, computed so that `.backward()` gives the exact
    full-batch gradients while only one chunk of `chunk_size` rows ever holds an autograd graph.

    `encoders`: one module shared by all branches, or a sequence with one per branch. `batches`: one input per
    branch, a tensor or a dict whose tensor entries are sliced on dim 0 (other entries pass through).
    Dropout is replayed bitwise; under `torch.no_grad()` this just returns the loss. DistributedDataParallel
    encoders replay under `no_sync()`, with exactly one gradient all-reduce per module in the backward.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if isinstance(batches, (torch.Tensor, Mapping)) or len(batches) == 0:
        raise ValueError("batches must be a non-empty sequence with one input per branch")
    per_branch = _encoders_per_branch(encoders, len(batches))
    chunks, flat_outputs, specs, leaf_branches = [], [], [], []
    for branch, (encoder, batch) in enumerate(zip(per_branch, batches)):
        branch_chunks, leaves, spec = _encode_without_graph(encoder, batch, chunk_size, branch)
        chunks += branch_chunks
        flat_outputs += leaves
        specs.append(spec)
        leaf_branches += [branch] * len(leaves)
    cache = _Cache(chunks, leaf_branches, _ambient_autocast())
    anchor = torch.empty(0, requires_grad=True)  # makes autograd record the Function; carries no gradient
    flat = _CachedEncoding.apply(cache, anchor, *flat_outputs)
    embeddings, start = [], 0
    for branch, spec in enumerate(specs):
        count = leaf_branches.count(branch)
        embeddings.append(_unflatten(flat[start:start + count], spec))
        start += count
    loss = loss_fn(*embeddings)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
    return loss
