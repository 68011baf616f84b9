"""Specification of the contrastive losses against explicit, loop-by-loop computations."""

import math

import pytest
import torch
import torch.nn.functional as F

from gcbs_lib.losses import LogitScale, info_nce, rank_info_nce

pytestmark = pytest.mark.usefixtures("float64_default")


def reference_info_nce(query, docs, scale, symmetric, groups=None):
    """−log softmax at each query's positive, written as a loop; with `groups` (document j's group
    groups[j], query i's that of its positive document i·group), each denominator runs over the
    positive and the negatives of other groups."""
    group = len(docs) // len(query)
    groups = range(len(docs)) if groups is None else groups
    scores = scale * query @ docs.T
    losses = []
    for i in range(len(query)):
        positive = i * group
        kept = [j for j in range(len(docs)) if j == positive or groups[j] != groups[positive]]
        losses.append(-(scores[i, positive] - scores[i, kept].logsumexp(0)))
    loss = torch.stack(losses).mean()
    if symmetric:  # positive document i against the queries j
        losses = []
        for i in range(len(query)):
            kept = [
                j for j in range(len(query)) if j == i or groups[j * group] != groups[i * group]
            ]
            losses.append(-(scores[i, i * group] - scores[kept, i * group].logsumexp(0)))
        loss = (loss + torch.stack(losses).mean()) / 2
    return loss


@pytest.mark.parametrize("hard_negatives", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_info_nce_is_cross_entropy_at_each_querys_positive(hard_negatives, symmetric):
    query, docs = torch.randn(5, 8), torch.randn(5 * (1 + hard_negatives), 8)
    expected = reference_info_nce(query, docs, 20.0, symmetric)
    torch.testing.assert_close(info_nce(query, docs, 20.0, symmetric), expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("hard_negatives", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_same_group_negatives_leave_the_denominator_and_the_positive_stays(
    hard_negatives, symmetric
):
    # unit rows at scale 5: every masked negative carries weight in the denominator
    generator = torch.Generator().manual_seed(hard_negatives + 2 * symmetric)
    query = F.normalize(torch.randn(6, 8, generator=generator), dim=1)
    docs = F.normalize(torch.randn(6 * (1 + hard_negatives), 8, generator=generator), dim=1)
    # four groups: every query has same-group negatives (hard ones among them) and its positive
    # shares its group with other queries' positives
    groups = torch.arange(len(docs)) % 4
    scale = torch.tensor(5.0, requires_grad=True)
    masked = info_nce(query, docs, scale, symmetric, groups=groups)
    expected = reference_info_nce(query, docs, scale, symmetric, groups.tolist())
    torch.testing.assert_close(masked, expected, rtol=1e-14, atol=0)
    assert not torch.isclose(masked, info_nce(query, docs, scale, symmetric))
    (grad,) = torch.autograd.grad(masked, scale)
    (expected_grad,) = torch.autograd.grad(expected, scale)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("hard_negatives", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_groups_that_never_repeat_give_exactly_the_unmasked_loss(hard_negatives, symmetric):
    query = torch.randn(5, 8, requires_grad=True)
    docs = torch.randn(5 * (1 + hard_negatives), 8)
    losses = [
        info_nce(query, docs, 20.0, symmetric, groups) for groups in (None, torch.arange(len(docs)))
    ]
    grads = [torch.autograd.grad(loss, query)[0] for loss in losses]
    assert torch.equal(*losses) and torch.equal(*grads)


def test_groups_of_the_wrong_length_are_refused():
    query, docs = torch.randn(4, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match=r"groups must hold one id per document \(8\), got \(4,\)"):
        info_nce(query, docs, groups=torch.arange(4))
    with pytest.raises(ValueError, match="one id per document"):
        rank_info_nce(query, docs, groups=torch.zeros(9, dtype=torch.long), rank=1, world_size=2)


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


@pytest.mark.parametrize("masked", [False, True], ids=["all_negatives", "mask_same_group"])
@pytest.mark.parametrize("hard_negatives", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_the_mean_of_the_rank_shares_is_info_nce_over_the_gathered_batch(
    hard_negatives, symmetric, masked
):
    world_size, per_rank = 3, 4
    queries, docs = (
        torch.randn(world_size * per_rank, 8),
        torch.randn(world_size * per_rank * (1 + hard_negatives), 8),
    )
    # groups across ranks: rank r's documents share groups with the other ranks'
    groups = torch.arange(len(docs)) % 5 if masked else None
    shares = [
        rank_info_nce(queries, docs, 5.0, symmetric, rank=r, world_size=world_size, groups=groups)
        for r in range(world_size)
    ]
    whole = info_nce(queries, docs, 5.0, symmetric, groups)
    torch.testing.assert_close(torch.stack(shares).mean(), whole, rtol=1e-14, atol=0)


def test_outside_a_process_group_the_rank_share_is_the_whole_loss():
    queries, docs = torch.randn(4, 8), torch.randn(8, 8)
    assert torch.equal(
        rank_info_nce(queries, docs, symmetric=True), info_nce(queries, docs, symmetric=True)
    )


def test_a_gathered_batch_that_does_not_split_over_the_ranks_is_refused():
    with pytest.raises(ValueError, match="queries must split over the ranks"):
        rank_info_nce(torch.randn(5, 8), torch.randn(5, 8), rank=0, world_size=2)
