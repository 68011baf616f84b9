"""Unsupervised SimCSE (Gao, Yao and Chen, 2021) as the GCBS paper trains it: the two dropout masks
of two passes make a sentence's positive pair, the batch's other sentences the negatives, ℓ_i =
−log( e^{cos(h_i, h_i⁺)/τ} / Σ_j e^{cos(h_i, h_j⁺)/τ} ), τ = 0.05, one direction; max length 32,
batch 64, lr 3e-5, [CLS] through an MLP at training time only. Scored by Spearman's ρ (a fraction;
papers print ×100) on SentEval or the stand-in (NOT STS)."""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.feature_extraction.text import TfidfVectorizer
from torch import nn

from gcbs_lib.data import data_root, ensure_built, read_json, sts
from gcbs_lib.experiments import Batch, Experiment, Outputs, TrainSet, to_device
from gcbs_lib.metrics import spearman
from gcbs_lib.models import MODEL_NAMES, text_encoder
from gcbs_lib.seeding import fixed_subset

# encoders built here (data_scripts/, arguments): tiny-bert, a random BERT for CI; mlm-bert, a small
# BERT pretrained as a masked LM on the stand-in; mlm-bert-minilm-emb, the same over MiniLM's words
BUILT_MODELS = {
    "tiny-bert": ["build_tiny_bert.py"],
    "mlm-bert": ["build_mlm_bert.py"],
    "mlm-bert-minilm-emb": ["build_mlm_bert.py", "--embeddings", "minilm"],
}


class SimCSE(Experiment):
    """Unsupervised SimCSE with a Hugging Face encoder (see the module docstring)."""

    @dataclass
    class Options:
        data: str = "standin"  # standin (gensim wheel; NOT STS) | paper (wiki1m + SentEval)
        data_root: str | None = None  # default: gcbs_lib.data.data_root()
        train_limit: int | None = None  # train on a fixed random subset of this many sentences
        eval_limit: int | None = None  # score at most this many pairs a task (fixed subset)
        encoder: str = "tiny-bert"  # a key of BUILT_MODELS | minilm | a Hugging Face name or path
        pooling: str = "cls_mlp_train"  # SimCSE's cls + MLP at training time only
        dropout: float | None = None  # None: the encoder's own (0.1 for BERT)
        max_length: int = 32  # training sentences
        eval_max_length: int = 256  # evaluation texts (Lee documents are paragraphs)
        eval_batch_size: int = 128

    dev_metric = "spearman"
    data_name = property(lambda self: "paper" if self.options.data == "paper" else sts.STANDIN_NAME)
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
        self.model_name = MODEL_NAMES.get(o.encoder, o.encoder)
        if o.encoder in BUILT_MODELS:
            script, *args = BUILT_MODELS[o.encoder]
            built = ensure_built(self.root / "models" / name, script, *args, "--root", self.root)
            name = str(built)
            # the rows name the weights: a build that came out otherwise shows there
            weights = read_json(built / "manifest.json").get("weights_sha256", "unknown")
            self.model_name += f"@{weights[:7]}"
        length = max(o.max_length, o.eval_max_length)
        self.encoder = text_encoder(name, pooling=o.pooling, max_length=length, dropout=o.dropout)
        return self.encoder

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """The sentences twice: the two branches draw two dropout masks."""
        tokens = self.encoder.tokenize([self.train[i] for i in indices], self.options.max_length)
        return Batch([tokens, tokens])

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple:
        """Each sentence's embedding, twice (eval mode has no dropout)."""
        z = model(to_device(self.collate(indices.tolist()).inputs[0], self.device))
        return z, z

    def evaluate(self, model: nn.Module, split: str) -> Outputs:
        """Each pair's cosine (to 6 decimals) and gold score, task by task; a Lee pair's cluster,
        its two documents (numbered by text)."""
        outputs = {}
        tokenize = partial(self.encoder.tokenize, max_length=self.options.eval_max_length)
        for name, (first, second, gold) in self.tasks[split].items():
            # a Lee document is in 24 pairs: encode it once
            distinct, rows = np.unique(first + second, return_inverse=True)
            vectors = self.embed_texts(model, distinct.tolist(), tokenize)[torch.from_numpy(rows)]
            cosines = F.cosine_similarity(*vectors.split(len(first)), dim=-1)
            outputs[name] = pair_outputs(cosines.numpy(), gold)
            # Lee's pairs are all pairs of 25 documents: the bootstrap resamples documents
            if name == "lee":
                outputs[name]["cluster"] = rows.reshape(2, -1).T.tolist()
        return outputs

    def baseline(self) -> tuple[str, Outputs]:
        """TF-IDF of character 2–4-grams, fit on each test task's texts: each pair's cosine."""
        outputs = {}
        for name, (first, second, gold) in self.tasks["test"].items():
            tfidf = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4)).fit(first + second)
            # rows of unit norm: the dot product is the cosine
            cosines = tfidf.transform(first).multiply(tfidf.transform(second)).sum(axis=1)
            outputs[name] = pair_outputs(np.asarray(cosines).ravel(), gold)
        return "tfidf", outputs

    @staticmethod
    def scores(outputs: Outputs) -> dict[str, float]:
        """Spearman's ρ of each task (0 where cosines or gold are constant: they rank nothing), and
        their average as `spearman`."""
        scores = {}
        for name, task in outputs.items():
            predicted, gold = task["predicted"], task["gold"]
            ranking = np.ptp(predicted) and np.ptp(gold)
            scores[f"spearman_{name}"] = spearman(predicted, gold) if ranking else 0.0
        return {"spearman": sum(scores.values()) / len(scores), **scores}


def pair_outputs(cosines: np.ndarray, gold) -> dict[str, list]:
    """A Spearman task's per-item outputs: cosines rounded to 6 decimals (what is scored and
    committed), gold scores."""
    return {
        "predicted": np.round(cosines.astype(float), 6).tolist(),
        "gold": np.asarray(gold, float).tolist(),
    }


def paper_data(root: Path) -> tuple[list[str], dict]:
    """From `<root>/sts/`: wiki1m to train; {"dev": STS-B dev, "test": every SentEval task}."""
    train_file, senteval = root / "sts" / "wiki1m_for_simcse.txt", root / "sts" / "SentEval"
    if not train_file.is_file():
        raise FileNotFoundError(
            f"no {train_file}: fetch it with data_scripts/download_sts.py (or set data_root), "
            f"or use data='standin' offline"
        )
    dev = sts.load(sts.senteval_path("STSBenchmark", senteval, "dev"), "STSBenchmark")
    test = {t: sts.load(sts.senteval_path(t, senteval), t) for t in sts.TASKS}
    return sts.read_sentences(train_file), {"dev": {"STSBenchmark": dev}, "test": test}


def standin_data(root: Path) -> tuple[list[str], dict]:
    """The stand-in (NOT STS): Wikipedia sentences to train; the Lee pairs among a fixed half of its
    documents as dev; the Lee pairs among the other half, WordSim353 and SimLex-999 as test."""
    test = {name: sts.load_standin(name, root) for name in ("lee-test", "wordsim353", "simlex999")}
    train = sts.read_sentences(sts.standin_file("train.txt", root))
    dev = {"lee": sts.load_standin("lee-dev", root)}
    return train, {"dev": dev, "test": {"lee": test.pop("lee-test"), **test}}


def _limit(task, limit: int | None, purpose: str):
    """A task cut to a fixed random subset of `limit` pairs."""
    keep = fixed_subset(len(task[2]), limit, purpose)
    return [task[0][i] for i in keep], [task[1][i] for i in keep], [float(task[2][i]) for i in keep]
