"""Run the notebooks headlessly with papermill in one profile, and merge what they measured into one table.

    python -m gcbs_lib.reproduce [--profile ci|cpu|paper] [--only NN ...] [-p NAME VALUE ...]
                                 [--nproc N] [--backend gloo|nccl] [--output-dir DIR] [--fail-fast] [--jobs N]

A profile is one parameter file per notebook, `notebooks/params/NN_topic.<profile>.yaml`, holding what differs
from the notebook's defaults (`ci` is the defaults themselves; a notebook without a file runs its defaults).
Every notebook with a `profile` parameter is told the profile's name. `-p NAME VALUE` values are YAML literals
(`-p memory_batch_sizes "[16, 64]"` arrives as a list), checked against the type of the notebook's default and
passed to every notebook that has NAME; `--nproc`/`--backend` go to the notebooks that launch ranks (those with
such parameters). Names no selected notebook has are refused before anything runs: papermill would only warn.

DIR (default `runs/<timestamp>/`) receives:
  NN_topic.ipynb            each executed notebook (a failing one keeps papermill's error cell)
  figures/                  every image output as PNG: <notebook>_in<execution count>[_<k>].png
  results/                  the rows each notebook `record`s (the runner points GCBS_RESULTS_DIR here)
  results.md, results.csv   the paper-vs-kit table of those rows (`gcbs_lib.results.build_table`)
  run.json                  command, commit, profile, parameters, status and seconds per notebook
(a DIR used before keeps its other files; the runner's own outputs above are replaced.)
A failing notebook makes the exit status 1 and is named with its failing cell; the others still run unless
`--fail-fast`. `--jobs N` runs N notebooks at once (each in its own kernel), with N × fewer threads each.
"""
from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import papermill
import yaml
from papermill.exceptions import PapermillExecutionError
from tqdm.auto import tqdm

from gcbs_lib.results import (REPOSITORY, RESULTS_DIR_VARIABLE, build_table, read_rows, to_markdown,
                              write_csv)

PROFILES = ("ci", "cpu", "paper")
NOTEBOOKS = REPOSITORY / "notebooks"
RUNNER_OUTPUTS = ("figures", "results", "results.md", "results.csv", "run.json")


class UsageError(Exception):
    """The command cannot run as given (unknown notebook or parameter, wrong type): nothing was executed."""


@dataclass(frozen=True)
class Notebook:
    path: Path
    defaults: dict  # parameter name -> default value of the `parameters` cell

    @property
    def name(self) -> str:
        return self.path.stem

    @classmethod
    def read(cls, path: Path) -> Notebook:
        """The names and literal values assigned in the notebook's cell tagged `parameters`."""
        cells = nbformat.read(path, as_version=4).cells
        cell = next((c for c in cells if "parameters" in c.metadata.get("tags", [])), None)
        try:
            statements = ast.parse(cell.source).body if cell is not None else []
        except SyntaxError as error:
            raise UsageError(f"{path.name}: its parameters cell is not plain Python: {error}") from None
        defaults = {}
        for statement in statements:
            for target in statement.targets if isinstance(statement, ast.Assign) else []:
                try:
                    defaults[target.id] = ast.literal_eval(statement.value)
                except ValueError:
                    defaults[target.id] = None  # not a literal: accept any value
        return cls(path, defaults)


@dataclass
class Outcome:
    status: str = "not run"  # "ok", "prepared", "failed" or "not run"
    seconds: float = 0.0
    error: str = ""
    figures: list[str] = field(default_factory=list)


def discover(folder: Path, only: list[str] | None) -> list[Notebook]:
    """The notebooks `NN_topic.ipynb` of `folder` in order, or those `only` names (by number or name)."""
    paths = sorted(folder.glob("[0-9]*.ipynb"))
    if not paths:
        raise UsageError(f"no notebooks NN_topic.ipynb in {folder}")
    if only:
        def picked(path: Path, token: str) -> bool:
            token = token.removesuffix(".ipynb")
            number = path.stem.split("_")[0]
            return token in (path.stem, number) or (token.isdigit() and int(token) == int(number))

        unknown = [t for t in only if not any(picked(p, t) for p in paths)]
        if unknown:
            raise UsageError(f"--only {' '.join(unknown)}: no such notebook; there are "
                             f"{', '.join(p.stem for p in paths)}")
        paths = [p for p in paths if any(picked(p, t) for t in only)]
    return [Notebook.read(p) for p in paths]


def coerce(value, raw: str | None, default, where: str):
    """`value` checked against the type of `default` (a float accepts an int; a string takes the raw text)."""
    if default is None:
        return value
    if isinstance(default, str) and raw is not None and not isinstance(value, (str, list, dict)):
        return raw  # `-p data_root 2024` means the text "2024"
    if isinstance(default, bool) or not isinstance(default, (int, float, list, tuple)):
        ok = isinstance(value, type(default))
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))
        if ok and default:
            value = [coerce(v, None, default[0], f"{where}, element {v!r}") for v in value]
    else:  # int or float
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (isinstance(default, float) or isinstance(value, int))
        value = float(value) if ok and isinstance(default, float) else value
    if not ok:
        raise UsageError(f"{where}: {value!r} ({type(value).__name__}) does not match the type of the default "
                         f"{default!r} ({type(default).__name__})")
    return value


def _valid_parameters(notebooks: list[Notebook]) -> str:
    return "\n".join(f"  {nb.name}: {', '.join(nb.defaults)}" for nb in notebooks)


def plan(notebooks: list[Notebook], profile: str, overrides: list[tuple[str, object, str | None, str]],
         params_dir: Path) -> dict[str, dict]:
    """Each notebook's papermill parameters: its profile file, then the overrides (name, value, raw text, flag)
    it has. Raises UsageError, before anything runs, on a name no selected notebook has or a wrong type."""
    unknown = sorted({name for name, _, _, _ in overrides if not any(name in nb.defaults for nb in notebooks)})
    if unknown:
        flags = sorted({flag for name, _, _, flag in overrides if name in unknown})
        raise UsageError(f"{' '.join(flags)}: no selected notebook has a parameter named "
                         f"{', '.join(map(repr, unknown))}; nothing was run. Valid parameters:\n"
                         f"{_valid_parameters(notebooks)}")
    plans = {}
    for nb in notebooks:
        parameters = {"profile": profile} if "profile" in nb.defaults else {}
        profile_file = params_dir / f"{nb.name}.{profile}.yaml"
        if profile_file.exists():
            values = yaml.safe_load(profile_file.read_text()) or {}
            if not isinstance(values, dict) or set(values) - set(nb.defaults):
                extra = sorted(set(values) - set(nb.defaults)) if isinstance(values, dict) else values
                raise UsageError(f"{profile_file}: {extra!r} are not parameters of {nb.name}; it has "
                                 f"{', '.join(nb.defaults)}")
            if values.get("profile", profile) != profile:
                raise UsageError(f"{profile_file} sets profile {values['profile']!r}, not {profile!r}")
            parameters |= {k: coerce(v, None, nb.defaults[k], f"{profile_file} {k}") for k, v in values.items()}
        for name, value, raw, flag in overrides:
            if name in nb.defaults:
                parameters[name] = coerce(value, raw, nb.defaults[name], f"{flag} for {nb.name}")
        plans[nb.name] = parameters
    return plans


def parse_overrides(args: argparse.Namespace) -> list[tuple[str, object, str | None, str]]:
    """`-p NAME VALUE` pairs with VALUE read as a YAML literal, then --nproc and --backend."""
    overrides = []
    for name, raw in args.parameter or []:
        try:
            overrides.append((name, yaml.safe_load(raw), raw, f"-p {name}"))
        except yaml.YAMLError as error:
            raise UsageError(f"-p {name} {raw!r} is not a YAML literal: {error}") from None
    if args.nproc is not None:
        overrides.append(("nproc", args.nproc, None, "--nproc"))
    if args.backend is not None:
        overrides.append(("backend", args.backend, None, "--backend"))
    return overrides


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def describe_failure(error: PapermillExecutionError) -> str:
    """'cell In [7], line 3: `x = 1 / 0`' and the exception, from papermill's error."""
    trace = _ANSI.sub("", "\n".join(error.traceback))
    where = f"cell In [{error.exec_count}]"
    lines = (error.source or "").splitlines()
    found = re.search(r"Cell In\s*\[\d+\], line (\d+)", trace)
    if found and 0 < int(found[1]) <= len(lines):
        where += f", line {found[1]}: `{lines[int(found[1]) - 1].strip()}`"
    elif lines:
        where += f" (starts `{lines[0].strip()}`)"
    return f"{where}\n    {error.ename}: {error.evalue}"


def save_figures(executed: Path, folder: Path) -> list[str]:
    """Write every image/png output of an executed notebook as `<notebook>_in<count>[_<k>].png`."""
    saved = []
    for index, cell in enumerate(nbformat.read(executed, as_version=4).cells):
        images = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        count = cell.get("execution_count")
        stem = f"{executed.stem}_in{count}" if count else f"{executed.stem}_cell{index}"
        for k, image in enumerate(images):
            path = folder / (f"{stem}.png" if len(images) == 1 else f"{stem}_{k + 1}.png")
            folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.b64decode(image))
            saved.append(path.name)
    return saved


def execute(nb: Notebook, parameters: dict, out: Path, position: int, prepare_only: bool) -> Outcome:
    """Run one notebook into `out` with papermill (kernel python3, cwd = the notebook's folder)."""
    executed = out / nb.path.name
    start = time.monotonic()
    outcome = Outcome(status="prepared" if prepare_only else "ok")
    try:
        papermill.execute_notebook(str(nb.path), str(executed), parameters=parameters, kernel_name="python3",
                                   cwd=str(nb.path.parent), prepare_only=prepare_only,
                                   progress_bar={"desc": nb.name, "position": position, "leave": False})
    except PapermillExecutionError as error:
        outcome.status, outcome.error = "failed", describe_failure(error)
    except Exception as error:  # the kernel died, would not start, ...: report it and go on with the others
        outcome.status, outcome.error = "failed", f"{type(error).__name__}: {error}"
    outcome.seconds = round(time.monotonic() - start, 1)
    if executed.exists() and not prepare_only:
        outcome.figures = save_figures(executed, out / "figures")
    return outcome


def current_commit() -> str:
    """The short HEAD commit, with "+dirty" when tracked files differ from it; "unknown" outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables (inherited by the kernels) for the duration, then restore them."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_all(notebooks: list[Notebook], plans: dict[str, dict], out: Path, jobs: int, fail_fast: bool,
            prepare_only: bool) -> dict[str, Outcome]:
    """Execute the notebooks, `jobs` at a time, with a progress bar over them."""
    outcomes = {nb.name: Outcome() for nb in notebooks}
    bar = tqdm(total=len(notebooks), desc="notebooks", unit="notebook", position=0)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        slots = list(range(1, jobs + 1))
        pending = {}

        def submit(nb: Notebook) -> None:
            slot = slots.pop(0)
            pending[pool.submit(execute, nb, plans[nb.name], out, slot, prepare_only)] = (nb, slot)

        queue = list(notebooks)
        while queue and slots:
            submit(queue.pop(0))
        while pending:
            future = next(as_completed(pending))
            nb, slot = pending.pop(future)
            slots.append(slot)
            outcomes[nb.name] = outcome = future.result()
            bar.update()
            tqdm.write(f"{outcome.status:>8}  {nb.name}  {outcome.seconds:.0f} s" +
                       (f"\n          {outcome.error}" if outcome.error else ""))
            if outcome.status == "failed" and fail_fast:
                queue.clear()
            if queue:
                submit(queue.pop(0))
    bar.close()
    return outcomes


def write_report(out: Path, run: dict, outcomes: dict[str, Outcome]) -> tuple[int, list[str]]:
    """Merge the recorded rows into results.md / results.csv; returns the number of rows and unreadable files."""
    rows, unreadable = [], []
    for path in sorted((out / "results").glob("*.json")):
        try:
            rows += read_rows(path)
        except (ValueError, OSError) as error:
            unreadable.append(f"{path.name}: {error}")
    lines = build_table([(rows, run["commit"])])
    write_csv(out / "results.csv", lines)
    notebooks = "\n".join(f"| {name} | {o.status} | {o.seconds:.0f} | {len(o.figures)} | "
                          f"{o.error.splitlines()[0] if o.error else ''} |" for name, o in outcomes.items())
    text = (f"# Results of `{run['command']}`\n\nProfile `{run['profile']}`, commit {run['commit']}, started "
            f"{run['started']}, {run['cores']} cores (load average {run['load_average']} at the start), {run['jobs']} "
            f"notebook(s) at a time.\n\n"
            + (to_markdown(lines) if lines else "No notebook recorded result rows.\n")
            + "".join(f"\nUnreadable results file (skipped): {u}\n" for u in unreadable)
            + "\n| notebook | status | seconds | figures | error |\n|---|---|---|---|---|\n" + notebooks + "\n")
    (out / "results.md").write_text(text)
    return len(rows), unreadable


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gcbs_lib.reproduce", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[4:]))
    parser.add_argument("--profile", choices=PROFILES, default="ci", help="parameter profile (default: ci)")
    parser.add_argument("--only", nargs="+", metavar="NN", help="run only these notebooks (number or name)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                        help="set a parameter (a YAML literal) in every notebook that has it")
    parser.add_argument("--nproc", type=int, help="ranks for the notebooks that launch them (parameter nproc)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="process-group backend (parameter backend)")
    parser.add_argument("--output-dir", type=Path, help="where to write (default: runs/<timestamp>/)")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failing notebook")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1: timings undisturbed)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="write the notebooks with their parameters injected, without executing them")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help=argparse.SUPPRESS)  # tests
    args = parser.parse_args(argv)
    if args.jobs < 1 or (args.nproc is not None and args.nproc < 1):
        parser.error("--jobs and --nproc must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m gcbs_lib.reproduce " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        notebooks = discover(args.notebooks, args.only)
        plans = plan(notebooks, args.profile, parse_overrides(args), args.notebooks / "params")
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = args.output_dir or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    for stale in RUNNER_OUTPUTS:  # one folder holds one run
        path = out / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    cores = os.cpu_count() or 1
    run = {"command": command, "commit": current_commit(), "profile": args.profile, "cores": cores,
           "load_average": round(os.getloadavg()[0], 1),  # other work on the machine slows what notebooks time
           "jobs": args.jobs, "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    threads = {} if args.jobs == 1 or "OMP_NUM_THREADS" in os.environ else {
        "OMP_NUM_THREADS": str(max(1, cores // args.jobs))}
    print(f"{len(notebooks)} notebook(s), profile {args.profile}, into {out}/")
    start = time.monotonic()
    with environment(**{RESULTS_DIR_VARIABLE: str((out / "results").resolve())}, **threads):
        outcomes = run_all(notebooks, plans, out, args.jobs, args.fail_fast, args.prepare_only)
    wall = time.monotonic() - start
    run["seconds"] = round(wall, 1)
    run["notebooks"] = {name: {"status": o.status, "seconds": o.seconds, "parameters": plans[name],
                               "error": o.error, "figures": o.figures} for name, o in outcomes.items()}
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    n_rows, unreadable = write_report(out, run, outcomes)
    busy = sum(o.seconds for o in outcomes.values())
    print(f"{wall:.0f} s wall" + (f" for {busy:.0f} s of notebook time ({busy - wall:.0f} s saved by --jobs "
                                  f"{args.jobs})" if args.jobs > 1 else "") +
          f"; {n_rows} result rows and {sum(len(o.figures) for o in outcomes.values())} figures in {out}/")
    for u in unreadable:
        print(f"unreadable results file (skipped): {u}", file=sys.stderr)
    failed = {n: o for n, o in outcomes.items() if o.status in ("failed", "not run")}
    for name, o in failed.items():
        print(f"FAILED {name}: {o.error}\n    executed notebook: {out / (name + '.ipynb')}" if o.error
              else f"NOT RUN {name} (--fail-fast)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
