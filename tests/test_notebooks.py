"""Specification of the notebook conventions (CONTRIBUTING.md); the runner's tests execute
notebooks."""

import ast
import re
from pathlib import Path

import jupytext
import nbformat
import papermill
import pytest
import yaml

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SCRIPTS = sorted(NOTEBOOKS.glob("[0-9]*.py"))


def code_cells(script):
    return [cell for cell in jupytext.read(script).cells if cell.cell_type == "code"]


def parameters(script):
    """The names and literal values of the first code cell, which must be tagged `parameters`."""
    first = code_cells(script)[0]
    assert "parameters" in first.metadata.get("tags", [])
    statements = ast.parse(first.source).body
    assert all(isinstance(s, ast.Assign) for s in statements), (
        "the parameters cell holds assignments only"
    )
    # raises if computed
    return {t.id: ast.literal_eval(s.value) for s in statements for t in s.targets}


def test_the_readme_teaches_exactly_the_notebooks_there_are():
    listed = re.findall(r"^\| `(\d\d_\w+)` \|", (NOTEBOOKS.parent / "README.md").read_text(), re.M)
    assert listed == [script.stem for script in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_sections_are_numbered_alike_and_end_with_result_rows_then_checks(script):
    headings = re.findall(r"^# ## (.*)$", script.read_text(), re.M)
    tail = [h for h in headings if h in ("Result rows", "Checks")]
    numbered = headings[: len(headings) - len(tail)]
    assert tail in (["Checks"], ["Result rows", "Checks"])
    assert numbered == [f"{n} · {h.split(' · ', 1)[-1]}" for n, h in enumerate(numbered, 1)]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_each_script_is_paired_with_a_notebook_that_keeps_the_python3_kernelspec(script):
    notebook = nbformat.read(script.with_suffix(".ipynb"), as_version=4)
    assert (
        jupytext.read(script).metadata["kernelspec"]["name"]
        == notebook.metadata["kernelspec"]["name"]
        == "python3"
    )
    assert "papermill" not in notebook.metadata


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_parameters_are_literals_named_alike_across_notebooks(script):
    names = parameters(script)
    assert {"device", "profile"} <= set(names) and ({"seed", "seeds"} & set(names))
    assert isinstance(names.get("seeds", []), list) and "n_seeds" not in names
    assert [name for name in names if name.endswith("profile")] == ["profile"]
    assert set(papermill.inspect_notebook(str(script.with_suffix(".ipynb")))) == set(names)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_notebook_ends_with_asserts_then_one_nbval_checked_summary(script):
    cells = code_cells(script)
    assert "assert " in cells[-2].source
    assert cells[-1].source.startswith("# NBVAL_CHECK_OUTPUT")
    assert sum("NBVAL_CHECK_OUTPUT" in cell.source for cell in cells) == 1


@pytest.mark.parametrize(
    "profile", sorted((NOTEBOOKS / "params").glob("*.yaml")), ids=lambda p: p.name
)
def test_profile_files_are_named_for_a_notebook_and_a_runner_profile_and_set_only_its_parameters(
    profile,
):
    stem, name, suffix = profile.name.split(".")
    assert name in ("cpu", "paper") and suffix == "yaml"  # ci is the notebook's own defaults
    values = yaml.safe_load(profile.read_text())
    assert values.get("profile", name) == name
    assert set(values) <= set(parameters(NOTEBOOKS / f"{stem}.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_plot_cell_is_tagged_with_what_its_figure_shows(script):
    """The runner names a figure `<notebook>_<name>.png` after its cell's tag `figure:<name>`."""
    for cell in code_cells(script):
        if "plt.show()" in cell.source:
            assert any(t.startswith("figure:") for t in cell.metadata.get("tags", [])), (
                cell.source.splitlines()[0]
            )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_committed_outputs_hold_no_paths_of_the_authors_machine(script):
    for cell in nbformat.read(script.with_suffix(".ipynb"), as_version=4).cells:
        for output in cell.get("outputs", []):
            text = (
                output.get("text", "")
                + "".join(
                    str(v) for k, v in output.get("data", {}).items() if k.startswith("text/")
                )
                + "".join(output.get("traceback", []))
            )
            found = [
                p for p in ("/work/", "/home/", "/root/", "/tmp/", "site-packages") if p in text
            ]
            assert not found, f"cell {cell.get('execution_count')} prints {found}: {text[:200]!r}"
