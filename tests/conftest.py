"""Shared fixtures for the test suite; data_scripts/ goes first on sys.path, so tests `import fetch`
as scripts do."""

import json
import random
import sys
from pathlib import Path

import psutil
import pytest
import torch

DATA_SCRIPTS = str(Path(__file__).resolve().parents[1] / "data_scripts")
if DATA_SCRIPTS not in sys.path:
    sys.path.insert(0, DATA_SCRIPTS)


@pytest.fixture
def float64_default():
    """Run a test with float64 as the default dtype, restoring the previous default afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def child_command_lines(pid: int | None = None) -> list[list[str]]:
    """The command lines of a process's descendants (default: this one's) that are still running; a
    child that exits while they are listed (gone, or a zombie) is left out."""
    lines = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            lines.append(child.cmdline())
        except psutil.NoSuchProcess:  # a ZombieProcess is one
            pass
    return lines


WORDS = [f"w{i}" for i in range(120)]


def planted_pair(rng: random.Random, i: int, split: str) -> dict:
    """A docstring and a function sharing four topic words, so a bag-of-words encoder can learn to
    match them."""
    topic = rng.sample(WORDS, 4)
    doc = topic + rng.sample(WORDS, 2)
    code = ["def", f"f{i}", "(", "x", ")", ":", "return", *topic, *rng.sample(WORDS, 3)]
    url = f"planted/{split}/file{i // 4}.py#L{i}"  # four functions a file
    return {"url": url, "docstring_tokens": doc, "code_tokens": code}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """Planted train/valid/test/codebase files where CodeSearchNet python lives under a data
    root."""
    root = tmp_path_factory.mktemp("data")
    folder = root / "codesearch" / "CSN" / "python"
    folder.mkdir(parents=True)
    rng = random.Random(0)
    splits = {
        split: [planted_pair(rng, i, split) for i in range(n)]
        for split, n in (("train", 192), ("valid", 48), ("test", 48))
    }
    # a duplicate query
    splits["train"][5]["docstring_tokens"] = splits["train"][4]["docstring_tokens"]
    for split, rows in splits.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "codebase.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in splits["valid"] + splits["test"])
    )
    return root
