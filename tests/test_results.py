"""The paper-vs-kit table built from result rows, and the tables generated from committed
rows: the README's headline table and the full one of docs/results.md."""

import json
import math
import statistics

import pytest

from gcbs_lib import results
from gcbs_lib.data import write_atomic
from gcbs_lib.experiments.codesearch import DATA_NAMES
from gcbs_lib.results import build_table, collect, number, to_markdown, update_pages
from gcbs_lib.rows import read_outputs, read_rows, result_row, write_outputs, write_rows


def row(
    arm,
    seed,
    value,
    metric="test_mrr",
    experiment="codesearch",
    profile="cpu",
    data="stdlib-docstrings",
):
    return result_row(
        experiment=experiment,
        arm=arm,
        seed=seed,
        metric=metric,
        value=value,
        profile=profile,
        data=data,
        model="all-MiniLM-L6-v2",
    )


def test_the_command_line_names_a_missing_or_corrupt_run_json_in_one_line(tmp_path, capsys):
    corrupt = fake_run(tmp_path / "corrupt", [row("random", 0, 0.5)])
    (corrupt / "run.json").write_text('{"command": ')
    for run in (tmp_path / "absent", corrupt):
        with pytest.raises(SystemExit) as exit:
            results.main(["collect", str(run), "--results-dir", str(tmp_path / "results")])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and str(run / "run.json") in err and "Traceback" not in err


def test_an_atomic_write_leaves_no_temporary_file(tmp_path):
    assert write_atomic(tmp_path / "deep" / "f.txt", "text").read_text() == "text"
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["f.txt"]


def test_table_gives_mean_and_sample_sd_over_seeds_and_the_paired_delta_with_its_t_interval():
    rows = [row("random", s, v) for s, v in enumerate([0.50, 0.52, 0.60])]
    rows += [row("gcbs", s, v) for s, v in enumerate([0.53, 0.56, 0.61])] + [
        row("start", s, 0.3) for s in range(3)
    ]
    (line,) = build_table(rows, "abc1234")
    assert (line.arm, line.commit, line.start) == ("gcbs", "abc1234", (0.3, 0.0, 3))
    assert line.kit == (
        pytest.approx(statistics.fmean([0.53, 0.56, 0.61])),
        pytest.approx(statistics.stdev([0.53, 0.56, 0.61])),
        3,
    )
    assert line.random.mean == pytest.approx(statistics.fmean([0.50, 0.52, 0.60]))
    differences = [0.03, 0.04, 0.01]
    # t(0.975, 2 degrees of freedom)
    half = 4.302652729911275 * statistics.stdev(differences) / math.sqrt(3)
    assert line.delta == pytest.approx(statistics.fmean(differences))
    assert (line.low, line.high) == (
        pytest.approx(line.delta - half),
        pytest.approx(line.delta + half),
    )


def test_delta_uses_only_the_seeds_both_arms_ran():
    rows = [
        row("random", 0, 0.5),
        row("random", 1, 0.7),
        row("gcbs", 1, 0.9),
        row("gcbs", 2, 0.1),
        row("hard_negatives", 5, 0.6),
        row("gcbs", 0, 0.4, metric="dev_mrr"),
    ]
    lines = {(line.arm, line.metric): line for line in build_table(rows)}
    assert (
        lines["gcbs", "test_mrr"].delta == pytest.approx(0.2)
        and lines["gcbs", "test_mrr"].low is None
    )
    # a verdict needs per-item outputs (tests/test_verdict.py)
    assert lines["gcbs", "test_mrr"].verdict == "no per-item test outputs: no verdict"
    assert lines["hard_negatives", "test_mrr"].delta is None  # no seed shared with random
    # no random, one seed
    assert lines["gcbs", "dev_mrr"].random is None and lines["gcbs", "dev_mrr"].kit.sd is None
    assert "| gcbs | 0.4 (n=1) | — |" in to_markdown([lines["gcbs", "dev_mrr"]])


def test_the_same_arm_and_seed_twice_is_refused():
    with pytest.raises(ValueError, match="same seed"):
        build_table([row("random", 0, 0.5), row("random", 0, 0.5)])


def test_different_profiles_or_experiments_are_never_averaged_together():
    rows = [
        row("random", 0, 0.5),
        row("random", 0, 0.9, profile="ci"),
        row("random", 0, 0.1, experiment="simcse"),
    ]
    lines = build_table(rows)
    assert sorted(line.random.mean for line in lines) == [0.1, 0.5, 0.9] and {
        line.arm for line in lines
    } == {None}


def test_the_paper_headline_is_attached_to_the_matching_arm_and_metric_only():
    lines = build_table(
        [row("random", 0, 0.5), row("gcbs", 0, 0.6), row("gcbs", 0, 0.1, metric="loss_gap")]
    )
    paper = {line.metric: line.paper for line in lines}
    assert paper["test_mrr"].deltas == (0.010, 0.020, 0.022) and paper["loss_gap"] is None
    moco = build_table([row("gcbs", 0, 0.6, experiment="moco", metric="test_knn_accuracy")])[0]
    assert "| none reported (no MoCo number in the paper" in to_markdown([moco])


@pytest.mark.parametrize(
    "data, deltas",
    [
        ("stdlib-docstrings-advtest", (0.020,)),  # a stand-in in AdvTest's layout
        ("advtest", (0.020,)),
        ("cosqa", (0.010,)),
        ("stdlib-docstrings-csn", (0.022,)),
        ("stdlib-docstrings", (0.010, 0.020, 0.022)),  # no dataset named: all three
        ("paper", (0.010, 0.020, 0.022)),  # paper rows do not say which dataset: all three
    ],
)
def test_the_paper_delta_is_that_of_the_dataset_the_data_is_or_copies(data, deltas):
    # the names the code-search experiment gives its stand-ins
    assert set(DATA_NAMES.values()) == {"stdlib-docstrings-csn", "stdlib-docstrings-advtest"}
    line = build_table([row("random", 0, 0.5, data=data), row("gcbs", 0, 0.6, data=data)])[0]
    assert line.paper.deltas == deltas


def test_markdown_shows_start_random_arm_both_checkpoints_paper_verdict_and_diagnostics():
    rows = [
        row("random", 0, 0.5),
        row("random", 1, 0.7),
        row("gcbs", 0, 0.6),
        row("gcbs", 1, 0.9),
        row("start", 0, 0.25),
        row("start", 1, 0.25),
    ]
    last = [row(r["arm"], r["seed"], r["value"] - 0.1, metric="last_test_mrr") for r in rows[:4]]
    gaps = [
        row(arm, seed, gap, metric="loss_gap@epoch0")
        for arm, gap in (("random", 1.7), ("gcbs", 1.3))
        for seed in (0, 1)
    ]
    # GCBS's graph: neighbours per item k and the edges each item has
    regime = [row("gcbs", 0, 5.1, metric="neighbours@epoch0")]
    regime += [row("gcbs", 0, 0.25, metric="edges_per_item@epoch0")]
    lines = build_table(rows + last + gaps + regime)
    assert to_markdown(lines).splitlines()[2] == (
        "| codesearch | test_mrr | 0.25 ± 0 (n=2) | 0.6 ± 0.14 (n=2) | gcbs | 0.75 ± 0.21 (n=2) | "
        "+0.15 [-0.4853, +0.7853] | +0.15 | +0.0100 / +0.0200 / +0.0220 (CosQA / AdvTest / "
        "CodeSearchNet, UniXcoder) | no per-item test outputs: no verdict | — | 1.7 / 1.3 | — | "
        "5.1 / 0.25 / — | stdlib-docstrings | all-MiniLM-L6-v2 | cpu | — |"
    )
    assert len(lines) == 1  # the last step and the diagnostics are columns, not lines
    assert lines[0].diagnostics["neighbours"] == (None, 5.1)


def test_float_round_off_of_a_delta_prints_as_zero_at_the_precision_of_its_mean():
    """MoCo's kNN accuracies on three seeds: equal means, whose paired Δ comes out as −3.7e-17."""
    rows = [
        row(arm, s, v)
        for arm, values in (("random", (0.539, 0.507, 0.533)), ("gcbs", (0.536, 0.477, 0.566)))
        for s, v in enumerate(values)
    ]
    (gcbs,) = build_table(rows)
    assert gcbs.delta != 0 and abs(gcbs.delta) < 1e-15
    assert "| 0.5263 ± 0.045 (n=3) | +0 [-0.0785, +0.0785] |" in to_markdown([gcbs])
    assert (
        number(-1e-18, 0.5) == "0"
        and number(-0.0) == "0"
        and number(-1e-18, 0.5, signed=True) == "+0"
    )
    # a real Δ keeps the decimals its mean shows
    assert number(-0.006079, 0.01107, signed=True) == "-0.00608"
    assert (
        number(-9.293e-05, 0.2419, signed=True) == "-0.0001"
        and number(2.5, 149.0, signed=True) == "+2.5"
    )
    assert (
        number(0.0707, 0.75, digits=2) == "0.071" and number(1.2e-05, 0.01107, digits=2) == "1e-05"
    )
    assert [number(math.nan), number(-math.inf, 0.5), number(0.01234, math.inf)] == [
        "nan",
        "-inf",
        "0.01234",
    ]


OUTPUTS = [
    dict(experiment="codesearch", arm=arm, seed=0, checkpoint="best", outputs=outputs)
    for arm, outputs in (("random", {"queries": {"rank": [2], "candidates": [9]}}),)
]


def fake_run(folder, rows, status="ok"):
    write_rows(folder / "results" / "04_gcbs_codesearch.json", rows)
    write_outputs(folder / "results" / "04_gcbs_codesearch.json", OUTPUTS)
    write_rows(
        folder / "results" / "03_gcbs_sampling.json",
        [row("random", 0, 0.5, experiment="gcbs_sampling")],
    )
    (folder / "run.json").write_text(
        json.dumps(
            {
                "command": "python -m gcbs_lib.reproduce --profile cpu --only 03 04",
                "commit": "abc1234",
                "profile": "cpu",
                "started": "2026-11-30T05:00:00Z",
                "cores": 2,
                "load_average": 1.5,
                "notebooks": {
                    "04_gcbs_codesearch": {"status": status, "seconds": 12.5},
                    "03_gcbs_sampling": {"status": "failed", "seconds": 3.0},
                },
            }
        )
    )
    return folder


def test_collect_copies_rows_of_notebooks_that_ran_with_provenance_and_the_tables_follow(
    tmp_path,
):
    committed, readme, page = tmp_path / "results", tmp_path / "README.md", tmp_path / "results.md"
    headline_start, headline_end = results.MARKERS["headline"]
    full_start, full_end = results.MARKERS["full"]
    readme.write_text(f"# Kit\n\n{headline_start}\nstale\n{headline_end}\n\nafter\n")
    page.write_text(f"# Results\n\n{full_start}\nstale\n{full_end}\n\nafter\n")
    rows = [row("random", 0, 0.5), row("gcbs", 0, 0.6)]
    assert [p.name for p in collect(fake_run(tmp_path / "run", rows), committed)] == [
        "04_gcbs_codesearch.cpu.json"
    ]
    assert read_rows(committed / "04_gcbs_codesearch.cpu.json") == rows
    # the per-item outputs travel with their rows
    assert read_outputs(committed / "04_gcbs_codesearch.cpu.json") == OUTPUTS
    assert json.loads((committed / "provenance.json").read_text())[
        "04_gcbs_codesearch.cpu.json"
    ] == {
        "command": "python -m gcbs_lib.reproduce --profile cpu --only 03 04",
        "commit": "abc1234",
        "cores": 2,
        "date": "2026-11-30T05:00:00Z",
        "load_average": 1.5,
        "seconds": 12.5,
    }
    # stale: the check fails and changes nothing
    assert update_pages([readme, page], committed, check=True) == [readme, page]
    assert "stale" in readme.read_text() and "stale" in page.read_text()
    assert update_pages([readme, page], committed) == [readme, page]  # rewrites
    assert update_pages([readme, page], committed, check=True) == []
    full = page.read_text()
    assert (
        "| codesearch | test_mrr |" in full
        and "| abc1234 |" in full
        and "gcbs_sampling" not in full
    )
    assert "Measured wall time of each run: 04_gcbs_codesearch 0 min on 2 cores\n" in full
    assert full.endswith(f"{full_end}\n\nafter\n") and "stale" not in full
    headline = readme.read_text()
    assert "| codesearch | test_mrr | +0.1 | no per-item test outputs: no verdict |" in headline
    assert "| abc1234 |" not in headline
    assert headline.endswith(f"{headline_end}\n\nafter\n") and "stale" not in headline


def test_a_page_without_the_markers_of_a_generated_table_is_refused(tmp_path):
    page = tmp_path / "README.md"
    start, end = results.MARKERS["headline"]
    for text in ("# no table here\n", f"{start}\n{end}\n{start}\n"):
        page.write_text(text)
        with pytest.raises(ValueError, match="needs one start and one end line"):
            update_pages([page], tmp_path / "results")


def test_the_headline_table_shows_each_experiments_first_gcbs_comparison_on_its_primary_metric():
    """The primary metric is the test score of the experiment's dev metric (code search: MRR);
    a line without a verdict, on another metric, of another arm (a control of notebook 09) or of a
    later comparison of the same experiment stays in the full table only."""
    line = build_table([row("random", 0, 0.5), row("gcbs", 0, 0.6)])[0]
    judged = line._replace(verdict="GCBS better", best=(0.05, 0.15))
    others = [judged._replace(metric="test_recall"), judged._replace(verdict="")]
    others += [judged._replace(arm="gcbs+mask"), judged._replace(delta=0.2)]
    assert results.headline([judged, *others]).splitlines()[2:] == [
        "| codesearch | test_mrr | +0.1 [+0.05, +0.15] | GCBS better | +0.0100 / +0.0200 / +0.0220 "
        "(CosQA / AdvTest / CodeSearchNet, UniXcoder) |"
    ]


def test_collect_refuses_a_run_without_rows_of_a_notebook_that_ran_to_the_end(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        collect(
            fake_run(tmp_path / "run", [row("random", 0, 0.5)], status="failed"),
            tmp_path / "results",
        )
