"""Specification of the arms comparison helpers on hand-made run summaries."""
import pytest

from gcbs_lib.arms import arms_table, first_gap_no_larger, mean_over_seeds


def summary(arm, seed, test, gaps, dev):
    rows = [dict(experiment="simcse", arm=arm, seed=seed, metric="test_spearman", value=test, profile="ci",
                 data="gensim-testdata-not-sts", model="tiny-bert")]
    return {"rows": rows, "epochs": [{"loss_gap": g} for g in gaps], "dev": [{"spearman": d} for d in dev]}


SUMMARIES = {("random", 0): summary("random", 0, 0.50, [1.0, 0.9], [0.1, 0.3]),
             ("random", 1): summary("random", 1, 0.40, [1.2, 1.1], [0.3, 0.5]),
             ("gcbs", 0): summary("gcbs", 0, 0.56, [0.8, 0.7], [0.2, 0.4]),
             ("gcbs", 1): summary("gcbs", 1, 0.42, [1.2, 1.0], [0.2, 0.6])}


def test_mean_over_seeds_averages_each_logged_point_across_seeds():
    assert mean_over_seeds(SUMMARIES, "random", "epochs", "loss_gap") == pytest.approx([1.1, 1.0])
    assert mean_over_seeds(SUMMARIES, "gcbs", "dev", "spearman") == pytest.approx([0.2, 0.5])


def test_arms_table_pairs_each_arm_with_random_by_seed_and_names_the_stand_in(capsys):
    deltas = arms_table(SUMMARIES, "test_spearman", 0.0103, "STS avg", stand_in="NOT STS")
    assert deltas == {"gcbs/test_spearman": pytest.approx(0.04)}  # mean of (+0.06, +0.02)
    printed = capsys.readouterr().out
    assert "NOT STS" in printed and "gensim-testdata-not-sts" in printed
    assert "measured Δ gcbs/test_spearman: +0.0400   paper: +0.0103 (STS avg)" in printed


def test_first_gap_no_larger_holds_only_when_it_holds_on_every_seed():
    assert first_gap_no_larger(SUMMARIES)  # 0.8 ≤ 1.0 and 1.2 ≤ 1.2
    worse = {**SUMMARIES, ("gcbs", 1): summary("gcbs", 1, 0.42, [1.3, 1.0], [0.2, 0.6])}
    assert not first_gap_no_larger(worse)
