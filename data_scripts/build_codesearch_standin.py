"""Build the offline code-search stand-in: (first docstring paragraph → function source without its
docstring) pairs extracted with `ast` from the Python standard library that runs this script,
deduplicated by code, split train/valid/test by top-level module (no module in two splits), written
under `<root>/codesearch/` in the real layouts that `gcbs_lib.data.codesearch.load` reads:

  stdlib-csn      CodeSearchNet: train/valid/test.jsonl, codebase.jsonl = valid + test (the pool)
  stdlib-advtest  AdvTest: valid/test.jsonl with `function`/`function_tokens`, names normalised to
  `func`,
                  `arg_0`, ...; each evaluation file is its own pool

Functions with identical docstrings are kept: they are the natural false negatives that GCBS batches
together. Idempotent: a folder whose manifest.json matches (source, Python, builder version) is
kept; concurrent runs (DDP ranks) are safe. The experiment `codesearch` runs this script on first
use of `data: stdlib-*`.

    python data_scripts/build_codesearch_standin.py [--root DIR] [--variant csn advtest] [--stdlib
    DIR]
"""

import argparse
import ast
import functools
import hashlib
import io
import json
import os
import re
import sys
import sysconfig
import textwrap
import time
import tokenize
from collections import Counter
from pathlib import Path
from typing import Iterator

from gcbs_lib.data import build_once, data_root

STANDIN_NAME = "stdlib-docstrings"
STANDIN_VARIANTS = ("csn", "advtest")
# bump when the extraction changes: existing stand-ins are rebuilt
BUILDER_VERSION = 1
HELD_OUT_SHARES = {"test": 0.1, "valid": 0.1}  # of all pairs; the remaining modules train
MIN_QUERY_WORDS = 3  # CodeSearchNet/AdvTest drop documents shorter than 3 tokens
SKIPPED_DIRECTORIES = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    # the last two: codec tables and help text, 9 pairs in 2 MB
    "encodings",
    "pydoc_data",
}
_LAYOUT_TOKENS = {
    tokenize.NEWLINE,
    tokenize.NL,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
    tokenize.COMMENT,
}


def ensure_stdlib_standin(
    root: str | Path | None = None, variant: str = "csn", stdlib: str | Path | None = None
) -> Path:
    """The folder of the stdlib stand-in under `root` (default `data_root()`), built once,
    deterministically.

    variant "csn": train/valid/test.jsonl + codebase.jsonl (pool of valid and test), like
    CodeSearchNet. variant "advtest": train.jsonl as "csn"; valid/test.jsonl with normalised
    `function`/`function_tokens`, each its own pool, like AdvTest. `stdlib` is the library to
    extract from (default: this Python's). A `manifest.json` records the source, split sizes,
    skipped files and file checksums; a folder built from another source, Python or builder version
    is rebuilt. Concurrent callers (DDP ranks) are safe.
    """
    if variant not in STANDIN_VARIANTS:
        raise ValueError(f"variant must be one of {STANDIN_VARIANTS}, got {variant!r}")
    folder = Path(root if root is not None else data_root()) / "codesearch" / f"stdlib-{variant}"
    stdlib = str(Path(stdlib or sysconfig.get_paths()["stdlib"]).resolve())
    spec = {
        "name": STANDIN_NAME,
        "variant": variant,
        "builder": BUILDER_VERSION,
        "python": _python_version(),
        "stdlib": stdlib,
    }
    return build_once(
        folder, spec, lambda staging: _write_standin(staging, variant, *_extracted(stdlib))
    )


@functools.lru_cache(maxsize=1)
def _extracted(stdlib: str) -> tuple[list[dict], list[str]]:
    """`extract_stdlib_pairs`, remembered so that building both variants extracts once."""
    return extract_stdlib_pairs(stdlib)


def _python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def _write_standin(folder: Path, variant: str, pairs: list[dict], skipped: list[str]) -> dict:
    """Split the pairs and write the stand-in files into `folder`; return the manifest's facts."""
    split_of = split_by_module(pairs)
    splits = {
        name: [p for p in pairs if split_of[p["module"]] == name]
        for name in ("train", "valid", "test")
    }
    files = {f"{name}.jsonl": [_csn_row(p, name) for p in rows] for name, rows in splits.items()}
    if variant == "csn":
        files["codebase.jsonl"] = files["valid.jsonl"] + files["test.jsonl"]
    else:
        for name in ("valid", "test"):
            files[f"{name}.jsonl"] = [_advtest_row(p, name) for p in splits[name]]
    checksums = {}
    for name, rows in files.items():
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        (folder / name).write_bytes(data)
        checksums[name] = hashlib.sha256(data).hexdigest()
    query_counts = Counter(tuple(p["docstring_tokens"]) for p in pairs)
    return {
        "pairs": {name: len(rows) for name, rows in splits.items()},
        "modules": {name: len({p["module"] for p in rows}) for name, rows in splits.items()},
        "pairs_sharing_their_query": sum(n for n in query_counts.values() if n > 1),
        "skipped_files": skipped,
        "sha256": checksums,
    }


def _csn_row(pair: dict, partition: str) -> dict:
    """A pair in the CodeSearchNet jsonl layout."""
    return {
        "repo": f"python-{_python_version()}-stdlib",
        "path": pair["path"],
        "func_name": pair["func_name"],
        "language": "python",
        "code": pair["code"],
        "code_tokens": pair["code_tokens"],
        "docstring": pair["docstring"],
        "docstring_tokens": pair["docstring_tokens"],
        "url": pair["url"],
        "partition": partition,
    }


def _advtest_row(pair: dict, partition: str) -> dict:
    """A held-out pair in the AdvTest layout: `function` / `function_tokens` with names
    normalised."""
    function, tokens = normalise_names(
        pair["code"], pair["func_name"].rsplit(".", 1)[-1], pair["arguments"]
    )
    row = _csn_row(pair, partition)
    del row["code"], row["code_tokens"]
    return {**row, "function": function, "function_tokens": tokens}


def extract_stdlib_pairs(stdlib: str | Path | None = None) -> tuple[list[dict], list[str]]:
    """(docstring → code) pairs from every module of `stdlib` (default: this Python's), deduplicated
    by code.

    Test folders and site-packages are skipped. Returns the pairs in path/line order and the files
    that could not be read or parsed ("path: reason").
    """
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    pairs, skipped, seen_code = [], [], set()
    for path in _python_files(stdlib):
        relative = path.relative_to(stdlib)
        try:
            with tokenize.open(path) as handle:
                source = handle.read()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError) as error:
            skipped.append(f"{relative.as_posix()}: {type(error).__name__}")
            continue
        lines = source.splitlines(keepends=True)
        for node, qualname in _functions(tree):
            pair = _pair(node, qualname, lines, relative.as_posix())
            if pair is not None and tuple(pair["code_tokens"]) not in seen_code:
                seen_code.add(tuple(pair["code_tokens"]))
                pairs.append(pair)
    return pairs, skipped


def _python_files(folder: Path) -> list[Path]:
    """The .py files below `folder` in sorted order, not descending into SKIPPED_DIRECTORIES."""
    found = []
    for directory, subdirectories, names in os.walk(folder):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRECTORIES]
        found += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(found)


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[ast.AST, str]]:
    """Every function and method below `node`, with its dotted qualified name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child, prefix + child.name
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        # expressions hold no `def`
        elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            yield from _functions(child, prefix)


def _pair(node, qualname: str, lines: list[str], relative: str) -> dict | None:
    """The (first docstring paragraph, source without docstring) pair of one function, or None to
    skip it.

    Skipped: no docstring, a first paragraph under MIN_QUERY_WORDS words, a body that is only
    `pass`/`...`, a docstring sharing a line with code.
    """
    docstring = ast.get_docstring(node)
    if not docstring:
        return None
    paragraph = " ".join(re.split(r"\n\s*\n", docstring, maxsplit=1)[0].split())
    if len(re.findall(r"\w+", paragraph)) < MIN_QUERY_WORDS:
        return None
    doc_node, rest = node.body[0], node.body[1:]
    if all(
        isinstance(s, ast.Pass)
        or (
            isinstance(s, ast.Expr)
            and isinstance(s.value, ast.Constant)
            and s.value.value is Ellipsis
        )
        for s in rest
    ):
        return None
    if (
        lines[doc_node.lineno - 1].encode()[: doc_node.col_offset].strip()
        or rest[0].lineno == doc_node.end_lineno
    ):
        return None
    kept = (
        lines[node.lineno - 1 : doc_node.lineno - 1] + lines[doc_node.end_lineno : node.end_lineno]
    )
    code = textwrap.dedent("".join(kept)).rstrip() + "\n"
    try:
        code_tokens = [
            t.string
            for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type not in _LAYOUT_TOKENS
        ]
    except (tokenize.TokenError, SyntaxError):
        return None
    module = relative.split("/", 1)[0].removesuffix(".py")
    arguments = node.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args]
    names += [arguments.vararg.arg] if arguments.vararg else []
    names += [a.arg for a in arguments.kwonlyargs] + (
        [arguments.kwarg.arg] if arguments.kwarg else []
    )
    return {
        "module": module,
        "path": relative,
        "func_name": qualname,
        "arguments": names,
        "docstring": paragraph,
        "docstring_tokens": re.findall(r"\w+|[^\w\s]", paragraph),
        "code": code,
        "code_tokens": code_tokens,
        "url": f"python-{_python_version()}-stdlib/{relative}#L{node.lineno}-L{node.end_lineno}",
    }


def split_by_module(pairs: list[dict]) -> dict[str, str]:
    """Assign each top-level module to "train", "valid" or "test", no module in two splits.

    Modules are visited in a fixed pseudo-random order (a hash of the name); each goes to the first
    held-out split still under its share of all pairs (HELD_OUT_SHARES), else to train.
    """
    sizes = Counter(pair["module"] for pair in pairs)
    total, filled, split_of = sum(sizes.values()), dict.fromkeys(HELD_OUT_SHARES, 0), {}
    for module in sorted(sizes, key=lambda m: hashlib.blake2b(m.encode(), digest_size=8).digest()):
        split_of[module] = next(
            (s for s, share in HELD_OUT_SHARES.items() if filled[s] < share * total), "train"
        )
        if split_of[module] != "train":
            filled[split_of[module]] += sizes[module]
    return split_of


def normalise_names(code: str, function: str, arguments: list[str]) -> tuple[str, list[str]]:
    """AdvTest-style renaming: the function's name → `func`, its arguments → `arg_0`, `arg_1`, ...

    The name after `def` is `func`; elsewhere an argument shadows a function of the same name; a
    name right after a `.` (an attribute) is left alone. Returns the renamed source and its tokens.
    """
    renamed = {function: "func", **{name: f"arg_{i}" for i, name in enumerate(arguments)}}
    lines, tokens, previous = code.splitlines(keepends=True), [], None
    edits = []  # (row, start column, end column, new text), applied right to left below
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type in _LAYOUT_TOKENS:
            continue
        text = token.string
        if token.type == tokenize.NAME and previous != "." and text in renamed:
            text = "func" if previous == "def" else renamed[text]
            edits.append((token.start[0] - 1, token.start[1], token.end[1], text))
        tokens.append(text)
        previous = token.string
    for row, start, end, text in reversed(edits):
        lines[row] = lines[row][:start] + text + lines[row][end:]
    return "".join(lines), tokens


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", help="data root (default: env GCBS_DATA_ROOT or <repo>/data)")
    parser.add_argument(
        "--variant", nargs="+", choices=STANDIN_VARIANTS, default=list(STANDIN_VARIANTS)
    )
    parser.add_argument(
        "--stdlib", help="the library to extract from (default: this Python's standard library)"
    )
    args = parser.parse_args(argv)
    for variant in args.variant:
        start = time.perf_counter()
        folder = ensure_stdlib_standin(args.root, variant, args.stdlib)
        manifest = json.loads((folder / "manifest.json").read_text())
        print(
            f"{variant:8s} {folder}  pairs {manifest['pairs']}  modules {manifest['modules']}  "
            f"pairs sharing their query {manifest['pairs_sharing_their_query']}  "
            f"({time.perf_counter() - start:.1f} s)"
        )


if __name__ == "__main__":
    main()
