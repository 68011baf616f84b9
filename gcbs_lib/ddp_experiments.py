"""Which gradient does a data-parallel contrastive step produce? One setup, six conventions, three ways to run it.

A convention fixes how each rank gathers the embeddings of the other ranks, which loss it takes, and whether
it multiplies that loss by the world size W; DistributedDataParallel then averages parameter gradients over
ranks. The same step runs

- on real ranks (`ddp_step`, run by the torchrun target `distributed_checks` through `distributed.launch`):
  GradCache on a DDP encoder, the convention's gather and loss, the logit scale averaged by `all_reduce_gradients`;
- on virtual ranks (`virtual_step`): the same arithmetic in one process, collectives written out;
- as the single-process reference (`full_batch_step`): the global mean InfoNCE over all W·B pairs.

Every run rebuilds the encoder from the same seed and seeds each rank's dropout from (seed, rank), encoding
each rank's rows chunk by chunk as `cached_loss` does, so all three draw the same dropout masks.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gcbs_lib.check import relative_error
from gcbs_lib.distributed import (VirtualRanks, all_reduce_gradients, gather_multi_vector, gather_with_grad,
                                  gradient_rank_difference, rank_and_world_size, rank_info_nce)
from gcbs_lib.gradcache import cached_loss, encode_in_chunks
from gcbs_lib.losses import LogitScale, info_nce
from gcbs_lib.models import TinyTextEncoder, random_token_batch


# ---- the two public gathers that drop the other ranks' gradient ---------------------------------------------

def gather_without_grad(x: torch.Tensor) -> torch.Tensor:
    """All-gather with no gradient, this rank's own rows put back so they keep theirs (GradCache's
    DistributedContrastiveLoss, Tevatron, open_clip without `gather_with_grad`)."""
    rank, world_size = rank_and_world_size()
    pieces = list(gather_with_grad(x.detach()).chunk(world_size))
    pieces[rank] = x
    return torch.cat(pieces)


class _AllGatherOwnSlice(torch.autograd.Function):
    """MIL-NCE's AllGather: forward gathers, backward returns this rank's rows of the gradient without summing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.rank = x.shape[0], dist.get_rank()
        return gather_with_grad(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def milnce_all_gather(x: torch.Tensor) -> torch.Tensor:
    """All-gather whose backward keeps only this rank's slice of the gradient (the official MIL-NCE code)."""
    return _AllGatherOwnSlice.apply(x) if rank_and_world_size()[1] > 1 else x


@dataclass(frozen=True)
class Gather:
    """A gather on real ranks, and what its backward does on virtual ranks."""

    real: Callable[[torch.Tensor], torch.Tensor]
    virtual_backward: Callable[[VirtualRanks, list[torch.Tensor]], list[torch.Tensor]]


GATHERS = {
    "with_grad": Gather(gather_with_grad, VirtualRanks.reduce_scatter),
    "without_grad": Gather(gather_without_grad, VirtualRanks.own_slice),
    "milnce": Gather(milnce_all_gather, VirtualRanks.own_slice),
}


@dataclass(frozen=True)
class Convention:
    """How a data-parallel step gathers (a key of GATHERS), which loss each rank takes (its share L_r, or the
    global loss L over all W·B queries), and whether that loss is multiplied by W."""

    label: str
    gather: str
    global_loss: bool
    times_world: bool

    def rank_loss(self, all_queries: torch.Tensor, all_docs: torch.Tensor, scale: nn.Module, symmetric: bool,
                  rank: int, world_size: int) -> torch.Tensor:
        """The loss rank `rank` back-propagates, from its gathered embeddings."""
        if self.global_loss:
            loss = info_nce(all_queries, all_docs, scale, symmetric)
        else:
            loss = rank_info_nce(all_queries, all_docs, scale, symmetric, rank, world_size)
        return loss * world_size if self.times_world else loss


CONVENTIONS = {
    "kit": Convention("gather_with_grad, rank share L_r (the kit)", "with_grad", False, False),
    "loss_x_W": Convention("gather_with_grad, rank share L_r, loss x W", "with_grad", False, True),
    "no_grad": Convention("gather without grad, global loss", "without_grad", True, False),
    "no_grad_x_W": Convention("gather without grad, global loss x W", "without_grad", True, True),
    "milnce": Convention("MIL-NCE AllGather, global loss", "milnce", True, False),
    "no_grad_share": Convention("gather without grad, rank share L_r", "without_grad", False, False),
}


# ---- one setup, shared by real ranks, virtual ranks and the reference ----------------------------------------

@dataclass(frozen=True)
class ScalingSetup:
    """Sizes and seeds of one contrastive step: `per_rank` pairs on each rank, encoded `chunk_size` rows at a time."""

    per_rank: int = 4
    chunk_size: int = 2
    length: int = 8
    vocab: int = 50
    dim: int = 8
    dropout: float = 0.0
    symmetric: bool = True
    seed: int = 0
    device: str = "cpu"


@dataclass
class StepResult:
    """The (reported) loss of one step and the gradients it leaves: flat encoder gradient and logit-scale gradient."""

    loss: float
    grads: dict[str, torch.Tensor]

    @classmethod
    def from_json(cls, result: dict) -> "StepResult":
        """Rebuild a result that came back from a launched rank as JSON."""
        return cls(result["loss"], {k: torch.tensor(v, dtype=torch.float64) for k, v in result["grads"].items()})


def build_models(setup: ScalingSetup) -> tuple[TinyTextEncoder, LogitScale]:
    """The encoder and learnable logit scale, in float64, initialised from `setup.seed`."""
    torch.manual_seed(setup.seed)
    encoder = TinyTextEncoder(setup.vocab, setup.dim, heads=2, layers=1, max_length=setup.length,
                              dropout=setup.dropout)
    device = _device(setup)
    return encoder.to(device, torch.float64), LogitScale().to(device, torch.float64)


def global_batch(setup: ScalingSetup, world_size: int) -> tuple[dict, dict]:
    """Queries and documents of all W·B pairs; rank r holds rows r·B:(r+1)·B."""
    generator = torch.Generator().manual_seed(setup.seed)
    n = world_size * setup.per_rank
    batches = [random_token_batch(n, setup.length, setup.vocab, generator) for _ in ("queries", "docs")]
    return tuple({k: v.to(_device(setup)) for k, v in batch.items()} for batch in batches)


def encode_ranks(encoder: nn.Module, ranks: VirtualRanks, setup: ScalingSetup) -> list[tuple[torch.Tensor, ...]]:
    """Each rank's query and document embeddings of its own rows, with a graph: under the rank's dropout seed,
    chunk by chunk in `cached_loss`'s order, so the masks are those a real rank draws."""
    queries, docs = global_batch(setup, ranks.world_size)
    local = []
    for rank, shards in enumerate(zip(ranks.shard(queries), ranks.shard(docs))):
        torch.manual_seed(rank_seed(setup, rank))
        local.append(tuple(encode_in_chunks(encoder, batch, setup.chunk_size) for batch in shards))
    return local


def rank_seed(setup: ScalingSetup, rank: int) -> int:
    """The seed of rank `rank`'s dropout masks."""
    return 1000 * setup.seed + rank


def flat_gradients(encoder: nn.Module, scale: LogitScale) -> dict[str, torch.Tensor]:
    """Every encoder gradient as one vector, and the logit scale's."""
    return {"encoder": _flat(p.grad for p in encoder.parameters()), "logit_scale": scale.log_scale.grad.reshape(1)}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def gradient_ratio(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """The c with ours ≈ c·reference (least squares), and how far ours is from c·reference (relative error)."""
    c = float(ours.double() @ reference.double() / (reference.double() @ reference.double()))
    return c, relative_error(ours, c * reference)


# ---- three ways to run the step ------------------------------------------------------------------------------

def full_batch_step(setup: ScalingSetup, world_size: int) -> StepResult:
    """The reference: one process, the global mean InfoNCE over all W·B pairs."""
    encoder, scale = build_models(setup)
    queries, docs = zip(*encode_ranks(encoder, VirtualRanks(world_size), setup))
    loss = info_nce(torch.cat(queries), torch.cat(docs), scale, setup.symmetric)
    loss.backward()
    return StepResult(loss.item(), flat_gradients(encoder, scale))


def virtual_step(convention: str, setup: ScalingSetup, world_size: int) -> StepResult:
    """One data-parallel step on W virtual ranks: encode, all-gather, each rank's loss, the gather's backward,
    each rank's encoder backward, then DDP's mean over ranks."""
    rule, ranks = CONVENTIONS[convention], VirtualRanks(world_size)
    encoder, scale = build_models(setup)
    local = encode_ranks(encoder, ranks, setup)
    all_queries, all_docs = ranks.all_gather([q for q, _ in local]), ranks.all_gather([d for _, d in local])
    losses = [rule.rank_loss(all_queries[r], all_docs[r], scale, setup.symmetric, r, world_size)
              for r in range(world_size)]
    to_queries, to_docs, to_scale = zip(*(torch.autograd.grad(loss, (all_queries[r], all_docs[r], scale.log_scale))
                                          for r, loss in enumerate(losses)))
    backward = GATHERS[rule.gather].virtual_backward
    own_queries, own_docs = backward(ranks, list(to_queries)), backward(ranks, list(to_docs))
    parameters = list(encoder.parameters())
    per_rank = [_flat(torch.autograd.grad(local[r], parameters, (own_queries[r], own_docs[r])))
                for r in range(world_size)]
    return StepResult(ranks.all_reduce_mean([loss.detach() for loss in losses]).item(),
                      {"encoder": ranks.all_reduce_mean(per_rank),
                       "logit_scale": ranks.all_reduce_mean(list(to_scale)).reshape(1)})


def ddp_step(convention: str, setup: ScalingSetup) -> dict:
    """One step on this real rank: GradCache over a DDP encoder with the convention's gather and loss, then the
    logit scale averaged. Returns the mean loss over ranks, the gradients, their largest difference between
    ranks, and the gradient all-reduces DDP ran (counted by a communication hook)."""
    rule, (rank, world_size) = CONVENTIONS[convention], rank_and_world_size()
    encoder, scale = build_models(setup)
    device = _device(setup)
    ddp = DistributedDataParallel(encoder, device_ids=[device.index] if device.type == "cuda" else None)
    allreduced = []
    ddp.register_comm_hook(allreduced, _count_allreduce)
    queries, docs = (VirtualRanks(world_size).shard(batch)[rank] for batch in global_batch(setup, world_size))
    gather = GATHERS[rule.gather].real
    torch.manual_seed(rank_seed(setup, rank))
    loss = cached_loss(lambda q, d: rule.rank_loss(gather(q), gather(d), scale, setup.symmetric, rank, world_size),
                       ddp, [queries, docs], setup.chunk_size)
    loss.backward()
    all_reduce_gradients(scale.parameters())
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return {"loss": mean_loss.item() / world_size, "grads": flat_gradients(encoder, scale),
            "rank_difference": gradient_rank_difference([*encoder.parameters(), *scale.parameters()]),
            "allreduce_calls": len(allreduced), "allreduced_numel": sum(allreduced),
            "encoder_numel": sum(p.numel() for p in encoder.parameters())}


def _count_allreduce(sizes: list[int], bucket):  # no annotation: DDP checks it, and future-annotations are strings
    sizes.append(bucket.buffer().numel())
    return allreduce_hook(None, bucket)


def _device(setup: ScalingSetup) -> torch.device:
    if setup.device == "cuda" and dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(setup.device)


# ---- torchrun targets ----------------------------------------------------------------------------------------

def distributed_checks(runs: list[dict], device: str = "cpu") -> dict:
    """Torchrun target running a whole scaling experiment in one process group: `ddp_step` for each
    run `{"convention": name, "setup": {ScalingSetup fields}}`, then `gather_checks` and `gradient_helper_checks`."""
    results = [ddp_step(run["convention"], ScalingSetup(**run["setup"])) for run in runs]
    rank, world_size = rank_and_world_size()
    print(f"rank {rank} of {world_size}: {len(results)} steps done, gradient all-reduces per step: "
          f"{sorted({result['allreduce_calls'] for result in results})}", flush=True)
    return {"runs": results, "gather": gather_checks(device=device), "gradients": gradient_helper_checks(device)}


def scaling_runs(setup: ScalingSetup, dropouts: tuple[float, ...] = ()) -> list[dict]:
    """The `runs` of `distributed_checks`: every convention on `setup`, plus the kit at each extra dropout."""
    runs = [{"convention": name, "setup": asdict(setup)} for name in CONVENTIONS]
    return runs + [{"convention": "kit", "setup": asdict(replace(setup, dropout=p))} for p in dropouts]


def gather_checks(rows: int = 3, dim: int = 4, seed: int = 0, device: str = "cpu") -> dict:
    """On every rank: `gather_with_grad` forward and backward against the concatenation and a reduce-scatter
    written out here; a shape mismatch must raise on every rank; `gather_multi_vector` pads to a common length."""
    rank, world_size = rank_and_world_size()

    def rank_tensors(r: int) -> tuple[torch.Tensor, torch.Tensor]:  # rank r's input and its incoming gradient
        generator = torch.Generator().manual_seed(seed * 1000 + r)
        return (torch.randn(rows, dim, generator=generator, dtype=torch.float64).to(device),
                torch.randn(world_size * rows, dim, generator=generator, dtype=torch.float64).to(device))

    x, grad = rank_tensors(rank)
    x.requires_grad_()
    gathered = gather_with_grad(x)
    gathered.backward(grad)
    everyone = [rank_tensors(r) for r in range(world_size)]
    reduce_scattered = sum(g for _, g in everyone)[rank * rows:(rank + 1) * rows]
    mismatch_error, dtype_error = (_raised(gather_with_grad, torch.zeros(rows + rank, dim, device=device)),
                                   _raised(gather_with_grad, torch.zeros(rows, dim, device=device,
                                                                         dtype=torch.float32 if rank else torch.float64)))
    vectors, mask = gather_multi_vector(torch.ones(rows, 2 + rank, dim, device=device),
                                        torch.ones(rows, 2 + rank, dtype=torch.bool, device=device))
    return {"forward_error": relative_error(gathered, torch.cat([t for t, _ in everyone])),
            "backward_error": relative_error(x.grad, reduce_scattered),
            "mismatch_raised_on": _count_over_ranks(bool(mismatch_error), x.device), "mismatch_error": mismatch_error,
            "dtype_mismatch_raised_on": _count_over_ranks(bool(dtype_error), x.device), "dtype_error": dtype_error,
            "multi_vector_shape": list(vectors.shape), "multi_vector_real_tokens": int(mask.sum())}


def gradient_helper_checks(device: str = "cpu") -> dict:
    """On every rank: `all_reduce_gradients` averages (rank r holds gradient r + 1), `gradient_rank_difference`
    sees ranks that disagree (rank r holds r), and a gradient present on rank 0 only raises on every rank."""
    rank, world_size = rank_and_world_size()
    p = nn.Parameter(torch.zeros(2, device=device))
    p.grad = torch.full_like(p, rank + 1.0)
    all_reduce_gradients([p, p])
    averaged = p.grad.tolist()
    p.grad = torch.full_like(p, float(rank))
    unsynced = gradient_rank_difference([p])
    p.grad = p.grad if rank == 0 else None
    missing_error = _raised(all_reduce_gradients, [p])
    return {"averaged": averaged, "unsynced_difference": unsynced,
            "missing_raised_on": _count_over_ranks(bool(missing_error), p.device)}


def _raised(function: Callable, *args) -> str:
    """The message of the ValueError `function(*args)` raises ("" when it returns)."""
    try:
        function(*args)
    except ValueError as error:
        return str(error)
    return ""


def _count_over_ranks(flag: bool, device: torch.device) -> int:
    count = torch.tensor(int(flag), device=device)
    dist.all_reduce(count)
    return int(count)


def misbehave(rank: int = 1, how: str = "raise") -> None:
    """Torchrun target: rank `rank` raises (how="raise") or never arrives (how="stall") while the other ranks
    wait for it in a barrier, the way one rank's bug looks in a real job."""
    if rank_and_world_size()[0] == rank:
        if how == "raise":
            raise RuntimeError(f"rank {rank} failed on purpose")
        time.sleep(3600)
    dist.barrier()
