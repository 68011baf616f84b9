"""GradCache (Gao et al., 2021): the exact contrastive-loss gradient of a batch beyond memory.

θ enters the loss only through the embeddings z_i = f_θ(x_i), so dL/dθ = Σ_i (∂L/∂z_i)·(∂z_i/∂θ)
accumulates chunk by chunk: (1) encode the batch chunk by chunk without a graph, saving each chunk's
RNG state; (2) compute L on the cached z and back-propagate it to them, g_i = ∂L/∂z_i; (3) re-encode
each chunk with a graph, under its RNG state (the same dropout masks) and step 1's autocast policy,
and back-propagate g through it. `cached_loss` makes step 1 the forward and step 3 the backward of
one autograd Function and the caller's loss step 2, so `loss.backward()` runs steps 2 and 3 and
scaling, parameters inside the loss and `no_grad` behave as usual."""

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import get_device_states, set_device_states

from gcbs_lib.batches import batch_length, slice_batch
from gcbs_lib.check import require

REPLAYED_INPUTS = "GradCache replays the encoder on its inputs, so compute them inside it or detach"
CHUNKED_NORM = "normalises each chunk by its own statistics (use LayerNorm, or eval mode)"


class RandContext:
    """Capture the RNG of the CPU and of the devices of `tensors`; entering replays it in a fork."""

    def __init__(self, *tensors: torch.Tensor):
        # one state per device
        tensors = {t.device: t for t in tensors}.values()

        self.cpu_state = torch.get_rng_state()
        # no device tensor: fork_rng's own default type, with no device to fork
        self.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), "cuda")
        self.devices, self.device_states = get_device_states(*tensors)

    def __enter__(self) -> "RandContext":
        self._fork = torch.random.fork_rng(devices=self.devices, device_type=self.device_type)
        self._fork.__enter__()

        torch.set_rng_state(self.cpu_state)
        set_device_states(self.devices, self.device_states, device_type=self.device_type)
        return self

    def __exit__(self, *exc) -> None:
        self._fork.__exit__(*exc)


def encode_in_chunks(encoder: Callable, batch, chunk_size: int) -> torch.Tensor:
    """`encoder` chunk by chunk from one RNG state (`cached_loss`'s dropout masks), one graph."""
    starts = range(0, batch_length(batch), chunk_size)
    return joined([encoder(slice_batch(batch, start, start + chunk_size)) for start in starts])


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Chunks' embeddings stacked on dim 0, zero-padded to the longest in each later dim."""
    shape = [max(sizes) for sizes in zip(*(part.shape[1:] for part in parts))]
    out = parts[0].new_zeros(sum(len(part) for part in parts), *shape)

    start = 0
    for part in parts:
        out[(slice(start, start + len(part)), *map(slice, part.shape[1:]))] = part
        start += len(part)
    return out


@dataclass
class _Chunk:
    """Rows `rows` of branch `branch`, and the RNG state step 1 encoded them under."""

    branch: int
    encoder: Callable
    inputs: Any
    rows: slice
    rng: RandContext | None = None
    kept: torch.Tensor | None = None  # the last chunk's embeddings with their graph: no replay

    @property
    def where(self) -> str:
        return f"branch {self.branch}, rows {self.rows.start}:{self.rows.stop}"


def cached_loss(
    loss_fn: Callable[..., torch.Tensor], encoders, batches: Sequence, chunk_size: int
) -> torch.Tensor:
    """`loss_fn(*[encoder(batch) for each branch])`, whose `.backward()` gives the full-batch
    gradients while at most `chunk_size` rows hold a graph. `encoders`: one shared module or one per
    branch; `batches`: a tensor or dict (tensor entries sliced on dim 0) per branch. A DDP encoder
    replays under `no_sync()` but for its last chunk (one all-reduce per module per call). Use
    `loss.backward()`, not `torch.autograd.grad`: encoder gradients come from unseen replays."""
    chunks = _chunks(encoders, batches, chunk_size)
    cached = []
    # the last chunk keeps its graph (one replay fewer), unless no backward will come or DDP would
    # see its forward before the replays' (DDP reduces after a module's last backward)
    last = chunks[-1]
    if torch.is_grad_enabled() and not isinstance(last.encoder, DistributedDataParallel):
        last.kept = last.inputs
    # step 1: each chunk without a graph, under an RNG state saved for its replay
    for chunk in chunks:
        params = list(chunk.encoder.parameters()) if isinstance(chunk.encoder, nn.Module) else []
        chunk.rng = RandContext(*_tensors(chunk.inputs), *params)
        with torch.set_grad_enabled(chunk.kept is not None):
            z = _checked(chunk.encoder(chunk.inputs), chunk)

        # a frozen encoder's chunk has no graph to keep
        if chunk.kept is not None:
            chunk.kept = z if z.requires_grad else None
        cached.append(z.detach())
    # one read of the device for all chunks, not one a chunk (which chunk: only on failure)
    finite = torch.stack([torch.isfinite(z).all().to(cached[0].device) for z in cached])
    if not finite.all():
        where = chunks[int(finite.int().argmin())].where
        raise FloatingPointError(f"{where}: the encoder produced NaN or inf embeddings")
    embeddings = [
        joined([z for z, c in zip(cached, chunks) if c.branch == b]) for b in range(len(batches))
    ]

    # makes autograd record the Function (no gradient)
    anchor = torch.empty(0, requires_grad=True)
    autocast = [
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]

    # step 2
    return loss_fn(*_CachedEmbeddings.apply(chunks, autocast, anchor, *embeddings))


class _CachedEmbeddings(torch.autograd.Function):
    """Forward: step 1's embeddings, a tensor per branch. Backward, given g = ∂L/∂z: step 3."""

    @staticmethod
    def forward(ctx, chunks: list[_Chunk], autocast: list, anchor, *embeddings: torch.Tensor):
        ctx.chunks = chunks
        ctx.autocast = autocast
        return tuple(z.view_as(z) for z in embeddings)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        last_use = {id(chunk.encoder): k for k, chunk in enumerate(ctx.chunks)}
        # step 3: the kept chunk first (its graph freed before replays build theirs), then replays
        last = ctx.chunks[-1]
        kept = last.kept

        # a second backward (retain_graph=True) replays it like the others
        last.kept = None
        if kept is not None:
            kept.backward(grads[last.branch][(last.rows, *map(slice, kept.shape[1:]))])
        for k, chunk in enumerate(ctx.chunks[: len(ctx.chunks) - (kept is not None)]):
            with contextlib.ExitStack() as stack:
                ddp = isinstance(chunk.encoder, DistributedDataParallel)

                # DDP all-reduces at its last chunk
                if ddp and last_use[id(chunk.encoder)] != k:
                    stack.enter_context(chunk.encoder.no_sync())

                # the dropout masks of step 1 and its autocast policy
                stack.enter_context(chunk.rng)
                for device, dtype in ctx.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
                with torch.enable_grad():
                    z = chunk.encoder(chunk.inputs)

                # ∂L/∂z without the padding `joined` added
                if z.requires_grad:
                    z.backward(grads[chunk.branch][(chunk.rows, *map(slice, z.shape[1:]))])
        return (None, None, None) + (None,) * len(grads)


def _checked(z, chunk: _Chunk) -> torch.Tensor:
    rows = isinstance(z, torch.Tensor) and z.shape[:1] == (chunk.rows.stop - chunk.rows.start,)
    got = getattr(z, "shape", type(z))
    require(rows, f"{chunk.where}: the encoder returned {got}, not one row per input row")
    return z


def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    return [v for v in batch.values() if isinstance(v, torch.Tensor)]


def _chunks(encoders, batches: Sequence, chunk_size: int) -> list[_Chunk]:
    """Every branch in chunks of `chunk_size` rows; refuses what GradCache cannot replay exactly."""
    positive = type(chunk_size) is int and chunk_size > 0
    require(positive, f"chunk_size must be a positive integer, got {chunk_size!r}")
    sequence = not isinstance(batches, (torch.Tensor, Mapping)) and len(batches) > 0
    require(sequence, "batches must be a non-empty sequence with one input per branch")

    if not isinstance(encoders, (list, tuple, nn.ModuleList)):
        encoders = [encoders] * len(batches)
    counts = f"{len(encoders)} encoders for {len(batches)} branches"
    require(len(encoders) == len(batches), f"{counts}: give one per branch or one shared")

    chunks = []
    for branch, (encoder, batch) in enumerate(zip(encoders, batches)):
        n = batch_length(batch)
        require(n, f"branch {branch} is an empty batch")
        grad = any(t.requires_grad for t in _tensors(batch))
        require(not grad, f"branch {branch}: the batch requires grad; {REPLAYED_INPUTS}")
        modules = encoder.modules() if isinstance(encoder, nn.Module) else []
        norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in modules)
        require(not norm, f"branch {branch}: BatchNorm in training mode {CHUNKED_NORM}")

        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            chunks.append(_Chunk(branch, encoder, slice_batch(batch, rows.start, rows.stop), rows))
    return chunks
