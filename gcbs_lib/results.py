"""Result rows: what every experiment measures, in one shape the runner merges into the results table.

A row is a dict with exactly the keys `FIELDS`:
  experiment  e.g. "codesearch"        arm      "random" (the baseline), "gcbs", "hard_negatives", ...
  seed        int                       metric   e.g. "test_mrr"
  value       float                     profile  "ci", "cpu" or "paper"
  data        "paper" or the stand-in's name (e.g. "stdlib-docstrings")      model  encoder name or path
A results file is a JSON list of rows.

`build_table` turns rows into the paper-vs-kit table (mean ± sd over seeds, Δ against the "random" arm, the
paper's headline Δ from `PAPER_DELTAS`); the runner writes it for each run. Committed `cpu`-profile rows live in
`results/<notebook>.cpu.json`, and the README's table is generated from them:

    python -m gcbs_lib.results collect runs/<stamp>   # copy a run's rows into results/, note how they were made
    python -m gcbs_lib.results readme [--check]       # regenerate (or check) the README's table
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
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


# ── The paper-vs-kit table ────────────────────

BASELINE_ARM = "random"


@dataclass(frozen=True)
class PaperDelta:
    """A headline Δ (arm − random batches) from the GCBS paper, on the metric's own 0–1 scale (no `deltas`: an
    experiment the paper's code runs but its text gives no number for; the table says so).

    The paper reports percentage points; +1.0 % MRR is +0.010 here, so it reads next to the kit's Δ of an MRR
    in [0, 1]. It belongs to the table line of the same experiment, arm and metric (the training loop's rows).
    """

    experiment: str
    arm: str
    metric: str
    deltas: tuple[float, ...]
    source: str

    def matches(self, experiment: str, arm: str, metric: str) -> bool:
        return (experiment, arm, metric) == (self.experiment, self.arm, self.metric)

    def text(self) -> str:
        if not self.deltas:
            return f"none reported ({self.source})"
        return " / ".join(f"{d:+.4f}" for d in self.deltas) + f" ({self.source})"


# Sachidananda, Yang & Zhu, "Global Selection of Contrastive Batches via Optimization on Sample Permutations",
# ICML 2023: the one place the kit states the paper's numbers.
PAPER_DELTAS = (
    PaperDelta("codesearch", "gcbs", "test_mrr", (0.010, 0.020, 0.022), "CosQA / AdvTest / CodeSearchNet, UniXcoder"),
    PaperDelta("simcse", "gcbs", "test_spearman", (0.0103,), "STS avg, unsupervised SimCSE BERT-base"),
    PaperDelta("promcse", "gcbs", "test_spearman", (0.0027,), "STS avg, PromCSE"),
    PaperDelta("moco", "gcbs", "test_knn_accuracy", (), "the paper gives no MoCo number; its repository trains "
               "MoCo on CIFAR-10 with GCBS"),
)


@dataclass(frozen=True)
class TableLine:
    """One (experiment, arm, metric) of the table: the kit's mean ± sd over seeds and its Δ against random."""

    experiment: str
    arm: str
    metric: str
    model: str
    data: str
    profile: str
    seeds: int
    mean: float | None  # None: a paper result the kit has not run
    sd: float | None  # None with a single seed
    delta: float | None
    delta_sd: float | None
    delta_note: str  # why there is no Δ ("baseline", "no random arm", ...), else ""
    paper: str
    commit: str


def _sd(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def _paper_text(experiment: str, arm: str, metric: str) -> str:
    return next((p.text() for p in PAPER_DELTAS if p.matches(experiment, arm, metric)), "")


def build_table(sources: Iterable[tuple[list[dict], str]], *,
                list_unrun_paper_results: bool = False) -> list[TableLine]:
    """Aggregate result rows into table lines; `sources` pairs each file's rows with the commit that made them.

    Rows are grouped by (experiment, model, data, profile, metric); within a group each arm gets mean ± sd over
    its seeds, and every arm but the baseline gets Δ = mean over shared seeds of (arm − random) ± the sd of those
    paired differences. Groups and arms keep the order of first appearance, the baseline first. With
    `list_unrun_paper_results`, paper headlines (with a number) without a matching kit line are listed as not run.
    """
    groups: dict[tuple, dict[str, dict[int, float]]] = {}
    commits: dict[tuple, set[str]] = {}
    for rows, commit in sources:
        for row in map(check_row, rows):
            key = (row["experiment"], row["model"], row["data"], row["profile"], row["metric"])
            seeds = groups.setdefault(key, {}).setdefault(row["arm"], {})
            if row["seed"] in seeds:
                raise ValueError(f"two rows for the same seed: {row} (a results file included twice?)")
            seeds[row["seed"]] = row["value"]
            commits.setdefault(key, set()).add(commit)
    lines = []
    for key, arms in groups.items():
        experiment, model, data, profile, metric = key
        baseline = arms.get(BASELINE_ARM)
        commit = ", ".join(sorted(c for c in commits[key] if c)) or "—"
        for arm in sorted(arms, key=lambda a: a != BASELINE_ARM):  # stable: baseline first, then as they came
            values = arms[arm]
            delta = delta_sd = None
            if arm == BASELINE_ARM:
                note = "baseline"
            elif baseline is None:
                note = ""  # nothing to compare with: not a sampling experiment, or its baseline is missing
            elif not (shared := sorted(set(values) & set(baseline))):
                note = f"no seed shared with {BASELINE_ARM}"
            else:
                differences = [values[s] - baseline[s] for s in shared]
                delta, delta_sd, note = statistics.fmean(differences), _sd(differences), ""
            lines.append(TableLine(experiment, arm, metric, model, data, profile, len(values),
                                   statistics.fmean(values.values()), _sd(list(values.values())), delta, delta_sd,
                                   note, _paper_text(experiment, arm, metric), commit))
    if list_unrun_paper_results:
        for paper in PAPER_DELTAS:
            if paper.deltas and not any(paper.matches(line.experiment, line.arm, line.metric) for line in lines):
                lines.append(TableLine(paper.experiment, paper.arm, paper.metric, "", "", "", 0, None, None, None,
                                       None, "", paper.text(), "—"))
    return lines


SIGNIFICANT = 4  # digits the table shows of a mean; its sd, Δ and Δ's sd are rounded to the same decimals


def number(x: float, scale: float | None = None, *, digits: int = SIGNIFICANT, signed: bool = False) -> str:
    """`x` rounded to the decimals that show `scale` (default, or when 0: `x` itself) to `SIGNIFICANT` significant
    digits, then written with `digits` significant digits: float round-off far below `scale` (a Δ of two equal
    means, −3.7e-17) prints as 0, never −0. NaN and infinities print as such (a non-finite `scale` is ignored)."""
    magnitude = abs(scale if scale and math.isfinite(scale) else x)
    decimals = SIGNIFICANT - 1 - math.floor(math.log10(magnitude)) if magnitude and math.isfinite(magnitude) else 0
    return f"{round(x, decimals) + 0.0:{'+' if signed else ''}.{digits}g}"  # + 0.0 turns −0.0 into 0.0


def _with_sd(value: float, sd: float | None, scale: float, signed: bool = False) -> str:
    text = number(value, scale, signed=signed)
    return text if sd is None else f"{text} ± {number(sd, scale, digits=2)}"


COLUMNS = ("experiment", "arm", "metric", "paper Δ", "kit (mean ± sd, n seeds)", f"Δ vs {BASELINE_ARM}", "data",
           "model", "profile", "commit")


def to_markdown(lines: list[TableLine]) -> str:
    """The table as GitHub markdown: each mean to `SIGNIFICANT` significant digits, its sd, Δ and Δ's sd rounded
    to the same decimals (see `number`)."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for line in lines:
        kit = "not run yet" if line.mean is None else f"{_with_sd(line.mean, line.sd, line.mean)} (n={line.seeds})"
        delta = line.delta_note if line.delta is None else _with_sd(line.delta, line.delta_sd, line.mean, signed=True)
        cells = (line.experiment, line.arm, line.metric, line.paper or "—", kit, delta or "—", line.data or "—",
                 line.model or "—", line.profile or "—", line.commit)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def write_csv(path: str | Path, lines: list[TableLine]) -> Path:
    """The table as CSV with raw numbers (empty where there is none)."""
    path = Path(path)
    names = [f.name for f in fields(TableLine)]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for line in lines:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(line).items()})
    return path


# ── Committed results and the README table ────────────────────

REPOSITORY = Path(__file__).resolve().parent.parent
COMMITTED = REPOSITORY / "results"  # <notebook>.<profile>.json rows, and provenance.json: how each was made
PROVENANCE = "provenance.json"
README_START = "<!-- cpu-results: generated by `python -m gcbs_lib.results readme` from results/*.cpu.json -->"
README_END = "<!-- cpu-results: end -->"


def collect(run_dir: str | Path, folder: str | Path = COMMITTED) -> tuple[list[Path], list[str]]:
    """Copy a runner folder's rows into `folder` as `<name>.<profile>.json` and note in `provenance.json` the
    commit, command, date and seconds of the run that produced them. Rows of a notebook that failed are not
    copied: returns the files written and, for each file left out, why."""
    run_dir, folder = Path(run_dir), Path(folder)
    run = json.loads((run_dir / "run.json").read_text())
    provenance_path = folder / PROVENANCE
    provenance = json.loads(provenance_path.read_text()) if provenance_path.exists() else {}
    written, skipped = [], []
    for source in sorted((run_dir / "results").glob("*.json")):
        notebook = run["notebooks"].get(source.stem, {})
        if notebook.get("status", "ok") != "ok":
            skipped.append(f"{source.name}: notebook {source.stem} {notebook['status']}")
            continue
        rows = read_rows(source)
        profiles = {row["profile"] for row in rows}
        if len(profiles) != 1:
            raise ValueError(f"{source}: a results file holds rows of one profile, got {sorted(profiles)}")
        target = write_rows(folder / f"{source.stem}.{profiles.pop()}.json", rows)
        provenance[target.name] = {"commit": run["commit"], "command": run["command"], "date": run["started"],
                                   "seconds": notebook.get("seconds"), "cores": run["cores"],
                                   "load_average": run["load_average"]}
        written.append(target)
    if not written:
        raise ValueError(f"{run_dir / 'results'} holds no result rows of a notebook that ran to the end "
                         f"{skipped or '(did the notebooks call record(...)?)'}")
    provenance_path.write_text(json.dumps(provenance, indent=1, sort_keys=True) + "\n")
    return written, skipped


def committed_table(folder: str | Path = COMMITTED, profile: str = "cpu") -> str:
    """The markdown table of the committed `*.<profile>.json` rows, paper headlines not yet run included, and
    how each file was produced."""
    folder = Path(folder)
    files = sorted(folder.glob(f"*.{profile}.json"))
    provenance_path = folder / PROVENANCE
    provenance = json.loads(provenance_path.read_text()) if provenance_path.exists() else {}
    made = [provenance.get(f.name, {}) for f in files]
    table = to_markdown(build_table([(read_rows(f), m.get("commit", "")) for f, m in zip(files, made)],
                                    list_unrun_paper_results=True))
    if not files:
        return table + f"\nNo {profile}-profile results are committed yet.\n"
    notes = []
    for file, m in zip(files, made):
        how = (f"`{m['command']}` at commit {m['commit']}, {m['date'][:10]}, "
               f"{m['seconds'] or '?'} s on {m['cores']} cores at load average {m['load_average']}"
               ) if m else "provenance not recorded"
        notes.append(f"- `results/{file.name}`: {how}")
    return table + "\nProduced by:\n" + "\n".join(notes) + "\n"


def update_readme(readme: str | Path = REPOSITORY / "README.md", folder: str | Path = COMMITTED,
                  check: bool = False) -> bool:
    """Rewrite the README's cpu-profile table between its marker comments; with `check`, only say whether it
    is up to date. Returns True when the README already held the generated table."""
    readme = Path(readme)
    text = readme.read_text()
    if text.count(README_START) != 1 or text.count(README_END) != 1:
        raise ValueError(f"{readme} needs exactly one {README_START!r} and one {README_END!r} line")
    head, rest = text.split(README_START + "\n", 1)
    _, tail = rest.split(README_END, 1)
    updated = f"{head}{README_START}\n{committed_table(folder)}{README_END}{tail}"
    if updated != text and not check:
        readme.write_text(updated)
    return updated == text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gcbs_lib.results", description="Committed result rows and "
                                     "the README's cpu-profile table generated from them.")
    paths = argparse.ArgumentParser(add_help=False)
    paths.add_argument("--results-dir", type=Path, default=COMMITTED, help="committed rows (default: results/)")
    paths.add_argument("--readme", type=Path, default=REPOSITORY / "README.md", help="default: README.md")
    commands = parser.add_subparsers(dest="command", required=True)
    readme = commands.add_parser("readme", parents=[paths],
                                 help="regenerate the README's cpu-profile table from results/*.cpu.json")
    readme.add_argument("--check", action="store_true", help="only fail when the README's table is out of date")
    gather = commands.add_parser("collect", parents=[paths], help="copy a runner folder's result rows into results/ "
                                                                  "with provenance, then regenerate the README's table")
    gather.add_argument("run_dir", type=Path, help="a folder written by python -m gcbs_lib.reproduce")
    args = parser.parse_args(argv)
    check = args.command == "readme" and args.check
    if args.command == "collect":
        written, skipped = collect(args.run_dir, args.results_dir)
        for path in written:
            print(f"wrote {path}")
        for reason in skipped:
            print(f"not collected: {reason}")
    if update_readme(args.readme, args.results_dir, check=check):
        print(f"{args.readme}: the cpu-profile table is up to date")
        return 0
    if check:
        print(f"{args.readme}: the cpu-profile table differs from {args.results_dir}/*.cpu.json; "
              f"run python -m gcbs_lib.results readme")
        return 1
    print(f"{args.readme}: cpu-profile table regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
