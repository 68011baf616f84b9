"""Build the offline sentence-embedding stand-in (NOT STS) from the gensim 4.4.0 wheel's test data: Wikipedia
sentences to train, the Lee corpus / WordSim353 / SimLex-999 to evaluate (idempotent).

    python data_scripts/build_sts_standin.py [--root DIR] [--wheel PATH]
"""
import argparse
import json
import time

from gcbs_lib.data.sts import ensure_sts_standin


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="data root (default: env GCBS_DATA_ROOT or <repo>/data)")
    parser.add_argument("--wheel", help="a gensim-4.4.0 wheel already on disk (default: fetched with pip)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    folder = ensure_sts_standin(args.root, args.wheel)
    sizes = json.loads((folder / "manifest.json").read_text())["sizes"]
    print(f"{folder}  lines per file {sizes}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
