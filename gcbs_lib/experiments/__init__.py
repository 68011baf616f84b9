"""The experiments `gcbs_lib.train` trains, by name: one module each, subclassing `Experiment`."""

import importlib
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from gcbs_lib.distributed import gather_with_grad
from gcbs_lib.losses import rank_info_nce

# name → module:class in this package
EXPERIMENTS = {
    "codesearch": "codesearch:CodeSearch",
    "simcse": "simcse:SimCSE",
    "promcse": "promcse:PromCSE",
    "milnce": "milnce:MilNce",
    "moco": "moco:MoCo",
    "simclr": "moco:SimCLR",
}


class TrainSet(NamedTuple):
    """Training items 0 … size−1; two of equal `duplicate_keys` are never each other's negatives;
    `groups` (default: the duplicate keys) say which in-batch pairs count as the same group in the
    `same_group_pairs` diagnostic (class, video, source module: a proxy for false negatives)."""

    size: int
    duplicate_keys: Sequence[Hashable] | None = None
    groups: Sequence[Hashable] | None = None  # a list, or an integer array


# Per-item outputs of an evaluation, {task: {array: a value per item}}: "predicted" and "gold"
# (Spearman's pairs, kNN's labels) or "rank" and "candidates" (retrieval). Committed beside the
# rows, they give the bootstrap over test items and the chance band of `gcbs_lib.verdict`.
Outputs = dict[str, dict[str, list]]


class Batch(NamedTuple):
    """This rank's rows of a step: `inputs` per branch; `extra`, more loss inputs (read only), with
    `mask_same_group` "groups": the group id of each document (an item's, then its mined negative's;
    MIL-NCE: of each clip), whole through GradCache's chunks."""

    inputs: list
    extra: dict[str, Any] | None = None


class Experiment(ABC):
    """What `gcbs_lib.train` calls. A subclass sets `Options` (a dataclass: its config keys),
    `dev_metric` (the `scores` key that picks the best model), `data_name` and
    `model_name` (of result rows), and defines the abstract hooks. The trainer runs
    `pair_embeddings` and `evaluate` in eval mode, without gradients."""

    Options: type
    dev_metric: str
    data_name: str
    model_name: str
    supports_mining = False  # collate takes mined `negatives`
    in_batch_negatives = True  # `mask_same_group` applies (MoCo's negatives: an ungrouped queue)
    config: str | None = None  # configs/<config>.yaml holds its profiles (default: its own name)
    from_scratch = False  # the start is a random init (the gate does not hold it to chance)
    minimum_gain = 0.0  # pre-registered: the least gain over the start that counts as training

    def __init__(self, options, *, seed: int, device):
        self.options, self.seed, self.device = options, seed, torch.device(device)

    @abstractmethod
    def load_data(self) -> TrainSet:
        """Reads (or builds) the data: the training items, and what `evaluate` scores."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The model to train (the trainer moves it to its device and dtype)."""

    @abstractmethod
    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """The batch of training items `indices`, with their mined `negatives` when given."""

    def loss(self, embeddings: Sequence[torch.Tensor], batch: Batch, scale) -> torch.Tensor:
        """Rank r's share of the global loss over the branches' embeddings (notebook 02); by
        default, InfoNCE of its anchors over every rank's positives (and their groups')."""
        groups = self.gathered_groups(batch)
        return rank_info_nce(*map(gather_with_grad, embeddings), scale, groups=groups)

    @staticmethod
    def gathered_groups(batch: Batch) -> torch.Tensor | None:
        """The global batch's group ids (`mask_same_group`), gathered as `gather_with_grad` gathers
        the embeddings; None without them (or without a batch)."""
        groups = (getattr(batch, "extra", None) or {}).get("groups")
        return None if groups is None else gather_with_grad(groups)

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple:
        """Two embeddings `(z1, z2)` of each item: what GCBS and mining compare; by default,
        `model` of each branch's inputs of the items' `collate` (one encoder for both branches)."""
        inputs = self.collate(indices.tolist()).inputs
        return tuple(model(to_device(x, self.device)) for x in inputs)

    @abstractmethod
    def evaluate(self, model: nn.Module, split: str) -> Outputs:
        """The per-item outputs of `split` ("dev" or "test"), on rank 0 only."""

    @staticmethod
    @abstractmethod
    def scores(outputs: Outputs) -> dict[str, float]:
        """The metrics of per-item `outputs` (also of a resampled or shuffled copy)."""

    def baseline(self) -> tuple[str, Outputs] | None:
        """A trivial scorer's name and test outputs (TF-IDF, raw pixels), where one exists."""
        return None

    def branches(self, model: nn.Module) -> list[nn.Module]:
        """The module of each branch; the trainer wraps each distinct one in DDP."""
        return [model, model]

    def after_step(self, model: nn.Module) -> None:
        """Runs after each optimizer step, without gradients (MoCo's momentum update)."""
        return None

    def embed_texts(self, model: nn.Module, texts: list[str], tokenize) -> torch.Tensor:
        """Evaluation embeddings of `texts` (float32, on the CPU): `model` of `tokenize`'s inputs,
        `eval_batch_size` texts at a time."""
        size = self.options.eval_batch_size
        batches = (tokenize(texts[i : i + size]) for i in range(0, len(texts), size))
        return embed_in_batches(model, batches, self.device).float().cpu()


@torch.no_grad()
def embed_in_batches(model: nn.Module, batches: Iterable, device) -> torch.Tensor:
    """`model` of each of `batches` (moved to `device`), concatenated: without gradients, in eval
    mode (each module's mode restored after)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        return torch.cat([model(to_device(batch, device)) for batch in batches])
    finally:
        for module, training in modes:
            module.training = training


def to_device(value, device):
    """Every tensor in `value` (and in its dicts, lists, tuples) moved to `device`, without
    blocking the host (a copy from pinned memory then overlaps what runs before it)."""
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def get(name: str) -> type:
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(available())}")
    module, cls = EXPERIMENTS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)  # imported on first use


def available() -> list[str]:
    return sorted(EXPERIMENTS)
