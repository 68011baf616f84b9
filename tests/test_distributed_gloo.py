"""Real data-parallel steps on gloo ranks, CPU, float64: one launched job per world size runs every
check.

The kit's step (GradCache over a DDP encoder, `gather_with_grad`, each rank's share of the loss)
must give the single-process full-batch gradient on every rank; the known mistakes must show their
exact ratios.
"""

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gcbs_lib.check import relative_error
from gcbs_lib.ddp_scaling import (
    CONVENTIONS,
    ScalingSetup,
    build_models,
    ddp_steps,
    flat_gradients,
    global_batch,
)
from gcbs_lib.distributed import (
    VirtualRanks,
    all_reduce_gradients,
    gather_ragged,
    gather_with_grad,
    rank_and_world_size,
    rank_difference,
)
from gcbs_lib.experiments import Batch, Experiment
from gcbs_lib.gradcache import cached_loss, encode_in_chunks
from gcbs_lib.launcher import launch
from gcbs_lib.losses import info_nce, rank_info_nce

# 2 chunks per branch: 4 replays, only the last may sync
SETUP = ScalingSetup(per_rank=4, chunk_size=2)
DROPOUT = 0.1
RUNS = [(name, SETUP) for name in CONVENTIONS] + [("kit", replace(SETUP, dropout=DROPOUT))]


def full_batch_step(setup: ScalingSetup, world_size: int) -> dict:
    """The reference: one process encodes each rank's rows chunk by chunk under that rank's dropout
    seed, and takes the symmetric InfoNCE over all W·B pairs."""
    encoder, scale = build_models(setup)
    shards = [VirtualRanks(world_size).shard(batch) for batch in global_batch(setup, world_size)]
    embeddings = []
    for rank in range(world_size):
        torch.manual_seed(setup.rank_seed(rank))
        embeddings.append(
            [encode_in_chunks(encoder, shard[rank], setup.chunk_size) for shard in shards]
        )
    queries, docs = (torch.cat(rows) for rows in zip(*embeddings))
    loss = info_nce(queries, docs, scale, symmetric=True)
    loss.backward()
    return {"loss": loss.item(), "grads": flat_gradients(encoder, scale)}


def gradient_ratio(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """The c with ours ≈ c·reference (least squares), and how far ours is from c·reference (relative
    error)."""
    c = float(ours @ reference / (reference @ reference))
    return c, relative_error(ours, c * reference)


def raised_on(function, *args) -> int:
    """On how many ranks `function(*args)` raised a ValueError."""
    try:
        function(*args)
        raised = 0
    except ValueError:
        raised = 1
    count = torch.tensor(raised)
    torch.distributed.all_reduce(count)
    return int(count)


def held_by_rank(held: torch.Tensor | None) -> list:
    """What every rank holds (a list, or None), from rank 0's gather of them."""
    everyone = [None] * rank_and_world_size()[1]
    torch.distributed.all_gather_object(everyone, None if held is None else held.tolist())
    return everyone


def collective_checks(rows: int = 3, dim: int = 4) -> dict:
    """On every rank: `gather_with_grad` against the concatenation and a reduce-scatter written out,
    mismatched shapes and dtypes, `gather_ragged` of rank r's r + 1 rows, `all_reduce_gradients` of
    r + 1."""
    rank, world_size = rank_and_world_size()

    # rank r's input and its incoming gradient
    def rank_tensors(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(r)
        return (
            torch.randn(rows, dim, generator=generator, dtype=torch.float64),
            torch.randn(world_size * rows, dim, generator=generator, dtype=torch.float64),
        )

    x, grad = rank_tensors(rank)
    x.requires_grad_()
    gathered = gather_with_grad(x)
    gathered.backward(grad)
    everyone = [rank_tensors(r) for r in range(world_size)]
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.full_like(p, rank + 1.0)
    all_reduce_gradients([p, p])
    averaged = p.grad.tolist()
    return {
        "forward_error": relative_error(gathered, torch.cat([t for t, _ in everyone])),
        "backward_error": relative_error(
            x.grad, sum(g for _, g in everyone)[rank * rows : (rank + 1) * rows]
        ),
        "shape_mismatch_raised_on": raised_on(gather_with_grad, torch.zeros(rows + rank, dim)),
        "dtype_mismatch_raised_on": raised_on(
            gather_with_grad, torch.zeros(rows, dtype=torch.float32 if rank else torch.float64)
        ),
        "ragged": gather_ragged(torch.full((rank + 1, 2), float(rank))).tolist(),
        "to_main": held_by_rank(
            gather_ragged(torch.full((rank + 1, 2), float(rank)), main_only=True)
        ),
        "averaged": averaged,
        "unsynced_difference": rank_difference([torch.full((2,), float(rank))]),
    }


def grouped_batch(world_size: int, per_rank: int = 4) -> tuple:
    """A float64 linear encoder, and the queries, documents (a positive and one hard negative per
    query) and document groups of W·B pairs, groups repeating within and across ranks."""
    torch.manual_seed(0)
    encoder = nn.Linear(6, 4).double()
    queries = torch.randn(world_size * per_rank, 6, dtype=torch.float64)
    docs = torch.randn(2 * world_size * per_rank, 6, dtype=torch.float64)
    return encoder, queries, docs, torch.arange(len(docs)) % 3


def masked_step(chunk_size: int = 3) -> list:
    """On every rank: its rows of `grouped_batch` through GradCache over a DDP encoder, its share of
    the symmetric InfoNCE with same-group negatives masked, the groups gathered as the trainer's
    batches carry them (`Batch.extra`); the encoder's gradient."""
    rank, world_size = rank_and_world_size()
    encoder, queries, docs, groups = grouped_batch(world_size)
    queries, docs, groups = (
        VirtualRanks(world_size).shard(x)[rank] for x in (queries, docs, groups)
    )
    batch = Batch([queries, docs], {"groups": groups})

    def loss_fn(*embeddings):
        gathered = map(gather_with_grad, embeddings)
        return rank_info_nce(*gathered, 5.0, True, groups=Experiment.gathered_groups(batch))

    cached_loss(loss_fn, DistributedDataParallel(encoder), batch.inputs, chunk_size).backward()
    return flat_grad(encoder).tolist()


def flat_grad(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def on_every_rank(runs) -> dict:
    steps, masked = ddp_steps(runs), masked_step()
    return {"steps": steps, "masked": masked, "collectives": collective_checks()}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"W={w}")
def job(request):
    world_size = request.param
    out = launch(on_every_rank, nproc=world_size, args={"runs": RUNS}, echo=False)
    return {
        "world_size": world_size,
        "collectives": out["collectives"],
        "masked": out["masked"],
        "runs": [(name, setup, step) for (name, setup), step in zip(RUNS, out["steps"])],
        "reference": {
            p: full_batch_step(replace(SETUP, dropout=p), world_size) for p in (0.0, DROPOUT)
        },
    }


def test_the_kit_step_gives_the_full_batch_gradient_and_loss_with_and_without_dropout(job):
    kit = [(setup, step) for name, setup, step in job["runs"] if name == "kit"]
    assert sorted(setup.dropout for setup, _ in kit) == [0.0, DROPOUT]
    for setup, step in kit:
        reference = job["reference"][setup.dropout]
        for name in ("encoder", "logit_scale"):
            assert relative_error(step["grads"][name], reference["grads"][name]) <= 1e-10, (
                setup.dropout,
                name,
            )
        assert abs(step["loss"] - reference["loss"]) <= 1e-10 * reference["loss"]


def test_masking_same_group_negatives_on_ranks_gives_the_one_process_masked_gradient(job):
    encoder, queries, docs, groups = grouped_batch(job["world_size"])
    info_nce(encoder(queries), encoder(docs), 5.0, True, groups).backward()
    reference = flat_grad(encoder)
    encoder.zero_grad()
    info_nce(encoder(queries), encoder(docs), 5.0, True).backward()
    unmasked = flat_grad(encoder)
    assert relative_error(torch.tensor(job["masked"], dtype=torch.float64), reference) <= 1e-12
    assert relative_error(unmasked, reference) > 1e-3


def test_dropout_really_changes_the_step(job):
    with_dropout, without = job["reference"][DROPOUT], job["reference"][0.0]
    assert relative_error(with_dropout["grads"]["encoder"], without["grads"]["encoder"]) > 1e-3


def test_gradients_are_bitwise_equal_across_ranks(job):
    assert [step["rank_difference"] for _, _, step in job["runs"]] == [0.0] * len(RUNS)


def test_each_step_runs_exactly_one_allreduce_and_the_replays_do_not_sync(job):
    # several replays per branch, so a sync per replay would show
    assert SETUP.per_rank // SETUP.chunk_size > 1
    for _, _, step in job["runs"]:
        assert step["allreduces"] == [step["grads"]["encoder"].numel()]


def test_the_known_mistakes_scale_the_gradient_by_exact_ratios(job):
    w = job["world_size"]
    predicted = {
        "kit": (1, 1),
        "loss_x_W": (w, w),
        "no_grad": (1 / w, 1),
        "no_grad_x_W": (1, w),
        "milnce": (1 / w, 1),
    }  # (encoder, logit scale), derived in notebook 02
    reference = job["reference"][0.0]
    for name, setup, step in job["runs"]:
        if name in predicted and setup.dropout == 0.0:
            for grad, expected in zip(("encoder", "logit_scale"), predicted[name]):
                ratio, residual = gradient_ratio(step["grads"][grad], reference["grads"][grad])
                assert abs(ratio - expected) <= 1e-10 * expected and residual <= 1e-10, (
                    name,
                    grad,
                    ratio,
                )
    assert set(predicted) | {"no_grad_share"} == set(CONVENTIONS)


def test_a_gather_without_grad_under_the_rank_share_is_not_even_a_multiple(job):
    step = next(step for name, _, step in job["runs"] if name == "no_grad_share")
    assert (
        gradient_ratio(step["grads"]["encoder"], job["reference"][0.0]["grads"]["encoder"])[1]
        > 1e-2
    )


def test_gather_with_grad_forward_is_the_concatenation_and_backward_a_reduce_scatter(job):
    assert job["collectives"]["forward_error"] == 0.0
    assert job["collectives"]["backward_error"] <= 1e-15


def test_ranks_with_different_shapes_or_dtypes_all_raise_instead_of_hanging(job):
    assert job["collectives"]["shape_mismatch_raised_on"] == job["world_size"]
    assert job["collectives"]["dtype_mismatch_raised_on"] == job["world_size"]


def test_gather_ragged_concatenates_ranks_holding_different_row_counts(job):
    assert job["collectives"]["ragged"] == [
        [float(r)] * 2 for r in range(job["world_size"]) for _ in range(r + 1)
    ]


def test_gather_ragged_to_main_only_gives_rank_0_alone_every_ranks_rows(job):
    assert job["collectives"]["to_main"] == [job["collectives"]["ragged"]] + [None] * (
        job["world_size"] - 1
    )


def test_all_reduce_gradients_averages_and_the_sync_check_sees_ranks_that_disagree(job):
    w = job["world_size"]
    assert job["collectives"]["averaged"] == [(w + 1) / 2] * 2
    assert job["collectives"]["unsynced_difference"] == w - 1
