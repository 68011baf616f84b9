"""Sentence-embedding data: SentEval's STS files, SimCSE's training file, and an offline stand-in
(NOT STS, built by data_scripts/build_sts_standin.py from the gensim 4.4.0 wheel's test data).
`load(path, task)` reads STS12 … STS16 from the year's folder (per sub-dataset <name>:
STS.input.<name>.txt of `sent1<TAB>sent2` lines, STS.gs.<name>.txt of scores; concatenated in
SentEval's order, pairs with an empty gold line dropped), STSBenchmark from sts-{train,dev,test}.csv
(tab-separated, unquoted, score in column 4, sentences in 5 and 6) and SICKRelatedness from
SICK_{train,trial,test_annotated}.txt (a header, sentences in columns 1 and 2, score in 3)."""

import csv
import math
from pathlib import Path

from gcbs_lib.check import require
from gcbs_lib.data import ensure_built

STS_YEARS = {  # SentEval's sub-datasets per year (STS13's SMT part is not distributed)
    "STS12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "STS13": ("FNWN", "headlines", "OnWN"),
    "STS14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "STS15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "STS16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}
SPLIT_FILES = {  # task -> (header lines, sentence 1, sentence 2, score columns), {split: file name}
    "STSBenchmark": ((0, 5, 6, 4), {s: f"sts-{s}.csv" for s in ("train", "dev", "test")}),
    "SICKRelatedness": (
        (1, 1, 2, 3),
        {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"},
    ),
}
TASKS = (*STS_YEARS, *SPLIT_FILES)
STANDIN_NAME = "gensim-testdata-not-sts"  # the `data` of result rows computed on the stand-in
STANDIN_SETS = ("lee", "lee-dev", "lee-test", "wordsim353", "simlex999")  # lee-*: document halves


def load(path: str | Path, task: str) -> tuple[list[str], list[str], list[float]]:
    """Sentence pairs and gold scores of one SentEval task (see the module docstring for `path`)."""
    path = Path(path)
    if task in STS_YEARS and not path.is_dir():
        raise NotADirectoryError(f"{task}: {path} is not a folder of STS.input/STS.gs files")
    require(task in TASKS, f"task must be one of {TASKS}, got {task!r}")
    if task in STS_YEARS:
        rows = [r for name in STS_YEARS[task] for r in _sts_subset(path, task, name)]
    else:
        rows = _split_file(path, task)
    require(rows, f"{path}: no {task} sentence pairs")
    scores = []
    for _, _, score, where in rows:
        try:
            scores.append(float(score))
        except ValueError:
            raise ValueError(f"{where}: the gold score {score!r} is not a number") from None
        require(math.isfinite(scores[-1]), f"{where}: the gold score {score!r} is not finite")
    return [" ".join(r[0].split()) for r in rows], [" ".join(r[1].split()) for r in rows], scores


def senteval_path(task: str, folder: str | Path, split: str = "test") -> Path:
    """Where `task` lies in SentEval: its year folder, or (STS-B, SICK-R) its `split` file."""
    require(task in TASKS, f"unknown task {task!r}; tasks {TASKS}")
    known = task in STS_YEARS or split in SPLIT_FILES[task][1]  # a year is one test set
    require(known, f"unknown split {split!r}: train, dev or test")
    name = f"{task}-en-test" if task in STS_YEARS else SPLIT_FILES[task][1][split]
    found = sorted(Path(folder).rglob(name))
    if not found:
        raise FileNotFoundError(
            f"no {name} below {folder}: unpack senteval.tar there (data_scripts/download_sts.py)"
        )
    return found[0]


def _sts_subset(folder: Path, task: str, name: str) -> list[tuple[str, str, str, str]]:
    inputs, gold = folder / f"STS.input.{name}.txt", folder / f"STS.gs.{name}.txt"
    for file in (inputs, gold):
        if not file.is_file():
            raise FileNotFoundError(
                f"missing {file}: SentEval's {task} has the sub-datasets {STS_YEARS[task]}"
            )
    pairs, scores = (file.read_text(encoding="utf-8").splitlines() for file in (inputs, gold))
    counts = f"{inputs.name} has {len(pairs)} lines but {gold.name} has {len(scores)}"
    require(len(pairs) == len(scores), counts)
    rows = [
        (*pair.split("\t")[:2], score, f"{gold}:{n}")
        for n, (pair, score) in enumerate(zip(pairs, scores), 1)
        if score.strip()
    ]
    require(all(len(row) >= 4 for row in rows), f"{inputs}: a line is not sent1<TAB>sent2")
    return rows


def _split_file(path: Path, task: str) -> list[tuple[str, str, str, str]]:
    (header, first, second, score), _ = SPLIT_FILES[task]
    needed = max(first, second, score) + 1
    rows = []
    with open(path, encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
            if number > header and any(field.strip() for field in row):
                columns = f"expected at least {needed} tab-separated columns, got {len(row)}"
                require(len(row) >= needed, f"{path}:{number}: {columns}")
                rows.append((row[first], row[second], row[score], f"{path}:{number}"))
    return rows


def read_sentences(path: str | Path) -> list[str]:
    """SimCSE's training file (wiki1m_for_simcse.txt): a sentence per line, blank lines skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    sentences = [line.strip() for line in lines if line.strip()]
    require(sentences, f"{path}: no sentences")
    return sentences


def standin_file(name: str, root: str | Path) -> Path:
    """`<root>/sts/gensim-standin/<name>`, its folder built first if missing (build_sts_standin)."""
    folder = Path(root) / "sts" / "gensim-standin"
    return ensure_built(folder, "build_sts_standin.py", "--root", root) / name


def load_standin(name: str, root: str | Path) -> tuple[list[str], list[str], list[float]]:
    """(texts1, texts2, human scores) of stand-in evaluation set `name` (NOT STS; STANDIN_SETS)."""
    require(name in STANDIN_SETS, f"stand-in evaluation sets are {STANDIN_SETS}, got {name!r}")
    text = standin_file(f"{name}.tsv", root).read_text("utf-8")
    rows = [line.split("\t") for line in text.splitlines()]
    return [r[0] for r in rows], [r[1] for r in rows], [float(r[2]) for r in rows]
