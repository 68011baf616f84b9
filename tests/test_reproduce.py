"""The papermill runner: parameters checked before anything runs, failures named, rows and figures collected."""
import ast
import json
import os
import re

import jupytext
import nbformat
import papermill
import pytest
import yaml

from gcbs_lib import reproduce
from gcbs_lib.reproduce import UsageError, coerce, discover
from gcbs_lib.results import RESULTS_DIR_VARIABLE, read_rows

NOTEBOOKS = reproduce.NOTEBOOKS
HEADER = ("# ---\n# jupyter:\n#   kernelspec:\n#     display_name: Python 3\n#     language: python\n"
          "#     name: python3\n# ---\n")
FAILING = HEADER + """
# %% tags=["parameters"]
n = 3
profile = "ci"

# %%
x = 1
y = x / (n - 3)
"""
PLOTTING = HEADER + """
# %% tags=["parameters"]
n = 3
profile = "ci"

# %%
import matplotlib.pyplot as plt
from gcbs_lib.results import record, result_row
plt.plot([0, n]); plt.show()
rows = [result_row(experiment="toy", arm=arm, seed=seed, metric="score", value=n + seed + (arm == "gcbs"),
                   profile=profile, data="planted", model="none") for arm in ("random", "gcbs") for seed in (0, 1)]
record(rows, "02_plot")
"""


@pytest.fixture(scope="module")
def toy_notebooks(tmp_path_factory):
    """01_fail (divides by zero in its second cell) and 02_plot (one figure, four result rows)."""
    folder = tmp_path_factory.mktemp("notebooks")
    for name, text in (("01_fail", FAILING), ("02_plot", PLOTTING)):
        nbformat.write(jupytext.reads(text, fmt="py:percent"), folder / f"{name}.ipynb")
    return folder


def run(capsys, *args):
    status = reproduce.main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def injected(notebook_path):
    cell = next(c for c in nbformat.read(notebook_path, as_version=4).cells
                if "injected-parameters" in c.metadata.get("tags", []))
    tree = ast.parse(cell.source)
    return {s.targets[0].id: ast.literal_eval(s.value) for s in tree.body}


def test_every_notebook_gets_its_profile_file_the_overrides_it_has_and_ranks_if_it_launches_them(tmp_path, capsys):
    status, out, _ = run(capsys, "--profile", "cpu", "--prepare-only", "-p", "seed", "7", "--nproc", "3",
                         "--backend", "gloo", "--output-dir", tmp_path)
    assert status == 0
    for notebook in sorted(NOTEBOOKS.glob("[0-9]*.ipynb")):
        defaults = papermill.inspect_notebook(str(notebook))
        profile_file = NOTEBOOKS / "params" / f"{notebook.stem}.cpu.yaml"
        expected = {"profile": "cpu", **(yaml.safe_load(profile_file.read_text()) if profile_file.exists() else {}),
                    "seed": 7}
        expected |= {k: v for k, v in (("nproc", 3), ("backend", "gloo")) if k in defaults}
        assert injected(tmp_path / notebook.name) == expected, notebook.name
    assert json.loads((tmp_path / "run.json").read_text())["profile"] == "cpu"


def test_an_unknown_parameter_is_refused_before_anything_runs_naming_the_notebooks_and_their_parameters(
        tmp_path, capsys):
    status, _, err = run(capsys, "-p", "no_such_parameter", "1", "--output-dir", tmp_path / "out")
    assert status == 2 and not (tmp_path / "out").exists()
    assert "'no_such_parameter'" in err and "nothing was run" in err
    listed = dict(line.strip().split(": ", 1) for line in err.splitlines()[1:])
    for notebook in NOTEBOOKS.glob("[0-9]*.ipynb"):
        assert set(papermill.inspect_notebook(str(notebook))) <= set(listed[notebook.stem].split(", "))


def test_values_of_the_wrong_type_and_ranks_for_notebooks_that_launch_none_are_refused(tmp_path, capsys):
    status, _, err = run(capsys, "--only", "01", "-p", "memory_batch_sizes", "16", "--output-dir", tmp_path / "a")
    assert status == 2 and "01_gradcache" in err and "list" in err and not (tmp_path / "a").exists()
    status, _, err = run(capsys, "--only", "01", "--nproc", "4", "--output-dir", tmp_path / "b")
    assert status == 2 and "--nproc" in err and not (tmp_path / "b").exists()


def test_values_are_yaml_literals_checked_against_the_default():
    assert coerce(yaml.safe_load("[16, 64]"), "[16, 64]", [16, 32], "-p") == [16, 64]
    assert coerce(1, "1", 0.5, "-p") == 1.0 and isinstance(coerce(1, "1", 0.5, "-p"), float)
    assert coerce(2024, "2024", "data", "-p") == "2024"  # a string parameter takes the text as written
    assert coerce({"a": 1}, "{a: 1}", None, "-p") == {"a": 1}  # a default of None takes anything
    for value, default in ((True, 1), (0.5, 1), ("16", 16), ([1, "x"], [1]), (16, [16])):
        with pytest.raises(UsageError, match="does not match"):
            coerce(value, None, default, "-p")


def test_only_selects_notebooks_by_number_or_name_and_names_the_ones_there_are():
    assert [nb.name for nb in discover(NOTEBOOKS, ["1", "03_gcbs_sampling"])] == ["01_gradcache", "03_gcbs_sampling"]
    with pytest.raises(UsageError, match="01_gradcache"):
        discover(NOTEBOOKS, ["99"])


def test_a_failing_notebook_exits_non_zero_naming_its_cell_and_the_others_still_run(toy_notebooks, tmp_path,
                                                                                       capsys):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "stale.json").write_text("[]")  # a previous run's rows are not merged
    status, _, err = run(capsys, "--notebooks", toy_notebooks, "--output-dir", tmp_path)
    assert status == 1
    assert re.search(r"FAILED 01_fail: cell In \[3\], line 2: `y = x / \(n - 3\)`\s+ZeroDivisionError", err)
    failed = nbformat.read(tmp_path / "01_fail.ipynb", as_version=4)
    assert any(o.get("ename") == "ZeroDivisionError" for c in failed.cells for o in c.get("outputs", []))
    run_record = json.loads((tmp_path / "run.json").read_text())
    assert {n: r["status"] for n, r in run_record["notebooks"].items()} == {"01_fail": "failed", "02_plot": "ok"}
    assert (tmp_path / "figures" / "02_plot_in3.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["02_plot.json"]
    assert len(read_rows(tmp_path / "results" / "02_plot.json")) == 4
    table = (tmp_path / "results.md").read_text()
    assert "| toy | gcbs | score | — | 4.5 ± 0.71 (n=2) | +1 ± 0 | planted | none | ci |" in table
    assert "| 01_fail | failed |" in table and (tmp_path / "results.csv").read_text().count("\n") == 3
    assert RESULTS_DIR_VARIABLE not in os.environ


def test_fail_fast_stops_at_the_first_failing_notebook(toy_notebooks, tmp_path, capsys):
    status, _, err = run(capsys, "--notebooks", toy_notebooks, "--output-dir", tmp_path, "--fail-fast")
    assert status == 1 and "NOT RUN 02_plot" in err and not (tmp_path / "02_plot.ipynb").exists()


def test_notebooks_run_at_once_with_jobs_give_the_same_rows(toy_notebooks, tmp_path, capsys):
    status, out, _ = run(capsys, "--notebooks", toy_notebooks, "--jobs", "2", "--output-dir", tmp_path)
    assert status == 1 and "saved by --jobs 2" in out
    assert {n: r["status"] for n, r in json.loads((tmp_path / "run.json").read_text())["notebooks"].items()} == {
        "01_fail": "failed", "02_plot": "ok"}
    assert sorted(r["value"] for r in read_rows(tmp_path / "results" / "02_plot.json")) == [3, 4, 4, 5]
