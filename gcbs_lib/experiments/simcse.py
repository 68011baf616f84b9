"""Unsupervised SimCSE (Gao, Yao and Chen, 2021) as the GCBS paper trains it: the two dropout masks
of two passes make a sentence's positive pair, the batch's other sentences the negatives, ℓ_i =
−log( e^{cos(h_i, h_i⁺)/τ} / Σ_j e^{cos(h_i, h_j⁺)/τ} ), τ = 0.05, one direction; max length 32,
batch 64, lr 3e-5, [CLS] through an MLP at training time only. Scored by Spearman's ρ (a fraction;
papers print ×100) on SentEval or the stand-in (NOT STS)."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gcbs_lib.data import data_root, ensure_built
from gcbs_lib.data.sts import (
    STANDIN_NAME,
    TASKS,
    load,
    load_standin,
    read_sentences,
    senteval_path,
    standin_file,
)
from gcbs_lib.distributed import gather_with_grad
from gcbs_lib.experiments import Batch, Experiment, TrainSet, embed_in_batches, to_device
from gcbs_lib.losses import rank_info_nce
from gcbs_lib.metrics import spearman
from gcbs_lib.models import MODEL_NAMES, text_encoder
from gcbs_lib.seeding import fixed_subset

# tiny-bert: a random BERT, for CI; mlm-bert: a small BERT pretrained as a masked LM on the stand-in
BUILT_MODELS = {"tiny-bert": "build_tiny_bert.py", "mlm-bert": "build_mlm_bert.py"}


class SimCSE(Experiment):
    """Unsupervised SimCSE with a Hugging Face encoder (see the module docstring)."""

    @dataclass
    class Options:
        data: str = "standin"  # standin (gensim wheel; NOT STS) | paper (wiki1m + SentEval)
        data_root: str | None = None  # default: gcbs_lib.data.data_root()
        train_limit: int | None = None  # train on a fixed random subset of this many sentences
        eval_limit: int | None = None  # score at most this many pairs a task (fixed subset)
        encoder: str = "tiny-bert"  # tiny-bert | mlm-bert | minilm | a Hugging Face name or path
        pooling: str = "cls_mlp_train"  # SimCSE's cls + MLP at training time only
        dropout: float | None = None  # None: the encoder's own (0.1 for BERT)
        max_length: int = 32  # training sentences
        eval_max_length: int = 256  # evaluation texts (Lee documents are paragraphs)
        eval_batch_size: int = 128

    dev_metric = "spearman"
    data_name = property(lambda self: "paper" if self.options.data == "paper" else STANDIN_NAME)
    model_name = property(lambda self: MODEL_NAMES.get(self.options.encoder, self.options.encoder))
    root = property(lambda self: data_root(self.options.data_root))

    def load_data(self) -> TrainSet:
        o = self.options
        if o.data not in ("standin", "paper"):
            raise ValueError(f"data must be 'standin' or 'paper', got {o.data!r}")
        train, tasks = (paper_data if o.data == "paper" else standin_data)(self.root)
        self.train = [train[i] for i in fixed_subset(len(train), o.train_limit, "train-subset")]
        self.tasks = {
            split: {
                name: _limit(task, o.eval_limit, f"{split}-{name}") for name, task in named.items()
            }
            for split, named in tasks.items()
        }
        return TrainSet(len(self.train), [" ".join(text.lower().split()) for text in self.train])

    def build_model(self) -> nn.Module:
        o = self.options
        name = o.encoder
        if o.encoder in BUILT_MODELS:
            built = self.root / "models" / o.encoder
            name = ensure_built(built, BUILT_MODELS[o.encoder], "--root", self.root)
        length = max(o.max_length, o.eval_max_length)
        self.encoder = text_encoder(
            str(name), pooling=o.pooling, max_length=length, dropout=o.dropout
        )
        return self.encoder

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """The sentences twice: the two branches draw two dropout masks."""
        tokens = self.encoder.tokenize([self.train[i] for i in indices], self.options.max_length)
        return Batch([tokens, tokens])

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        # every rank's anchors, positives
        return rank_info_nce(*(gather_with_grad(z) for z in embeddings), scale)

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple:
        """Each sentence's embedding, twice (eval mode has no dropout)."""
        z = model(to_device(self.collate(indices.tolist()).inputs[0], self.device))
        return z, z

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Spearman's ρ of each task of `split`, and their average as `spearman`."""
        scores = {}
        for name, (first, second, gold) in self.tasks[split].items():
            distinct = sorted(set(first + second))  # a Lee document is in 24 pairs: encode it once
            vectors = self.embed(model, distinct)
            row = {text: i for i, text in enumerate(distinct)}
            cosines = F.cosine_similarity(
                vectors[[row[t] for t in first]], vectors[[row[t] for t in second]], dim=-1
            )
            scores[f"spearman_{name}"] = spearman(cosines.numpy(), gold)
        return {"spearman": sum(scores.values()) / len(scores), **scores}

    def embed(self, model: nn.Module, texts: list[str]) -> torch.Tensor:
        """Evaluation embeddings of `texts` (float32, on the CPU), `eval_batch_size` at a time."""
        size, length = self.options.eval_batch_size, self.options.eval_max_length
        batches = (
            self.encoder.tokenize(texts[i : i + size], length) for i in range(0, len(texts), size)
        )
        return embed_in_batches(model, batches, self.device).float().cpu()


def paper_data(root: Path) -> tuple[list[str], dict]:
    """From `<root>/sts/`: wiki1m to train; {"dev": STS-B dev, "test": every SentEval task}."""
    train_file, senteval = root / "sts" / "wiki1m_for_simcse.txt", root / "sts" / "SentEval"
    if not train_file.is_file():
        raise FileNotFoundError(
            f"no {train_file}: fetch it with data_scripts/download_sts.py (or set data_root), "
            f"or use data='standin' offline"
        )
    dev = {"STSBenchmark": load(senteval_path("STSBenchmark", senteval, "dev"), "STSBenchmark")}
    train = read_sentences(train_file)
    test = {t: load(senteval_path(t, senteval), t) for t in TASKS}
    return train, {"dev": dev, "test": test}


def standin_data(root: Path) -> tuple[list[str], dict]:
    """The stand-in (NOT STS): Wikipedia sentences to train; the Lee pairs among a fixed half of its
    documents as dev; the Lee pairs among the other half, WordSim353 and SimLex-999 as test."""
    test = {name: load_standin(name, root) for name in ("lee-test", "wordsim353", "simlex999")}
    train = read_sentences(standin_file("train.txt", root))
    dev = {"lee": load_standin("lee-dev", root)}
    return train, {"dev": dev, "test": {"lee": test.pop("lee-test"), **test}}


def _limit(task, limit: int | None, purpose: str):
    """A task cut to a fixed random subset of `limit` pairs."""
    keep = fixed_subset(len(task[2]), limit, purpose)
    return [task[0][i] for i in keep], [task[1][i] for i in keep], [float(task[2][i]) for i in keep]
