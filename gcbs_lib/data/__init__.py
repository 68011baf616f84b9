"""Data families, one module each: real-format readers, offline real stand-ins, planted synthetic data.

  codesearch  CosQA / AdvTest / CodeSearchNet files as UniXcoder reads them; the stdlib docstring→code stand-in
  sts         SentEval STS12–16, STS-B, SICK-R; the gensim-wheel stand-ins (not STS)
  howto100m   per-video features and captions, MIL-NCE bags; the python-doc narrated stand-in

Everything downloaded or built lives under `data_root()`.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA_ROOT_VARIABLE = "GCBS_DATA_ROOT"


def data_root() -> Path:
    """The data folder: env `GCBS_DATA_ROOT` if set, else `<repo>/data` (git-ignored)."""
    configured = os.environ.get(DATA_ROOT_VARIABLE)
    return Path(configured).expanduser() if configured else Path(__file__).resolve().parents[2] / "data"
