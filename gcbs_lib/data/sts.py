"""Sentence-embedding data: the SentEval files SimCSE evaluates on, its training files, and an offline stand-in.

Evaluation, `load(path, task)` → `(sentences1, sentences2, scores)`, read as SentEval reads them (sentences
re-joined on whitespace, as SimCSE's batcher sees them):

  STS12 … STS16    path = the year's folder (e.g. STS12-en-test/) holding, per sub-dataset <name>,
                   STS.input.<name>.txt (`sent1<TAB>sent2` lines) and STS.gs.<name>.txt (one score per line);
                   all sub-datasets concatenated in SentEval's order; a pair whose gold line is empty is dropped.
  STSBenchmark     path = sts-{train,dev,test}.csv: tab-separated, no header, score in column 4, sentences in 5
                   and 6 (from 0); no quoting (quotes are part of the text).
  SICKRelatedness  path = SICK_{train,trial,test_annotated}.txt: a header line, sentences in columns 1 and 2,
                   score in 3.

The reported number is Spearman ×100 on each (STS12–16 over the year's concatenation, STS-B and SICK-R test),
and their average. Training: `read_sentences` (wiki1m_for_simcse.txt, one sentence per line) and `read_nli`
(nli_for_simcse.csv: sent0, sent1, hard_neg). Downloads: `data_scripts/download_sts.py`.

Offline stand-in (`ensure_sts_standin`), NOT STS: files from the test data of the `gensim` 4.4.0 wheel (read
from the wheel, gensim is not installed): ≈17k sentences of a Wikipedia extract to train, and three human-scored
sets to evaluate by Spearman (`load_standin`): "lee" (the Lee corpus, 50 news documents, 1,225 document pairs
scored 0–1; documents are long, a 32-token encoder sees their openings), "wordsim353" and "simlex999" (word
pairs: relatedness and similarity).
"""
from __future__ import annotations

import bz2
import csv
import hashlib
import re
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

from gcbs_lib.data import build_once, data_root, pip_wheel

STS_YEARS = {  # SentEval's sub-datasets per year (STS13's SMT part is not distributed)
    "STS12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "STS13": ("FNWN", "headlines", "OnWN"),
    "STS14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "STS15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "STS16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}
SPLIT_FILE_COLUMNS = {  # task -> (header lines, sentence 1, sentence 2, score) columns
    "STSBenchmark": (0, 5, 6, 4),
    "SICKRelatedness": (1, 1, 2, 3),
}
TASKS = (*STS_YEARS, *SPLIT_FILE_COLUMNS)
SPLIT_FILES = {  # task -> split -> file name, as SentEval names them
    "STSBenchmark": {"train": "sts-train.csv", "dev": "sts-dev.csv", "test": "sts-test.csv"},
    "SICKRelatedness": {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"},
}

Triple = tuple[list[str], list[str], list[float]]


def load(path: str | Path, task: str) -> Triple:
    """Sentence pairs and gold scores of one SentEval task (see the module docstring for `path`)."""
    path = Path(path)
    if task in STS_YEARS:
        if not path.is_dir():
            raise NotADirectoryError(f"{task}: expected the year's folder of STS.input/STS.gs files, got {path}")
        parts = [_sts_subset(path, task, name) for name in STS_YEARS[task]]
        return tuple([x for part in parts for x in part[i]] for i in range(3))
    if task in SPLIT_FILE_COLUMNS:
        return _split_file(path, task)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def senteval_path(task: str, folder: str | Path, split: str = "test") -> Path:
    """Where `task` lies in an unpacked SentEval data folder: the year folder `STS12-en-test` ... or, for STS-B
    and SICK-R, the file of `split` ("train", "dev" or "test")."""
    if task in STS_YEARS:
        name = f"{task}-en-test"
    elif task in SPLIT_FILES and split in SPLIT_FILES[task]:
        name = SPLIT_FILES[task][split]
    else:
        raise ValueError(f"unknown task {task!r} or split {split!r}; tasks {TASKS}, splits train/dev/test")
    found = sorted(Path(folder).rglob(name))
    if not found:
        raise FileNotFoundError(f"no {name} below {folder}: unpack senteval.tar there (data_scripts/download_sts.py)")
    return found[0]


def _sts_subset(folder: Path, task: str, name: str) -> Triple:
    """One STS sub-dataset; pairs whose gold line is empty are dropped (SentEval does the same)."""
    inputs, gold = folder / f"STS.input.{name}.txt", folder / f"STS.gs.{name}.txt"
    for file in (inputs, gold):
        if not file.is_file():
            raise FileNotFoundError(f"missing {file}: SentEval's {task} has the sub-datasets {STS_YEARS[task]}")
    pairs = inputs.read_text(encoding="utf-8").splitlines()
    scores = gold.read_text(encoding="utf-8").splitlines()
    if len(pairs) != len(scores):
        raise ValueError(f"{inputs.name} has {len(pairs)} lines but {gold.name} has {len(scores)}")
    s1, s2, kept = [], [], []
    for number, (pair, score) in enumerate(zip(pairs, scores), 1):
        if not score.strip():
            continue
        fields = pair.split("\t")
        if len(fields) < 2:
            raise ValueError(f"{inputs}:{number}: expected sent1<TAB>sent2")
        s1.append(" ".join(fields[0].split()))
        s2.append(" ".join(fields[1].split()))
        kept.append(_score(score, gold, number))
    return s1, s2, kept


def _split_file(path: Path, task: str) -> Triple:
    """STS-B or SICK-R split file: tab-separated, read without quoting (quotes belong to the sentences)."""
    if not path.is_file():
        raise FileNotFoundError(f"{task}: no split file at {path}")
    header, first, second, score_column = SPLIT_FILE_COLUMNS[task]
    s1, s2, scores = [], [], []
    with open(path, encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        for number, row in enumerate(rows, 1):
            if number <= header or not any(field.strip() for field in row):
                continue
            if len(row) <= max(first, second, score_column):
                raise ValueError(f"{path}:{number}: expected at least {max(first, second, score_column) + 1} "
                                 f"tab-separated columns, got {len(row)}")
            s1.append(" ".join(row[first].split()))
            s2.append(" ".join(row[second].split()))
            scores.append(_score(row[score_column], path, number))
    return s1, s2, scores


def _score(text: str, path: Path, number: int) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{path}:{number}: the gold score {text!r} is not a number") from None


def read_sentences(path: str | Path) -> list[str]:
    """SimCSE's unsupervised training file (wiki1m_for_simcse.txt): one sentence per line, blank lines skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    sentences = [line.strip() for line in lines if line.strip()]
    if not sentences:
        raise ValueError(f"{path}: no sentences")
    return sentences


def read_nli(path: str | Path) -> list[tuple[str, str, str]]:
    """SimCSE's supervised training file (nli_for_simcse.csv): (sentence, entailment, contradiction) triples."""
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"sent0", "sent1", "hard_neg"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: the NLI csv needs the columns sent0, sent1, hard_neg; missing {sorted(missing)}")
        return [(row["sent0"], row["sent1"], row["hard_neg"]) for row in reader]


# ------------------------------------------------------------------------------------------- gensim stand-in

STANDIN_NAME = "gensim-testdata-not-sts"  # the `data` field of result rows computed on the stand-in
STANDIN_EVAL_SETS = ("lee", "wordsim353", "simlex999")
GENSIM_WHEEL = "gensim==4.4.0"
BUILDER_VERSION = 1
_WHEEL_DATA = "gensim/test/test_data/"
WIKIPEDIA_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WHEEL_FILES = {  # test-data file -> SHA-256, text files with \n line ends (Windows wheels hold \r\n)
    WIKIPEDIA_DUMP: "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
    "lee.cor": "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e",
    "similarities0-1.txt": "23762bc6b728897144dda3d324a2c032dc1e059e1009806226d64b6dd123ed79",
    "wordsim353.tsv": "f92a022fc2537793a15bc3a8c162ebcd74990e033a228bb6388cb71e4c0b1e1d",
    "simlex999.txt": "d5e0501971478a511430ee880bd0121e94ac701ba86d90544d83e6d2ba3db05d",
}
MIN_WORDS, MAX_WORDS = 5, 64  # sentences kept from the Wikipedia extract


def ensure_sts_standin(root: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The folder of the gensim-wheel stand-in under `root` (default `data_root()`), built once.

    Files: train.txt (Wikipedia sentences, one per line: `read_sentences` reads it), lee.tsv, wordsim353.tsv,
    simlex999.tsv (`sent1<TAB>sent2<TAB>score`: `load_standin` reads them), manifest.json. `wheel` is a gensim
    4.4.0 wheel already on disk; by default one is fetched with `pip download` (PyPI must be reachable) into
    `<root>/sts/downloads/`. Every file taken from the wheel is checked against its SHA-256 (WHEEL_FILES).
    """
    root = Path(root if root is not None else data_root())
    spec = {"name": STANDIN_NAME, "builder": BUILDER_VERSION, "wheel": GENSIM_WHEEL}

    def write(staging: Path) -> dict:
        source = Path(wheel) if wheel is not None else pip_wheel(GENSIM_WHEEL, root / "sts" / "downloads")
        members = _wheel_members(source)
        return _write_standin(staging, members)

    return build_once(root / "sts" / "gensim-standin", spec, write)


def load_standin(name: str, root: str | Path | None = None) -> Triple:
    """One stand-in evaluation set (NOT STS) as (texts1, texts2, human scores): "lee", "wordsim353", "simlex999"."""
    if name not in STANDIN_EVAL_SETS:
        raise ValueError(f"stand-in evaluation sets are {STANDIN_EVAL_SETS}, got {name!r}")
    path = ensure_sts_standin(root) / f"{name}.tsv"
    rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    return [r[0] for r in rows], [r[1] for r in rows], [float(r[2]) for r in rows]


def _wheel_members(wheel: Path) -> dict[str, bytes]:
    """The test-data files the stand-in needs, read from the wheel and checked against WHEEL_FILES."""
    with zipfile.ZipFile(wheel) as zipped:
        members = {name: zipped.read(_WHEEL_DATA + name) for name in WHEEL_FILES}
    for name, data in members.items():
        if name != WIKIPEDIA_DUMP:
            members[name] = data = data.replace(b"\r\n", b"\n")
        if hashlib.sha256(data).hexdigest() != WHEEL_FILES[name]:
            raise ValueError(f"{wheel.name}: {name} has SHA-256 {hashlib.sha256(data).hexdigest()}, "
                             f"expected {WHEEL_FILES[name]} (the file of gensim 4.4.0)")
    return members


def _write_standin(folder: Path, members: dict[str, bytes]) -> dict:
    """Write the stand-in files into `folder`; return the manifest's facts (lines and SHA-256 per file)."""
    sentences = wikipedia_sentences(members[WIKIPEDIA_DUMP])
    files = {"train.txt": "".join(s + "\n" for s in sentences)}
    for name, rows in (("lee", _lee_pairs(members["lee.cor"], members["similarities0-1.txt"])),
                       ("wordsim353", _word_pairs(members["wordsim353.tsv"])),
                       ("simlex999", _word_pairs(members["simlex999.txt"]))):
        files[f"{name}.tsv"] = "".join(f"{a}\t{b}\t{score}\n" for a, b, score in rows)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return {"sizes": {name: text.count("\n") for name, text in files.items()},
            "sha256": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}}


def wikipedia_sentences(dump_bz2: bytes) -> list[str]:
    """Plain sentences of the article pages in a bz2 MediaWiki XML dump, deduplicated, in page order.

    Wiki markup is stripped with regular expressions (templates, tables, references, files, links, bold and
    italics, HTML); headings, lists and table rows are skipped; paragraphs are cut after . ! ? before a capital
    or quote; sentences of MIN_WORDS..MAX_WORDS words ending in . ! ? without leftover markup are kept.
    """
    root = ElementTree.fromstring(bz2.decompress(dump_bz2))
    ns = {"m": root.tag.split("}")[0].lstrip("{")}
    sentences, seen = [], set()
    for page in root.findall("m:page", ns):
        text = page.findtext("m:revision/m:text", default="", namespaces=ns)
        if page.findtext("m:ns", namespaces=ns) != "0" or text.lstrip().upper().startswith("#REDIRECT"):
            continue
        for paragraph in _strip_markup(text).split("\n"):
            paragraph = paragraph.strip()
            if not paragraph or paragraph[0] in "=*#:;|!{}":
                continue
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", paragraph):
                words = sentence.split()
                sentence = " ".join(words)
                if (MIN_WORDS <= len(words) <= MAX_WORDS and sentence[-1] in ".!?"
                        and not re.search(r"[{}\[\]|=<>]", sentence) and sentence not in seen):
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences


def _strip_markup(text: str) -> str:
    """Wiki markup → plain text (approximate: what survives is filtered by `wikipedia_sentences`)."""
    text = re.sub(r"<!--.*?-->|<ref[^>/]*/>|<ref.*?</ref>", "", text, flags=re.S)
    for _ in range(5):  # nested templates {{...}} and tables {|...|}, innermost first
        text = re.sub(r"\{\{[^{}]*\}\}|\{\|[^{}]*?\|\}", "", text, flags=re.S)
    text = re.sub(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
    text = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", text)     # [[target|label]] → label
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]|\[https?://\S+\]", r"\1", text)
    text = re.sub(r"<[^>]+>|'{2,}", "", text)
    return text.replace("&nbsp;", " ")


def _lee_pairs(corpus: bytes, similarities: bytes) -> list[tuple[str, str, float]]:
    """The Lee corpus (Latin-1): every pair i < j of its 50 documents with their mean human similarity."""
    documents = [" ".join(line.split()) for line in corpus.decode("latin-1").splitlines() if line.strip()]
    matrix = [[float(x) for x in line.split()] for line in similarities.decode("utf-8").splitlines() if line.strip()]
    if len(documents) != 50 or len(matrix) != 50 or any(len(row) != 50 for row in matrix):
        raise ValueError(f"the Lee corpus should hold 50 documents and a 50×50 similarity matrix, got "
                         f"{len(documents)} and {len(matrix)} rows")
    return [(documents[i], documents[j], matrix[i][j]) for i in range(50) for j in range(i + 1, 50)]


def _word_pairs(table: bytes) -> list[tuple[str, str, float]]:
    """A word-similarity table (`word1<TAB>word2<TAB>score`, `#` comment lines)."""
    rows = [line.split("\t") for line in table.decode("utf-8").splitlines() if line.strip()
            and not line.startswith("#")]
    return [(a.strip(), b.strip(), float(score)) for a, b, score in rows]
