"""Build the offline code-search stand-in: stdlib docstring → function pairs, in the CodeSearchNet and AdvTest
layouts, under the data root (idempotent: an existing build is kept).

    python data_scripts/build_codesearch_standin.py [--root DIR] [--variant csn advtest]
"""
import argparse
import json
import time

from gcbs_lib.data.codesearch import STANDIN_VARIANTS, ensure_stdlib_standin


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="data root (default: env GCBS_DATA_ROOT or <repo>/data)")
    parser.add_argument("--variant", nargs="+", choices=STANDIN_VARIANTS, default=list(STANDIN_VARIANTS))
    args = parser.parse_args(argv)
    for variant in args.variant:
        start = time.perf_counter()
        folder = ensure_stdlib_standin(args.root, variant)
        manifest = json.loads((folder / "manifest.json").read_text())
        print(f"{variant:8s} {folder}  pairs {manifest['pairs']}  modules {manifest['modules']}  "
              f"pairs sharing their query {manifest['pairs_sharing_their_query']}  "
              f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
