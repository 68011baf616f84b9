"""Data families, one module each: real-format readers, offline real stand-ins, planted synthetic data.

  codesearch  CosQA / AdvTest / CodeSearchNet files as UniXcoder reads them; the stdlib docstring→code stand-in
  sts         SentEval STS12–16, STS-B, SICK-R; the gensim-wheel stand-ins (not STS)
  howto100m   per-video features and captions, MIL-NCE bags; the python-doc narrated stand-in

Everything downloaded or built lives under `data_root()`; `download` fetches one file there, checksummed.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

DATA_ROOT_VARIABLE = "GCBS_DATA_ROOT"


def data_root() -> Path:
    """The data folder: env `GCBS_DATA_ROOT` if set, else `<repo>/data` (git-ignored)."""
    configured = os.environ.get(DATA_ROOT_VARIABLE)
    return Path(configured).expanduser() if configured else Path(__file__).resolve().parents[2] / "data"


class DownloadError(RuntimeError):
    """A file could not be fetched (no route to the host, HTTP error, timeout)."""


def sha256sum(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, path: str | Path, sha256: str | None = None, timeout: float = 60) -> Path:
    """Fetch `url` to `path` unless it is already there, then check its SHA-256 when one is known.

    The file appears atomically (written to `<path>.part`, then renamed). A file whose checksum differs is
    removed and refused. An unreachable host raises `DownloadError` saying where to put the file by hand.
    """
    path = Path(path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
                shutil.copyfileobj(response, out)
        except (urllib.error.URLError, OSError) as error:
            partial.unlink(missing_ok=True)
            raise DownloadError(f"could not download {url} ({error}). This machine may not reach it: fetch "
                                f"it where the network allows and place it at {path}") from None
        os.replace(partial, path)
    if sha256 is not None and sha256sum(path) != sha256:
        actual = sha256sum(path)
        path.unlink()
        raise ValueError(f"{path.name}: SHA-256 {actual} differs from the recorded {sha256}; file removed")
    return path
