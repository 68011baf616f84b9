"""Data families, one reader module each (codesearch, sts, howto100m, images), and the kit's file
tools (`read_json`, `write_atomic`, builds under `data_root()`); builders are in `data_scripts/`."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPOSITORY = Path(__file__).resolve().parents[2]


def data_root(chosen=None, option="data_root", *, built_here=False) -> Path:
    """The data folder: `chosen` (it, or if `built_here` its parent, must exist: a typo would put
    data astray), $GCBS_DATA_ROOT or <repo>/data."""
    folder = Path(chosen or os.environ.get("GCBS_DATA_ROOT") or REPOSITORY / "data").expanduser()
    if chosen and not (folder.parent if built_here else folder).is_dir():
        raise ValueError(
            f"{option} {chosen}{': its parent folder' if built_here else ''} does not exist: "
            f"create it, or leave {option} unset for {data_root()}"
        )
    return folder


def run_data_script(script: str, *args) -> None:
    """Run `data_scripts/<script> args...` in a fresh Python; a failure raises with its output."""
    command = [sys.executable, str(REPOSITORY / "data_scripts" / script), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        output = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"data_scripts/{script} failed (exit {done.returncode}):\n{output}")


def ensure_built(folder: str | Path, script: str, *args) -> Path:
    """`folder`, built first by `run_data_script(script, *args)` unless it holds a manifest.json."""
    if not (Path(folder) / "manifest.json").is_file():
        run_data_script(script, *args)
    return Path(folder)


def read_json(where: str | Path, text: str | None = None, hint: str = ""):
    """The JSON value of file `where`, or of `text` from it ("file:line"); errors name `where`."""
    try:
        return json.loads(Path(where).read_text() if text is None else text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON ({error}){hint}") from None


def write_atomic(path: str | Path, content: str | Callable[[Path], object]) -> Path:
    """Write `content` (a text, or a function writing the file it is given, as `partial(torch.save,
    state)`) via a temporary file and a rename: no reader ever sees half a file."""
    temporary = Path(path).with_name(f".{Path(path).name}.tmp")
    temporary.parent.mkdir(parents=True, exist_ok=True)
    content(temporary) if callable(content) else temporary.write_text(content)
    return temporary.replace(path)


def build_once(folder: str | Path, spec: dict, write: Callable[[Path], dict]) -> Path:
    """`folder`, built unless its `manifest.json` matches `spec`: `write(staging)` fills a staging
    folder and returns extra manifest fields, then one rename publishes it (no half builds; the
    first rename wins among concurrent callers, e.g. DDP ranks; another spec's build is redone)."""
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
    return manifest.is_file() and {k: read_json(manifest).get(k) for k in spec} == spec


class PlainUnpickler(pickle.Unpickler):
    """Unpickles plain containers, numbers, strings and numpy arrays only (else unpickling runs
    the code a file names); the kit's pickles (HowTo100M captions, CIFAR-10) hold nothing else."""

    PLAIN = (dict, list, tuple, set, frozenset, str, bytes, int, float, complex, bool)
    NUMPY = ("numpy.core.multiarray", "numpy._core.multiarray")
    ALLOWED = {("builtins", t.__name__) for t in PLAIN}
    ALLOWED |= {(m, n) for m in NUMPY for n in ("_reconstruct", "scalar")}
    ALLOWED |= {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}  # _codecs: bytes

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"the pickle refers to {module}.{name}; only plain containers, numbers, "
                f"strings and numpy arrays are read (unpickling could run its code)"
            )
        return super().find_class(module, name)
