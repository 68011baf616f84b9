"""One training loop for every experiment: optimizer, schedule, GradCache, DDP, samplers, checkpoints, logs.

Used three ways, with the same code path:

    train(load_config("codesearch", "ci", {"sampler": "gcbs"}), "runs/x")          # in-process, e.g. a notebook
    python -m gcbs_lib.train --experiment codesearch --profile ci --output-dir runs/x --sampler gcbs
    torchrun --nproc-per-node 4 -m gcbs_lib.train ...    # or gcbs_lib.distributed.launch("gcbs_lib.train:launched")

A step. Every epoch is planned up front as `steps_per_epoch` global batches of `batch_size` item indices (the
last incomplete batch dropped) by the sampler: `random` (a seeded permutation), `gcbs` (the GCBS order of the
current model's pair embeddings: `gcbs.GCBSBatchSampler`) or `hard_negatives` (random batches plus one mined
negative per item: `mining.mine_hard_negatives`). Rank r takes rows [r·B/W, (r+1)·B/W) of each batch; the
experiment collates them (tokenising outside the timed step) and its loss is rank r's share L_r of the global
loss over embeddings gathered with `gather_with_grad`. With `chunk_size` the loss goes through GradCache's
`cached_loss`; DDP averages gradients with one all-reduce per step (notebook 02: this is exactly the
single-process full-batch gradient), parameters outside DDP (a learnable logit scale) are averaged by
`all_reduce_gradients`. Then clipping, AdamW, the experiment's `after_step` hook (e.g. MoCo's momentum
encoder), the schedule (warmup, then linear or cosine decay to 0), and
the logit scale's clamp.

Randomness. Every stream comes from `seeding.stream_seed(seed, epoch, purpose)`: model init, batch order,
GCBS relabelling and batch shuffle, mining, and dropout (reseeded at every step from the step number and
rank), so a run is a function of its config and a resumed run of its checkpoint.

Files in the output directory (rank 0 writes them; on resume every rank reads checkpoint.pt, so several
nodes need the directory on a shared filesystem):
  checkpoint.pt  the latest state, written atomically (temp file + os.replace) every `checkpoint_every`
                 steps and at the end: model, logit scale, optimizer, scheduler, step, epoch, the epoch's
                 materialised batches (a GCBS order depends on the model at epoch start, so it is restored,
                 never recomputed), every RNG, the best dev score, the config. Loaded with weights_only=True.
                 A rerun with the same arguments resumes from it and ends bitwise equal to an uninterrupted run.
  best.pt        the model with the best dev score so far (`Experiment.dev_metric`).
  metrics.jsonl  one JSON object per line: "step" records (loss, lr, grad norm, scale, seconds), "epoch"
                 records at each epoch start (sampler cost, loss gap of the batches planned), "eval" records.
  results.json   result rows (`gcbs_lib.results`) of the best model on the test split.
A non-finite loss or gradient norm stops the run with `TrainingDiverged` naming the step; nothing is saved
after it, so the last checkpoint stays the last good state.

Watches. Under DDP every rank must hold the same parameters and, after the all-reduce, the same gradients; with
`sync_check_every: N` every N-th step compares them across ranks (after the all-reduce and clipping), logs
the largest difference as `rank_difference` and stops with `RanksOutOfSync` naming the step when it exceeds
`sync_tolerance` (0: bitwise equal). A gradient norm above `grad_norm_watch` times the median of the last
`GRAD_NORM_WINDOW` steps is warned about once per run (stderr, and a `warning` in that step's record).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
import types
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from gcbs_lib import experiments
from gcbs_lib.distributed import all_reduce_gradients, rank_and_world_size, rank_difference
from gcbs_lib.gcbs import GCBSBatchSampler, embed_all, loss_gap
from gcbs_lib.gradcache import cached_loss
from gcbs_lib.losses import LogitScale
from gcbs_lib.mining import mine_hard_negatives
from gcbs_lib.results import read_rows, result_row, write_rows
from gcbs_lib.seeding import generator, stream_seed

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SAMPLERS = ("random", "gcbs", "hard_negatives")
# keys a resumed run may change: they never alter the parameters' trajectory
RESUMABLE_CHANGES = {"checkpoint_every", "eval_every", "progress", "device", "sync_check_every", "sync_tolerance",
                     "grad_norm_watch"}
GRAD_NORM_WINDOW, GRAD_NORM_MIN_STEPS = 50, 10  # the gradient-norm watch: median of the last 50 steps, from step 11


# ------------------------------------------------------------------------------------------------ config

@dataclass
class TrainConfig:
    """Everything a run depends on. The experiment's own settings are `options` (its `Options` dataclass)."""

    experiment: str
    profile: str = "ci"
    seed: int = 0
    sampler: Literal["random", "gcbs", "hard_negatives"] = "random"
    arm: str | None = None                 # result rows' arm (default: the sampler's name)
    device: str = "cpu"                    # "cpu" or "cuda" (each DDP rank takes cuda:LOCAL_RANK)
    batch_size: int = 64                   # global: all ranks together
    chunk_size: int | None = None          # GradCache chunk per rank; None: one plain forward and backward
    epochs: int = 1
    max_steps: int | None = None           # stop (and end the schedule) earlier than `epochs` would
    lr: float = 2e-5
    weight_decay: float = 0.0
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    warmup_steps: int = 0
    clip_norm: float | None = 1.0
    bf16: bool = False                     # autocast the forward passes and the loss to bfloat16
    dtype: Literal["float32", "float64"] = "float32"  # parameters' dtype (float64: exact comparisons in tests)
    scale: float = 20.0                    # logit scale 1/τ (the start value when learnable)
    learnable_scale: bool = False
    max_scale: float = 100.0
    gcbs_quantile: float = 0.999
    gcbs_top_k: int | None = None          # GCBS graph from each row's top-k instead of the quantile
    mine_top_k: int = 30                   # mining: candidates per query (ranks skip … top_k−1 after exclusions)
    mine_skip: int = 3                     # mining: top ranks skipped as likely false negatives
    embed_batch_size: int = 256
    log_loss_gap: bool = True              # embed the training set at each epoch start to log the loss gap
    eval_every: int = 0                    # dev evaluation every N steps (0: at each epoch end only)
    checkpoint_every: int = 100
    sync_check_every: int = 0              # DDP: compare parameters and gradients across ranks every N steps (0: off)
    sync_tolerance: float = 0.0            # the largest difference between ranks the sync check accepts
    grad_norm_watch: float | None = 10.0   # warn once when a grad norm exceeds this × the recent median (None: off)
    progress: bool = True
    options: Any = None                    # the experiment's Options (filled by `load_config`)

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        for key in ("batch_size", "epochs", "embed_batch_size", "checkpoint_every", "mine_top_k"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.sync_check_every < 0 or not self.sync_tolerance >= 0:
            raise ValueError(f"need sync_check_every ≥ 0 and sync_tolerance ≥ 0, got {self.sync_check_every}, "
                             f"{self.sync_tolerance}")
        if self.grad_norm_watch is not None and not self.grad_norm_watch > 1:
            raise ValueError(f"grad_norm_watch must be above 1 or None, got {self.grad_norm_watch}")
        for key in ("chunk_size", "max_steps", "gcbs_top_k"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1 or None, got {getattr(self, key)}")
        if not self.lr > 0 or not self.scale > 0:
            raise ValueError(f"lr and scale must be positive, got {self.lr}, {self.scale}")
        if not 0 <= self.mine_skip < self.mine_top_k:
            raise ValueError(f"need 0 ≤ mine_skip < mine_top_k, got {self.mine_skip}, {self.mine_top_k}")


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """`value` (from yaml, or a `--set` string) as the annotated type; a clear error when it does not fit."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if value not in arguments:
            raise ValueError(f"{key} must be one of {list(arguments)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType) and type(None) in arguments:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            return None
        (inner,) = [a for a in arguments if a is not type(None)]
        return _coerce(key, value, inner)
    if annotation is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif annotation is Any:
        return value
    raise ValueError(f"{key} must be {getattr(annotation, '__name__', annotation)}, got {value!r}")


def read_profile(experiment: str, profile: str) -> dict[str, Any]:
    """The settings of `profile`: a section of `gcbs_lib/configs/<experiment>.yaml` (its `common` section
    first, then the profile's), or, if `profile` names a yaml file, that file's flat mapping."""
    if profile.endswith((".yaml", ".yml")):
        settings = yaml.safe_load(Path(profile).read_text()) or {}
        where = profile
    else:
        path = CONFIG_DIR / f"{experiment}.yaml"
        if not path.exists():
            raise FileNotFoundError(f"experiment {experiment!r} has no profile file {path}")
        sections = yaml.safe_load(path.read_text()) or {}
        if profile not in sections or profile == "common":
            raise KeyError(f"{path} has no profile {profile!r}; it has {sorted(set(sections) - {'common'})}")
        settings = {**(sections.get("common") or {}), **(sections[profile] or {})}
        where = f"{path} [{profile}]"
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: a profile is a mapping of config keys, got {type(settings).__name__}")
    return settings


def load_config(experiment: str, profile: str = "ci", overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config of `experiment` under `profile`, then `overrides` (typed values or `--set` strings).

    Keys are the `TrainConfig` fields and the experiment's `Options` fields (one flat namespace); an unknown
    key, or a value of the wrong type, is refused with the list of valid keys.
    """
    options_class = experiments.get(experiment).Options
    train_types = {k: v for k, v in _field_types(TrainConfig).items() if k not in ("experiment", "options")}
    option_types = _field_types(options_class)
    clash = set(train_types) & set(option_types)
    if clash:
        raise TypeError(f"{experiment}'s Options reuse training keys {sorted(clash)}")
    settings = {**read_profile(experiment, profile), "profile": Path(profile).stem if profile.endswith(
        (".yaml", ".yml")) else profile, **(overrides or {})}
    train_values, option_values = {}, {}
    for key, value in settings.items():
        if key in train_types:
            train_values[key] = _coerce(key, value, train_types[key])
        elif key in option_types:
            option_values[key] = _coerce(key, value, option_types[key])
        else:
            raise KeyError(f"unknown config key {key!r} for experiment {experiment!r}; training keys: "
                           f"{sorted(train_types)}; {experiment} keys: {sorted(option_types)}")
    return TrainConfig(experiment=experiment, options=options_class(**option_values), **train_values)


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """Rebuild a config from `asdict(config)` (what `launched` receives and checkpoints store)."""
    values = dict(values)
    options = values.pop("options") or {}
    return TrainConfig(**values, options=experiments.get(values["experiment"]).Options(**options))


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """`["lr=3e-5", "chunk_size=8"]` → `{"lr": "3e-5", "chunk_size": "8"}` (typed later by `load_config`)."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set takes KEY=VALUE, got {pair!r}")
        overrides[key.strip()] = value.strip()
    return overrides


# ------------------------------------------------------------------------------------------------ files

def atomic_save(obj: Any, path: str | Path) -> None:
    """`torch.save` to a temporary file in the same folder, flushed to disk, then renamed over `path`:
    a reader (or a crash) sees the old file or the new one, never a partial one."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """A checkpoint written by `train`, read with `weights_only=True` (tensors and plain containers only)."""
    return torch.load(path, map_location=map_location, weights_only=True)


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or gradient: the run stops before the broken state reaches any checkpoint."""


class RanksOutOfSync(RuntimeError):
    """DDP ranks hold different parameters or gradients: a bug in the step, never noise."""


def _diverged(what: str, step: int, config: TrainConfig) -> TrainingDiverged:
    return TrainingDiverged(
        f"{what} is not finite at step {step + 1}; the run stopped and the last checkpoint (if any) still holds "
        f"the last good state. Likely causes: a temperature too low / logit scale too high (scale="
        f"{config.scale}{', learnable' if config.learnable_scale else ''}), overflow in reduced precision "
        f"(bf16={config.bf16}; fp16 overflows above 65504), a learning rate too high (lr={config.lr}), or "
        f"NaN/inf in the inputs.")


# ------------------------------------------------------------------------------------------------ RNG

def rng_state() -> dict:
    """Every random generator the process holds: torch CPU and CUDA, numpy's global one, Python's."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": position,
                      "has_gauss": has_gauss, "gauss": gauss},
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# ------------------------------------------------------------------------------------------------ schedule

def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """The learning-rate multiplier at `step`: linear warmup from 0 over `warmup` steps, then constant, or
    linear or cosine decay to 0 at `total` (as transformers' schedules)."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


# ------------------------------------------------------------------------------------------------ plans

@dataclass
class EpochPlan:
    """One epoch's global batches `[steps, batch_size]` of item indices, and each item's mined negative."""

    batches: torch.Tensor
    negatives: torch.Tensor | None = None

    def state(self) -> dict:
        return {"batches": self.batches, "negatives": self.negatives}


_EMBEDDINGS: dict[tuple, tuple[torch.Tensor, torch.Tensor, float]] = {}  # the latest training-set embeddings


def _fingerprint(model: nn.Module) -> str:
    """A digest of every parameter and buffer bit: equal exactly when the model states are equal."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _broadcast(obj: Any, world_size: int) -> Any:
    """Rank 0's `obj` on every rank."""
    if world_size == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


class Trainer:
    """One run: `Trainer(config, output_dir).fit()` (what `train` does). See the module docstring."""

    def __init__(self, config: TrainConfig, output_dir: str | Path):
        self.config, self.dir = config, Path(output_dir)
        self.rank, self.world_size = rank_and_world_size()
        self.main = self.rank == 0
        if config.batch_size % self.world_size:
            raise ValueError(f"batch_size {config.batch_size} does not divide over {self.world_size} ranks")
        self.device = self._device()
        experiment_class = experiments.get(config.experiment)
        if config.sampler == "hard_negatives" and not experiment_class.supports_mining:
            raise ValueError(f"experiment {config.experiment!r} does not take mined negatives")
        self.experiment = experiment_class(config.options, seed=config.seed, device=self.device)
        self.train_set = self.experiment.load_data()
        self.steps_per_epoch = self.train_set.size // config.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch_size {config.batch_size} exceeds the {self.train_set.size} training items")
        self.total_steps = config.epochs * self.steps_per_epoch
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        torch.manual_seed(stream_seed(config.seed, 0, "init"))
        dtype = getattr(torch, config.dtype)
        self.model = self.experiment.build_model().to(self.device, dtype)
        self.scale = LogitScale(config.scale, config.max_scale).to(self.device, dtype) if config.learnable_scale \
            else config.scale
        self.branch_modules, self.outside_ddp = self._wrap_branches()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if isinstance(self.scale, LogitScale):
            trainable += list(self.scale.parameters())
        self.parameters = trainable
        self.optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, config.warmup_steps, config.schedule))
        self.step, self.epoch, self.position, self.plan = 0, 0, 0, None
        self.best = {"value": None, "step": None}
        self.log_lines = 0
        self.recent_grad_norms, self.grad_norm_warned = [], False  # the gradient-norm watch (rank 0)

    # ---- setup ------------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.config.device == "cuda" and self.world_size > 1:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
            return device
        return torch.device(self.config.device)

    def _wrap_branches(self) -> tuple[list[nn.Module], list[nn.Parameter]]:
        """Per-branch modules, each distinct trainable one wrapped in DDP when distributed; and the trainable
        parameters outside every branch module (their gradients are averaged by `all_reduce_gradients`)."""
        modules = self.experiment.branches(self.model)
        inside = {id(p) for m in modules for p in m.parameters()}
        outside = [p for p in self.model.parameters() if p.requires_grad and id(p) not in inside]
        if isinstance(self.scale, LogitScale):
            outside += list(self.scale.parameters())
        if self.world_size == 1:
            return modules, outside
        wrapped = {}
        for module in modules:
            if id(module) not in wrapped:
                trains = any(p.requires_grad for p in module.parameters())
                wrapped[id(module)] = DistributedDataParallel(
                    module, device_ids=[self.device.index] if self.device.type == "cuda" else None) if trains else module
        return [wrapped[id(m)] for m in modules], outside

    # ---- logging ----------------------------------------------------------------------------------------
    def _log(self, record: dict) -> None:
        if self.main:
            with open(self.dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self.log_lines += 1

    def _records(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    # ---- checkpoints ------------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"model": self.model.state_dict(),
                "scale": self.scale.state_dict() if isinstance(self.scale, LogitScale) else {},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step, "epoch": self.epoch, "position": self.position, "plan": self.plan.state(),
                "rng": rng_state(), "best": dict(self.best), "log_lines": self.log_lines,
                "config": asdict(self.config)}

    def _save(self) -> None:
        if self.main:
            atomic_save(self._state(), self.dir / "checkpoint.pt")

    def _resume(self) -> bool:
        path = self.dir / "checkpoint.pt"
        if not path.exists():
            return False
        state = load_checkpoint(path, self.device)
        saved, current = state["config"], asdict(self.config)
        changed = sorted(k for k in set(saved) | set(current)
                         if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
        if changed:
            raise ValueError(f"{path} was written by a run with other settings ({', '.join(changed)}: "
                             f"{[saved.get(k) for k in changed]} there, {[current.get(k) for k in changed]} now); "
                             f"use another output directory, or the same settings to resume")
        self.model.load_state_dict(state["model"])
        if isinstance(self.scale, LogitScale):
            self.scale.load_state_dict(state["scale"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.plan = EpochPlan(state["plan"]["batches"].cpu(), None if state["plan"]["negatives"] is None
                              else state["plan"]["negatives"].cpu())
        self.best, self.log_lines = state["best"], state["log_lines"]
        set_rng_state(state["rng"])
        if self.main:  # drop what the interrupted run logged after this checkpoint
            lines = (self.dir / "metrics.jsonl").read_text().splitlines()[: self.log_lines]
            (self.dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
        return True

    # ---- epochs -----------------------------------------------------------------------------------------
    def _embeddings(self) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
        """(z1, z2) of the whole training set from the current model, the seconds computing them took, and
        whether they were reused: runs in one process that start an epoch from the same model state (every arm
        and seed of a pretrained encoder at epoch 0) share one computation, its time still reported; also the
        same seed when the experiment's `pair_embeddings_depend_on_seed`."""
        seed = self.config.seed if self.experiment.pair_embeddings_depend_on_seed else None
        key = (self.config.experiment, json.dumps(asdict(self.config.options), sort_keys=True), self.config.dtype,
               str(self.device), seed, _fingerprint(self.model))
        if key not in _EMBEDDINGS:
            start = time.perf_counter()
            z1, z2 = embed_all(lambda idx: tuple(z.float().cpu() for z in self.experiment.pair_embeddings(self.model, idx)),
                               self.train_set.size, self.config.embed_batch_size, self.model, progress=False)
            _EMBEDDINGS.clear()
            _EMBEDDINGS[key] = (z1, z2, time.perf_counter() - start)
            return z1, z2, _EMBEDDINGS[key][2], False
        return (*_EMBEDDINGS[key], True)

    def _plan_epoch(self) -> EpochPlan:
        """Rank 0 plans the epoch (and logs its cost and loss gap); every rank receives the plan."""
        plan = None
        if self.main:
            plan, record = self._make_plan()
            self._log(record)
        return _broadcast(plan, self.world_size)

    def _make_plan(self) -> tuple[EpochPlan, dict]:
        config, n, b = self.config, self.train_set.size, self.config.batch_size
        steps = self.steps_per_epoch
        needs_embeddings = config.sampler != "random" or config.log_loss_gap
        z1, z2, embed_seconds, reused = self._embeddings() if needs_embeddings else (None, None, 0.0, False)
        clock = time.perf_counter()
        negatives = None
        if config.sampler == "gcbs":
            sampler = GCBSBatchSampler(lambda idx: (z1[idx], z2[idx]), n, b, "drop", quantile=config.gcbs_quantile,
                                       top_k=config.gcbs_top_k, keys=self.train_set.duplicate_keys,
                                       seed=config.seed, progress=False)
            sampler.set_epoch(self.epoch)
            batches = torch.tensor(list(sampler), dtype=torch.long)
        else:
            order = torch.randperm(n, generator=generator(config.seed, self.epoch, "shuffle"))
            batches = order[: steps * b].view(steps, b)
            if config.sampler == "hard_negatives":
                negatives = mine_hard_negatives(z1, z2, batches, keys=self.train_set.duplicate_keys,
                                                top_k=config.mine_top_k, skip=config.mine_skip,
                                                generator=generator(config.seed, self.epoch, "mining"))
        sampler_seconds = time.perf_counter() - clock
        if batches.shape != (steps, b):
            raise RuntimeError(f"the {config.sampler} sampler planned {tuple(batches.shape)} batches, "
                               f"expected {(steps, b)}")
        record = {"kind": "epoch", "epoch": self.epoch, "step": self.step, "sampler": config.sampler,
                  "embed_seconds": embed_seconds, "embeddings_reused": reused, "sampler_seconds": sampler_seconds}
        if z1 is not None and config.log_loss_gap:
            items = batches.reshape(-1)
            record["loss_gap"] = loss_gap(z1[items], z2[items], torch.arange(len(items)), b, 1 / self._scale_value())
        return EpochPlan(batches, negatives), record

    def _scale_value(self) -> float:
        return self.scale().item() if isinstance(self.scale, LogitScale) else float(self.scale)

    # ---- steps ------------------------------------------------------------------------------------------
    def _my_rows(self, row: torch.Tensor) -> list[int]:
        part = self.config.batch_size // self.world_size
        return row[self.rank * part:(self.rank + 1) * part].tolist()

    def _train_step(self, batch: experiments.Batch) -> dict:
        config = self.config
        batch = experiments.Batch(experiments.to_device(batch.inputs, self.device),
                                  experiments.to_device(batch.extra, self.device))
        torch.manual_seed(stream_seed(config.seed, self.epoch, f"dropout/rank{self.rank}/step{self.step}"))
        start = time.perf_counter()

        def loss_fn(*embeddings):
            return self.experiment.loss(embeddings, batch, self.scale)

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=config.bf16):
            try:
                if config.chunk_size is not None:
                    loss = cached_loss(loss_fn, self.branch_modules, batch.inputs, config.chunk_size)
                else:
                    loss = loss_fn(*[module(x) for module, x in zip(self.branch_modules, batch.inputs)])
            except FloatingPointError as error:
                raise _diverged(f"an embedding ({error})", self.step, config) from error
        global_loss = loss.detach().double()
        if self.world_size > 1:
            dist.all_reduce(global_loss)
            global_loss /= self.world_size
        if not torch.isfinite(global_loss):
            raise _diverged("the loss", self.step, config)
        loss.backward()
        all_reduce_gradients(self.outside_ddp)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, config.clip_norm or math.inf)
        if not torch.isfinite(grad_norm):
            raise _diverged("the gradient norm", self.step, config)
        checked = self._check_sync()  # after the finiteness check: inf − inf would read as ranks out of sync
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        with torch.no_grad():
            self.experiment.after_step(self.model)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(self.scale, LogitScale):
            self.scale.clamp_()
        return {"loss": float(global_loss), "lr": lr, "grad_norm": float(grad_norm), "scale": self._scale_value(),
                "seconds": time.perf_counter() - start, **checked}

    def _check_sync(self) -> dict:
        """Every `sync_check_every` steps under DDP (a collective: every rank calls it at the same steps): the
        largest difference between ranks in any trainable parameter or gradient, refused above `sync_tolerance`."""
        every = self.config.sync_check_every
        if self.world_size == 1 or not every or (self.step + 1) % every:
            return {}
        difference = rank_difference([*self.parameters, *(p.grad for p in self.parameters if p.grad is not None)])
        if not difference <= self.config.sync_tolerance:
            raise RanksOutOfSync(
                f"ranks out of sync at step {self.step + 1}: parameters or gradients differ between the "
                f"{self.world_size} ranks by up to {difference:.3g} after the gradient all-reduce (tolerance "
                f"{self.config.sync_tolerance:g}); the run stopped. Every rank must hold the same model: look for a "
                f"module called outside its DDP wrapper (through `.module`), a parameter changed on one rank only, "
                f"or a loss that depends on the rank in a way the all-reduce does not average.")
        return {"rank_difference": difference}

    def _watch_grad_norm(self, record: dict) -> None:
        """Rank 0: warn once per run (stderr and `record["warning"]`) when the gradient norm jumps above
        `grad_norm_watch` × the median of the last `GRAD_NORM_WINDOW` steps; the run goes on."""
        norms, factor = self.recent_grad_norms, self.config.grad_norm_watch
        if factor is not None and not self.grad_norm_warned and len(norms) >= GRAD_NORM_MIN_STEPS:
            median = statistics.median(norms)
            if record["grad_norm"] > factor * median:
                record["warning"] = (f"step {record['step']}: gradient norm {record['grad_norm']:.3g} is above "
                                     f"{factor:g}× the median {median:.3g} of the last {len(norms)} steps (warned "
                                     f"once per run); spikes often come before a divergence: check the learning "
                                     f"rate, the logit scale and the batch's data")
                self.grad_norm_warned = True
                tqdm.write(f"warning: {record['warning']}", file=sys.stderr)
        self.recent_grad_norms = [*norms, record["grad_norm"]][-GRAD_NORM_WINDOW:]

    # ---- evaluation -------------------------------------------------------------------------------------
    def _evaluate(self, split: str) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self.experiment.evaluate(self.model, split)
        finally:
            self.model.train(was_training)

    def _dev_eval(self) -> None:
        """Rank 0 scores the dev split and keeps the best model in best.pt (other ranks go on)."""
        if not self.main:
            return
        start = time.perf_counter()
        scores = self._evaluate("dev")
        value = scores[self.experiment.dev_metric]
        improved = self.best["value"] is None or value > self.best["value"]
        if improved:
            self.best = {"value": value, "step": self.step}
            atomic_save({"model": self.model.state_dict(), "step": self.step, "value": value}, self.dir / "best.pt")
        self._log({"kind": "eval", "split": "dev", "step": self.step, "epoch": self.epoch, **scores,
                   "best": improved, "seconds": time.perf_counter() - start})

    # ---- the run ----------------------------------------------------------------------------------------
    def fit(self) -> dict | None:
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
        if self.world_size > 1:
            dist.barrier()
        resumed = self._resume()
        if not resumed and self.main:
            (self.dir / "metrics.jsonl").write_text("")
        already_finished = resumed and self.step >= self.total_steps
        if resumed and self.main:  # the gradient-norm watch goes on from the steps logged before
            steps = [r for r in self._records() if r["kind"] == "step"]
            self.recent_grad_norms = [r["grad_norm"] for r in steps][-GRAD_NORM_WINDOW:]
            self.grad_norm_warned = any("warning" in r for r in steps)
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (self.config.progress and self.main),
                   desc=f"{self.config.experiment}/{self.config.sampler}/seed{self.config.seed}", dynamic_ncols=True)
        while self.step < self.total_steps:
            if self.plan is None or self.position == self.steps_per_epoch:
                if self.plan is not None:
                    self.epoch, self.position = self.epoch + 1, 0
                self.plan = self._plan_epoch()
            row = self.plan.batches[self.position]
            negatives = None if self.plan.negatives is None else self._my_rows(self.plan.negatives[self.position])
            batch = self.experiment.collate(self._my_rows(row), negatives)
            record = self._train_step(batch)
            self.step, self.position = self.step + 1, self.position + 1
            record = {"kind": "step", "step": self.step, "epoch": self.epoch, **record}
            if self.main:
                self._watch_grad_norm(record)
            self._log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            epoch_end = self.position == self.steps_per_epoch
            if (self.config.eval_every and self.step % self.config.eval_every == 0) or epoch_end \
                    or self.step == self.total_steps:
                self._dev_eval()
            if self.step % self.config.checkpoint_every == 0 or self.step == self.total_steps:
                self._save()
        bar.close()
        return self._finish(already_finished)

    def _finish(self, already_finished: bool) -> dict | None:
        """Rank 0 scores the best model on the test split and writes results.json (a run that had finished
        before this call reads them back instead); returns the run's summary."""
        if self.world_size > 1:
            dist.barrier()
        if not self.main:
            return None
        results = self.dir / "results.json"
        if already_finished and results.exists():
            rows = read_rows(results)
        else:
            rows = self._test_rows()
            write_rows(results, rows)
        records = self._records()
        return {"output_dir": str(self.dir), "experiment": self.config.experiment, "arm": rows[0]["arm"],
                "seed": self.config.seed, "steps": self.step, "steps_per_epoch": self.steps_per_epoch,
                "best_step": self.best["step"], "rows": rows,
                "test": {r["metric"].removeprefix("test_"): r["value"] for r in rows if r["metric"].startswith("test_")},
                "epochs": [r for r in records if r["kind"] == "epoch"],
                "dev": [r for r in records if r["kind"] == "eval"],
                "train_seconds": sum(r["seconds"] for r in records if r["kind"] == "step")}

    def _test_rows(self) -> list[dict]:
        """Result rows: the test metrics of best.pt, and its dev score."""
        final = {k: v.clone() for k, v in self.model.state_dict().items()}
        best = load_checkpoint(self.dir / "best.pt", self.device)
        self.model.load_state_dict(best["model"])
        test = self._evaluate("test")
        self.model.load_state_dict(final)
        config, experiment = self.config, self.experiment

        def row(metric, value):
            return result_row(experiment=config.experiment, arm=config.arm or config.sampler, seed=config.seed,
                              metric=metric, value=value, profile=config.profile, data=experiment.data_name,
                              model=experiment.model_name)

        return [row(f"test_{k}", v) for k, v in test.items()] + [row(f"dev_{experiment.dev_metric}", best["value"])]


def train(config: TrainConfig, output_dir: str | Path) -> dict | None:
    """Train `config` into `output_dir` (resuming from its checkpoint.pt if there is one); rank 0 returns a
    summary (test metrics, result rows, epoch records with sampler costs and loss gaps, dev evaluations)."""
    return Trainer(config, output_dir).fit()


def launched(config: dict, output_dir: str) -> dict | None:
    """`train` from a JSON config (`asdict(config)`), the target of `gcbs_lib.distributed.launch`."""
    return train(config_from_dict(config), output_dir)


# ------------------------------------------------------------------------------------------------ command line

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gcbs_lib.train",
        description="Train one experiment with one sampler, resuming from OUTPUT_DIR/checkpoint.pt if it exists. "
                    "The same command runs under torchrun (one process per GPU, any number of nodes).",
        epilog="Config keys for --set: the training keys of gcbs_lib.train.TrainConfig (batch_size, chunk_size, "
               "lr, max_steps, checkpoint_every, epochs, ...) and the experiment's Options fields. Profiles: "
               "gcbs_lib/configs/<experiment>.yaml (ci, cpu, paper), or a path to a yaml file. Example: "
               "python -m gcbs_lib.train --experiment codesearch --profile ci --output-dir runs/cs "
               "--sampler gcbs --set batch_size=32 --set lr=3e-5")
    parser.add_argument("--experiment", required=True, help="experiment name (codesearch, simcse, promcse, milnce, ...)")
    parser.add_argument("--profile", default="ci", help="profile name or yaml file (default: ci)")
    parser.add_argument("--output-dir", required=True, help="where checkpoint.pt, metrics.jsonl, results.json go")
    parser.add_argument("--seed", type=int, help="run seed (default: the profile's, else 0)")
    parser.add_argument("--sampler", choices=SAMPLERS, help="batch sampler (default: the profile's, else random)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key (repeatable); values are typed by the key")
    return parser


def main(argv: list[str] | None = None) -> None:
    arguments = _parser().parse_args(argv)
    overrides = parse_overrides(arguments.overrides)
    for key in ("seed", "sampler"):
        if getattr(arguments, key) is not None:
            overrides[key] = getattr(arguments, key)
    config = load_config(arguments.experiment, arguments.profile, overrides)
    started_group = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if config.device == "cuda" else "gloo")
        started_group = True
    try:
        summary = train(config, arguments.output_dir)
        if summary is not None:
            print(json.dumps({"test": summary["test"], "best_step": summary["best_step"],
                              "output_dir": summary["output_dir"]}))
    finally:
        if started_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
