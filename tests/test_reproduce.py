"""The papermill runner: parameters checked before anything runs, failures named, rows and figures
collected."""

import ast
import csv
import json
import os
import re

import jupytext
import nbformat
import papermill
import pytest
import yaml

from gcbs_lib import reproduce
from gcbs_lib.reproduce import discover, typed
from gcbs_lib.rows import RESULTS_DIR_VARIABLE, read_rows

NOTEBOOKS = reproduce.NOTEBOOKS
HEADER = (
    "# ---\n# jupyter:\n#   kernelspec:\n#     display_name: Python 3\n#     language: python\n"
    "#     name: python3\n# ---\n"
)
FAILING = (
    HEADER
    + """
# %% tags=["parameters"]
n = 3
profile = "ci"

# %%
x = 1
y = x / (n - 3)
"""
)
PLOTTING = (
    HEADER
    + """
# %% tags=["parameters"]
n = 3
profile = "ci"
output_dir = "../runs/02_plot"
seeds = [0, 1]

# %% tags=["figure:line"]
import matplotlib.pyplot as plt
from gcbs_lib.rows import record, result_row
plt.plot([0, n])
plt.show()
rows = [result_row(experiment=name, arm=arm, seed=seed, metric="score",
                   value=n + seed + (arm == "gcbs"), profile=profile, data="planted", model="none")
        for name in ("toy", "other") for arm in ("random", "gcbs") for seed in seeds]
record(rows, "02_plot")

# %%
plt.plot([n, 0])
plt.show()
"""
)


@pytest.fixture(scope="module")
def toy_notebooks(tmp_path_factory):
    """01_fail (divides by zero in its second cell) and 02_plot (an output_dir, two figures, result
    rows of two experiments and two arms for each of its seeds)."""
    folder = tmp_path_factory.mktemp("notebooks")
    for name, text in (("01_fail", FAILING), ("02_plot", PLOTTING)):
        nbformat.write(jupytext.reads(text, fmt="py:percent"), folder / f"{name}.ipynb")
    return folder


def run(capsys, *args):
    try:
        status = reproduce.main([str(a) for a in args])
    except SystemExit as usage_error:  # argparse's parser.error
        status = usage_error.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def injected(notebook_path):
    cell = next(
        c
        for c in nbformat.read(notebook_path, as_version=4).cells
        if "injected-parameters" in c.metadata.get("tags", [])
    )
    return {s.targets[0].id: ast.literal_eval(s.value) for s in ast.parse(cell.source).body}


def test_every_notebook_gets_its_profile_file_the_overrides_it_has_and_ranks_if_it_launches_them(
    tmp_path, capsys
):
    status, _, _ = run(
        capsys,
        "--profile",
        "cpu",
        "--prepare-only",
        "-p",
        "device",
        "cuda",
        "--nproc",
        "3",
        "--backend",
        "gloo",
        "--output-dir",
        tmp_path,
    )
    assert status == 0
    for notebook in sorted(NOTEBOOKS.glob("[0-9]*.ipynb")):
        defaults = papermill.inspect_notebook(str(notebook))
        profile_file = NOTEBOOKS / "params" / f"{notebook.stem}.cpu.yaml"
        expected = {
            "profile": "cpu",
            **(yaml.safe_load(profile_file.read_text()) if profile_file.exists() else {}),
            "device": "cuda",
        }
        expected |= {k: v for k, v in (("nproc", 3), ("backend", "gloo")) if k in defaults}
        expected |= (
            {"output_dir": str(tmp_path.resolve() / "work" / notebook.stem)}
            if "output_dir" in defaults
            else {}
        )
        prepared = nbformat.read(tmp_path / notebook.name, as_version=4)
        assert injected(tmp_path / notebook.name) == expected, notebook.name
        assert not any(c.get("outputs") or c.get("execution_count") for c in prepared.cells), (
            "committed outputs"
        )
    assert json.loads((tmp_path / "run.json").read_text())["profile"] == "cpu"


def test_an_unknown_parameter_is_refused_before_anything_runs_naming_notebooks_and_parameters(
    tmp_path, capsys
):
    status, _, err = run(capsys, "-p", "no_such_parameter", "1", "--output-dir", tmp_path / "out")
    assert status == 2 and not (tmp_path / "out").exists()
    assert "'no_such_parameter'" in err and "nothing was run" in err
    listed = dict(
        line.strip().split(": ", 1) for line in err.partition("Valid parameters:\n")[2].splitlines()
    )
    for notebook in NOTEBOOKS.glob("[0-9]*.ipynb"):
        assert set(papermill.inspect_notebook(str(notebook))) == set(
            listed[notebook.stem].split(", ")
        )


def test_values_of_the_wrong_type_and_ranks_for_notebooks_that_launch_none_are_refused(
    tmp_path, capsys
):
    status, _, err = run(
        capsys, "--only", "01", "-p", "memory_batch_sizes", "16", "--output-dir", tmp_path / "a"
    )
    assert (
        status == 2
        and "01_gradcache" in err
        and "[16, 32, 64, 128]" in err
        and not (tmp_path / "a").exists()
    )
    status, _, err = run(capsys, "--only", "01", "--nproc", "4", "--output-dir", tmp_path / "b")
    assert status == 2 and "--nproc" in err and not (tmp_path / "b").exists()


def test_values_keep_the_type_of_the_default():
    assert typed(yaml.safe_load("[16, 64]"), [16, 32], "-p") == [16, 64]
    assert typed(1, 0.5, "-p") == 1.0 and isinstance(typed(1, 0.5, "-p"), float)
    assert typed({"a": 1}, None, "-p") == {"a": 1}  # a default of None takes anything
    for value, default in ((True, 1), (0.5, 1), ("16", 16), (16, [16]), ([16], "16")):
        with pytest.raises(ValueError, match="does not match"):
            typed(value, default, "-p")


def test_a_string_parameter_takes_the_text_as_written(tmp_path, capsys):
    assert (
        run(
            capsys,
            "--only",
            "1",
            "--prepare-only",
            "-p",
            "device",
            "2024",
            "--output-dir",
            tmp_path,
        )[0]
        == 0
    )
    assert injected(tmp_path / "01_gradcache.ipynb")["device"] == "2024"


def test_only_selects_notebooks_by_number_or_name_and_names_the_ones_there_are():
    assert [p.stem for p in discover(NOTEBOOKS, ["1", "03_gcbs_sampling"])] == [
        "01_gradcache",
        "03_gcbs_sampling",
    ]
    with pytest.raises(ValueError, match="01_gradcache"):
        discover(NOTEBOOKS, ["99"])


def test_a_failing_notebook_exits_non_zero_naming_its_cell_and_the_others_still_run(
    toy_notebooks, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(reproduce, "NOTEBOOKS", toy_notebooks)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "stale.json").write_text("[]")  # a previous run's rows are not merged
    status, _, err = run(capsys, "--output-dir", tmp_path)
    assert status == 1
    assert re.search(r"FAILED 01_fail: cell In \[3\] \(starts `x = 1`\): ZeroDivisionError", err)
    failed = nbformat.read(tmp_path / "01_fail.ipynb", as_version=4)
    assert any(
        o.get("ename") == "ZeroDivisionError" for c in failed.cells for o in c.get("outputs", [])
    )
    run_record = json.loads((tmp_path / "run.json").read_text())
    assert {n: r["status"] for n, r in run_record["notebooks"].items()} == {
        "01_fail": "failed",
        "02_plot": "ok",
    }
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == [
        "02_plot_in4.png",
        "02_plot_line.png",
    ]
    assert (tmp_path / "figures" / "02_plot_line.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["02_plot.json"]
    assert len(read_rows(tmp_path / "results" / "02_plot.json")) == 8
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("ci profile: a smoke test; these numbers mean nothing about GCBS\n")
    # no test metric and no per-item outputs: a Δ, no verdict (tests/test_verdict.py)
    assert (
        "| toy | score | — | 3.5 ± 0.71 (n=2) | gcbs | 4.5 ± 0.71 (n=2) | +1 [+1, +1] | — | — | — "
        "| — | — | — | — | planted | none | ci |"
    ) in table
    toy, other = table.split("## toy\n")[1].split("## other\n")  # one table per experiment
    # the same table as CSV, numbers unrounded
    (toy_row,) = [
        r for r in csv.DictReader(open(tmp_path / "results.csv")) if r["experiment"] == "toy"
    ]
    assert (toy_row["arm"], toy_row["random_mean"], toy_row["arm_mean"]) == ("gcbs", "3.5", "4.5")
    assert (float(toy_row["delta"]), float(toy_row["high"]), toy_row["arm_n"]) == (1.0, 1.0, "2")
    assert (
        "| toy |" in toy
        and "| other |" not in toy
        and "| other |" in other
        and "| toy |" not in other
    )
    assert RESULTS_DIR_VARIABLE not in os.environ


def test_fail_fast_stops_at_the_first_failing_notebook(
    toy_notebooks, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(reproduce, "NOTEBOOKS", toy_notebooks)
    status, _, err = run(capsys, "--output-dir", tmp_path, "--fail-fast")
    assert status == 1 and "FAILED 01_fail" in err and not (tmp_path / "02_plot.ipynb").exists()


def test_a_notebook_trains_inside_the_run_folder_unless_output_dir_is_given(
    toy_notebooks, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(reproduce, "NOTEBOOKS", toy_notebooks)
    assert run(capsys, "--prepare-only", "--output-dir", tmp_path / "a")[0] == 0
    work = (tmp_path / "a").resolve() / "work"
    # absolute
    assert injected(tmp_path / "a" / "02_plot.ipynb")["output_dir"] == str(work / "02_plot")
    # it has no such parameter
    assert "output_dir" not in injected(tmp_path / "a" / "01_fail.ipynb")
    assert (
        run(capsys, "--prepare-only", "-p", "output_dir", "mine", "--output-dir", tmp_path / "b")[0]
        == 0
    )
    assert injected(tmp_path / "b" / "02_plot.ipynb")["output_dir"] == "mine"


@pytest.mark.parametrize(
    "mistake",
    [
        ("-p", "no_such_parameter", "1"),
        ("-p", "seeds", "0"),
        ("--only", "99"),
        ("--profile", "nightly"),
        ("--nproc", "0"),
        ("--output-dir", "a-file"),
    ],
    ids=" ".join,
)
def test_a_usage_mistake_prints_an_error_without_a_traceback_exits_2_and_writes_nothing(
    mistake, tmp_path, capsys
):
    (tmp_path / "a-file").write_text("")
    status, out, err = run(
        capsys,
        "--output-dir",
        tmp_path / "out",
        *(str(tmp_path / a) if a == "a-file" else a for a in mistake),
    )
    assert status == 2 and "Traceback" not in out + err and not (tmp_path / "out").exists()
    assert re.search(r"^python -m gcbs_lib.reproduce: error: \S", err, re.MULTILINE)
    if mistake[0] == "--output-dir":
        assert f"{tmp_path / 'a-file'} is a file" in err


def test_seeds_run_in_separate_invocations_add_up_only_at_the_same_commit_and_settings(
    toy_notebooks, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(reproduce, "NOTEBOOKS", toy_notebooks)
    monkeypatch.setattr(reproduce, "current_commit", lambda: "abc1234")
    executed = reproduce.execute
    # 10 s a notebook
    monkeypatch.setattr(reproduce, "execute", lambda *args: {**executed(*args), "seconds": 10.0})

    def invocation(*args, status=0):
        assert run(capsys, "--output-dir", tmp_path, *args)[0] == status
        rows = read_rows(tmp_path / "results" / "02_plot.json")
        record = json.loads((tmp_path / "run.json").read_text())
        return (
            sorted({r["seed"] for r in rows}),
            len(rows),
            record["notebooks"]["02_plot"]["seconds"],
            record,
        )

    first = invocation("--only", "02", "-p", "seeds", "[0, 1]")[3]
    seeds, n_rows, seconds, second = invocation("--only", "02", "-p", "seeds", "[2]")
    assert (seeds, n_rows, seconds) == ([0, 1, 2], 12, 20.0) and "(n=3)" in (
        tmp_path / "results.md"
    ).read_text()
    assert (
        second["command"]
        == f"{first['command']} && python -m gcbs_lib.reproduce --output-dir {tmp_path} "
        "--only 02 -p seeds '[2]'"
    )
    assert invocation("--only", "01", "02", "--fail-fast", "-p", "seeds", "[3]", status=1)[:3] == (
        [0, 1, 2],
        12,
        20.0,
    )
    # a stop lost no rows
    assert invocation("--only", "02", "-p", "seeds", "[3]")[:3] == ([0, 1, 2, 3], 16, 30.0)
    # other settings
    assert invocation("--only", "02", "-p", "seeds", "[4]", "-p", "n", "4")[:3] == ([4], 4, 10.0)
    # code that no commit pins: never pooled, not even with itself
    for commit in ("abc1234+dirty", "unknown"):
        monkeypatch.setattr(reproduce, "current_commit", lambda commit=commit: commit)
        for seed in (5, 6):
            assert invocation("--only", "02", "-p", "seeds", f"[{seed}]", "-p", "n", "4")[:3] == (
                [seed],
                4,
                10.0,
            )
