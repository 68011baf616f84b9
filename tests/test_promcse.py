"""Specification of PromCSE's loss terms and experiment."""
import pytest
import torch
import torch.nn.functional as F

from gcbs_lib.losses import energy_hinge

pytestmark = pytest.mark.usefixtures("float64_default")


def promcse_margin_loss(z1, z2, z3, margin):
    """The term as PromCSE's `cl_forward` computes it: MarginRankingLoss(cos(z1, z2_i), max over the other z2
    (own positive masked with −1e9) and every z3)."""
    z1_z2 = F.cosine_similarity(z1[:, None], z2[None], dim=-1)
    z1_z3 = F.cosine_similarity(z1[:, None], z3[None], dim=-1)
    anchor_pos = torch.diag(z1_z2)[:, None]
    masked = z1_z2 - 1e9 * torch.eye(len(z1))
    hardest = torch.cat([masked, z1_z3], dim=-1).max(dim=-1, keepdim=True).values
    return torch.nn.MarginRankingLoss(margin=margin)(anchor_pos, hardest, torch.ones_like(anchor_pos))


def test_energy_hinge_equals_promcse_margin_ranking_term_with_hard_negatives():
    torch.manual_seed(0)
    z1, z2, z3 = torch.randn(6, 5), torch.randn(6, 5), torch.randn(6, 5)
    docs = torch.stack([z2, z3], dim=1).reshape(12, 5)  # [pos_0, neg_0, pos_1, neg_1, ...]
    expected = 10.0 * promcse_margin_loss(z1, z2, z3, margin=0.2)
    assert expected > 0
    torch.testing.assert_close(energy_hinge(z1, docs), expected, rtol=1e-14, atol=0)


def test_energy_hinge_without_hard_negatives_uses_the_other_positives():
    torch.manual_seed(1)
    query, docs = torch.randn(5, 4), torch.randn(5, 4)
    cosines = F.normalize(query, dim=-1) @ F.normalize(docs, dim=-1).T
    per_query = [max(0.0, 0.3 - cosines[i, i] + max(cosines[i, j] for j in range(5) if j != i)) for i in range(5)]
    result = energy_hinge(query, docs, margin=0.3, weight=2.0, reduction="none")
    torch.testing.assert_close(result, 2.0 * torch.tensor(per_query), rtol=1e-14, atol=0)


def test_energy_hinge_uses_raw_cosines_so_embedding_norms_do_not_matter():
    torch.manual_seed(2)
    query, docs = torch.randn(4, 3), torch.randn(8, 3)
    torch.testing.assert_close(energy_hinge(query * 7.0, docs * 0.1), energy_hinge(query, docs), rtol=1e-13, atol=0)


def test_energy_hinge_vanishes_once_positives_beat_every_negative_by_the_margin():
    query = torch.eye(3)
    docs = torch.eye(3)  # cos(positive) = 1, every negative 0: margin 0.2 is met
    assert energy_hinge(query, docs) == 0
    assert energy_hinge(query, docs, margin=1.5) == pytest.approx(10 * 0.5)


def test_energy_hinge_refuses_bad_inputs():
    with pytest.raises(ValueError, match="multiple"):
        energy_hinge(torch.randn(3, 4), torch.randn(4, 4))
    with pytest.raises(ValueError, match="at least one negative"):
        energy_hinge(torch.randn(1, 4), torch.randn(1, 4))
    with pytest.raises(ValueError, match="reduction"):
        energy_hinge(torch.randn(2, 4), torch.randn(2, 4), reduction="sum")
