"""Specification of hard-negative mining: which documents may be mined, and that the draw is seeded
and blockwise."""

import pytest
import torch
import torch.nn.functional as F

import gcbs_lib.gcbs as gcbs
from gcbs_lib.mining import mine_hard_negatives
from gcbs_lib.seeding import generator

N, B, D = 96, 8, 16


@pytest.fixture
def pairs():
    g = torch.Generator().manual_seed(0)
    z1 = F.normalize(torch.randn(N, D, generator=g), dim=1)
    z2 = F.normalize(z1 + 0.3 * torch.randn(N, D, generator=g), dim=1)
    batches = torch.randperm(N, generator=g)[: (N // B) * B].view(-1, B)
    keys = [i // 3 if i < 30 else i for i in range(N)]  # items 0-29 come in duplicate triples
    return z1, z2, batches, keys


def allowed_ranking(z1, z2, batches, keys, item):
    """Documents item may get, most similar first: not itself, not its batch-mates, no duplicate of
    it."""
    batch = batches[(batches == item).any(dim=1)][0].tolist()
    scores = z1[item] @ z2.T
    candidates = [
        j
        for j in scores.argsort(descending=True).tolist()
        if j not in batch and keys[j] != keys[item]
    ]
    return candidates


def test_each_negative_is_drawn_from_ranks_skip_to_top_k_of_the_allowed_documents(pairs):
    z1, z2, batches, keys = pairs
    negatives = mine_hard_negatives(
        z1, z2, batches, top_k=10, skip=2, keys=keys, generator=generator(0, 0, "mining")
    )
    assert negatives.shape == batches.shape
    ranks = [
        allowed_ranking(z1, z2, batches, keys, i).index(j)
        for i, j in zip(batches.flatten().tolist(), negatives.flatten().tolist())
    ]
    assert min(ranks) >= 2 and max(ranks) <= 9
    assert len(set(ranks)) > 4  # a draw, not always the same rank


def test_the_draw_is_seeded_and_the_same_in_blocks_of_one_row(pairs, monkeypatch):
    z1, z2, batches, keys = pairs
    first = mine_hard_negatives(z1, z2, batches, keys=keys, generator=generator(0, 1, "mining"))
    monkeypatch.setattr(gcbs, "BLOCK_ELEMENTS", 1)
    assert torch.equal(
        mine_hard_negatives(z1, z2, batches, keys=keys, generator=generator(0, 1, "mining")), first
    )
    assert not torch.equal(
        mine_hard_negatives(z1, z2, batches, keys=keys, generator=generator(0, 2, "mining")), first
    )


def test_an_item_without_candidates_left_is_an_error():
    z = F.normalize(torch.randn(4, 3), dim=1)
    with pytest.raises(ValueError, match="no candidate beyond rank"):
        mine_hard_negatives(z, z, torch.tensor([[0, 1], [2, 3]]), top_k=3, skip=2)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(batches=torch.tensor([[0, 0]])), "distinct item indices"),
        (dict(batches=torch.tensor([[0, 99]])), "distinct item indices"),
        (dict(skip=5, top_k=5), "skip < top_k"),
        (dict(keys=[0, 1]), "keys for"),
    ],
)
def test_bad_inputs_are_refused(pairs, bad, match):
    z1, z2, batches, _ = pairs
    with pytest.raises(ValueError, match=match):
        mine_hard_negatives(z1, z2, **{"batches": batches, **bad})
    with pytest.raises(ValueError, match="NaN"):
        mine_hard_negatives(z1 * float("nan"), z2, batches)
