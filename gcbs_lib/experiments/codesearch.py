"""Code search as UniXcoder fine-tunes it (GCBS paper, Table 1): one encoder embeds queries and
code, mean pooling, L2 norm, scale 20, each query's cross-entropy over the batch's code; MRR over
the whole pool, 0 beyond rank 1000. Data (FILES): UniXcoder's layouts, real or the stdlib stand-ins
(`data_scripts/build_codesearch_standin.py`, built on first use). Pairs sharing a query or a code
(false negatives) form a duplicate group, kept out of a batch."""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components
from torch import nn

from gcbs_lib.check import require
from gcbs_lib.data import data_root, run_data_script
from gcbs_lib.data.codesearch import load, retrieval_task
from gcbs_lib.experiments import Batch, Experiment, Outputs, TrainSet
from gcbs_lib.metrics import mrr, recall_at, retrieval_ranks
from gcbs_lib.models import MODEL_NAMES, text_encoder
from gcbs_lib.seeding import fixed_subset

# {split: (query file, pool file)}; AdvTest's: each split its own pool
CSN = {"dev": ("valid.jsonl", "codebase.jsonl"), "test": ("test.jsonl", "codebase.jsonl")}
ADVTEST = {"dev": ("valid.jsonl", None), "test": ("test.jsonl", None)}
COSQA = {
    split: (f"cosqa-retrieval-{split}-500.json", "code_idx_map.txt") for split in ("dev", "test")
}
# data → (folder under <data_root>/codesearch, train file, splits)
FILES = {
    "cosqa": ("cosqa", "cosqa-retrieval-train-19604.json", COSQA),
    "advtest": ("AdvTest", "train.jsonl", ADVTEST),
    "csn": ("CSN/{language}", "train.jsonl", CSN),
    "stdlib-csn": ("stdlib-csn", "train.jsonl", CSN),
    "stdlib-advtest": ("stdlib-advtest", "train.jsonl", ADVTEST),
}
# the `data` of result rows (real data: "paper")
DATA_NAMES = {f"stdlib-{d}": f"stdlib-docstrings-{d}" for d in ("csn", "advtest")}


class CodeSearch(Experiment):
    """NL→code retrieval with one shared text encoder (see the module docstring)."""

    @dataclass
    class Options:
        data: str = "stdlib-csn"  # a key of FILES
        data_root: str | None = None  # default: gcbs_lib.data.data_root()
        language: str = "python"  # CodeSearchNet language folder
        train_limit: int | None = None  # train on a fixed random subset of this many pairs
        eval_limit: int | None = None  # dev/test queries to score (fixed subset); pool stays whole
        encoder: str = "tiny"  # tiny | minilm | a Hugging Face model (microsoft/unixcoder-base)
        prefix: str | None = None  # UniXcoder's mode token "<encoder-only>"
        dropout: float | None = None  # None: the encoder's own
        query_length: int = 128  # UniXcoder's nl_length
        code_length: int = 256  # UniXcoder's code_length
        tiny_dim: int = 32
        tiny_layers: int = 2
        eval_batch_size: int = 256

    dev_metric = "mrr"
    supports_mining = True
    data_name = property(lambda self: DATA_NAMES.get(self.options.data, "paper"))
    model_name = property(lambda self: MODEL_NAMES.get(self.options.encoder, self.options.encoder))

    def load_data(self) -> TrainSet:
        """The training pairs and each split's queries and pool (pool problems show right away)."""
        o = self.options
        require(o.data in FILES, f"data must be one of {sorted(FILES)}, got {o.data!r}")
        root = data_root(o.data_root)
        if o.data.startswith("stdlib-"):
            variant = o.data.removeprefix("stdlib-")
            run_data_script("build_codesearch_standin.py", "--root", root, "--variant", variant)
        name, train, splits = FILES[o.data]
        folder = root / "codesearch" / name.format(language=o.language)
        pairs = load(folder / train)  # refused when empty
        self.tasks = {}
        # as UniXcoder's script: a query with no match scores 0 (positive -1)
        for split, (q, p) in splits.items():
            task = retrieval_task(folder / q, folder / p if p else None)
            if task.missing or task.repeated:
                print(
                    f"{split}: {task.missing} queries with no pool key (scored 0), "
                    f"{task.repeated} repeated keys (first kept)"
                )
            keep = fixed_subset(len(task.queries), o.eval_limit, f"{split}-subset")
            queries = [task.queries[i] for i in keep]
            sources = [task.sources[i] for i in keep]
            self.tasks[split] = task._replace(
                queries=queries, positive=task.positive[keep], sources=sources
            )
        self.train = [pairs[i] for i in fixed_subset(len(pairs), o.train_limit, "train-subset")]
        modules = [pair["key"].partition("#")[0] for pair in self.train]  # a url's file
        return TrainSet(len(self.train), duplicate_groups(self.train), modules)

    def build_model(self) -> nn.Module:
        o = self.options
        length = max(o.query_length, o.code_length)
        options = dict(dropout=o.dropout, tiny_dim=o.tiny_dim, tiny_layers=o.tiny_layers)
        self.encoder = text_encoder(o.encoder, max_length=length, prefix=o.prefix, **options)
        return self.encoder

    def tokens(self, texts: Sequence[str], side: str) -> dict:
        """Encoder inputs of `side` "query" or "code" texts, each cut to its side's length."""
        return self.encoder.tokenize(texts, getattr(self.options, f"{side}_length"))

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """Queries of `indices` and their code, each followed by its mined negative's if given."""
        codes = list(indices)
        if negatives is not None:
            codes = [k for pair in zip(indices, negatives) for k in pair]
        queries = self.tokens([self.train[i]["query"] for i in indices], "query")
        code = self.tokens([self.train[k]["code"] for k in codes], "code")
        return Batch([queries, code])

    def evaluate(self, model: nn.Module, split: str) -> Outputs:
        """The rank of each of the split's queries' code in its whole pool; its cluster, the
        source (module, repository) it comes from."""
        task = self.tasks[split]
        queries = self.embed_texts(model, task.queries, partial(self.tokens, side="query"))
        pool = self.embed_texts(model, task.codes, partial(self.tokens, side="code"))
        ranks = retrieval_ranks(queries, pool, task.positive.clamp(0))
        ranks = ranks.masked_fill(task.positive < 0, 1001 + len(pool))  # no match: scored 0
        candidates = [len(pool)] * len(ranks)
        return {
            "queries": {"rank": ranks.tolist(), "candidates": candidates, "cluster": task.sources}
        }

    @staticmethod
    def scores(outputs: Outputs) -> dict[str, float]:
        """MRR (0 beyond rank 1000), R@1 and R@10."""
        ranks = outputs["queries"]["rank"]
        recalls = {f"recall@{k}": recall_at(ranks, k) for k in (1, 10)}
        return {"mrr": mrr(ranks, cutoff=1000), **recalls}


def duplicate_groups(pairs: list[dict]) -> list[int]:
    """A group id per pair: components of "same query or same code" (whitespace ignored)."""
    texts: dict[tuple, int] = {}
    nodes = [
        texts.setdefault((side, *p[side].split()), len(pairs) + len(texts))
        for side in ("query", "code")
        for p in pairs
    ]
    size = len(pairs) + len(texts)
    graph = coo_matrix(
        (np.ones(len(nodes)), (np.tile(np.arange(len(pairs)), 2), nodes)), shape=(size, size)
    )
    return connected_components(graph, directed=False)[1][: len(pairs)].tolist()
