"""Six conventions of a data-parallel contrastive step (how each rank gathers the others'
embeddings, which loss it takes, a factor W), and `ddp_steps`, their step on real ranks; notebook 02
derives and compares their gradients."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
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
from gcbs_lib.losses import LogitScale, info_nce, rank_info_nce
from gcbs_lib.models import TinyTextEncoder, random_token_batch


def gather_without_grad(x: torch.Tensor) -> torch.Tensor:
    """All-gather, with a gradient to this rank's own rows only (as GradCache and Tevatron do)."""
    rank, world_size = rank_and_world_size()
    pieces = list(gather_with_grad(x.detach()).chunk(world_size))
    pieces[rank] = x
    return torch.cat(pieces)


class MilNceAllGather(torch.autograd.Function):
    """MIL-NCE's official AllGather: forward gathers; backward keeps this rank's rows, unsummed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.rows = x.shape[0]
        return gather_with_grad(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad[dist.get_rank() * ctx.rows : (dist.get_rank() + 1) * ctx.rows]


@dataclass(frozen=True)
class Convention:
    """A gather, each rank's loss (global L over all W·B queries, or its share L_r), a factor W."""

    label: str
    gather: Callable[[torch.Tensor], torch.Tensor]
    global_loss: bool
    times_world: bool

    def rank_loss(self, all_queries, all_docs, scale, rank: int, world_size: int) -> torch.Tensor:
        """The (symmetric) loss rank `rank` back-propagates, from its gathered embeddings."""
        if self.global_loss:
            loss = info_nce(all_queries, all_docs, scale, symmetric=True)
        else:
            loss = rank_info_nce(
                all_queries, all_docs, scale, symmetric=True, rank=rank, world_size=world_size
            )
        return loss * world_size if self.times_world else loss


CONVENTIONS = {
    "kit": Convention("gather_with_grad, rank share L_r (the kit)", gather_with_grad, False, False),
    "loss_x_W": Convention(
        "gather_with_grad, rank share L_r, loss x W", gather_with_grad, False, True
    ),
    "no_grad": Convention("gather without grad, global loss", gather_without_grad, True, False),
    "no_grad_x_W": Convention(
        "gather without grad, global loss x W", gather_without_grad, True, True
    ),
    "milnce": Convention("MIL-NCE AllGather, global loss", MilNceAllGather.apply, True, False),
    "no_grad_share": Convention(
        "gather without grad, rank share L_r", gather_without_grad, False, False
    ),
}
LENGTH, VOCAB, DIM = 8, 50, 8  # tokens per text, vocabulary, embedding size


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
    encoder = TinyTextEncoder(
        VOCAB, DIM, heads=2, layers=1, max_length=LENGTH, dropout=setup.dropout
    )
    return encoder.to(setup.device, torch.float64), LogitScale().to(setup.device, torch.float64)


def global_batch(setup: ScalingSetup, world_size: int) -> list[dict]:
    """Queries and documents of all W·B pairs; rank r holds rows r·B:(r+1)·B."""
    generator = torch.Generator().manual_seed(setup.seed)
    rows = world_size * setup.per_rank
    batches = [random_token_batch(rows, LENGTH, VOCAB, generator) for _ in "qd"]
    return [{k: v.to(setup.device) for k, v in batch.items()} for batch in batches]


def flat_gradients(encoder, scale: LogitScale) -> dict[str, torch.Tensor]:
    """Every encoder gradient as one vector, and the logit scale's."""
    return {
        "encoder": torch.cat([p.grad.reshape(-1) for p in encoder.parameters()]).cpu(),
        "logit_scale": scale.log_scale.grad.reshape(1).cpu(),
    }


def ddp_steps(runs: list[tuple[str, ScalingSetup]]) -> list[dict]:
    """A `launch` target: per (convention, setup) of `runs`, one step on this rank (GradCache over
    a DDP encoder, the scale averaged): mean loss, `flat_gradients`, all-reduce sizes, rank gap."""
    rank, world_size = rank_and_world_size()
    results = []
    for convention, setup in runs:
        rule = CONVENTIONS[convention]
        encoder, scale = build_models(setup)
        ddp = DistributedDataParallel(encoder)
        allreduces = []
        ddp.register_comm_hook(allreduces, _count_allreduce)
        queries, docs = (
            VirtualRanks(world_size).shard(batch)[rank] for batch in global_batch(setup, world_size)
        )
        torch.manual_seed(setup.rank_seed(rank))
        loss_fn = partial(_rank_loss, rule, scale, rank, world_size)
        loss = cached_loss(loss_fn, ddp, [queries, docs], setup.chunk_size)
        loss.backward()
        all_reduce_gradients(scale.parameters())
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        grads = [p.grad for p in (*encoder.parameters(), *scale.parameters())]
        result = {
            "loss": mean_loss.item() / world_size,
            "grads": flat_gradients(encoder, scale),
            "allreduces": allreduces,
            "rank_difference": rank_difference(grads),
        }
        results.append(result)
    return results


# bucket and return left unannotated: DDP checks a hook's types
def _rank_loss(rule, scale, rank: int, world_size: int, q, d):
    """One rank's loss under `rule`, on its own queries and documents against the gathered ones."""
    return rule.rank_loss(rule.gather(q), rule.gather(d), scale, rank, world_size)


def _count_allreduce(sizes: list[int], bucket):
    sizes.append(bucket.buffer().numel())
    return allreduce_hook(None, bucket)
