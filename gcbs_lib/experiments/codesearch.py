"""Code search as UniXcoder fine-tunes it (GCBS paper, Table 1): natural-language query → code, one shared encoder.

Recipe (UniXcoder's code-search run.py): the same encoder embeds queries and code, mean pooling, L2 norm,
logit scale 20 (τ = 0.05), cross-entropy of each query over the batch's code only (NL→code), AdamW 2e-5,
batch 64; MRR over the whole evaluation pool, a match beyond rank 1000 counting 0; the best dev MRR is kept.

Data (`data`): the real datasets in UniXcoder's layout under `<data_root>/codesearch/`:
  cosqa    cosqa/cosqa-retrieval-{train-19604,dev-500,test-500}.json, pool cosqa/code_idx_map.txt
  advtest  AdvTest/{train,valid,test}.jsonl, each evaluation file its own pool
  csn      CSN/<language>/{train,valid,test}.jsonl, pool CSN/<language>/codebase.jsonl
or the offline stand-ins built from the Python standard library (`stdlib-csn`, `stdlib-advtest`).
Pairs whose queries or code are identical are one duplicate group (connected components of "same query or same
code"): GCBS keeps a group's pairs in different batches and mining never picks within it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gcbs_lib.data import data_root
from gcbs_lib.data.codesearch import STANDIN_NAME, load, retrieval_task, ensure_stdlib_standin
from gcbs_lib.distributed import gather_with_grad, rank_info_nce
from gcbs_lib.experiments import Batch, Experiment, TrainSet, register, to_device
from gcbs_lib.metrics import mrr, recall_at, retrieval_ranks
from gcbs_lib.models import text_encoder
from gcbs_lib.seeding import fixed_subset

# data name → (train file, {split: (query file, pool file or None)}) relative to <data_root>/codesearch
REAL_DATA = {
    "cosqa": ("cosqa/cosqa-retrieval-train-19604.json",
              {"dev": ("cosqa/cosqa-retrieval-dev-500.json", "cosqa/code_idx_map.txt"),
               "test": ("cosqa/cosqa-retrieval-test-500.json", "cosqa/code_idx_map.txt")}),
    "advtest": ("AdvTest/train.jsonl", {"dev": ("AdvTest/valid.jsonl", None), "test": ("AdvTest/test.jsonl", None)}),
    "csn": ("CSN/{language}/train.jsonl", {"dev": ("CSN/{language}/valid.jsonl", "CSN/{language}/codebase.jsonl"),
                                           "test": ("CSN/{language}/test.jsonl", "CSN/{language}/codebase.jsonl")}),
}
STANDINS = {"stdlib-csn": ("csn", {"dev": ("valid.jsonl", "codebase.jsonl"), "test": ("test.jsonl", "codebase.jsonl")}),
            "stdlib-advtest": ("advtest", {"dev": ("valid.jsonl", None), "test": ("test.jsonl", None)})}
MODEL_NAMES = {"tiny": "tiny-text-encoder", "minilm": "all-MiniLM-L6-v2"}


@register("codesearch")
class CodeSearch(Experiment):
    """NL→code retrieval with a shared text encoder (see the module docstring)."""

    @dataclass
    class Options:
        data: str = "stdlib-csn"          # stdlib-csn | stdlib-advtest (offline stand-ins) | cosqa | advtest | csn
        data_root: str | None = None      # default: gcbs_lib.data.data_root()
        language: str = "python"          # CodeSearchNet language folder
        train_limit: int | None = None    # train on a fixed random subset of this many pairs
        eval_limit: int | None = None     # score this many dev/test queries (fixed subset); the pool stays whole
        encoder: str = "tiny"             # tiny | minilm | a Hugging Face name or path (microsoft/unixcoder-base)
        pooling: str = "mean"
        prefix: str | None = None         # UniXcoder: "<encoder-only>"
        dropout: float | None = None      # None: the encoder's own
        query_length: int = 128           # UniXcoder's nl_length
        code_length: int = 256            # UniXcoder's code_length
        tiny_dim: int = 32
        tiny_layers: int = 2
        eval_batch_size: int = 256
        mrr_cutoff: int = 1000

    dev_metric = "mrr"
    supports_mining = True

    # ---- data -------------------------------------------------------------------------------------------
    def load_data(self) -> TrainSet:
        o = self.options
        root = Path(o.data_root) if o.data_root else data_root()
        if o.data in STANDINS:
            variant, splits = STANDINS[o.data]
            folder = ensure_stdlib_standin(root, variant)
            train_file, self.splits = folder / "train.jsonl", {
                split: (folder / q, None if p is None else folder / p) for split, (q, p) in splits.items()}
        elif o.data in REAL_DATA:
            train, splits = REAL_DATA[o.data]
            base = root / "codesearch"

            def path(name):
                return base / name.format(language=o.language)

            train_file = path(train)
            self.splits = {split: (path(q), None if p is None else path(p)) for split, (q, p) in splits.items()}
            missing = [str(f) for f in [train_file, *[f for q, p in self.splits.values() for f in (q, p) if f]]
                       if not f.exists()]
            if missing:
                raise FileNotFoundError(f"code-search data {o.data!r} is missing {missing}: fetch it with "
                                        f"data_scripts/ (or set data_root), or use data='stdlib-csn' offline")
        else:
            raise ValueError(f"data must be one of {sorted(STANDINS) + sorted(REAL_DATA)}, got {o.data!r}")
        pairs = load(train_file)
        self.train = [pairs[i] for i in fixed_subset(len(pairs), o.train_limit, "train-subset")]
        self._tasks = {}
        return TrainSet(len(self.train), duplicate_groups(self.train))

    @property
    def data_name(self) -> str:
        if self.options.data in STANDINS:
            return STANDIN_NAME if self.options.data == "stdlib-csn" else f"{STANDIN_NAME}-advtest"
        return "paper"

    @property
    def model_name(self) -> str:
        return MODEL_NAMES.get(self.options.encoder, self.options.encoder)

    # ---- model and steps --------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        o = self.options
        self.encoder = text_encoder(o.encoder, pooling=o.pooling, max_length=max(o.query_length, o.code_length),
                                    prefix=o.prefix, dropout=o.dropout, tiny_dim=o.tiny_dim, tiny_layers=o.tiny_layers)
        return self.encoder

    def _queries(self, texts: Sequence[str]):
        return self.encoder.tokenize(texts, self.options.query_length)

    def _codes(self, texts: Sequence[str]):
        return self.encoder.tokenize(texts, self.options.code_length)

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """Queries of `indices`, and their code, each followed by its mined negative's code when given."""
        codes = [self.train[i]["code"] for i in indices]
        if negatives is not None:
            codes = [code for i, j in zip(indices, negatives) for code in (self.train[i]["code"], self.train[j]["code"])]
        return Batch([self._queries([self.train[i]["query"] for i in indices]), self._codes(codes)])

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        queries, codes = embeddings
        return rank_info_nce(gather_with_grad(queries), gather_with_grad(codes), scale)

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.train[i] for i in indices.tolist()]
        return (model(to_device(self._queries([e["query"] for e in items]), self.device)),
                model(to_device(self._codes([e["code"] for e in items]), self.device)))

    # ---- evaluation -------------------------------------------------------------------------------------
    def _task(self, split: str):
        if split not in self._tasks:
            queries, pool = self.splits[split]
            task = retrieval_task(queries, pool)
            keep = fixed_subset(len(task.queries), self.options.eval_limit, f"{split}-subset")
            self._tasks[split] = task._replace(queries=[task.queries[i] for i in keep], positive=task.positive[keep])
        return self._tasks[split]

    def _embed(self, model: nn.Module, texts: list[str], tokenize) -> torch.Tensor:
        size = self.options.eval_batch_size
        return torch.cat([model(to_device(tokenize(texts[i:i + size]), self.device)).float().cpu()
                          for i in range(0, len(texts), size)])

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """MRR (cutoff `mrr_cutoff`), R@1 and R@10 of the split's queries against its whole pool."""
        task = self._task(split)
        ranks = retrieval_ranks(self._embed(model, task.queries, self._queries),
                                self._embed(model, task.codes, self._codes), task.positive)
        return {"mrr": mrr(ranks, cutoff=self.options.mrr_cutoff), "recall@1": recall_at(ranks, 1),
                "recall@10": recall_at(ranks, 10)}


def duplicate_groups(pairs: list[dict]) -> list[int]:
    """A group id per pair: pairs linked by an identical query or identical code share it (union-find)."""
    parent = list(range(len(pairs)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for field in ("query", "code"):
        first: dict[str, int] = {}
        for i, pair in enumerate(pairs):
            j = first.setdefault(" ".join(pair[field].split()), i)
            parent[root(i)] = root(j)
    return [root(i) for i in range(len(pairs))]
