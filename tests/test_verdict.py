"""The verdict protocol: a paired hierarchical bootstrap over seeds and test items, a chance band
from a permutation null, the gate before any verdict, one checkpoint rule for both arms, and
`python -m gcbs_lib.results verify` recomputing what is committed. Planted code-search outputs:
each query's rank among 1,000 candidates."""

import json

import numpy as np
import pytest

from gcbs_lib import results, verdict
from gcbs_lib.experiments.codesearch import CodeSearch
from gcbs_lib.experiments.milnce import MilNce
from gcbs_lib.experiments.moco import MoCo
from gcbs_lib.experiments.simcse import SimCSE
from gcbs_lib.results import Summary, build_table, write_rows


def ranked(ranks) -> dict:
    return {"queries": {"rank": list(ranks), "candidates": [1000] * len(ranks)}}


def runs(arm: str, ranks_by_seed: dict, checkpoint: str = "best") -> tuple[list, list]:
    """Rows (test_ or last_test_ metrics) and output records of `arm` on each seed."""
    rows, records = [], []
    for seed, ranks in ranks_by_seed.items():
        outputs = ranked(ranks)
        for metric, value in CodeSearch.scores(outputs).items():
            rows.append(
                results.result_row(
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


def comparison(random: dict, gcbs: dict, start: dict, last: tuple[dict, dict] | None = None):
    """The test_mrr line of random vs gcbs on their seeds ({seed: ranks}), with the start's rows."""
    parts = [runs("random", random), runs("gcbs", gcbs), runs("start", start)]
    if last:
        parts += [runs("random", last[0], "last"), runs("gcbs", last[1], "last")]
    rows = [r for part in parts for r in part[0]]
    records = [r for part in parts for r in part[1]]
    lines = build_table(rows, outputs=records)
    return next(x for x in lines if x.metric == "test_mrr"), rows, records


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
    assert line.boot_low < line.delta < line.boot_high and line.boot_high - line.boot_low > 0.02


def test_the_bootstrap_pairs_the_items_so_a_shared_hard_item_cancels():
    # gcbs ranks every query one place better than random: Δ certain however hard each query is
    random = {s: planted(s, 2) for s in range(3)}
    gcbs = {s: [max(1, r - 1) for r in ranks] for s, ranks in random.items()}
    line, _, _ = comparison(random, gcbs, {s: planted(9, 40) for s in range(3)})
    assert 0 < line.boot_low <= line.delta <= line.boot_high
    assert line.verdict.startswith("GCBS better")


def test_gcbs_better_worse_and_not_resolved_come_from_the_bootstrap_interval():
    random = {s: planted(s, 3) for s in range(4)}
    start = {s: planted(9, 40) for s in range(4)}
    better, _, _ = comparison(random, {s: planted(s + 10, 1.5) for s in range(4)}, start)
    worse, _, _ = comparison(random, {s: planted(s + 10, 6) for s in range(4)}, start)
    same, _, _ = comparison(random, dict(random), start)
    assert better.verdict.startswith("GCBS better") and better.boot_low > 0
    assert worse.verdict.startswith("GCBS worse") and worse.boot_high < 0
    assert same.verdict.startswith("not resolved") and same.boot_low <= 0 <= same.boot_high
    # the paper's Δ (AdvTest's +0.020) placed against the bootstrap interval
    assert better.verdict.endswith("paper Δ outside it") and better.paper.deltas == (0.020,)


def test_arms_that_differ_at_the_last_step_only_depend_on_checkpoint_selection():
    random = {s: planted(s, 3) for s in range(3)}
    start = {s: planted(9, 40) for s in range(3)}
    last = (random, {s: planted(s + 10, 1.5) for s in range(3)})
    line, _, _ = comparison(random, dict(random), start, last)
    assert line.verdict.startswith(
        "depends on checkpoint selection (best dev: not resolved; last step: GCBS better)"
    )


def test_a_random_arm_at_chance_gets_no_verdict():
    uniform = {s: np.random.default_rng(s).integers(1, 1001, 200).tolist() for s in range(3)}
    better = {s: planted(s, 1.5) for s in range(3)}
    line, _, _ = comparison(uniform, better, uniform)
    assert line.verdict.startswith("not measurable here: the start within chance")
    assert "random within chance" in line.verdict and line.gate


def test_the_gate_asks_for_a_gain_over_the_start_and_a_trivial_baseline_beaten():
    band = (0.007, 0.003)  # MRR's chance band of 1,000 candidates
    start, random = Summary(0.30, 0.0, 3), Summary(0.31, 0.01, 3)
    assert verdict.gate("test_mrr", start, random, band, None) == [
        "random's gain over the start under 3 seed sd"
    ]
    assert verdict.gate("test_mrr", start, Summary(0.40, 0.01, 3), band, None) == []
    assert verdict.gate("test_mrr", start, Summary(0.40, 0.01, 3), band, 0.45) == [
        "random not above the trivial baseline (0.45)"
    ]
    # lower is better: a median rank far below chance's 500 passes
    assert not verdict.gate(
        "test_median_rank", Summary(300, 0, 3), Summary(100, 5, 3), (500, 10), None
    )


def test_a_start_trained_from_scratch_is_held_to_its_gain_not_to_chance():
    band = (0.014, 0.004)  # R@10 of 700 clips
    start, random = Summary(0.015, 0.003, 3), Summary(0.15, 0.01, 3)
    assert verdict.gate("test_r10", start, random, band, None) == [
        "the start within chance (0.014 ± 3·0.004)"
    ]
    assert verdict.gate("test_r10", start, random, band, None, scratch=True) == []
    stuck = Summary(0.016, 0.01, 3)
    assert verdict.gate("test_r10", start, stuck, band, None, scratch=True) == [
        "random within chance (0.014 ± 3·0.004)",
        "random's gain over the start under 3 seed sd",
    ]
    assert MilNce.from_scratch and MoCo.from_scratch and not SimCSE.from_scratch


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
        results.write_outputs(folder / "04_x.cpu.json", records)

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


def test_outputs_are_written_a_record_a_line_and_a_corrupt_file_is_named(tmp_path):
    _, _, records = comparison({0: [1, 2]}, {0: [1, 1]}, {0: [3, 4]})
    path = results.write_outputs(tmp_path / "r.json", records)
    assert path.name == "r.outputs.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    assert results.read_outputs(tmp_path / "r.json") == records
    path.write_text('{"experiment": \n')
    with pytest.raises(ValueError, match="r.outputs.jsonl is not valid JSON Lines"):
        results.read_outputs(tmp_path / "r.json")
