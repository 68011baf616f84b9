"""Code search data: the files UniXcoder's code-search script reads, as `{"query", "code", "key"}`
examples (`data_scripts/build_codesearch_standin.py` writes its stand-in in the last two below).

  CosQA          cosqa-retrieval-*.json, a JSON list: query `doc`, key `retrieval_idx` (`label`
                 ignored, as UniXcoder does). Pool: code_idx_map.txt, {code: retrieval_idx}.
  AdvTest        {train,valid,test}.jsonl: `docstring_tokens`, `code_tokens` (train) or
                 `function_tokens` (names normalised, valid/test), key `url`. Pool: the split file.
  CodeSearchNet  {train,valid,test}.jsonl: `docstring_tokens`, `code_tokens`, `url`. Pool:
                 codebase.jsonl."""

from pathlib import Path
from typing import NamedTuple

import torch

from gcbs_lib.check import require
from gcbs_lib.data import read_json


def load(path: str | Path) -> list[dict]:
    """`{"query", "code", "key"}` dicts of any file UniXcoder's run.py reads: `.jsonl`, a JSON list
    (CosQA) or object {code: retrieval_idx} (code_idx_map.txt, query ""); errors name file, line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no code-search file at {path} (fetch it: data_scripts/download_codesearch.py)"
        )
    text = path.read_text(encoding="utf-8")
    if path.name.endswith(".jsonl"):
        lines = [(f"{path}:{n}", line) for n, line in enumerate(text.splitlines(), 1)]
        examples = [_example(read_json(at, line), at) for at, line in lines if line.strip()]
    else:
        document = read_json(path, text, "; JSON-lines files are named *.jsonl")
        got = f"expected a JSON list or object, got {type(document).__name__}"
        require(isinstance(document, (dict, list)), f"{path}: {got}")
        if isinstance(document, dict):  # code_idx_map
            integers = all(type(idx) is int for idx in document.values())
            require(integers, f"{path}: a code map holds integer retrieval_idx")
            examples = [
                {"query": "", "code": _joined(c), "key": str(i)} for c, i in document.items()
            ]
        else:
            examples = [_example(row, f"{path}[{i}]") for i, row in enumerate(document)]
    require(examples, f"{path}: no code-search examples")
    return examples


def _example(row: dict, where: str) -> dict:
    """One row as {"query", "code", "key"}, with run.py's field choices."""
    require(isinstance(row, dict), f"{where}: expected a JSON object, got {type(row).__name__}")
    code = row.get("function_tokens", row.get("code_tokens"))
    key = row.get("url", row.get("retrieval_idx"))
    query = row.get("docstring_tokens")
    query = query if isinstance(query, list) else row.get("doc", query)
    needs = "docstring_tokens or doc, code_tokens or function_tokens, and url or retrieval_idx"
    require(None not in (code, query, key), f"{where}: a row needs {needs}; it has {sorted(row)}")
    return {"query": _joined(query), "code": _joined(code), "key": str(key)}


def _joined(tokens: list | str) -> str:
    """Tokens joined by one space (a string is split on whitespace first)."""
    return " ".join(tokens.split() if isinstance(tokens, str) else map(str, tokens))


class RetrievalTask(NamedTuple):
    """A query file matched against a pool, as UniXcoder's script scores it."""

    queries: list[str]
    codes: list[str]  # the pool's code texts
    positive: torch.Tensor  # LongTensor [Q]: the pool row of each query's match, −1: none
    missing: int  # queries with no match
    repeated: int  # repeated pool keys
    sources: list[str]  # each query's `source_of` its key


def retrieval_task(query_file: str | Path, pool_file: str | Path | None = None) -> RetrievalTask:
    """Pair each query of `query_file` with the row of `pool_file` (None: the query file) holding
    its key, as UniXcoder's script does: a repeated key keeps its first row, no match gets −1."""
    queries = load(query_file)
    pool = queries if pool_file is None else load(pool_file)
    first = {}  # key: its first row in the pool
    for row, example in enumerate(pool):
        first.setdefault(example["key"], row)
    index = {key: i for i, key in enumerate(first)}
    positive = torch.tensor([index.get(e["key"], -1) for e in queries], dtype=torch.long)
    texts = [e["query"] for e in queries]
    codes = [pool[r]["code"] for r in first.values()]
    missing = int((positive < 0).sum())
    sources = [source_of(e["key"]) for e in queries]
    return RetrievalTask(texts, codes, positive, missing, len(pool) - len(first), sources)


def source_of(key: str) -> str:
    """The unit a test split is drawn by, from an example's key: a GitHub url's repository, a
    stand-in url's top-level module (`python-3.11.7-stdlib/email`), else the key (CosQA's index)."""
    parts = key.partition("#")[0].removeprefix("https://").split("/")
    return "/".join(parts[: 3 if parts[0] == "github.com" else 2]).removesuffix(".py")
