"""Experiments: what `gcbs_lib.train` trains, one class per experiment, found by name.

The training loop owns everything every experiment shares: optimizer, schedule, GradCache, DDP, samplers
(random, GCBS, mined hard negatives), random streams, checkpoints, logging and result rows. An experiment owns
what differs: its data, its trainable model, how item indices become encoder inputs, its loss, the pair
embeddings that GCBS orders by, and its evaluation. It never sees the optimizer or the process group setup.

One training step, for this rank's share `indices` of a global batch (and, with the hard-negative sampler, one
mined item per index in `negatives`):

    batch = experiment.collate(indices, negatives)         # tokenise here: outside the timed step
    modules = experiment.branches(model)                    # one encoder per branch (the trainer wraps them in DDP)
    embeddings = [m(x) for m, x in zip(modules, batch.inputs)]      # or chunk by chunk with `cached_loss`
    loss = experiment.loss(embeddings, batch, scale)         # L_r, this rank's share (see below)
    loss.backward(); optimizer.step(); experiment.after_step(model)   # the trainer's part, then the hook

The loss follows the kit's exact DDP convention (notebook 02): gather every rank's embeddings with
`gcbs_lib.distributed.gather_with_grad`, and return rank r's share L_r of the global loss, i.e. its own queries
against all gathered documents averaged over its own queries (`gcbs_lib.distributed.rank_info_nce` does that for
InfoNCE). DDP's gradient average then gives every rank exactly the single-process full-batch gradient. `scale`
is a number or a callable such as `gcbs_lib.losses.LogitScale` (learnable; the trainer averages its gradient).

An experiment's own settings are the fields of its `Options` dataclass (defaults there; profiles in
`gcbs_lib/configs/<name>.yaml` and `--set KEY=VALUE` override them, typed by the field annotations). To add an
experiment, put a module in this package with a subclass decorated `@register("name")`; `get("name")` finds it
(every module of the package is imported on first lookup), and `train.py` needs no change.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

_REGISTRY: dict[str, type["Experiment"]] = {}


@dataclass
class TrainSet:
    """The training items, seen by the trainer only as indices 0 … size−1.

    `duplicate_keys` (optional, one per item): items with equal keys must never be each other's negatives
    (identical texts, the same video). GCBS keeps them in different batches and mining never picks them.
    """

    size: int
    duplicate_keys: Sequence[Hashable] | None = None

    def __post_init__(self):
        if self.size < 1:
            raise ValueError("the training set is empty")
        if self.duplicate_keys is not None and len(self.duplicate_keys) != self.size:
            raise ValueError(f"{len(self.duplicate_keys)} duplicate keys for {self.size} training items")


@dataclass
class Batch:
    """This rank's rows of one step. `inputs`: one encoder input per branch (a tensor, or a dict whose tensor
    entries are sliced on dim 0 by GradCache; non-tensor entries pass through). `extra`: whatever else the loss
    needs (e.g. MIL-NCE bag indices); tensors in both are moved to the training device by the trainer."""

    inputs: list
    extra: dict[str, Any] = field(default_factory=dict)


class Experiment(ABC):
    """One experiment: data, model, collation, loss, pair embeddings and evaluation (see the module docstring).

    Subclasses set `name` (through `@register`), `Options` (a dataclass of their settings) and `dev_metric`
    (the key of `evaluate(model, "dev")` that is maximised to keep the best checkpoint), say with
    `supports_mining` whether `collate` accepts mined negatives, and with `pair_embeddings_depend_on_seed`
    whether `pair_embeddings` depends on the run seed.
    """

    name: ClassVar[str]
    Options: ClassVar[type]
    dev_metric: ClassVar[str]
    supports_mining: ClassVar[bool] = False
    # False: `pair_embeddings` depends only on the model state, the options and the data, so the trainer reuses
    # one computation across runs (every arm and seed of a pretrained encoder). True: it also depends on the
    # run seed (e.g. MoCo's fixed views, drawn from it), and is reused only within a seed.
    pair_embeddings_depend_on_seed: ClassVar[bool] = False

    def __init__(self, options, *, seed: int, device: torch.device):
        if not isinstance(options, self.Options):
            raise TypeError(f"{type(self).__name__} needs {self.Options.__name__} options, got {type(options).__name__}")
        self.options, self.seed, self.device = options, seed, torch.device(device)

    # ---- data -------------------------------------------------------------------------------------------
    @abstractmethod
    def load_data(self) -> TrainSet:
        """Load (or build) the training, dev and test data; called once per run, on every rank."""

    @property
    @abstractmethod
    def data_name(self) -> str:
        """`"paper"` for the paper's data, else the stand-in's name (the `data` of result rows)."""

    @property
    @abstractmethod
    def model_name(self) -> str:
        """The encoder's name or path (the `model` of result rows)."""

    # ---- model ------------------------------------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """The model to train, on the CPU (the trainer seeds its initialisation and moves it to the device).
        Parameters with `requires_grad=False` stay frozen (e.g. a PromCSE backbone)."""

    def branches(self, model: nn.Module) -> list[nn.Module]:
        """One encoder module per branch of `collate(...).inputs` (submodules of `model`, the same one repeated
        when branches share it). The default: two branches through the whole model (queries and documents, or a
        sentence twice). Under DDP the trainer wraps each distinct module that has trainable parameters; model
        parameters outside every branch module get their gradients averaged separately."""
        return [model, model]

    # ---- steps ------------------------------------------------------------------------------------------
    @abstractmethod
    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """Encoder inputs for training items `indices` (this rank's rows of the global batch, on the CPU).
        `negatives[i]` is the mined hard negative of `indices[i]` (only with `supports_mining`)."""

    @abstractmethod
    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        """Rank r's share L_r of the global loss from this rank's branch outputs (gather the other ranks' with
        `gather_with_grad`); equals the full-batch loss in one process."""

    def after_step(self, model: nn.Module) -> None:
        """Called by the trainer after every optimizer step, on every rank, without gradients: state that follows
        the trained weights (e.g. MoCo's momentum encoder) is updated here. The default does nothing."""

    @abstractmethod
    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z1, z2) `[len(indices), d]` for training items: anchors and positives, as GCBS and mining compare
        them. Called without gradients with the model in eval mode."""

    @abstractmethod
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Metrics on `split` ("dev" or "test"), e.g. `{"mrr": 0.41}`; called without gradients in eval mode,
        on rank 0 only (it must not use collectives)."""


def to_device(value, device: torch.device):
    """`value` with every tensor in it (inside dicts, lists and tuples) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def register(name: str):
    """Class decorator: make an `Experiment` subclass trainable as `--experiment name`."""

    def add(cls: type[Experiment]) -> type[Experiment]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"two experiments are named {name!r}: {_REGISTRY[name].__qualname__} and {cls.__qualname__}")
        for attribute in ("Options", "dev_metric"):
            if not hasattr(cls, attribute):
                raise TypeError(f"experiment {name!r} must define {attribute}")
        if not dataclasses.is_dataclass(cls.Options):
            raise TypeError(f"experiment {name!r}: Options must be a dataclass")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def _import_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def get(name: str) -> type[Experiment]:
    """The experiment class registered under `name`."""
    if name not in _REGISTRY:
        _import_all()
    if name not in _REGISTRY:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(available())}")
    return _REGISTRY[name]


def available() -> list[str]:
    """Names of every experiment in this package."""
    _import_all()
    return sorted(_REGISTRY)
