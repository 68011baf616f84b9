"""The README and docs/ as a reader meets them: a front page short enough to read, paragraphs
short enough to scan, links that lead somewhere, an example that runs, and no name of a flag, config
key or function that the code does not have.

The names are read from the pages' code spans and `bash` blocks: `--flags` of the runner, trainer
and results commands, config keys (`key=value`, `--set KEY=VALUE`, the keys of `-p overrides`),
`gcbs_lib.…` dotted names with the arguments they are shown called with, `make` targets, files of
the repository's code folders, and bare snake_case names, which must be defined in `gcbs_lib`, be a
config key, a notebook parameter or a committed metric.
"""

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import re
from pathlib import Path

import pytest
import scipy.sparse.csgraph
import torch
from torch.nn.parallel import DistributedDataParallel

from gcbs_lib import experiments, reproduce, results, train
from gcbs_lib.rows import DIAGNOSTICS, read_rows

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# a generated record of past measurements, each section naming the commit it measured
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOCUMENTED = [page for page in PAGES if page != BENCHMARKS]
COMMANDS = {"gcbs_lib.train": train, "gcbs_lib.reproduce": reproduce, "gcbs_lib.results": results}
# folders whose files the pages name as they are (docs/ also names files a command will write)
CODE_FOLDERS = ("bench", "data_scripts", "gcbs_lib", "notebooks", "results", "tests", "tools")
# names of other libraries the docs cite, where they live
ELSEWHERE = {"no_sync": DistributedDataParallel, "reverse_cuthill_mckee": scipy.sparse.csgraph}


def prose(text: str) -> str:
    """`text` without its fenced code blocks and HTML comments."""
    return re.sub(r"```.*?```|<!--.*?-->", "", text, flags=re.S)


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a markdown text: blocks between blank lines without tables and
    headings, each list item a paragraph of its own."""
    found = []
    for block in re.split(r"\n\s*\n", prose(text)):
        lines = [line for line in block.splitlines() if not line.lstrip().startswith(("|", "#"))]
        items = re.split(r"\n(?=\s*(?:[-*]|\d+\.) )", "\n".join(lines))
        found += [item for item in items if item.strip()]
    return found


def spans(page: Path) -> list[str]:
    """The code spans of a page's prose and the lines of its `bash` blocks."""
    text = page.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    return re.findall(r"`([^`\n]+)`", prose(text)) + lines


def options(module) -> set[str]:
    """The long options a command's `--help` lists."""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        module.main(["--help"])
    return set(re.findall(r"--[a-z][a-z-]*", shown.getvalue()))


def config_keys() -> set[str]:
    """Every `TrainConfig` field and every experiment's `Options` field."""
    kinds = [train.TrainConfig, *(experiments.get(e).Options for e in experiments.available())]
    return {field.name for kind in kinds for field in dataclasses.fields(kind)}


def package_names() -> set[str]:
    """Every name `gcbs_lib` defines: its modules, functions, classes, their arguments, assigned
    names and attributes."""
    names = {"gcbs_lib"}
    for path in (ROOT / "gcbs_lib").rglob("*.py"):
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def notebook_parameters() -> set[str]:
    """The names in every notebook's `parameters` cell."""
    names = set()
    for notebook in (ROOT / "notebooks").glob("[0-9]*.py"):
        cell = notebook.read_text().split('# %% tags=["parameters"]')[1].split("# %%")[0]
        names |= {t.id for node in ast.parse(cell).body for t in getattr(node, "targets", [])}
    return names


def metrics() -> set[str]:
    """The metrics of the committed rows, without their `@epoch<N>`, and the per-epoch diagnostics
    a run writes."""
    rows = [row for f in (ROOT / "results").glob("*.*.json") for row in read_rows(f)]
    return {row["metric"].split("@")[0] for row in rows} | set(DIAGNOSTICS)


def resolved(dotted: str):
    """The object a `gcbs_lib.…` dotted name names: the longest importable module, then
    attributes; AttributeError or ImportError where there is none."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        with contextlib.suppress(ImportError):
            found = importlib.import_module(".".join(parts[:end]))
            for attribute in parts[end:]:
                found = getattr(found, attribute)
            return found
    raise ImportError(dotted)


def unknown_names(span: str, known: dict) -> list[str]:
    """The flags, config keys and names in one code span or command line that the code lacks."""
    missing = []
    command = re.search(r"-m (gcbs_lib\.\w+)(.*)", span)
    if command and command[1] in COMMANDS:
        flags = set(re.findall(r"(?<!\S)--[a-z][a-z-]*", command[2]))
        missing += sorted(flags - known["options"][command[1]])
    elif span.startswith("--"):
        flags = set(re.findall(r"(?<!\S)--[a-z][a-z-]*", span))
        missing += sorted(flags - set().union(*known["options"].values()))
    keys = re.findall(r"--set ([a-z_]\w*)=", span) + re.findall(r'"(\w+)": ', span)
    if re.fullmatch(r"[a-z_]\w*=[^=\s]\S*", span):
        keys.append(span.split("=")[0])
    missing += [key for key in keys if key not in known["config"]]
    for dotted, arguments in re.findall(r"\b(gcbs_lib(?:\.\w+)+)(?:\(([^)]*)\))?", span):
        try:
            named = resolved(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
            continue
        words = re.findall(r"(?:^|,)\s*([a-z_]\w*)", arguments)
        missing += [w for w in words if w not in inspect.signature(named).parameters]
    if re.fullmatch(r"_?[a-z][a-z0-9]*(_[a-z0-9]+)+", span) and span not in known["names"]:
        missing.append(span)
    target = re.match(r"make ([a-z][\w-]*)(?!\S)", span)
    if target and target[1] not in known["targets"]:
        missing.append(f"make {target[1]}")
    # a path with a <placeholder> names a pattern, not a file
    paths = re.findall(rf"(?<![\w/.])(?:{'|'.join(CODE_FOLDERS)})/[^\s`]*", span)
    missing += [p for p in paths if "<" not in p and not any(ROOT.glob(p.rstrip("/")))]
    return missing


@pytest.fixture(scope="module")
def known():
    names = package_names() | config_keys() | notebook_parameters() | metrics()
    assert all(hasattr(where, name) for name, where in ELSEWHERE.items())
    return {
        "options": {name: options(module) for name, module in COMMANDS.items()},
        "config": config_keys(),
        "names": names | set(ELSEWHERE),
        "targets": set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M)),
    }


def test_the_readme_is_a_front_page_of_at_most_1500_words():
    assert len(prose(README.read_text()).split()) <= 1500


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_paragraph_is_over_150_words(page):
    lengths = [len(paragraph.split()) for paragraph in paragraphs(page.read_text())]
    assert lengths and max(lengths) <= 150


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_to_a_file_of_the_repository_leads_to_it_and_its_heading(page):
    for target, anchor in re.findall(r"\]\(([^):#]*)(?:#([^)]*))?\)", page.read_text()):
        linked = (page.parent / target).resolve() if target else page
        assert linked.is_file(), f"{page.name} links to {target}, which is not there"
        headings = re.findall(r"^#+ (.*)$", prose(linked.read_text()), flags=re.M)
        assert not anchor or anchor in map(slug, headings), f"{page.name}: no heading #{anchor}"


@pytest.mark.parametrize("page", DOCUMENTED, ids=lambda page: page.name)
def test_every_flag_config_key_and_function_the_page_names_exists(page, known):
    missing = [name for span in spans(page) for name in unknown_names(span, known)]
    assert not missing, f"{page.name} names what the code does not have: {missing}"


@pytest.mark.parametrize(
    "stale",
    [
        "`plan_sample`",
        "`--plan-sample`",
        "`--set plan_sample=100`",
        "`plan_sample=100`",
        "`torch==2.13.0` `plan_sample`",
        "`gcbs_lib.gcbs.gcbs_batches`",
        "`gcbs_lib.launcher.launch(target, workers=2)`",
        "`python -m gcbs_lib.results readme --readme README.md`",
        """`-p overrides '{"plan_sample": 100}'`""",
        "`make plan`",
        "`python gcbs_lib/ddp_experiments.py`",
        "`notebooks/params/*.gpu.yaml`",
    ],
)
def test_a_stale_name_fails_the_check(stale, known, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"A sentence that names {stale} in passing.\n")
    assert [name for span in spans(page) for name in unknown_names(span, known)]


def test_the_readme_example_gives_the_full_batch_gradients():
    example = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.S)[1]
    run = {}
    exec(example, run)
    cached = run["encoder"].weight.grad.clone()
    run["encoder"].zero_grad()
    loss = run["info_nce"](run["encoder"](run["queries"]), run["encoder"](run["documents"]))
    loss.backward()
    torch.testing.assert_close(cached, run["encoder"].weight.grad)
