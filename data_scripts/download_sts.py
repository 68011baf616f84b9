"""Download the sentence-embedding data SimCSE uses, from the URLs of its scripts, into `<data
root>/sts/` (idempotent: files already there are kept).

    python data_scripts/download_sts.py [--root DIR] [--only senteval wiki1m]

  senteval  senteval.tar (SentEval/data/downstream/download_dataset.sh), unpacked into
  sts/SentEval/: the
            STS12–16 year folders, STSBenchmark/sts-{train,dev,test}.csv and SICK/SICK_*.txt;
            `gcbs_lib.data.sts.senteval_path(task, <data root>/sts/SentEval)` finds each task's path
            in it.
  wiki1m    wiki1m_for_simcse.txt, the unsupervised training sentences (data/download_wiki.sh).

Checksums: SimCSE publishes none, and huggingface.co cannot be reached from the machine this kit was
built on, so SHA256 below is None for every file: the first fetch records each file's SHA-256 in
sts/SHA256SUMS, and every later run (or a copy of that file on another node) checks against it; a
value filled in is enforced instead. Offline, build the stand-in (NOT STS) from the gensim wheel's
test data: `python data_scripts/build_sts_standin.py`.
"""

from pathlib import Path

from fetch import download, download_main, unpack, unpacked

BASE = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main/"
FILES = {"senteval": "senteval.tar", "wiki1m": "wiki1m_for_simcse.txt"}
SHA256 = {name: None for name in FILES.values()}  # unknown here: see the docstring


def fetch(key: str, root: Path) -> Path:
    name = FILES[key]
    path = download(BASE + name, root / "sts" / name, SHA256[name])
    folder = root / "sts" / "SentEval"
    if key == "senteval" and not unpacked(path, folder):
        unpack(path, folder)
        return folder
    return path


def main(argv=None):
    download_main(
        __doc__,
        fetch,
        list(FILES),
        "use the stand-in (NOT STS): python data_scripts/build_sts_standin.py",
        argv,
    )


if __name__ == "__main__":
    main()
