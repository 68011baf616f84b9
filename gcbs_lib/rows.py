"""Result rows: a results file is a JSON list of rows, each one measured number with the keys
`FIELDS`, beside its runs' per-item test outputs in JSON Lines. Training writes them, a notebook run
by the runner `record`s them, and `gcbs_lib.results` builds tables and verdicts from them."""

import json
import math
import os
import subprocess
from operator import itemgetter
from pathlib import Path

from gcbs_lib.check import require
from gcbs_lib.data import REPOSITORY, read_json, write_atomic

FIELDS = ("experiment", "arm", "seed", "metric", "value", "profile", "data", "model")
RESULTS_DIR_VARIABLE = "GCBS_RESULTS_DIR"  # the runner sets it; `record` writes there
# what a run measures each epoch, rows `<name>@epoch<N>` (the last two, of GCBS's graph, where a
# run logs them)
DIAGNOSTICS = tuple(
    "loss_gap same_group_pairs neighbours edges_per_item isolated_share dropped_again".split()
)


def check_row(row: dict) -> dict:
    """`row` with an int seed and a float value; other keys, empty names, NaN or inf: ValueError."""
    if not isinstance(row, dict) or set(row) != set(FIELDS):
        raise ValueError(f"a result row has exactly the keys {list(FIELDS)}, got {row!r}")
    row = {**row, "seed": int(row["seed"]), "value": float(row["value"])}
    named = all(isinstance(row[k], str) and row[k] for k in FIELDS if k not in ("seed", "value"))
    require(math.isfinite(row["value"]), f"a result row has a finite value, got {row}")
    require(named, f"a result row has non-empty names, got {row}")
    return row


def result_row(**fields) -> dict:
    """A checked row from keywords experiment, arm, seed, metric, value, profile, data, model."""
    return check_row(fields)


def write_rows(path: str | Path, rows: list[dict]) -> Path:
    return write_atomic(path, json.dumps([check_row(r) for r in rows], indent=1) + "\n")


def read_rows(path: str | Path) -> list[dict]:
    rows = read_json(path)
    require(isinstance(rows, list), f"{path}: a results file holds a JSON list of rows")
    return [check_row(r) for r in rows]


def record(rows: list[dict], name: str, outputs: list[dict] = ()) -> Path | None:
    """Save a notebook's rows as `<name>.json` in the runner's folder, over the rows there of the
    same arm, seed and metric, and the runs' per-item test `outputs` ({experiment, arm, seed,
    checkpoint, outputs} records) as `<name>.outputs.jsonl` likewise (the runner keeps earlier files
    only from the same commit and settings); without the runner, nothing."""
    folder = os.environ.get(RESULTS_DIR_VARIABLE)
    if not folder:
        return None
    path = Path(folder) / f"{name}.json"
    write_outputs(path, merged(read_outputs(path), outputs, "experiment arm seed checkpoint"))
    old = read_rows(path) if path.exists() else []
    new = [check_row(row) for row in rows]
    return write_rows(path, merged(old, new, "experiment arm seed metric"))


def merged(old: list[dict], new: list[dict], key: str) -> list[dict]:
    """`new` after the records of `old` whose `key` fields no record of `new` has."""
    fields = itemgetter(*key.split())
    replaced = {fields(record) for record in new}
    return [record for record in old if fields(record) not in replaced] + list(new)


def read_outputs(rows_path: str | Path) -> list[dict]:
    """The per-item test output records beside the rows file `rows_path`, in JSON Lines
    `<stem>.outputs.jsonl` ([] where none); a corrupt line is named ("file:line")."""
    path = Path(rows_path).with_suffix(".outputs.jsonl")
    lines = path.read_text().splitlines() if path.exists() else []
    return [read_json(f"{path}:{n}", line) for n, line in enumerate(lines, 1)]


def write_outputs(rows_path: str | Path, records: list[dict]) -> Path | None:
    """Write `records` beside the rows file `rows_path` (see `read_outputs`), a record a line."""
    if records:
        text = "".join(json.dumps(record) + "\n" for record in records)
        return write_atomic(Path(rows_path).with_suffix(".outputs.jsonl"), text)
    return None


def current_commit() -> str:
    """This checkout's commit (7 hex digits), `+dirty` if files differ; "unknown" outside git."""
    git = ["git", "describe", "--always", "--abbrev=7", "--exclude=*", "--dirty=+dirty"]
    try:
        described = subprocess.run(git, cwd=REPOSITORY, capture_output=True, text=True)
        return described.stdout.strip() or "unknown"
    except OSError:  # no git here
        return "unknown"
