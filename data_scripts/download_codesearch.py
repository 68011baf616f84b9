"""Download the real code-search datasets the way UniXcoder's code-search README does, into
`<data root>/codesearch/{cosqa,AdvTest,CSN}` (idempotent: files already there are kept).

    python data_scripts/download_codesearch.py [--root DIR] [--only cosqa advtest csn]

  cosqa    four files from the CoCLR repository (no preprocessing).
  advtest  CodeXGLUE's dataset.zip, then the CodeSearchNet python.zip from Zenodo, then the bundled
           preprocess.py (it writes train/valid/test.jsonl).
  csn      GraphCodeBERT's dataset.zip, then its bundled run.sh, which downloads the six
  CodeSearchNet
           languages (several GB) and writes <lang>/{train,valid,test,codebase}.jsonl.
The bundled preprocess.py / run.sh come from those archives and are run as the official README runs
them.

Checksums: the publishers give none, and these hosts cannot be reached from the machine this kit was
built on, so every checksum in FILES is None: the first fetch records each file's SHA-256 in
SHA256SUMS beside it, and every later run checks the file against that line (copy SHA256SUMS to
another node to check its files too; `sha256sum -c SHA256SUMS` reads it). A value filled in FILES is
enforced instead. Offline, use the stand-in instead: `python
data_scripts/build_codesearch_standin.py`.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

from fetch import download, download_main

COSQA = "https://github.com/Jun-jie-Huang/CoCLR/raw/main/data/search/"
UNKNOWN = None  # no published checksum, and unreachable here: see the docstring
FILES = {  # dataset -> [(url, file name, SHA-256)]
    "cosqa": [
        (COSQA + name, name, UNKNOWN)
        for name in (
            "code_idx_map.txt",
            "cosqa-retrieval-dev-500.json",
            "cosqa-retrieval-test-500.json",
            "cosqa-retrieval-train-19604.json",
        )
    ],
    "advtest": [
        (
            "https://github.com/microsoft/CodeXGLUE/raw/main/Text-Code/NL-code-search-Adv/dataset.zip",
            "dataset.zip",
            UNKNOWN,
        ),
        ("https://zenodo.org/record/7857872/files/python.zip", "python.zip", UNKNOWN),
    ],
    "csn": [
        (
            "https://github.com/microsoft/CodeBERT/raw/master/GraphCodeBERT/codesearch/dataset.zip",
            "dataset.zip",
            UNKNOWN,
        )
    ],
}
FOLDER = {"cosqa": "cosqa", "advtest": "AdvTest", "csn": "CSN"}
PREPARED = ".prepared"  # the marker of a dataset whose preprocessing ran to its end


def unpack_dataset_zip(archive: Path, folder: Path) -> None:
    """Extract a `dataset/...` archive so that its contents land directly in `folder`."""
    with zipfile.ZipFile(archive) as zipped:
        for member in zipped.infolist():
            name = Path(member.filename)
            if member.is_dir() or name.parts[0] != "dataset" or ".." in name.parts:
                continue
            target = folder.joinpath(*name.parts[1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zipped.read(member))


def fetch(dataset: str, root: Path) -> Path:
    folder = root / "codesearch" / FOLDER[dataset]
    for url, name, sha256 in FILES[dataset]:
        download(
            url, folder / "downloads" / name if name.endswith(".zip") else folder / name, sha256
        )
    # written after the last step: a run stopped midway is redone, whichever file it stopped at
    prepared = folder / PREPARED
    if dataset == "advtest" and not prepared.is_file():
        unpack_dataset_zip(folder / "downloads" / "dataset.zip", folder)
        with zipfile.ZipFile(folder / "downloads" / "python.zip") as zipped:
            zipped.extractall(folder)
        subprocess.run([sys.executable, "preprocess.py"], cwd=folder, check=True)
        prepared.write_text("preprocess.py finished\n")
    if dataset == "csn" and not prepared.is_file():
        unpack_dataset_zip(folder / "downloads" / "dataset.zip", folder)
        subprocess.run(["bash", "run.sh"], cwd=folder, check=True)
        prepared.write_text("run.sh finished\n")
    return folder


def main(argv=None):
    download_main(
        __doc__,
        fetch,
        list(FILES),
        "build the stand-in: python data_scripts/build_codesearch_standin.py",
        argv,
    )


if __name__ == "__main__":
    main()
