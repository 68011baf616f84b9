"""Specification of data_scripts/download_cifar10.py on a tiny archive in CIFAR-10's real layout,
served from a file: URL (no network): it unpacks where `load("cifar10")` reads, keeps a complete
folder without downloading, checks the MD5, and refuses unsafe archive members with or without
`tarfile.data_filter` (Python < 3.11.4)."""

import hashlib
import io
import pickle
import tarfile

import pytest
from fetch import DownloadError
from test_data_images import cifar_batch
from test_data_sts import script

from gcbs_lib.data.images import CIFAR10_FILES, load_cifar10


def write_archive(path, members=None):
    """A .tar.gz with `cifar-10-batches-py/` holding every batch (2 images each) and batches.meta,
    plus `members` ({TarInfo: bytes or None})."""
    with tarfile.open(path, "w:gz") as tar:
        files = {name: cifar_batch(2) for names in CIFAR10_FILES.values() for name in names}
        files["batches.meta"] = {b"label_names": [b"airplane"]}
        for name, content in files.items():
            data = pickle.dumps(content, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in (members or {}).items():
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


@pytest.fixture
def cifar(tmp_path, monkeypatch):
    """The script, its URL pointing at a tiny archive whose MD5 it expects."""
    module = script("download_cifar10")
    archive = write_archive(tmp_path / "served.tar.gz")
    monkeypatch.setattr(module, "URL", archive.as_uri())
    monkeypatch.setattr(module, "MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    return module


def test_the_batches_land_where_the_reader_finds_them(cifar, tmp_path):
    folder = cifar.fetch(tmp_path / "data")
    assert folder == tmp_path / "data" / "images" / "cifar-10-batches-py"
    assert len(load_cifar10(folder, "train")[0]) == 10 and len(load_cifar10(folder, "test")[0]) == 2


def test_a_complete_folder_is_kept_without_downloading_the_archive_again(
    cifar, tmp_path, monkeypatch
):
    root = tmp_path / "data"
    folder = cifar.fetch(root)
    (root / "images" / "cifar-10-python.tar.gz").unlink()
    monkeypatch.setattr(cifar, "URL", (tmp_path / "gone.tar.gz").as_uri())  # a download would fail
    assert cifar.fetch(root) == folder
    assert not (root / "images" / "cifar-10-python.tar.gz").exists()
    (folder / "data_batch_3").unlink()  # incomplete: fetched again
    with pytest.raises(DownloadError):
        cifar.fetch(root)


def test_an_archive_with_another_md5_is_removed_and_refused(cifar, tmp_path, monkeypatch):
    monkeypatch.setattr(cifar, "MD5", "0" * 32)
    with pytest.raises(ValueError, match="differs from the published"):
        cifar.fetch(tmp_path / "data")
    assert not (tmp_path / "data" / "images" / "cifar-10-python.tar.gz").exists()


def python_before_3_11_4(monkeypatch):
    """tarfile as in Python 3.11.0–3.11.3: no `data_filter`, and `extractall` takes no filter
    (trusts all)."""
    monkeypatch.delattr(tarfile, "data_filter")
    extractall = tarfile.TarFile.extractall

    def unfiltered(self, path=".", members=None, *, numeric_owner=False):
        return extractall(self, path, members, numeric_owner=numeric_owner, filter="fully_trusted")

    monkeypatch.setattr(tarfile.TarFile, "extractall", unfiltered)


def unsafe(kind, tmp_path):
    """An archive member that would write outside the target folder."""
    info = tarfile.TarInfo(
        {
            "dotdot": "cifar-10-batches-py/../../../escaped",
            "absolute": f"{tmp_path}/escaped",
            "symlink": "cifar-10-batches-py/outside",
        }[kind]
    )
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, "../../../escaped"
        return {info: None}
    info.size = 1
    return {info: b"x"}


@pytest.mark.parametrize("data_filter", [True, False], ids=["data-filter", "python-before-3.11.4"])
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_unsafe_members_never_reach_outside_the_folder_with_or_without_tarfile_data_filter(
    cifar, tmp_path, monkeypatch, kind, data_filter
):
    if not data_filter:
        python_before_3_11_4(monkeypatch)
    archive = write_archive(tmp_path / "unsafe.tar.gz", unsafe(kind, tmp_path))
    monkeypatch.setattr(cifar, "URL", archive.as_uri())
    monkeypatch.setattr(cifar, "MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    images = tmp_path / "data" / "images"
    # the data filter drops the leading "/": the file lands inside
    if data_filter and kind == "absolute":
        cifar.fetch(tmp_path / "data")
        assert (images / str(tmp_path).lstrip("/") / "escaped").is_file()
    else:
        with pytest.raises(ValueError if not data_filter else (ValueError, tarfile.FilterError)):
            cifar.fetch(tmp_path / "data")
    assert (
        not (tmp_path / "escaped").exists()
        and not (images / "cifar-10-batches-py" / "outside").is_symlink()
    )


def test_without_data_filter_a_safe_archive_still_unpacks(cifar, tmp_path, monkeypatch):
    python_before_3_11_4(monkeypatch)
    folder = cifar.fetch(tmp_path / "data")
    assert len(load_cifar10(folder, "test")[0]) == 2
