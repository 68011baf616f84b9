"""Real data-parallel steps: torchrun, gloo, CPU, float64. One process group per world size runs every check.

The kit's step (GradCache over a DDP encoder, `gather_with_grad`, each rank's share of the loss) must give the
single-process full-batch gradient on every rank; the known mistakes must show their exact ratios.
"""
import pytest

from gcbs_lib.check import relative_error
from gcbs_lib.ddp_experiments import (CONVENTIONS, ScalingSetup, StepResult, full_batch_step, gradient_ratio,
                                      scaling_runs, virtual_step)
from gcbs_lib.distributed import launch

SETUP = ScalingSetup(per_rank=4, chunk_size=2)  # 2 chunks per branch: 4 replays, only the last may sync
DROPOUT = 0.1


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W={w}")
def job(request):
    world_size = request.param
    runs = scaling_runs(SETUP, dropouts=(DROPOUT,))
    out = launch("gcbs_lib.ddp_experiments:distributed_checks", nproc=world_size, args={"runs": runs}, timeout=150,
                 echo=False)
    setups = [ScalingSetup(**run["setup"]) for run in runs]
    return {"world_size": world_size, "gather": out["gather"], "gradients": out["gradients"],
            "runs": [(run["convention"], setup, result, StepResult.from_json(result))
                     for run, setup, result in zip(runs, setups, out["runs"])],
            "reference": {p: full_batch_step(s, world_size) for p, s in {s.dropout: s for s in setups}.items()}}


def kit_runs(job):
    return [(setup, step) for name, setup, _, step in job["runs"] if name == "kit"]


def test_the_kit_step_gives_the_full_batch_gradient_and_loss_with_and_without_dropout(job):
    assert sorted(setup.dropout for setup, _ in kit_runs(job)) == [0.0, DROPOUT]
    for setup, step in kit_runs(job):
        reference = job["reference"][setup.dropout]
        for name in ("encoder", "logit_scale"):
            assert relative_error(step.grads[name], reference.grads[name]) <= 1e-10, (setup.dropout, name)
        assert abs(step.loss - reference.loss) <= 1e-10 * reference.loss


def test_dropout_really_changes_the_step(job):
    with_dropout, without = job["reference"][DROPOUT], job["reference"][0.0]
    assert relative_error(with_dropout.grads["encoder"], without.grads["encoder"]) > 1e-3


def test_gradients_are_bitwise_equal_across_ranks(job):
    assert [result["rank_difference"] for _, _, result, _ in job["runs"]] == [0.0] * len(job["runs"])


def test_each_step_runs_exactly_one_allreduce_and_the_replays_do_not_sync(job):
    for _, setup, result, _ in job["runs"]:
        assert SETUP.per_rank // setup.chunk_size > 1  # several replays per branch, so a sync per replay would show
        assert result["allreduce_calls"] == 1
        assert result["allreduced_numel"] == result["encoder_numel"]


def test_real_ranks_compute_what_virtual_ranks_compute(job):
    for name, setup, _, step in job["runs"]:
        virtual = virtual_step(name, setup, job["world_size"])
        for grad in ("encoder", "logit_scale"):
            assert relative_error(step.grads[grad], virtual.grads[grad]) <= 1e-10, (name, grad)
        assert abs(step.loss - virtual.loss) <= 1e-10 * abs(virtual.loss)


def test_the_known_mistakes_scale_the_gradient_by_exact_ratios(job):
    w = job["world_size"]
    predicted = {"kit": (1, 1), "loss_x_W": (w, w), "no_grad": (1 / w, 1), "no_grad_x_W": (1, w),
                 "milnce": (1 / w, 1)}  # (encoder, logit scale), derived in notebook 02
    reference = job["reference"][0.0]
    for name, setup, _, step in job["runs"]:
        if name in predicted and setup.dropout == 0.0:
            for grad, expected in zip(("encoder", "logit_scale"), predicted[name]):
                ratio, residual = gradient_ratio(step.grads[grad], reference.grads[grad])
                assert abs(ratio - expected) <= 1e-10 * expected and residual <= 1e-10, (name, grad, ratio)
    assert set(predicted) | {"no_grad_share"} == set(CONVENTIONS)


def test_a_gather_without_grad_under_the_rank_share_is_not_even_a_multiple(job):
    step = next(step for name, _, _, step in job["runs"] if name == "no_grad_share")
    _, residual = gradient_ratio(step.grads["encoder"], job["reference"][0.0].grads["encoder"])
    assert residual > 1e-2


def test_gather_with_grad_forward_is_the_concatenation_and_backward_a_reduce_scatter(job):
    assert job["gather"]["forward_error"] == 0.0
    assert job["gather"]["backward_error"] <= 1e-15


def test_ranks_with_different_shapes_or_dtypes_all_raise_instead_of_hanging(job):
    assert job["gather"]["mismatch_raised_on"] == job["world_size"]
    assert "different shapes" in job["gather"]["mismatch_error"]
    assert job["gather"]["dtype_mismatch_raised_on"] == job["world_size"]
    assert "different dtypes" in job["gather"]["dtype_error"]


def test_multi_vector_outputs_are_padded_to_the_longest_rank(job):
    w, rows, dim = job["world_size"], 3, 4
    assert job["gather"]["multi_vector_shape"] == [w * rows, 2 + (w - 1), dim]
    assert job["gather"]["multi_vector_real_tokens"] == sum(rows * (2 + r) for r in range(w))


def test_all_reduce_gradients_averages_and_the_sync_check_sees_ranks_that_disagree(job):
    w = job["world_size"]
    assert job["gradients"]["averaged"] == [(w + 1) / 2] * 2
    assert job["gradients"]["unsynced_difference"] == w - 1


def test_a_gradient_missing_on_some_ranks_raises_on_every_rank(job):
    assert job["gradients"]["missing_raised_on"] == job["world_size"]
