"""Run the notebooks headlessly with papermill in one profile, and merge what they measured into one
table.

A profile is `notebooks/params/<notebook>.<profile>.yaml` (`ci`: the defaults). `-p NAME VALUE`
(YAML, or the text for a string), `--nproc` and `--backend` go to each notebook with that parameter,
typed like its default; a name none has is refused before anything runs. DIR gets the executed
notebooks, `work/<notebook>` (their `output_dir` unless given), `figures/` (<notebook>_<name> by a
cell tag `figure:<name>`, else <notebook>_in<execution count>), `results/` (the rows notebooks
`record`), `results.md`, `results.csv` and `run.json`. Rerun into DIR at the same clean commit, a
notebook with the same parameters but `seeds` keeps its rows and seconds; other rows go."""

import argparse
import ast
import base64
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import nbformat
import papermill
import yaml

from gcbs_lib import results
from gcbs_lib.check import as_type, require
from gcbs_lib.data import REPOSITORY, read_json, write_atomic
from gcbs_lib.rows import RESULTS_DIR_VARIABLE, current_commit, read_outputs, read_rows

NOTEBOOKS = REPOSITORY / "notebooks"


def discover(folder: Path, only: list[str] | None = None) -> dict[Path, dict]:
    """`{notebook: {parameter: default}}` of `folder`'s `NN_topic.ipynb` (or those `only` names)."""
    paths = sorted(folder.glob("[0-9]*.ipynb"))
    named = {t: [p for p in paths if t.zfill(2) in (p.stem, p.stem[:2])] for t in only or []}
    unknown = [t for t, found in named.items() if not found]
    if unknown or not paths:
        there = ", ".join(p.stem for p in paths)
        raise ValueError(f"no notebook {' '.join(unknown)} in {folder}; there are {there}")
    chosen = [p for p in paths if not only or any(p in found for found in named.values())]
    return {
        p: {k: ast.literal_eval(v["default"]) for k, v in papermill.inspect_notebook(p).items()}
        for p in chosen
    }


def typed(value, default, where: str):
    """`value` if its type is the default's (a float takes an int; a default None, anything)."""
    wrong = f"{where}: {value!r} does not match the type of the default {default!r}"
    return as_type(value, Any if default is None else type(default), wrong)


def plan(notebooks: dict[Path, dict], profile: str, overrides: dict[str, tuple]) -> dict:
    """Each notebook's papermill parameters: the profile's name and file, then the `overrides` it
    has (name -> (YAML value, text, flag)); a name no notebook has or a wrong type: ValueError."""
    unknown = [n for n in overrides if not any(n in values for values in notebooks.values())]
    if unknown:
        valid = "\n".join(f"  {p.stem}: {', '.join(names)}" for p, names in notebooks.items())
        raise ValueError(
            f"{' '.join(overrides[n][2] for n in unknown)}: no selected notebook has a parameter "
            f"named {', '.join(map(repr, unknown))}; nothing was run. Valid parameters:\n{valid}"
        )
    plans = {}
    for path, values in notebooks.items():
        plans[path] = {"profile": profile} if "profile" in values else {}
        profile_file = path.parent / "params" / f"{path.stem}.{profile}.yaml"
        preset = yaml.safe_load(profile_file.read_text()) or {} if profile_file.exists() else {}
        for name, value in preset.items():
            require(name in values, f"{profile_file}: {name!r} is not a parameter of {path.stem}")
            plans[path][name] = typed(value, values[name], f"{profile_file} {name}")
        for name, (value, text, flag) in overrides.items():
            if name in values:  # a string parameter takes the text as written
                value = text if isinstance(values[name], str) else value
                plans[path][name] = typed(value, values[name], f"{flag} for {path.stem}")
    return plans


def save_figures(executed: Path, folder: Path) -> None:
    """Write the executed notebook's PNGs into `folder`, named as the module docstring says."""
    for cell in nbformat.read(executed, as_version=4).cells:
        outputs = [o.get("data", {}) for o in cell.get("outputs", [])]
        images = [data["image/png"] for data in outputs if "image/png" in data]
        tags = cell.metadata.get("tags", [])
        names = [t.removeprefix("figure:") for t in tags if t.startswith("figure:")]
        stem = f"{executed.stem}_{names[0] if names else 'in' + str(cell.get('execution_count'))}"
        for k, image in enumerate(images, 1):
            name = f"{stem}_{k}.png" if len(images) > 1 else f"{stem}.png"
            (folder / name).write_bytes(base64.b64decode(image))


def execute(notebook: Path, parameters: dict, out: Path, prepare_only: bool = False) -> dict:
    """Run one notebook into `out` by papermill (python3, in its folder); what happened."""
    start = time.monotonic()
    executed = out / notebook.name
    outcome = dict(parameters=parameters, status="prepared" if prepare_only else "ok", error="")
    source = nbformat.read(notebook, as_version=4)
    for cell in source.cells:  # without the committed outputs, also in a prepared copy
        cell.update({"outputs": [], "execution_count": None} if cell.cell_type == "code" else {})
    try:
        options = dict(kernel_name="python3", cwd=notebook.parent, prepare_only=prepare_only)
        papermill.execute_notebook(source, executed, parameters=parameters, **options)
    except papermill.PapermillExecutionError as e:
        where = f"cell In [{e.exec_count}] (starts `{e.source.partition(chr(10))[0]}`)"
        outcome.update(status="failed", error=f"{where}: {e.ename}: {e.evalue}")
    except Exception as error:  # the kernel died or would not start: go on with the others
        outcome.update(status="failed", error=f"{type(error).__name__}: {error}")
    if executed.exists() and not prepare_only:
        save_figures(executed, out / "figures")
    return {**outcome, "seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gcbs_lib.reproduce",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--profile", choices=("ci", "cpu", "paper"), default="ci", help="default: ci")
    add("--only", nargs="+", metavar="NN", help="run only these notebooks (number or name)")
    pairs = dict(nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    add("-p", "--parameter", **pairs, help="set a parameter in every notebook that has it")
    add("--nproc", type=int, help="ranks a run, or GPUs for side-by-side runs (parameter nproc)")
    add("--backend", choices=("gloo", "nccl"), help="process-group backend (parameter backend)")
    add("--output-dir", type=Path, help="where to write (default: runs/<timestamp>/)")
    add("--fail-fast", action="store_true", help="stop at the first failing notebook")
    add("--prepare-only", action="store_true", help="inject the parameters, execute nothing")
    args = parser.parse_args(argv)
    out = args.output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if out.exists() and not out.is_dir():
        parser.error(f"--output-dir {out} is a file, not a folder")
    try:
        overrides = {n: (yaml.safe_load(t), t, f"-p {n}") for n, t in args.parameter}
        flags = {"nproc": args.nproc, "backend": args.backend}
        overrides |= {k: (v, v, f"--{k}") for k, v in flags.items() if v}
        notebooks = discover(NOTEBOOKS, args.only)
        plans = plan(notebooks, args.profile, overrides)
    except (ValueError, yaml.YAMLError) as error:  # a usage error: nothing was run
        parser.error(str(error))
    for notebook, parameters in plans.items():  # its training runs stay in this run's folder
        if "output_dir" in notebooks[notebook] and "output_dir" not in overrides:
            parameters["output_dir"] = str((out / "work" / notebook.stem).resolve())
    command = "python -m gcbs_lib.reproduce " + shlex.join(sys.argv[1:] if argv is None else argv)
    commit = current_commit()
    pinned = not args.prepare_only and "+dirty" not in commit and commit != "unknown"
    earlier = read_json(out / "run.json") if pinned and (out / "run.json").exists() else {}
    kept = {}  # notebooks run before with these parameters (seeds may differ)
    for p, parameters in plans.items():
        entry = earlier.get("notebooks", {}).get(p.stem, {})
        ran = earlier.get("commit") == commit and entry.get("status") in ("ok", "failed")
        if ran and {**entry["parameters"], "seeds": None} == {**parameters, "seeds": None}:
            kept[p.stem] = entry
    shutil.rmtree(out / "figures", ignore_errors=True)  # a folder used before
    for stale in out.glob("results/*.json*"):  # rows, and their outputs.jsonl
        if stale.name.split(".")[0] not in kept:
            stale.unlink()
    (out / "figures").mkdir(parents=True)
    run = {
        "command": f"{earlier['command']} && {command}" if kept else command,
        "commit": commit,
        "profile": args.profile,
        "cores": os.cpu_count(),
        "notebooks": dict(kept),  # kept: until each runs again
        "load_average": round(os.getloadavg()[0], 1),  # other work slows what notebooks time
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    # notebooks `record` their rows there
    with mock.patch.dict(os.environ, {RESULTS_DIR_VARIABLE: str((out / "results").resolve())}):
        for notebook, parameters in plans.items():
            done = execute(notebook, parameters, out, args.prepare_only)
            before = kept.get(notebook.stem, {}).get("seconds", 0)
            done["seconds"] = round(done["seconds"] + before, 1)
            run["notebooks"][notebook.stem] = done
            print(f"{done['status']:>8}  {notebook.stem}  {done['seconds']:.0f} s  {done['error']}")
            write_atomic(out / "run.json", json.dumps(run, indent=1) + "\n")
            if args.fail_fast and done["status"] == "failed":
                break
    files = sorted(out.glob("results/*.json"))
    rows = [row for path in files for row in read_rows(path)]
    outputs = [run for path in files for run in read_outputs(path)]
    lines = results.build_table(rows, commit, outputs)
    tables = [
        f"## {name}\n\n{results.to_markdown([line for line in lines if line.experiment == name])}"
        for name in dict.fromkeys(line.experiment for line in lines)  # one table per experiment
    ]
    smoke = "ci profile: a smoke test; these numbers mean nothing about GCBS\n\n"
    heading = f"{smoke if args.profile == 'ci' else ''}# `{run['command']}`\n\nat {commit}\n\n"
    write_atomic(out / "results.md", heading + "\n".join(tables))
    write_atomic(out / "results.csv", results.to_csv(lines))
    failed = {n: r["error"] for n, r in run["notebooks"].items() if r["status"] == "failed"}
    print(f"results.md, results.csv and figures/ in {out}/", file=sys.stderr if failed else None)
    for name, error in failed.items():
        print(f"FAILED {name}: {error}\n    see {out / name}.ipynb", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
