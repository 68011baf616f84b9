"""Specification of the contrastive losses against explicit, loop-by-loop computations."""
import math

import pytest
import torch

from gcbs_lib.losses import LogitScale, info_nce, late_interaction_loss, late_interaction_scores

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
    with pytest.raises(ValueError, match="empty batch"):
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


def test_late_interaction_is_the_sum_over_query_tokens_of_the_best_document_token():
    q, d = torch.randn(3, 4, 6), torch.randn(5, 7, 6)
    q_mask = torch.arange(4)[None] < torch.tensor([[4], [2], [1]])
    d_mask = torch.arange(7)[None] < torch.tensor([[7], [3], [1], [5], [2]])
    scores = late_interaction_scores((q, q_mask), (d, d_mask))
    for a in range(3):
        for b in range(5):
            expected = sum(max(q[a, i] @ d[b, j] for j in range(7) if d_mask[b, j])
                           for i in range(4) if q_mask[a, i])
            assert scores[a, b].item() == pytest.approx(expected.item(), rel=1e-12)


def test_late_interaction_loss_refuses_a_document_without_real_tokens():
    q, d = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    mask = torch.ones(2, 3, dtype=torch.bool)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match="no real token"):
        late_interaction_loss((q, mask), (d, empty))
