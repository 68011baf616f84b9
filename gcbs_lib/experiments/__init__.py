"""The experiments `gcbs_lib.train` trains, by name: one module each, with a subclass of
`Experiment` defining `Options` (a dataclass: its config keys), `dev_metric` (the `evaluate(model,
"dev")` key whose best model is kept), `data_name`, `model_name` (of result rows), `load_data() ->
TrainSet`, `build_model()`, `collate(indices, negatives=None) -> Batch`, `loss(embeddings, batch,
scale)` (rank r's share of the global loss over embeddings gathered with `gather_with_grad`:
notebook 02), `pair_embeddings(model, indices) -> (z1, z2)` (what GCBS and mining compare) and
`evaluate(model, split) -> dict` (rank 0 only; both in eval mode, without gradients)."""

import importlib
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

EXPERIMENTS = {
    "codesearch": "codesearch:CodeSearch",
    "simcse": "simcse:SimCSE",
    "promcse": "promcse:PromCSE",
    # name → module:class in this package
    "milnce": "milnce:MilNce",
    "moco": "moco:MoCo",
}


class TrainSet(NamedTuple):
    """Training items 0 … size−1; items with equal `duplicate_keys` are never one another's
    negatives."""

    size: int
    duplicate_keys: Sequence[Hashable] | None = None


class Batch(NamedTuple):
    """This rank's rows of a step: `inputs`, one per branch; `extra` (read only), whatever else the
    loss needs."""

    inputs: list
    extra: dict[str, Any] = {}


class Experiment:
    """The defaults: no mined negatives, two branches through the whole model (the trainer wraps
    each distinct branch module in DDP), nothing to do after an optimizer step (MoCo's momentum
    update goes there)."""

    supports_mining = False

    def __init__(self, options, *, seed: int, device):
        self.options, self.seed, self.device = options, seed, torch.device(device)

    def branches(self, model):
        return [model, model]

    def after_step(self, model):
        pass


# every tensor in `value` (and in its dicts, lists, tuples) moved to `device`
def to_device(value, device):
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value.to(device) if isinstance(value, torch.Tensor) else value


def get(name: str) -> type:
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(available())}")
    module, cls = EXPERIMENTS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)  # imported on first use


def available() -> list[str]:
    return sorted(EXPERIMENTS)
