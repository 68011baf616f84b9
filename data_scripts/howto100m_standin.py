"""Build the offline MIL-NCE stand-in from Debian's python3.11-doc in the HowTo100M layout.

    apt-get update && apt-get install -y python3.11-doc
    python data_scripts/howto100m_standin.py [OUT]      # default: <data root>/howto100m/python-doc

Each documentation page is a "video": every block (prose paragraph or code block) lasts one second, the code
on screen is encoded by frozen encoders into features_2d/ (all-MiniLM-L6-v2, offline wheel) and features_3d/
(hashed bag of tokens), the prose paragraphs are the captions (caption.json) and the code blocks the clips
(clips.json). Idempotent: an OUT that already holds videos.csv is left alone.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gcbs_lib.data import data_root  # noqa: E402
from gcbs_lib.data.howto100m import (PYTHON_DOC_SOURCES, python_doc_pages, standin_encoders,  # noqa: E402
                                     write_python_doc_standin)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=data_root() / "howto100m" / "python-doc")
    parser.add_argument("--source", type=Path, default=PYTHON_DOC_SOURCES)
    args = parser.parse_args(argv)
    if (args.out / "videos.csv").exists():
        print(f"{args.out} already holds the stand-in")
        return
    start = time.perf_counter()
    pages = python_doc_pages(args.source)
    clips = write_python_doc_standin(args.out, pages, standin_encoders())
    print(f"{len(pages)} pages, {sum(map(len, clips.values()))} code clips, "
          f"{sum(kind == 'prose' for blocks in pages.values() for kind, _ in blocks)} prose captions "
          f"→ {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
