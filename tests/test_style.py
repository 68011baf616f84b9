"""The code's layout and size: a formatter and a linter own the layout (`make lint`), and what no
rule of theirs says is checked here on the syntax tree; the package stays within its line budget."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["gcbs_lib", "tests", "bench", "tools", "data_scripts", "notebooks"]
CORE = ["gradcache", "losses", "gcbs", "mining", "distributed", "seeding"]
CORE_BUDGET = 1100
PACKAGE_BUDGET = 5000


def python_files():
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def package_lines(names=None):
    """Lines of gcbs_lib's files (as `ruff format` lays them out: `make lint` holds them so)."""
    files = sorted((ROOT / "gcbs_lib").rglob("*.py"))
    if names is not None:
        files = [ROOT / "gcbs_lib" / f"{name}.py" for name in names]
    return sum(len(path.read_text().splitlines()) for path in files)


def plainness_faults(source: str) -> list[str]:
    """Line-numbered faults in code that a formatter cannot see: assignment expressions inside calls
    or comprehension filters, and conditional expressions nested in one another."""
    faults = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            inside = [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, ast.comprehension):
            inside = node.ifs
        elif isinstance(node, ast.IfExp):
            for part in (node.body, node.orelse, node.test):
                if any(isinstance(n, ast.IfExp) for n in ast.walk(part)):
                    faults.append(f"line {node.lineno}: a nested conditional expression")
            continue
        else:
            continue
        for part in inside:
            for n in ast.walk(part):
                if isinstance(n, ast.NamedExpr):
                    faults.append(
                        f"line {n.lineno}: an assignment expression inside a call or filter"
                    )
    return sorted(faults, key=lambda fault: int(fault.split()[1].rstrip(":")))


def test_plainness_faults_are_found_where_they_are():
    assert plainness_faults(
        "f(n := 3)\n[x for x in y if (z := x)]\nv = a if b else (c if d else e)\n"
    ) == [
        "line 1: an assignment expression inside a call or filter",
        "line 2: an assignment expression inside a call or filter",
        "line 3: a nested conditional expression",
    ]
    assert plainness_faults("if (n := len(x)) > 2:\n    v = a if b else c\n") == []


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_is_plain(path):
    assert plainness_faults(path.read_text()) == []


def test_the_core_and_the_package_stay_within_their_line_budgets():
    assert package_lines(CORE) <= CORE_BUDGET
    assert package_lines() <= PACKAGE_BUDGET


def test_every_public_function_of_the_core_is_shown_in_a_notebook():
    notebooks = "\n".join(p.read_text() for p in (ROOT / "notebooks").glob("[0-9]*.py"))
    for name in CORE:
        tree = ast.parse((ROOT / "gcbs_lib" / f"{name}.py").read_text())
        public = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        for function in (f for f in public if not f.startswith("_")):
            assert re.search(rf"\b{function}\b", notebooks), f"{name}.{function} is in no notebook"


def test_the_formatter_and_linter_run_in_make_test():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\blint\b", makefile, re.MULTILINE)
    lint = subprocess.run(["make", "-n", "lint"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "ruff format --check" in lint and "ruff check" in lint
