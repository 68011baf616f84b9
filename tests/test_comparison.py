"""Specification of the sampler comparison: one config per (arm, seed), seed-major; runs in this
process or on gloo ranks through torchrun (the tiny code-search encoder on planted pairs,
`data_root` in conftest); and the helpers on hand-made run summaries."""

import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from conftest import child_command_lines

from gcbs_lib import results
from gcbs_lib.comparison import (
    READING,
    arm_configs,
    arms_table,
    better_readings,
    committed_run,
    contrasts,
    first_gap_no_larger,
    plot_comparison,
    plot_over_seeds,
    plot_regime,
    record_runs,
    regime_of,
    regime_readings,
    rows_of,
    run_arms,
)
from gcbs_lib.launcher import LaunchError
from gcbs_lib.rows import RESULTS_DIR_VARIABLE, read_outputs, read_rows
from gcbs_lib.train import load_checkpoint


def summary(arm, seed, test, gaps, dev):
    rows = [
        dict(
            experiment="simcse",
            arm=arm,
            seed=seed,
            metric="test_spearman",
            value=test,
            profile="ci",
            data="gensim-testdata-not-sts",
            model="tiny-bert",
        )
    ]
    return {
        "rows": rows,
        "outputs": {},  # no per-item outputs: no verdict (tests/test_verdict.py)
        "epochs": [{"loss_gap": g} for g in gaps],
        "dev": [{"spearman": d, "step": 4 * (i + 1)} for i, d in enumerate(dev)],
    }


SUMMARIES = {
    ("random", 0): summary("random", 0, 0.50, [1.0, 0.9], [0.1, 0.3]),
    ("random", 1): summary("random", 1, 0.40, [1.2, 1.1], [0.3, 0.5]),
    ("gcbs", 0): summary("gcbs", 0, 0.56, [0.8, 0.7], [0.2, 0.4]),
    ("gcbs", 1): summary("gcbs", 1, 0.42, [1.2, 1.0], [0.2, 0.6]),
}


def test_arm_configs_are_seed_major_and_differ_only_in_sampler_and_seed():
    configs = arm_configs("codesearch", "ci", ["random", "gcbs"], [3, 4], {"lr": 0.5})
    assert list(configs) == [("random", 3), ("gcbs", 3), ("random", 4), ("gcbs", 4)]
    assert all(
        (c.sampler, c.arm, c.seed, c.lr) == (arm, arm, seed, 0.5)
        for (arm, seed), c in configs.items()
    )


def test_arms_that_differ_in_more_than_their_sampler_are_named_settings():
    arms = {
        "random": {"sampler": "random"},
        "gcbs+mask": {"sampler": "gcbs", "mask_same_group": True},
    }
    configs = arm_configs("codesearch", "ci", arms, [3])
    assert [(c.arm, c.sampler, c.mask_same_group) for c in configs.values()] == [
        ("random", "random", False),
        ("gcbs+mask", "gcbs", True),
    ]


def test_a_named_arm_trains_in_its_own_folder_and_names_its_rows(tmp_path, data_root):
    arms = {"gcbs+shuffled": {"sampler": "gcbs", "batch_order": "shuffled"}}
    runs = run_arms("codesearch", "ci", arms, [0], tmp_path, tiny(data_root))
    assert list(runs) == [("start", 0), ("gcbs+shuffled", 0)]
    assert {row["arm"] for row in runs["gcbs+shuffled", 0]["rows"]} == {"gcbs+shuffled"}
    assert (tmp_path / "gcbs+shuffled-seed0" / "checkpoint.pt").exists()


def tiny(data_root, **overrides):
    """Two float64 steps without dropout on the planted pairs: one rank and two ranks agree to
    rounding."""
    return {
        "data": "csn",
        "data_root": str(data_root),
        "batch_size": 16,
        "epochs": 1,
        "max_steps": 2,
        "lr": 1e-3,
        "query_length": 16,
        "code_length": 24,
        "tiny_dim": 16,
        "tiny_layers": 1,
        "embed_batch_size": 64,
        "dropout": 0.0,
        "dtype": "float64",
        "progress": False,
        **overrides,
    }


def test_with_nproc_2_each_run_trains_on_two_gloo_ranks_the_model_of_one_process(
    tmp_path, data_root
):
    one = run_arms("codesearch", "ci", ["gcbs"], [0], tmp_path / "one", tiny(data_root))
    two = run_arms(
        "codesearch",
        "ci",
        ["gcbs"],
        [0],
        tmp_path / "two",
        tiny(data_root),
        nproc=2,
        backend="gloo",
    )
    assert (
        list(two) == [("start", 0), ("gcbs", 0)]
        and two["gcbs", 0]["steps"] == one["gcbs", 0]["steps"] == 2
    )
    # the untrained model, scored on test
    assert {row["arm"] for row in two["start", 0]["rows"]} == {"start"}
    a, b = (
        load_checkpoint(tmp_path / run / "gcbs-seed0" / "checkpoint.pt")["model"]
        for run in ("one", "two")
    )
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-9, atol=1e-11)
    assert two["gcbs", 0]["test"] == pytest.approx(one["gcbs", 0]["test"], abs=1e-9)
    assert rows_of(two) == [
        {**row, "value": pytest.approx(row["value"], abs=1e-9)} for row in rows_of(one)
    ]


def test_with_two_devices_the_runs_go_side_by_side_each_device_in_its_process_with_the_same_rows(
    tmp_path, data_root, capsys
):
    runs = ("codesearch", "ci", ["random", "gcbs"], [0])
    one = run_arms(*runs, tmp_path / "one", tiny(data_root))
    printed = capsys.readouterr().out
    workers = []  # how many spawned workers run at each look while the runs go
    with ThreadPoolExecutor(1) as thread:
        side = thread.submit(
            run_arms, *runs, tmp_path / "side", tiny(data_root), devices=["cpu", "cpu"]
        )
        while not side.done():
            workers.append(sum("spawn_main" in " ".join(line) for line in child_command_lines()))
            time.sleep(0.05)
    assert rows_of(side.result()) == rows_of(one)  # bitwise: the same runs, elsewhere
    assert max(workers) == 2  # one process a device, both at once
    assert capsys.readouterr().out == printed  # the same lines, in the same order


@pytest.mark.parametrize(
    "devices, nproc, error",
    [
        (["cuda:0", "cuda:1"], 2, "single-process runs"),
        ([], 1, "name at least one"),
        (["cuda:0", "cpu", "cuda:0"], 1, "a GPU named twice"),
    ],
)
def test_devices_that_cannot_take_the_runs_are_refused(tmp_path, devices, nproc, error):
    with pytest.raises(ValueError, match=error):
        run_arms("codesearch", "ci", ["random"], [0], tmp_path, devices=devices, nproc=nproc)


def test_a_run_that_fails_on_its_ranks_raises_with_the_ranks_error(tmp_path, data_root):
    with pytest.raises(LaunchError, match=r"ValueError: batch_size 15\b"):
        run_arms(
            "codesearch", "ci", ["random"], [0], tmp_path, tiny(data_root, batch_size=15), nproc=2
        )


def test_rows_of_lists_every_runs_rows_run_after_run():
    assert rows_of(SUMMARIES) == [SUMMARIES[key]["rows"][0] for key in SUMMARIES]


def test_record_runs_records_the_rows_and_outputs_under_the_runner_and_nothing_elsewhere(
    tmp_path, monkeypatch
):
    with_outputs = {
        key: {**run, "outputs": {"best": [[0.1, 0.2]]}} for key, run in SUMMARIES.items()
    }
    monkeypatch.delenv(RESULTS_DIR_VARIABLE, raising=False)
    assert record_runs(with_outputs, "05_gcbs_simcse") == rows_of(SUMMARIES)
    assert not any(tmp_path.iterdir())

    monkeypatch.setenv(RESULTS_DIR_VARIABLE, str(tmp_path))
    rows = record_runs(with_outputs, "05_gcbs_simcse")
    assert read_rows(tmp_path / "05_gcbs_simcse.json") == rows == rows_of(SUMMARIES)
    recorded = read_outputs(tmp_path / "05_gcbs_simcse.json")
    assert [(r["arm"], r["seed"], r["checkpoint"]) for r in recorded] == [
        (arm, seed, "best") for arm, seed in SUMMARIES
    ]


def test_arms_table_pairs_each_arm_with_random_by_seed_and_names_the_stand_in(capsys):
    lines = arms_table(SUMMARIES, stand_in="NOT STS")
    assert list(lines) == ["gcbs/test_spearman"]
    gcbs = lines["gcbs/test_spearman"]  # paired differences +0.06 and +0.02
    assert (gcbs.delta, gcbs.kit.n, gcbs.paper.deltas) == (pytest.approx(0.04), 2, (0.0103,))
    assert gcbs.differences == pytest.approx([0.06, 0.02])  # seed by seed
    printed = capsys.readouterr().out
    assert "NOT STS" in printed and "gensim-testdata-not-sts" in printed
    assert (
        "| +0.04 [-0.2141, +0.2941] | — | +0.0103 (STS avg" in printed
        and "| no per-item test outputs: no verdict |" in printed
    )
    assert "training moved the model" not in printed  # no start rows: no gain to state
    with_start = {
        **SUMMARIES,
        ("start", 0): summary("start", 0, 0.30, [], []),
        ("start", 1): summary("start", 1, 0.30, [], []),
    }
    arms_table(with_start)
    assert (
        "training moved the model, random − start (sd over seeds): spearman +0.1500 (0.0707)"
        in capsys.readouterr().out
    )


def test_plot_over_seeds_draws_the_seed_means_per_arm():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    expected = {"loss_gap": ([1.1, 1.0], [1.0, 0.85]), "spearman": ([0.2, 0.4], [0.2, 0.5])}
    for records, key in (("epochs", "loss_gap"), ("dev", "spearman")):
        fig, ax = plt.subplots()
        curves = plot_over_seeds(ax, SUMMARIES, ["random", "gcbs"], records, key)
        assert curves == dict(zip(["random", "gcbs"], map(pytest.approx, expected[key])))
        assert [list(line.get_xdata()) for line in ax.get_lines()] == [
            [0, 1] if records == "epochs" else [4, 8]
        ] * 2
        assert ax.get_xlabel() == ("epoch" if records == "epochs" else "step")
        plt.close(fig)


def test_plot_comparison_draws_dev_curves_loss_gaps_and_each_delta_beside_the_papers(capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = list(arms_table(SUMMARIES).values())
    plot_comparison(SUMMARIES, ["random", "gcbs"], "spearman", lines, "SimCSE", ["GCBS"])
    dev, gap, deltas = plt.gcf().axes
    assert dev.get_title() == "SimCSE" and len(dev.get_lines()) == 2
    assert all(tick == int(tick) for tick in gap.get_xticks())  # whole epochs
    aligned = "random loss gap per epoch: 1.1000  1.0000\n  gcbs loss gap per epoch: 1.0000  0.8500"
    assert aligned in capsys.readouterr().out
    point, paper = deltas.lines[0].get_xydata().tolist(), list(deltas.lines[-2].get_xdata())
    assert point == [[pytest.approx(0.04), 0]] and paper == [0.0103]  # the last line: 0
    assert [label.get_text() for label in deltas.get_yticklabels()] == ["GCBS"]
    plt.close("all")


def test_first_gap_no_larger_holds_only_when_it_holds_on_every_seed():
    assert first_gap_no_larger(SUMMARIES)  # 0.8 ≤ 1.0 and 1.2 ≤ 1.2
    worse = {**SUMMARIES, ("gcbs", 1): summary("gcbs", 1, 0.42, [1.3, 1.0], [0.2, 0.6])}
    assert not first_gap_no_larger(worse)


def test_contrasts_are_measured_at_both_checkpoints_and_only_where_their_arms_ran():
    ranks = {"random": [1, 2, 3, 4] * 10, "gcbs": [1, 1, 2, 3] * 10}  # gcbs: ranked higher
    records = [
        dict(experiment="codesearch", arm=arm, seed=seed, checkpoint=checkpoint)
        | {"outputs": {"queries": {"rank": ranks[arm], "candidates": [1000] * 40}}}
        for arm in ranks
        for seed in (0, 1)
        for checkpoint in ("best", "last")
    ]
    named = {
        "gcbs − random": (("gcbs",), ("random",)),
        "I": (("gcbs+mask", "random"), ("random+mask", "gcbs")),  # its masked arms never ran
    }
    measured = contrasts("codesearch", "mrr", records, named)
    assert set(measured) == {("gcbs − random", "best"), ("gcbs − random", "last")}
    mrr = {arm: statistics.mean(1 / r for r in found) for arm, found in ranks.items()}
    delta, low, high = measured["gcbs − random", "best"]
    assert delta == pytest.approx(mrr["gcbs"] - mrr["random"]) and 0 < low <= delta <= high
    assert contrasts("codesearch", "mrr", records, {"I": named["I"]}) == {}  # none ran


def regime_rows(arm, neighbours, gaps):
    rows = [
        dict(SUMMARIES["random", 0]["rows"][0], arm=arm, metric=f"loss_gap@epoch{e}", value=gap)
        for e, gap in enumerate(gaps)
    ]
    if neighbours is not None:
        rows.append(dict(rows[0], metric="neighbours@epoch0", value=neighbours))
    return rows


def test_regime_of_averages_each_diagnostic_over_epochs_and_seeds():
    rows = regime_rows("gcbs", 16, [1.0, 0.5]) + regime_rows("gcbs", 16, [0.9, 0.6])
    rows += SUMMARIES["gcbs", 0]["rows"]  # a test score: no diagnostic
    assert regime_of(rows) == {"gcbs": {"loss_gap": pytest.approx(0.75), "neighbours": 16}}


def test_plot_regime_draws_each_gcbs_arms_delta_and_loss_gap_at_its_k_over_b(capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = regime_rows("random", None, [2.0]) + regime_rows("gcbs-k16", 16, [1.5])
    rows += regime_rows("gcbs-k64", 64, [1.8])  # the simcse ci profile's batch: 32
    lines = {
        f"{arm}/test_spearman": SimpleNamespace(delta=delta, best=(delta - 0.1, delta + 0.1))
        for arm, delta in (("gcbs-k16", -0.05), ("gcbs-k64", 0.02))
    }
    plot_regime(lines, rows, "test_spearman", "regime")
    deltas, gaps = plt.gcf().axes
    assert [line.get_xydata().tolist() for line in gaps.lines[:2]] == [[[0.5, 1.5]], [[2, 1.8]]]
    assert deltas.get_title() == "regime" and [t.get_text() for t in deltas.texts] == [
        "gcbs-k16",
        "gcbs-k64",
    ]
    assert "gcbs-k64: loss_gap 1.800  neighbours 64.000" in capsys.readouterr().out
    plt.close("all")
    lines["gcbs-k16/test_spearman"].best = None  # a run without per-item outputs: no interval
    plot_regime(lines, rows, "test_spearman", "regime")
    assert len(plt.gcf().axes[0].texts) == 2
    plt.close("all")


def regime_lines(**calls):
    """Table lines of test_mrr with each arm's gated calls (best dev, last step)."""
    return {
        f"{arm.replace('_', '-')}/test_mrr": SimpleNamespace(
            arm=arm.replace("_", "-"), metric="test_mrr", calls=said
        )
        for arm, said in calls.items()
    }


def test_regime_readings_come_from_the_gated_calls_at_each_checkpoint():
    lines = regime_lines(
        gcbs=("GCBS worse", "GCBS worse"),
        gcbs_random_ties=("not resolved", "not resolved"),
        gcbs_k20=("gcbs-k20 worse", "not resolved"),
        gcbs_k250=("gcbs-k250 better", "gcbs-k250 better"),
    )
    lines["gcbs-pruned/test_mrr"] = (
        SimpleNamespace(  # not in the sweep: else a sign at the last step
            arm="gcbs-pruned", metric="test_mrr", calls=("", "gcbs-pruned worse")
        )
    )
    assert regime_readings(lines, "test_mrr") == {
        "the regime decides the sign": (True, False),
        "GCBS needs its regime": (True, True),
        "storage-order ties change the call": (True, True),
    }


def test_regime_readings_are_not_measurable_where_the_gate_failed():
    lines = regime_lines(gcbs=("", ""), gcbs_random_ties=("", ""), gcbs_k20=("", ""))
    assert set(regime_readings(lines, "test_mrr").values()) == {(None, None)}
    assert READING[None] == "not measurable here"


def test_regime_readings_compare_signs_not_names_and_only_arms_that_passed_the_gate():
    lines = regime_lines(
        gcbs=("GCBS worse", ""),  # the last step: gated out
        gcbs_random_ties=("gcbs-random-ties worse", "not resolved"),
        gcbs_k20=("gcbs-k20 better", "gcbs-k20 better"),
    )
    assert regime_readings(lines, "test_mrr") == {
        "the regime decides the sign": (True, False),
        "GCBS needs its regime": (True, True),
        "storage-order ties change the call": (False, None),
    }
    lines = regime_lines(
        gcbs=("not resolved", "not resolved"),
        gcbs_random_ties=("", ""),
        gcbs_k20=("gcbs-k20 better", "gcbs-k20 worse"),
    )
    assert set(regime_readings(lines, "test_mrr").values()) == {(None, None)}


def test_a_reading_the_gated_calls_decide_holds_or_fails_whatever_the_arms_without_a_call():
    lines = regime_lines(
        gcbs=("not resolved", ""),
        gcbs_random_ties=("gcbs-random-ties better", "not resolved"),
        gcbs_k20=("gcbs-k20 worse", ""),
        gcbs_k250=("", "gcbs-k250 better"),
    )
    assert regime_readings(lines, "test_mrr") == {
        "the regime decides the sign": (True, None),  # best: +1 and −1 shown; last: k20 open
        "GCBS needs its regime": (False, True),  # best: the published Δ is already above 0
        "storage-order ties change the call": (True, None),
    }


def test_an_arm_reads_better_where_its_gated_call_says_so_and_not_measurable_without_a_call():
    lines = regime_lines(
        gcbs_pruned=("gcbs-pruned better", ""), gcbs=("not resolved", "GCBS worse")
    )
    assert better_readings(lines["gcbs-pruned/test_mrr"]) == (True, None)
    assert better_readings(lines["gcbs/test_mrr"]) == (False, False)


def test_a_notebook_without_a_committed_cpu_run_is_told_the_command_that_makes_one(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(results, "COMMITTED", tmp_path)
    assert committed_run("04_gcbs_codesearch", "test_mrr") is None
    said = capsys.readouterr().out
    assert "python -m gcbs_lib.reproduce --profile cpu --only 04" in said


def test_a_committed_run_without_per_item_outputs_is_printed_without_intervals(
    tmp_path, monkeypatch, capsys
):
    rows = results.COMMITTED / "04_gcbs_codesearch.cpu.json"
    shutil.copy(rows, tmp_path / rows.name)
    monkeypatch.setattr(results, "COMMITTED", tmp_path)
    lines, _, records = committed_run("04_gcbs_codesearch", "test_mrr")
    assert records == []
    assert all(line.best is None for line in lines.values())
    said = capsys.readouterr().out.splitlines()
    assert len(said) == len(lines)
    assert all(": Δ " in line and " no interval: " in line for line in said)
