"""Specification of the contrastive losses against explicit, loop-by-loop computations."""

import math

import pytest
import torch

from gcbs_lib.losses import LogitScale, info_nce, rank_info_nce

pytestmark = pytest.mark.usefixtures("float64_default")


def reference_info_nce(query, docs, scale, symmetric):
    """−log softmax at each query's positive, written as a loop."""
    group = len(docs) // len(query)
    scores = scale * query @ docs.T
    forward = [-(scores[i, i * group] - scores[i].logsumexp(0)) for i in range(len(query))]
    loss = torch.stack(forward).mean()
    if symmetric:
        positives = scores[:, ::group]
        backward = [-(positives[i, i] - positives[:, i].logsumexp(0)) for i in range(len(query))]
        loss = (loss + torch.stack(backward).mean()) / 2
    return loss


@pytest.mark.parametrize("hard_negatives", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_info_nce_is_cross_entropy_at_each_querys_positive(hard_negatives, symmetric):
    query, docs = torch.randn(5, 8), torch.randn(5 * (1 + hard_negatives), 8)
    expected = reference_info_nce(query, docs, 20.0, symmetric)
    torch.testing.assert_close(info_nce(query, docs, 20.0, symmetric), expected, rtol=1e-14, atol=0)


def test_documents_that_do_not_divide_among_queries_are_refused():
    with pytest.raises(ValueError, match="multiple of the query count"):
        info_nce(torch.randn(4, 8), torch.randn(6, 8))


def test_mismatched_embedding_sizes_and_empty_batches_are_refused():
    with pytest.raises(ValueError, match="embedding sizes differ"):
        info_nce(torch.randn(4, 8), torch.randn(4, 7))
    with pytest.raises(ValueError, match="0 documents for 0 queries"):
        info_nce(torch.randn(0, 8), torch.randn(0, 8))


def test_logit_scale_starts_at_one_over_0_07_and_its_forward_does_not_clamp():
    scale = LogitScale()
    assert math.isclose(scale().item(), 1 / 0.07, rel_tol=1e-6)
    with torch.no_grad():
        scale.log_scale.fill_(10.0)
    value = scale()
    value.backward()
    assert value.item() == pytest.approx(math.exp(10.0))
    assert scale.log_scale.grad.item() == pytest.approx(math.exp(10.0))


def test_logit_scale_clamp_keeps_log_scale_within_zero_and_log_100():
    scale = LogitScale()
    for raw, expected in [(10.0, math.log(100)), (-3.0, 0.0), (2.0, 2.0)]:
        with torch.no_grad():
            scale.log_scale.fill_(raw)
        scale.clamp_()
        assert scale.log_scale.item() == pytest.approx(expected)


def test_logit_scale_receives_the_gradient_of_the_loss():
    scale = LogitScale().double()
    query, docs = torch.randn(4, 8), torch.randn(4, 8)
    info_nce(query, docs, scale).backward()
    log_scale = scale.log_scale.detach().clone().requires_grad_()
    reference_info_nce(query, docs, log_scale.exp(), False).backward()
    torch.testing.assert_close(scale.log_scale.grad, log_scale.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("hard_negatives", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_the_mean_of_the_rank_shares_is_info_nce_over_the_gathered_batch(hard_negatives, symmetric):
    world_size, per_rank = 3, 4
    queries, docs = (
        torch.randn(world_size * per_rank, 8),
        torch.randn(world_size * per_rank * (1 + hard_negatives), 8),
    )
    shares = [
        rank_info_nce(queries, docs, 5.0, symmetric, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    torch.testing.assert_close(
        torch.stack(shares).mean(), info_nce(queries, docs, 5.0, symmetric), rtol=1e-14, atol=0
    )


def test_outside_a_process_group_the_rank_share_is_the_whole_loss():
    queries, docs = torch.randn(4, 8), torch.randn(8, 8)
    assert torch.equal(
        rank_info_nce(queries, docs, symmetric=True), info_nce(queries, docs, symmetric=True)
    )


def test_a_gathered_batch_that_does_not_split_over_the_ranks_is_refused():
    with pytest.raises(ValueError, match="queries must split over the ranks"):
        rank_info_nce(torch.randn(5, 8), torch.randn(5, 8), rank=0, world_size=2)
