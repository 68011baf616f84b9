"""Six conventions of a data-parallel contrastive step (gather, loss, a factor W) and `ddp_steps`,
their step on real ranks; notebook 02 derives and compares their gradients."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gcbs_lib.distributed import (
    VirtualRanks,
    all_reduce_gradients,
    gather_with_grad,
    rank_and_world_size,
    rank_difference,
)
from gcbs_lib.gradcache import cached_loss
from gcbs_lib.losses import LogitScale, rank_info_nce
from gcbs_lib.models import TinyTextEncoder, random_token_batch


def gather_without_grad(x: torch.Tensor) -> torch.Tensor:
    """All-gather, with a gradient to this rank's own rows only (as GradCache and Tevatron do); the
    same forward and backward as MIL-NCE's official AllGather (own rows' gradient, unsummed)."""
    rank, world_size = rank_and_world_size()
    pieces = list(gather_with_grad(x.detach()).chunk(world_size))
    pieces[rank] = x
    return torch.cat(pieces)


@dataclass(frozen=True)
class Convention:
    """A gather, each rank's loss (global L over all W·B queries, or its share L_r), a factor W."""

    label: str
    gather: Callable[[torch.Tensor], torch.Tensor]
    global_loss: bool
    times_world: bool

    def rank_loss(self, all_queries, all_docs, scale, rank: int, world_size: int) -> torch.Tensor:
        """The (symmetric) loss rank `rank` back-propagates, from its gathered embeddings."""
        share = (0, 1) if self.global_loss else (rank, world_size)  # (0, 1): info_nce
        loss = rank_info_nce(all_queries, all_docs, scale, True, *share)
        return loss * world_size if self.times_world else loss

    def gathered_loss(self, scale, rank: int, world_size: int, q, d) -> torch.Tensor:
        """`rank_loss` of this rank's own queries and documents, gathered by `gather`."""
        return self.rank_loss(self.gather(q), self.gather(d), scale, rank, world_size)


CONVENTIONS = {
    name: Convention(label, gather, global_loss, times_world)
    for name, label, gather, global_loss, times_world in [
        ("kit", "gather_with_grad, rank share L_r (the kit)", gather_with_grad, False, False),
        ("loss_x_W", "gather_with_grad, rank share L_r, loss x W", gather_with_grad, False, True),
        ("no_grad", "gather without grad, global loss", gather_without_grad, True, False),
        ("no_grad_x_W", "gather without grad, global loss x W", gather_without_grad, True, True),
        ("milnce", "MIL-NCE AllGather, global loss", gather_without_grad, True, False),
        ("no_grad_share", "gather without grad, rank share L_r", gather_without_grad, False, False),
    ]
}
LENGTH = 8  # tokens per text
VOCAB = 50  # vocabulary
DIM = 8  # embedding size


@dataclass(frozen=True)
class ScalingSetup:
    """One step: `per_rank` pairs a rank, encoded `chunk_size` rows at a time, in float64."""

    per_rank: int = 4
    chunk_size: int = 2
    dropout: float = 0.0
    seed: int = 0
    device: str = "cpu"

    def rank_seed(self, rank: int) -> int:
        """The seed of rank `rank`'s dropout masks."""
        return 1000 * self.seed + rank


def build_models(setup: ScalingSetup) -> tuple[TinyTextEncoder, LogitScale]:
    """The encoder and learnable logit scale, in float64, initialised from `setup.seed`."""
    torch.manual_seed(setup.seed)
    encoder = TinyTextEncoder(VOCAB, DIM, 2, 1, LENGTH, setup.dropout)  # 2 heads, 1 layer
    return encoder.to(setup.device, torch.float64), LogitScale().to(setup.device, torch.float64)


def global_batch(setup: ScalingSetup, world_size: int) -> list[dict]:
    """Queries and documents of all W·B pairs; rank r holds rows r·B:(r+1)·B."""
    generator = torch.Generator().manual_seed(setup.seed)
    rows = world_size * setup.per_rank
    batches = [random_token_batch(rows, LENGTH, VOCAB, generator) for _ in "qd"]
    return [{k: v.to(setup.device) for k, v in batch.items()} for batch in batches]


def flat_gradients(encoder, scale: LogitScale) -> dict[str, torch.Tensor]:
    """Every encoder gradient as one vector, and the logit scale's."""
    grads = torch.cat([p.grad.reshape(-1) for p in encoder.parameters()])
    return {"encoder": grads.cpu(), "logit_scale": scale.log_scale.grad.reshape(1).cpu()}


def ddp_steps(runs: list[tuple[str, ScalingSetup]]) -> list[dict]:
    """A `launch` target: per (convention, setup) of `runs`, one step on this rank (GradCache over
    a DDP encoder, the scale averaged): mean loss, `flat_gradients`, all-reduce sizes, rank gap."""
    rank, world_size = rank_and_world_size()
    results = []
    for convention, setup in runs:
        encoder, scale = build_models(setup)
        ddp = DistributedDataParallel(encoder)
        allreduces = []
        ddp.register_comm_hook(allreduces, _count_allreduce)
        shards = [VirtualRanks(world_size).shard(b)[rank] for b in global_batch(setup, world_size)]
        torch.manual_seed(setup.rank_seed(rank))
        loss_fn = partial(CONVENTIONS[convention].gathered_loss, scale, rank, world_size)
        loss = cached_loss(loss_fn, ddp, shards, setup.chunk_size)
        loss.backward()
        all_reduce_gradients(scale.parameters())
        mean_loss = gather_with_grad(loss.detach()[None]).mean().item()
        grads = [p.grad for p in (*encoder.parameters(), *scale.parameters())]
        result = {"loss": mean_loss, "grads": flat_gradients(encoder, scale)}
        result |= {"allreduces": allreduces, "rank_difference": rank_difference(grads)}
        results.append(result)
    return results


# bucket and return left unannotated: DDP checks a hook's types
def _count_allreduce(sizes: list[int], bucket):
    sizes.append(bucket.buffer().numel())
    return allreduce_hook(None, bucket)
