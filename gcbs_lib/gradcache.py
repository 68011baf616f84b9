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

One chunk is never replayed: the last chunk of the last branch keeps the graph of its step-1 forward (one
chunk's graph is the memory budget anyway), and step 3 back-propagates it first, freeing it before any
replay. A second backward (`retain_graph=True`) finds that graph spent and replays the chunk like the others.
Until its backward, a call holds that one graph: two calls before one backward hold two.

Each chunk's backward adds to every parameter's gradient, and an `nn.Embedding`'s dense backward builds a
vocabulary-sized tensor (47 MB for BERT's 30k word pieces) to add a few rows: per chunk, that costs more than the
chunk's own embedding work. So a replay whose embedding weight already holds a dense gradient runs the embedding
with `sparse=True` for that chunk: its backward adds only the rows of the chunk's tokens, and `.grad` stays dense
(the same sums, in another order). DistributedDataParallel encoders keep dense gradients (their reducer's layout).

Exactness needs a deterministic encoder given its RNG state and inputs: no BatchNorm in training mode (it
normalises each chunk by its own statistics), no inputs carrying a graph; both are refused with an error.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.checkpoint import get_device_states, set_device_states


class RandContext:
    """Capture the CPU RNG and the RNG of the devices holding `tensors` now; replay them on enter.

    Without a device tensor among `tensors`, the current CUDA device is captured when CUDA is initialised.
    Entering forks the RNG (like `torch.random.fork_rng`), so on exit the generators are back where they
    were before entering: a replay leaves the random stream untouched.
    """

    def __init__(self, *tensors: torch.Tensor):
        self.cpu_state = torch.get_rng_state()
        self.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), "cuda")
        self.devices, self.device_states = get_device_states(*tensors)
        if not self.devices and torch.cuda.is_initialized():
            self.devices = [torch.cuda.current_device()]
            self.device_states = [torch.cuda.get_rng_state(self.devices[0])]
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
    """Rows in a batch: a tensor, or a dict whose tensor entries (all of the same length) are sliced on dim 0."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    if not isinstance(batch, Mapping):
        raise TypeError(f"a branch's batch must be a tensor or a dict of tensors, got {type(batch).__name__}")
    lengths = {key: value.shape[0] if value.dim() else None
               for key, value in batch.items() if isinstance(value, torch.Tensor)}
    if not lengths:
        raise ValueError("a dict batch needs at least one tensor entry")
    if len(set(lengths.values())) > 1 or None in lengths.values():
        raise ValueError(f"tensor entries of a batch have different lengths (None: a 0-dim tensor): {lengths}")
    return next(iter(lengths.values()))


def slice_batch(batch: torch.Tensor | Mapping[str, Any], start: int, stop: int):
    """Rows start:stop of a batch; non-tensor dict entries pass through unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    return {key: value[start:stop] if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _tensors_of(batch) -> list[torch.Tensor]:
    return [batch] if isinstance(batch, torch.Tensor) else [v for v in batch.values() if isinstance(v, torch.Tensor)]


# ---- encoder outputs: any pytree (tensor, tuple, namedtuple, dict, ModelOutput) of batch-first tensors ---------

def _chunk_leaves(output, rows: slice, branch: int) -> tuple[list, TreeSpec]:
    """Flatten one chunk's output; every tensor in it must have one row per input row."""
    leaves, spec = tree_flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.shape[0] != rows.stop - rows.start):
            raise ValueError(f"branch {branch}, rows {rows.start}:{rows.stop}: the encoder returned a tensor of shape "
                             f"{tuple(leaf.shape)}; every output tensor must have one row per input row")
    return leaves, spec


def _merge_chunks(per_chunk: list[tuple[list, TreeSpec]], branch: int) -> tuple[list, TreeSpec]:
    """Concatenate the chunks' tensor leaves on dim 0; other leaves (None, numbers) must agree across chunks."""
    specs = {spec for _, spec in per_chunk}
    if len(specs) > 1:
        raise ValueError(f"branch {branch}: the encoder returned differently structured outputs for different chunks")
    merged = []
    for parts in zip(*(leaves for leaves, _ in per_chunk)):
        if isinstance(parts[0], torch.Tensor):
            merged.append(torch.cat(parts))
        elif all(part == parts[0] for part in parts):
            merged.append(parts[0])
        else:
            raise ValueError(f"branch {branch}: a non-tensor output differs between chunks: {parts}")
    return merged, per_chunk[0][1]


def encode_in_chunks(encoder: Callable, batch, chunk_size: int):
    """`encoder` applied chunk by chunk, with a graph, outputs concatenated: the reference that draws the same
    dropout masks as `cached_loss` (started from the same RNG state) but holds the whole batch's graph."""
    n = batch_length(batch)
    per_chunk = [_chunk_leaves(encoder(slice_batch(batch, start, min(start + chunk_size, n))),
                               slice(start, min(start + chunk_size, n)), 0) for start in range(0, n, chunk_size)]
    return tree_unflatten(*_merge_chunks(per_chunk, 0))


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
    kept: list | None = None  # the step-1 output leaves with their graph, until step 3 back-propagates them


@dataclass
class _Cache:
    """Everything one `cached_loss` call remembers between its forward (step 1) and backward (step 3)."""

    chunks: list[_Chunk]
    tensor_branches: list[int]  # the branch of each cached output tensor, in order
    autocast: list[tuple[str, torch.dtype]]


class _CachedEncoding(torch.autograd.Function):
    """Forward = step 1's cached embeddings; backward = step 3 (replay each chunk, push its ∂L/∂z through it)."""

    @staticmethod
    def forward(ctx, cache: _Cache, anchor: torch.Tensor, *cached: torch.Tensor):
        ctx.cache = cache
        outputs = tuple(t.view_as(t) for t in cached)
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grads_by_branch: dict[int, list[torch.Tensor]] = {}
        for branch, grad in zip(ctx.cache.tensor_branches, grads):
            grads_by_branch.setdefault(branch, []).append(grad)
        _replay(ctx.cache, grads_by_branch)
        return (None, None) + (None,) * len(grads)


def _is_ddp(encoder) -> bool:
    return isinstance(encoder, DistributedDataParallel)


def _replay(cache: _Cache, grads_by_branch: dict[int, list[torch.Tensor]]) -> None:
    """Step 3: back-propagate each chunk's slice of ∂L/∂z through its graph: the kept graph first, then each
    other chunk re-encoded with a graph.

    A DistributedDataParallel encoder replays under `no_sync()` except its last chunk, whose backward runs
    one gradient all-reduce over everything accumulated (`_sync_on_last_use` orders the chunks so).
    """
    chunks = _in_backward_order(cache.chunks)
    syncs = _sync_on_last_use(chunks)
    for chunk, sync in zip(chunks, syncs):
        grads = [grad[chunk.rows] for grad in grads_by_branch[chunk.branch]]
        if chunk.kept is not None:
            leaves, chunk.kept = chunk.kept, None  # a second backward replays this chunk instead
            _backward_through(leaves, grads, chunk)
            continue
        with contextlib.ExitStack() as stack:
            if not sync:
                stack.enter_context(chunk.encoder.no_sync())
            stack.enter_context(chunk.rng)
            stack.enter_context(_sparse_embedding_gradients(chunk.encoder))
            for device, dtype in cache.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(torch.enable_grad())
            _backward_through(tree_flatten(chunk.encoder(chunk.inputs))[0], grads, chunk)


@contextlib.contextmanager
def _sparse_embedding_gradients(encoder):
    """Within: the encoder's dense `nn.Embedding`s whose weight already has a dense `.grad` produce sparse
    gradients (added row by row into that `.grad`); outside, they are dense again. Not for DDP encoders."""
    embeddings = [] if _is_ddp(encoder) or not isinstance(encoder, nn.Module) else [
        m for m in encoder.modules() if isinstance(m, nn.Embedding) and not m.sparse
        and m.weight.grad is not None and m.weight.grad.layout == torch.strided]
    for module in embeddings:
        module.sparse = True
    try:
        yield
    finally:
        for module in embeddings:
            module.sparse = False


def _in_backward_order(chunks: list[_Chunk]) -> list[_Chunk]:
    """The chunk that kept its graph first (so that graph is freed before any replay), then the others in order."""
    return sorted(chunks, key=lambda chunk: chunk.kept is None)


def _sync_on_last_use(chunks: list[_Chunk]) -> list[bool]:
    """For each chunk in backward order, whether its backward may run DDP's gradient all-reduce: only the last
    chunk of each DistributedDataParallel module (every chunk of any other encoder: nothing to synchronise)."""
    last_use = {id(chunk.encoder): k for k, chunk in enumerate(chunks)}
    return [not _is_ddp(chunk.encoder) or last_use[id(chunk.encoder)] == k for k, chunk in enumerate(chunks)]


def _backward_through(leaves: list, grads: list[torch.Tensor], chunk: _Chunk) -> None:
    """Back-propagate `grads` (one per output tensor) through a chunk's output leaves."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    pairs = [(t, grad) for t, grad in zip(tensors, grads) if t.is_floating_point() and t.requires_grad]
    for output, grad in pairs:
        if output.shape != grad.shape:
            raise RuntimeError(f"branch {chunk.branch}, rows {chunk.rows.start}:{chunk.rows.stop}: the replay "
                               f"gave shape {tuple(output.shape)}, the first pass {tuple(grad.shape)}")
    if pairs:
        torch.autograd.backward(*zip(*pairs))


def _encoders_per_branch(encoders, branches: int) -> list[Callable]:
    if isinstance(encoders, (list, tuple, nn.ModuleList)):
        if len(encoders) != branches:
            raise ValueError(f"{len(encoders)} encoders for {branches} branches: give one per branch or one shared")
        return list(encoders)
    return [encoders] * branches


def _check_replayable(encoder, batch, branch: int) -> None:
    """Refuse what GradCache cannot replay exactly: inputs with a graph, and BatchNorm in training mode."""
    if any(t.requires_grad for t in _tensors_of(batch)):
        raise ValueError(f"branch {branch}: the batch requires grad; GradCache replays the encoder on its inputs, "
                         f"so compute them inside the encoder (or detach them)")
    if isinstance(encoder, nn.Module) and any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                                              for m in encoder.modules()):
        raise ValueError(f"branch {branch}: BatchNorm in training mode normalises each chunk by its own statistics "
                         f"(and updates them twice), so chunked gradients cannot equal the full batch's; use "
                         f"LayerNorm or put BatchNorm in eval mode")


def _encode_branch(encoder, batch, chunk_size: int, branch: int, keep_last: bool,
                   earlier: list[_Chunk]) -> tuple[list[_Chunk], list, TreeSpec]:
    """Step 1 for one branch: encode chunk by chunk under no_grad, saving each chunk's RNG state. With
    `keep_last`, the last chunk is encoded with a graph that step 3 back-propagates instead of replaying it;
    a DDP encoder then runs that forward under `no_sync()` unless no `earlier` chunk uses it (see `_replay`)."""
    n = batch_length(batch)
    if n == 0:
        raise ValueError(f"branch {branch} is an empty batch")
    _check_replayable(encoder, batch, branch)
    parameters = list(encoder.parameters()) if isinstance(encoder, nn.Module) else []
    chunks, per_chunk = [], []
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        inputs = slice_batch(batch, rows.start, rows.stop)
        rng = RandContext(*_tensors_of(inputs), *parameters)  # the parameters' devices: dropout may run there
        keep = keep_last and rows.stop == n
        with contextlib.ExitStack() as stack:
            if not keep:
                stack.enter_context(torch.no_grad())
            elif _is_ddp(encoder) and any(chunk.encoder is encoder for chunk in earlier + chunks):
                stack.enter_context(encoder.no_sync())
            leaves, spec = _chunk_leaves(encoder(inputs), rows, branch)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.isfinite(leaf).all():
                raise FloatingPointError(f"branch {branch}, rows {rows.start}:{rows.stop}: "
                                         f"the encoder produced NaN or inf embeddings")
        chunks.append(_Chunk(branch, encoder, inputs, rows, rng, kept=leaves if keep else None))
        per_chunk.append(([leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec))
    return (chunks, *_merge_chunks(per_chunk, branch))


def cached_loss(loss_fn: Callable[..., torch.Tensor], encoders, batches: Sequence, chunk_size: int) -> torch.Tensor:
    """The loss `loss_fn(*[encoder(batch) for each branch])`, computed so that `.backward()` gives the exact
    full-batch gradients while only one chunk of `chunk_size` rows ever holds an autograd graph.

    `encoders`: one module shared by all branches, or a sequence with one per branch. `batches`: one input per
    branch, a tensor or a dict whose tensor entries are sliced on dim 0 (other entries pass through). Encoder
    outputs may be tensors or nested tuples/dicts/namedtuples of batch-first tensors. Dropout is replayed
    bitwise; under `torch.no_grad()` this just returns the loss. A DistributedDataParallel encoder replays under
    `no_sync()` but for its last chunk, so each call runs one gradient all-reduce per DDP module.

    The encoder parameters get their gradients inside the loss's backward, from replays that autograd cannot
    see: use `loss.backward()` (or `torch.autograd.backward`), not `torch.autograd.grad(loss, parameters)`.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if isinstance(batches, (torch.Tensor, Mapping)) or len(batches) == 0:
        raise ValueError("batches must be a non-empty sequence with one input per branch")
    chunks, cached, structures, tensor_branches = [], [], [], []
    last = len(batches) - 1
    for branch, (encoder, batch) in enumerate(zip(_encoders_per_branch(encoders, len(batches)), batches)):
        keep_last = branch == last and torch.is_grad_enabled()
        branch_chunks, leaves, spec = _encode_branch(encoder, batch, chunk_size, branch, keep_last, chunks)
        chunks += branch_chunks
        structures.append((leaves, spec))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        cached += tensors
        tensor_branches += [branch] * len(tensors)
    cache = _Cache(chunks, tensor_branches, _ambient_autocast())
    anchor = torch.empty(0, requires_grad=True)  # makes autograd record the Function; carries no gradient
    outputs = iter(_CachedEncoding.apply(cache, anchor, *cached))
    embeddings = [tree_unflatten([next(outputs) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
                  for leaves, spec in structures]
    loss = loss_fn(*embeddings)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
    return loss
