"""Specification of the retrieval and correlation metrics (hand-computed values, scipy, ties)."""

import numpy as np
import pytest
import scipy.stats
import torch

from gcbs_lib import metrics
from gcbs_lib.metrics import (
    knn_predict,
    median_rank,
    mrr,
    ranks,
    recall_at,
    retrieval_ranks,
    spearman,
)


def test_rank_counts_candidates_scoring_higher_plus_one():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.4, 0.6]])
    # query 0's match (col 2, 0.5) is beaten by 0.9 only; query 1's (col 1, 0.2) by all three others
    assert ranks(scores, torch.tensor([2, 1])).tolist() == [2, 4]


def test_a_candidate_tying_the_match_counts_above_it():
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.1], [0.7, 0.7, 0.2, 0.7]])
    assert ranks(scores, torch.tensor([0, 1])).tolist() == [3, 3]
    constant = torch.zeros(3, 5)
    assert ranks(constant, torch.tensor([0, 2, 4])).tolist() == [5, 5, 5]


def test_ranks_are_a_long_tensor_on_the_scores_device():
    r = ranks(torch.rand(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    assert r.dtype == torch.long and r.shape == (4,) and r.device == torch.device("cpu")


def test_minus_infinity_acts_as_a_mask():
    scores = torch.tensor([[0.2, float("-inf"), 0.9]])
    assert ranks(scores, torch.tensor([0])).tolist() == [2]


def test_mrr_recall_and_median_rank_by_hand():
    r = torch.tensor([1, 2, 4, 10])
    assert mrr(r) == pytest.approx((1 + 1 / 2 + 1 / 4 + 1 / 10) / 4)
    assert recall_at(r, 1) == 0.25 and recall_at(r, 4) == 0.75 and recall_at(r, 10) == 1.0
    assert median_rank(r) == 3.0 and median_rank([5, 1, 3]) == 3.0


def test_mrr_counts_ranks_beyond_the_cutoff_as_zero():
    r = [1, 1000, 1001, 5000]
    assert mrr(r, cutoff=1000) == pytest.approx((1 + 1 / 1000) / 4)
    assert mrr(r) == pytest.approx((1 + 1 / 1000 + 1 / 1001 + 1 / 5000) / 4)


def test_mrr_matches_unixcoder_loop_on_distinct_scores():
    # UniXcoder's run.py: sort descending, walk the first `cutoff` entries, 1/position of the match
    # else 0.
    g = torch.Generator().manual_seed(0)
    scores, positive, cutoff = (
        torch.rand(50, 300, generator=g),
        torch.randint(0, 300, (50,), generator=g),
        100,
    )
    reference = []
    for row, p in zip(scores.numpy(), positive.tolist()):
        order = np.argsort(row)[::-1][:cutoff].tolist()
        reference.append(1 / (order.index(p) + 1) if p in order else 0.0)
    assert mrr(ranks(scores, positive), cutoff=cutoff) == pytest.approx(np.mean(reference))


def test_retrieval_ranks_equal_ranks_of_the_full_matrix_for_every_block_size(monkeypatch):
    g = torch.Generator().manual_seed(1)
    # small integers: exact dot products, ties
    queries = torch.randint(-2, 3, (13, 4), generator=g).double()
    pool = torch.randint(-2, 3, (29, 4), generator=g).double()
    positive = torch.randint(0, 29, (13,), generator=g)
    full = ranks(queries @ pool.T, positive)
    assert (full > 1).any()
    for block_size in (1, 4, 13, 100):
        monkeypatch.setattr(metrics, "BLOCK_ELEMENTS", block_size * len(pool))
        assert torch.equal(retrieval_ranks(queries, pool, positive), full)


def test_retrieval_ranks_count_a_pool_duplicate_of_the_match_above_it():
    pool = torch.nn.functional.normalize(
        torch.randn(6, 8, generator=torch.Generator().manual_seed(2)), dim=1
    )
    pool = torch.cat([pool, pool[3:4]])  # row 6 duplicates row 3
    assert retrieval_ranks(pool[3:4], pool, torch.tensor([3])).tolist() == [2]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ranks(torch.rand(2, 3), torch.tensor([0, 3])), "lie in"),
        (lambda: ranks(torch.rand(2, 3), torch.tensor([-1, 0])), "lie in"),
        (lambda: ranks(torch.rand(2, 3), torch.tensor([0])), "one entry per query"),
        (lambda: ranks(torch.rand(2, 3), torch.tensor([0.0, 1.0])), "integer"),
        (lambda: ranks(torch.rand(3), torch.tensor([0])), "2-D"),
        (lambda: ranks(torch.tensor([[0.1, float("nan")]]), torch.tensor([0])), "NaN"),
        (
            lambda: retrieval_ranks(torch.rand(2, 3), torch.rand(4, 5), torch.tensor([0, 1])),
            "same width",
        ),
        (lambda: mrr([]), "non-empty"),
        (lambda: mrr([0, 1]), ">= 1"),
        (lambda: mrr([1, 2], cutoff=0), "cutoff"),
        (lambda: recall_at([1, 2], 0), "k must"),
        (lambda: median_rank([1.5]), "integers"),
    ],
)
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_spearman_by_hand_with_ties():
    # x ranks (1, 2.5, 2.5, 4), y ranks (1, 2, 3, 4): rho = Pearson of the rank vectors
    rx, ry = np.array([1, 2.5, 2.5, 4]), np.array([1, 2, 3, 4.0])
    expected = np.corrcoef(rx, ry)[0, 1]
    assert spearman([1, 5, 5, 9], [0.1, 0.2, 0.3, 0.4]) == pytest.approx(expected, abs=1e-15)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


@pytest.mark.parametrize("seed", range(5))
def test_spearman_equals_scipy_including_ties(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, size=40).astype(float)  # many ties
    y = x + rng.integers(0, 3, size=40) + rng.normal(size=40).round(1)
    assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    assert spearman(torch.tensor(x), torch.tensor(y)) == spearman(x, y)


@pytest.mark.parametrize(
    "x, y, message",
    [
        ([1, 2, 3], [1, 2], "equally long"),
        ([1], [1], "at least 2"),
        ([1, float("nan")], [1, 2], "finite"),
        ([1, 1, 1], [1, 2, 3], "constant"),
        (["a", "b"], [1, 2], "could not convert string to float"),
    ],
)
def test_spearman_refuses_bad_input(x, y, message):
    with pytest.raises(ValueError, match=message):
        spearman(x, y)


def knn_label(query, bank, bank_labels, k, temperature=1.0):
    """The class `knn_predict` gives one query."""
    (label,) = knn_predict(
        torch.tensor([query]),
        torch.tensor(bank),
        torch.tensor(bank_labels),
        k=k,
        temperature=temperature,
    ).tolist()
    return label


def test_knn_votes_weigh_each_neighbour_by_exp_cosine_over_tau():
    bank, labels = [[1.0, 0.0], [0.0, 1.0], [0.0, 2.0]], [0, 1, 1]
    # class 0: e^(1/τ); class 1: 2·e^0. τ=0.1: 22026 vs 2 -> 0; τ=100: 1.01 vs 2 -> the majority, 1
    assert knn_label([3.0, 0.0], bank, labels, k=3, temperature=0.1) == 0
    assert knn_label([3.0, 0.0], bank, labels, k=3, temperature=100.0) == 1


def test_knn_ties_take_the_lower_bank_index_then_the_smaller_class():
    bank, labels = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.0]], [2, 1, 1, 0]
    # rows 0 and 2 tie at cos 1: row 0 first
    assert knn_label([1.0, 0.0], bank, labels, k=1) == 2
    # e^1 for class 2 and for class 1: smaller class
    assert knn_label([1.0, 0.0], bank, labels, k=2) == 1
    # row 1 (cos 0) adds e^0 to class 1
    assert knn_label([1.0, 0.0], bank, labels, k=3) == 1


def test_knn_predict_votes_block_by_block_as_at_once(monkeypatch):
    torch.manual_seed(0)
    bank = torch.randn(50, 8)
    bank_labels = torch.randint(0, 3, (50,))
    queries = bank[:20] + 0.01 * torch.randn(20, 8)
    whole = knn_predict(queries, bank, bank_labels, k=1)
    assert whole.equal(bank_labels[:20])
    at_once = knn_predict(queries, bank, bank_labels, k=5)
    monkeypatch.setattr(metrics, "BLOCK_ELEMENTS", 3 * len(bank))  # 3 queries a block
    assert knn_predict(queries, bank, bank_labels, k=5).equal(at_once)
    with pytest.raises(ValueError, match="k must lie in 1..50"):
        knn_predict(queries, bank, bank_labels, k=51)


@pytest.mark.parametrize(
    "features, bank_labels, message",
    [
        (torch.zeros(0, 2), torch.tensor([0, 1]), "no features to score"),
        (torch.ones(1, 2), torch.tensor([0.0, 1.0]), "bank_labels must be integer"),
        (torch.ones(1, 2), torch.tensor([0, -1]), "bank_labels must be class"),
        (torch.tensor([[float("nan"), 1.0]]), torch.tensor([0, 1]), "features are not finite"),
    ],
)
def test_knn_predict_refuses_bad_input(features, bank_labels, message):
    with pytest.raises(ValueError, match=message):
        knn_predict(features, torch.eye(2), bank_labels, k=1)
