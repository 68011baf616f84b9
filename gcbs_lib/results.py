"""Result rows: what every experiment measures, in one shape the runner merges into the results table.

A row is a dict with exactly the keys `FIELDS`:
  experiment  e.g. "codesearch"        arm      "random" (the baseline), "gcbs", "hard_negatives", ...
  seed        int                       metric   e.g. "test_mrr"
  value       float                     profile  "ci", "cpu" or "paper"
  data        "paper" or the stand-in's name (e.g. "stdlib-docstrings")      model  encoder name or path
A results file is a JSON list of rows.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

FIELDS = ("experiment", "arm", "seed", "metric", "value", "profile", "data", "model")
RESULTS_DIR_VARIABLE = "GCBS_RESULTS_DIR"  # the runner sets it; notebooks' rows land there


def result_row(*, experiment: str, arm: str, seed: int, metric: str, value: float, profile: str, data: str,
               model: str) -> dict:
    """One validated result row."""
    return check_row(dict(experiment=experiment, arm=arm, seed=seed, metric=metric, value=value,
                          profile=profile, data=data, model=model))


def check_row(row: dict) -> dict:
    """Return `row` with `seed` as int and `value` as float; a clear error for missing/extra keys or a NaN."""
    if not isinstance(row, dict) or set(row) != set(FIELDS):
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"a result row has exactly the keys {list(FIELDS)}, got {keys}")
    row = {**row, "seed": int(row["seed"]), "value": float(row["value"])}
    if not math.isfinite(row["value"]):
        raise ValueError(f"result value is not finite: {row}")
    for key in ("experiment", "arm", "metric", "profile", "data", "model"):
        if not isinstance(row[key], str) or not row[key]:
            raise ValueError(f"result field {key!r} must be a non-empty string, got {row[key]!r}")
    return row


def write_rows(path: str | Path, rows: list[dict]) -> Path:
    """Write rows as a JSON list (atomically: temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps([check_row(r) for r in rows], indent=1) + "\n")
    os.replace(temporary, path)
    return path


def read_rows(path: str | Path) -> list[dict]:
    """Read and validate a results file."""
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a results file holds a JSON list of rows")
    return [check_row(r) for r in rows]


def record(rows: list[dict], name: str) -> Path | None:
    """Save a notebook's rows as `<name>.json` in the runner's results folder (env `GCBS_RESULTS_DIR`).

    Run interactively (no runner), nothing is written and None is returned.
    """
    folder = os.environ.get(RESULTS_DIR_VARIABLE)
    return write_rows(Path(folder) / f"{name}.json", rows) if folder else None
