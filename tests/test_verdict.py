"""The verdict protocol (v2): a paired bootstrap over seeds and clusters of test items with a
small-sample t check, a chance band from a permutation null, the gate on interval bounds for both
arms, a verdict on the primary metric only, one checkpoint rule for both arms, and
`python -m gcbs_lib.results verify` recomputing what is committed. Planted code-search outputs:
each query's rank among 1,000 candidates."""

import numpy as np
import pytest

from gcbs_lib import results, verdict
from gcbs_lib.experiments.codesearch import CodeSearch
from gcbs_lib.experiments.milnce import MilNce
from gcbs_lib.experiments.moco import MoCo
from gcbs_lib.experiments.simcse import SimCSE
from gcbs_lib.results import build_table
from gcbs_lib.rows import result_row, write_outputs, write_rows


def ranked(ranks, clusters=None) -> dict:
    queries = {"rank": list(ranks), "candidates": [1000] * len(ranks)}
    return {"queries": queries if clusters is None else {**queries, "cluster": list(clusters)}}


def runs(arm: str, ranks_by_seed: dict, checkpoint="best", clusters=None) -> tuple[list, list]:
    """Rows (test_ or last_test_ metrics) and output records of `arm` on each seed."""
    rows, records = [], []
    for seed, ranks in ranks_by_seed.items():
        outputs = ranked(ranks, clusters)
        for metric, value in CodeSearch.scores(outputs).items():
            rows.append(
                result_row(
                    experiment="codesearch",
                    arm=arm,
                    seed=seed,
                    metric=results.CHECKPOINTS[checkpoint] + metric,
                    value=value,
                    profile="cpu",
                    data="stdlib-docstrings-advtest",
                    model="m",
                )
            )
        records.append(
            dict(
                experiment="codesearch", arm=arm, seed=seed, checkpoint=checkpoint, outputs=outputs
            )
        )
    return rows, records


def comparison(random: dict, gcbs: dict, start: dict, last=None, clusters=None, metric="test_mrr"):
    """The `metric` line of random vs gcbs on their seeds ({seed: ranks}), with the start's rows;
    `last`: (random, gcbs) of the last step; `clusters`: each query's."""
    parts = [runs(arm, ranks, "best", clusters) for arm, ranks in zip(ARMS, (random, gcbs, start))]
    if last:
        parts += [
            runs("random", last[0], "last", clusters),
            runs("gcbs", last[1], "last", clusters),
        ]
    rows = [r for part in parts for r in part[0]]
    records = [r for part in parts for r in part[1]]
    lines = build_table(rows, outputs=records)
    return next(x for x in lines if x.metric == metric), rows, records


ARMS = ("random", "gcbs", "start")


def planted(seed: int, best: int, n: int = 200) -> list[int]:
    """n ranks: a share of matches at rank 1 (more with a lower `best`), the rest spread."""
    generator = np.random.default_rng(seed)
    return np.where(generator.random(n) < 0.6 / best, 1, generator.integers(2, 50, n)).tolist()


def test_the_bootstrap_interval_holds_the_test_sets_sampling_error_the_t_interval_leaves_out():
    # every seed scores the same items alike: no spread over seeds, only the test set's
    random = {s: planted(0, 3) for s in range(3)}
    gcbs = {s: planted(1, 3) for s in range(3)}
    line, _, _ = comparison(random, gcbs, {s: planted(2, 30) for s in range(3)})
    assert line.low == pytest.approx(line.high)  # a t-interval of zero width
    assert line.best[0] < line.delta < line.best[1] and line.best[1] - line.best[0] > 0.02


def test_the_bootstrap_pairs_the_items_so_a_shared_hard_item_cancels():
    # gcbs ranks every query one place better than random: Δ certain however hard each query is
    random = {s: planted(s, 2) for s in range(3)}
    gcbs = {s: [max(1, r - 1) for r in ranks] for s, ranks in random.items()}
    line, _, _ = comparison(random, gcbs, {s: planted(9, 40) for s in range(3)})
    assert 0 < line.best[0] <= line.delta <= line.best[1]
    assert line.verdict.startswith("GCBS better")


def outputs_of_arms(arms: dict) -> dict:
    """{arm: {seed: ranked outputs}} of {arm: {seed: ranks}}."""
    return {a: {s: ranked(ranks) for s, ranks in arm.items()} for a, arm in arms.items()}


def test_a_contrast_of_four_arms_gets_its_interval_from_the_same_paired_draws():
    """The interaction I = (g+m − r+m) − (g − r): where the mask removes all of GCBS's harm (g+m
    ranks as r+m, g one place worse than r on every query), I equals the harm, one-signed;
    where the mask changes nothing, I is 0 with an interval about it."""
    seeds = range(4)
    random = {s: planted(s, 3) for s in seeds}
    worse = {s: [r + 1 for r in ranks] for s, ranks in random.items()}
    interaction = (("gcbs+mask", "random"), ("random+mask", "gcbs"))
    masked = outputs_of_arms(
        {"random": random, "gcbs": worse, "random+mask": random, "gcbs+mask": random}
    )
    harm = verdict.bootstrap("codesearch", masked, [("gcbs", "random"), interaction], draws=200)
    delta, low, high = harm[interaction]["mrr"]
    assert delta == pytest.approx(-harm["gcbs", "random"]["mrr"][0]) and 0 < low <= delta <= high
    same = outputs_of_arms(
        {"random": random, "gcbs": worse, "random+mask": random, "gcbs+mask": worse}
    )
    delta, low, high = verdict.bootstrap("codesearch", same, [interaction], draws=200)[interaction][
        "mrr"
    ]
    assert delta == pytest.approx(0.0, abs=1e-12) and low <= 0 <= high


def test_gcbs_better_worse_and_not_resolved_come_from_the_interval():
    random = {s: planted(s, 3) for s in range(4)}
    start = {s: planted(9, 40) for s in range(4)}
    better, _, _ = comparison(random, {s: planted(s + 10, 1.5) for s in range(4)}, start)
    worse, _, _ = comparison(random, {s: planted(s + 10, 6) for s in range(4)}, start)
    same, _, _ = comparison(random, dict(random), start)
    assert better.verdict.startswith("GCBS better") and better.best[0] > 0
    assert worse.verdict.startswith("GCBS worse") and worse.best[1] < 0
    assert same.verdict.startswith("not resolved") and same.best[0] <= 0 <= same.best[1]
    # the paper's Δ (AdvTest's +0.020) placed against the interval
    assert better.verdict.endswith("paper Δ outside it") and better.paper.deltas == (0.020,)
    assert better.calls == ("GCBS better", "")  # no last step here
    assert [
        verdict.call_sign(call) for call in ("GCBS better", "GCBS worse", "not resolved", "")
    ] == [
        1,
        -1,
        0,
        None,
    ]
    with pytest.raises(ValueError, match="not a call"):
        verdict.call_sign(better.verdict)  # a verdict, which may name two checkpoints' calls


def test_arms_that_differ_at_the_last_step_only_depend_on_checkpoint_selection():
    random = {s: planted(s, 3) for s in range(3)}
    start = {s: planted(9, 40) for s in range(3)}
    last = (random, {s: planted(s + 10, 1.5) for s in range(3)})
    line, _, _ = comparison(random, dict(random), start, last)
    assert line.verdict.startswith(
        "depends on checkpoint selection (best dev: not resolved; last step: GCBS better)"
    )
    # the last step's Δ, interval and call stand beside best dev's
    assert line.last_delta > 0 and line.last[0] > 0 and line.calls[1] == "GCBS better"
    assert ": GCBS better |" in results.to_markdown([line])


def test_only_the_primary_metric_gets_a_verdict_the_others_read_exploratory():
    random = {s: planted(s, 3) for s in range(3)}
    gcbs = {s: planted(s + 10, 1.5) for s in range(3)}
    start = {s: planted(9, 40) for s in range(3)}
    recall, _, _ = comparison(random, gcbs, start, metric="test_recall@1")
    assert CodeSearch.dev_metric == "mrr"  # the pre-registered primary metric
    assert recall.verdict == "exploratory" and recall.best[0] > 0 and recall.calls == ("", "")


def test_clustered_items_are_resampled_whole_so_correlated_items_widen_the_interval():
    # ten source modules of 20 queries; GCBS helps every query of five modules, none of the others
    modules = np.repeat(np.arange(10), 20)
    random = {s: [5] * 200 for s in range(3)}
    gcbs = {s: np.where(modules % 2 == 0, 1, 5).tolist() for s in range(3)}
    start = {s: [40] * 200 for s in range(3)}
    items, _, _ = comparison(random, gcbs, start)
    clustered, _, _ = comparison(random, gcbs, start, clusters=modules.tolist())
    assert clustered.delta == items.delta
    width = [line.best[1] - line.best[0] for line in (items, clustered)]
    assert width[1] > 3 * width[0]
    assert clustered.clusters == "queries 10 of 200"
    assert items.clusters == "queries 200 of 200"
    # in a draw, a cluster's items are taken equally often: the cluster stays whole
    members = verdict.cluster_members({"rank": [0] * 200, "cluster": modules.tolist()})
    counts = np.bincount(verdict.drawn_items(members, np.random.default_rng(0)), minlength=200)
    assert all(len(set(counts[modules == m])) == 1 for m in range(10)) and counts.sum() > 0


def test_a_pair_of_documents_is_drawn_as_often_as_it_occurs_among_the_drawn_documents():
    pairs = [[a, b] for a in range(6) for b in range(a + 1, 6)]  # every pair of 6 documents
    members = verdict.cluster_members({"predicted": [0.0] * 15, "cluster": pairs})
    documents = np.bincount(np.random.default_rng(3).integers(0, 6, 6), minlength=6)
    counts = np.bincount(verdict.drawn_items(members, np.random.default_rng(3)), minlength=15)
    assert counts.tolist() == [documents[a] * documents[b] for a, b in pairs]


def test_the_t_correction_widens_a_four_seed_interval(monkeypatch):
    # the seeds disagree (GCBS helps 0 to 60 of 200 queries); the test items barely vary
    random = {s: [5] * 200 for s in range(4)}
    gcbs = {s: [1] * m + [5] * (200 - m) for s, m in enumerate((0, 10, 20, 60))}
    start = {s: [40] * 200 for s in range(4)}
    # the seeds' part alone: the classic t-interval over seeds, 3 degrees of freedom
    per_seed = np.array([0.0, 0.04, 0.08, 0.24])
    low, high = verdict.welch_t(per_seed, 0.0)
    half = 3.182446305284263 * per_seed.std(ddof=1) / 2
    assert (low, high) == (
        pytest.approx(per_seed.mean() - half),
        pytest.approx(per_seed.mean() + half),
    )
    assert verdict.welch_t(per_seed[:1], 0.0) is None
    corrected, _, _ = comparison(random, gcbs, start)
    monkeypatch.setattr(verdict, "welch_t", lambda *_: None)  # the percentile bootstrap alone
    percentile, _, _ = comparison(random, gcbs, start)
    width = [line.best[1] - line.best[0] for line in (percentile, corrected)]
    assert width[1] > 1.5 * width[0]


def test_a_start_at_chance_gets_no_verdict():
    uniform = {s: np.random.default_rng(s).integers(1, 1001, 200).tolist() for s in range(3)}
    better = {s: planted(s, 1.5) for s in range(3)}
    line, _, _ = comparison(uniform, better, uniform)
    assert line.verdict.startswith("not measurable here: the start within chance")
    assert "random within chance" in line.verdict and line.gate
    assert line.calls == ("", "")


def test_the_gate_asks_each_arm_for_a_gain_above_the_start_and_the_baseline_by_interval():
    assert verdict.arm_gate("random", "test_mrr", {"the start": (0.02, 0.01, 0.03)}) == []
    # an interval that holds 0 is no gain, however large its point
    assert verdict.arm_gate(
        "random", "test_mrr", {"the trivial baseline": (0.011, -0.02, 0.04)}
    ) == ["random's gain over the trivial baseline not above 0: +0.011 [-0.02, +0.04]"]
    # a pre-registered minimum gain
    assert verdict.arm_gate("random", "test_mrr", {"the start": (0.02, 0.01, 0.03)}, 0.015) == [
        "random's gain over the start not above 0.015: +0.02 [+0.01, +0.03]"
    ]
    # lower is better: a median rank far below the start's passes
    assert verdict.arm_gate("random", "test_median_rank", {"the start": (-200, -250, -150)}) == []


def test_a_negative_gain_is_said_as_negative():
    assert verdict.arm_gate("random", "test_spearman", {"the start": (-0.04, -0.05, -0.03)}) == [
        "random's gain over the start negative: -0.04 [-0.05, -0.03]"
    ]
    # negative at its point, its interval holding 0: still said
    assert verdict.arm_gate("GCBS", "test_mrr", {"the start": (-0.004, -0.038, 0.029)}) == [
        "GCBS's gain over the start negative: -0.004 [-0.038, +0.029]"
    ]


def test_the_gate_applies_to_both_arms_so_a_rescue_by_gcbs_can_be_seen():
    start = {s: planted(9, 2) for s in range(4)}
    degrading = {s: planted(s, 6) for s in range(4)}  # random falls below the start
    rescue = {s: planted(s + 10, 1.2) for s in range(4)}  # GCBS rises above it
    line, _, _ = comparison(degrading, rescue, start)
    assert line.verdict.startswith("GCBS better (random's gain over the start negative: ")
    # both arms fall: nothing to measure, each arm's reason said
    line, _, _ = comparison(degrading, {s: planted(s + 10, 5) for s in range(4)}, start)
    assert line.verdict.startswith("not measurable here: random's gain over the start negative")
    assert "GCBS's gain over the start negative" in line.verdict


def test_a_start_trained_from_scratch_is_not_held_to_chance():
    assert MilNce.from_scratch and MoCo.from_scratch and not SimCSE.from_scratch
    assert verdict.within_chance("the start", "test_r10", 0.015, (0.014, 0.004)) == [
        "the start within chance (0.014 ± 3·0.004)"
    ]
    assert verdict.within_chance("random", "test_r10", 0.15, (0.014, 0.004)) == []
    # lower is better: chance's median rank is high
    assert verdict.within_chance("random", "test_median_rank", 100, (500, 10)) == []


def test_the_chance_band_is_the_metric_under_shuffled_gold():
    generator = np.random.default_rng(0)
    gold = generator.random(400)
    outputs = {"lee": {"predicted": (gold + generator.random(400)).tolist(), "gold": gold.tolist()}}
    band = verdict.chance_band("simcse", outputs)
    assert SimCSE.scores(outputs)["spearman"] > 0.5
    assert abs(band["spearman"][0]) < 0.02 and band["spearman"][1] == pytest.approx(0.05, rel=0.2)
    mrr = verdict.chance_band("codesearch", ranked([1] * 300))["mrr"]
    assert mrr[0] == pytest.approx(np.mean(1 / np.arange(1, 1001)), rel=0.1)


def test_a_lower_median_rank_is_the_better_one():
    assert verdict.called("gcbs", "test_median_rank", -3.0, -1.0) == "GCBS better"
    assert verdict.called("gcbs", "test_mrr", -3.0, -1.0) == "GCBS worse"


def test_verify_recomputes_rows_and_the_generated_tables_from_the_committed_outputs(
    tmp_path, capsys
):
    random = {s: planted(s, 3) for s in range(2)}
    gcbs, start = {s: planted(s + 5, 2) for s in range(2)}, {s: planted(9, 40) for s in range(2)}
    folder, readme, page = tmp_path / "results", tmp_path / "README.md", tmp_path / "results.md"
    pages = [readme, page]

    def commit(rows, records):
        write_rows(folder / "04_x.cpu.json", rows)
        write_outputs(folder / "04_x.cpu.json", records)

    _, rows, records = comparison(random, gcbs, start)
    commit(rows, records)
    readme.write_text("\n".join(results.MARKERS["headline"]) + "\n")
    page.write_text("\n".join(results.MARKERS["full"]) + "\n")
    results.update_pages(pages, folder)
    assert "| codesearch | test_mrr |" in readme.read_text()
    assert "| codesearch | test_mrr |" in page.read_text()
    assert results.verify(folder, pages) is None
    arguments = ["verify", "--results-dir", str(folder), "--pages", str(readme), str(page)]
    with pytest.raises(SystemExit) as done:
        results.main(arguments)
    assert done.value.code == 0
    # a row that its outputs do not give
    commit([{**rows[0], "value": rows[0]["value"] + 0.001}, *rows[1:]], records)
    assert "its per-item outputs give" in results.verify(folder, pages)
    with pytest.raises(SystemExit) as done:
        results.main(arguments)
    assert done.value.code == 1 and "its per-item outputs give" in capsys.readouterr().out
    # rows and outputs agree, but the table was made from others
    commit(*comparison({**random, 0: [1] * 200}, gcbs, start)[1:])
    assert "its table differs" in results.verify(folder, pages)


def test_the_committed_results_verify():
    assert results.verify() is None
