"""Specification of the notebook conventions (the runner's tests execute notebooks with injected parameters)."""
import ast
from pathlib import Path

import jupytext
import nbformat
import papermill
import pytest
import yaml

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SCRIPTS = sorted(NOTEBOOKS.glob("[0-9]*.py"))
COMMON_PARAMETERS = {"device", "seed", "profile"}


def code_cells(script):
    return [cell for cell in jupytext.read(script).cells if cell.cell_type == "code"]


def test_there_are_notebooks():
    assert SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_each_script_is_paired_with_a_notebook_that_keeps_the_python3_kernelspec(script):
    notebook = script.with_suffix(".ipynb")
    assert notebook.exists()
    for metadata in (jupytext.read(script).metadata, nbformat.read(notebook, as_version=4).metadata):
        assert metadata["kernelspec"]["name"] == "python3"
    assert "papermill" not in nbformat.read(notebook, as_version=4).metadata


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_the_first_code_cell_is_tagged_parameters_and_holds_literals_only(script):
    first = code_cells(script)[0]
    assert "parameters" in first.metadata.get("tags", [])
    names = set()
    for statement in ast.parse(first.source).body:
        assert isinstance(statement, ast.Assign), f"not an assignment: {ast.unparse(statement)}"
        ast.literal_eval(statement.value)  # raises if the value is computed
        names |= {target.id for target in statement.targets}
    assert COMMON_PARAMETERS <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_papermill_parses_every_parameter(script):
    first = code_cells(script)[0]
    assigned = {t.id for s in ast.parse(first.source).body for t in s.targets}
    assert set(papermill.inspect_notebook(str(script.with_suffix(".ipynb")))) == assigned


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_notebook_ends_with_asserts_then_one_nbval_checked_summary(script):
    cells = code_cells(script)
    assert "assert " in cells[-2].source
    assert cells[-1].source.startswith("# NBVAL_CHECK_OUTPUT")
    assert sum("NBVAL_CHECK_OUTPUT" in cell.source for cell in cells) == 1


@pytest.mark.parametrize("profile", sorted((NOTEBOOKS / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_profile_files_are_named_for_a_notebook_and_a_runner_profile_and_set_only_its_parameters(profile):
    stem, name, suffix = profile.name.split(".")
    assert name in ("cpu", "paper") and suffix == "yaml"  # ci is the notebook's own defaults
    values = yaml.safe_load(profile.read_text())
    assert values.get("profile", name) == name
    assert set(values) <= set(papermill.inspect_notebook(str(NOTEBOOKS / f"{stem}.ipynb")))
