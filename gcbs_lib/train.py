"""One training loop for every experiment, in nanoGPT's shape: plan the epoch, collate, step, log,
evaluate, save. `train(load_config("codesearch", "ci", {"sampler": "gcbs"}), "runs/x")`, or the
command (also under torchrun): `python -m gcbs_lib.train --experiment codesearch --profile ci
--output-dir runs/x --sampler gcbs --set lr=1e-4`. Rank r's loss is its share of the global loss
(notebook 02), through GradCache with `chunk_size`. Random streams come from `seeding.stream_seed`,
the global one reseeded at each step: a rerun resumes bitwise from checkpoint.pt."""

import argparse
import gc
import hashlib
import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from gcbs_lib import distributed, experiments, gcbs, gradcache, losses, mining, seeding
from gcbs_lib.check import as_type, require
from gcbs_lib.data import write_atomic
from gcbs_lib.launcher import collective_timeout
from gcbs_lib.rows import DIAGNOSTICS, current_commit, result_row, write_rows

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
STATE = ("step", "epoch", "position", "plan", "best")  # where a run is, beside its tensors
RESUMABLE = set(
    "checkpoint_every eval_every progress device sync_check_every collective_timeout"
    " loader_workers".split()
)
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainConfig:
    """Everything a run depends on; `options`: the experiment's own settings (its `Options`)."""

    experiment: str
    profile: str = "ci"
    seed: int = 0
    sampler: Literal["random", "gcbs", "hard_negatives"] = "random"
    arm: str | None = None  # result rows' arm (default: the sampler's name)
    device: str = "cpu"  # "cpu", "cuda" (each DDP rank takes cuda:LOCAL_RANK) or one GPU, "cuda:3"
    batch_size: int = 64  # global: all ranks together
    chunk_size: int | None = None  # GradCache chunk per rank; None: one plain forward and backward
    epochs: int = 1
    max_steps: int | None = None  # stop (and end the schedule) earlier than `epochs` would
    lr: float = 2e-5
    weight_decay: float = 0.0
    optimizer: Literal["adamw", "sgd"] = "adamw"  # sgd: with momentum 0.9 (its weight decay is L2)
    schedule: Literal["linear", "cosine", "constant"] = "linear"  # after linear warmup
    warmup_steps: int = 0
    clip_norm: float | None = 1.0
    dtype: Literal["float32", "float64"] = "float32"  # of parameters (float64: exact tests)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # bf16, fp16: autocast (fp16: GradScaler)
    scale: float = 20.0  # logit scale 1/τ (the start value when learnable)
    learnable_scale: bool = False
    max_scale: float = 100.0
    gcbs_quantile: float = 0.999
    gcbs_neighbours: float | None = None  # k: when set, q = 1 − k / N of the epoch
    gcbs_ties: Literal["index", "random"] = "index"  # random: items relabelled before RCM
    gcbs_prune_groups: bool = False  # same-group edges deleted from the graph before RCM
    batch_order: Literal["planned", "shuffled"] = "planned"  # shuffled: the batches' order only
    mine_top_k: int = 30  # mining: candidates per query
    mine_skip: int = 3  # mining: top ranks skipped as likely false negatives
    embed_batch_size: int = 256
    log_loss_gap: bool = True  # log the loss gap of each epoch's planned batches
    # the loss gap from a sample of the epoch's batches and this many reference items (the random
    # arm embeds only those), alike for every arm; None, or at least N: exact (all embedded)
    diagnostic_sample: int | None = None
    one_per_group: bool = False  # each epoch: one item per `TrainSet.groups`, drawn afresh
    # in-batch negatives of the anchor's group (`TrainSet.groups`, else the duplicate keys) leave
    # the InfoNCE denominators: the supervised oracle for false negatives
    mask_same_group: bool = False
    eval_every: int = 0  # dev evaluation every N steps (0: at each epoch end only)
    checkpoint_every: int = 100
    # DDP: compare parameters and gradients across ranks every N steps (they must agree bitwise)
    sync_check_every: int = 0
    # DDP: seconds a rank waits for the others before the job fails (None: launcher's
    # collective_timeout, $GCBS_COLLECTIVE_TIMEOUT or 1800)
    collective_timeout: float | None = None
    progress: bool = True
    # processes that collate the epoch's batches ahead of the step (0: the training process);
    # on a GPU the batches are pinned and copied without blocking
    loader_workers: int = 0
    options: Any = None  # the experiment's Options (filled by `load_config`)

    def __post_init__(self):
        positive = (
            "batch_size epochs embed_batch_size checkpoint_every chunk_size max_steps lr clip_norm"
            " scale max_scale gcbs_neighbours collective_timeout diagnostic_sample"
        ).split()
        wrong = [k for k in positive if getattr(self, k) is not None and not getattr(self, k) > 0]
        require(not wrong, f"{', '.join(wrong)} must be positive")
        require(
            self.loader_workers >= 0, f"loader_workers must be 0 or more: {self.loader_workers}"
        )


def _typed(key: str, value: Any, kind: Any) -> Any:
    """A config value as its field's type `kind`: a `--set` text is read as YAML unless the field
    takes text, and "none" is None where the field allows None."""
    parsed = yaml.safe_load(value) if isinstance(value, str) and value.strip() else value
    choices = get_args(kind) if get_origin(kind) is not Literal else ()
    if type(None) in choices and parsed in (None, "none", "None"):
        return None

    text = kind is str or str in choices or get_origin(kind) is Literal
    name = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
    return as_type(value if text else parsed, kind, f"{key} must be {name}, got {value!r}")


def load_config(
    experiment: str, profile: str = "ci", overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """The config of `experiment`: the `common`, then the `profile` section of
    `configs/<experiment>.yaml` (or its class's `config`), then `overrides` (typed values or
    `--set` strings), as `TrainConfig` fields and the experiment's `Options` fields."""
    kind = experiments.get(experiment)
    sections = yaml.safe_load((CONFIG_DIR / f"{kind.config or experiment}.yaml").read_text())
    known = sorted(set(sections) - {"common"})
    require(profile in known, f"unknown profile {profile!r} for {experiment}; known: {known}")

    train_types = get_type_hints(TrainConfig)
    del train_types["experiment"], train_types["options"]
    types = {**get_type_hints(kind.Options), **train_types}

    values = {}
    merged = {**(sections.get("common") or {}), **(sections[profile] or {}), "profile": profile}
    for key, value in {**merged, **(overrides or {})}.items():
        if key not in types:
            raise KeyError(
                f"unknown config key {key!r}; training keys: {', '.join(sorted(train_types))}; "
                f"{experiment} keys: {', '.join(sorted(set(types) - set(train_types)))}"
            )
        values[key] = _typed(key, value, types[key])

    train_values = {k: values.pop(k) for k in list(values) if k in train_types}
    return TrainConfig(experiment, options=kind.Options(**values), **train_values)


def code_fingerprint() -> dict:
    """The sha256 of the package's code and profiles (sorted by path), its git commit, and now."""
    files = sorted([*CONFIG_DIR.parent.rglob("*.py"), *CONFIG_DIR.glob("*.yaml")])
    return {
        "sha256": hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest(),
        "commit": current_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint written by `train`, loaded to the CPU with `weights_only`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a corrupt file raises one of many kinds
        raise ValueError(
            f"{path} is unreadable ({error!r}): delete it, or use another output directory"
        ) from None


class RunFolder:
    """What a run keeps in its output folder, written by rank 0: metrics.jsonl, best.pt, and
    checkpoint.pt, which also holds the settings and the code (`code_fingerprint`) that made it."""

    def __init__(self, folder: str | Path, config: TrainConfig, main: bool):
        self.dir = Path(folder)
        require(
            not self.dir.exists() or self.dir.is_dir(),
            f"output directory {self.dir} is a file: name a folder (made if missing)",
        )

        self.config = config
        self.main = main
        self.log_lines = 0  # what metrics.jsonl holds of this run

    def resume(self, stateful: dict, total_steps: int, world_size: int) -> dict:
        """Load `stateful` from checkpoint.pt and return where the run was (`STATE`), if this code
        made it; {} for a new run, or a redo of one made by other code. Other settings: refused; so
        are ranks that would start from different steps (a folder per node, not one shared)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "checkpoint.pt"
        self.code = code_fingerprint()
        state = load_checkpoint(path) if path.exists() else {}
        made = state.get("code", {})
        redo = bool(state) and made.get("sha256") != self.code["sha256"]

        # every rank's step (and, before rank 0 removes a checkpoint, every rank has read it)
        here = (f"{socket.gethostname()}:{self.dir.resolve()}", 0 if redo else state.get("step", 0))
        ranks = [here] * world_size
        if world_size > 1:
            dist.all_gather_object(ranks, here)
        if len({step for _, step in ranks}) > 1:
            steps = ", ".join(f"rank {r} {at} at step {step}" for r, (at, step) in enumerate(ranks))
            raise ValueError(
                f"the ranks would resume from different steps ({steps}): --output-dir must be one "
                "folder shared by every node, so that all resume from rank 0's checkpoint"
            )

        settings = asdict(self.config)
        old = state.get("config", settings)
        # compared only with what this code made (other code's run is redone, whatever its keys)
        changed = [k for k, v in settings.items() if k not in RESUMABLE and old.get(k, v) != v]
        require(
            redo or not changed,
            f"{path} was written with other settings ({', '.join(changed)}): use another "
            "output directory, or the same settings to resume",
        )

        say = tqdm.write if self.main else lambda message: None
        if redo:
            say(
                f"redoing {self.dir}: its checkpoint was made by other code (commit "
                f"{made.get('commit', 'unknown')}, {made.get('date', 'unknown date')})"
            )
            for name in ("checkpoint.pt", "best.pt", "metrics.jsonl", "results.json"):
                if self.main:
                    (self.dir / name).unlink(missing_ok=True)
            state = {}

        log = self.dir / "metrics.jsonl"
        if not state:
            if self.main:
                log.write_text("")
            return {}

        finished = state["step"] == total_steps
        say(
            f"reusing {self.dir}: finished at step {state['step']}, made {made['date']}, commit "
            f"{made['commit']}"
            if finished
            else f"resuming {path} at step {state['step']} of {total_steps}"
        )
        for key, part in stateful.items():
            part.load_state_dict(state[key])
        self.log_lines = state["log_lines"]
        if self.main:  # drop what the interrupted run logged after this checkpoint
            log.write_text("".join(log.read_text().splitlines(keepends=True)[: self.log_lines]))
        return {key: state[key] for key in STATE}

    def save(self, stateful: dict, where: dict) -> None:
        """Write checkpoint.pt: the state of `stateful`, where the run is, its settings and code."""
        if self.main:
            state = {**where, "log_lines": self.log_lines, "config": asdict(self.config)}
            state |= {key: part.state_dict() for key, part in stateful.items()}
            state["code"] = self.code
            write_atomic(self.dir / "checkpoint.pt", partial(torch.save, state))

    def log(self, record: dict) -> None:
        if self.main:
            with open(self.dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self.log_lines += 1

    def records(self, kind: str) -> list[dict]:
        lines = (self.dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or gradient norm: the run stops before a checkpoint keeps it."""


class RanksOutOfSync(RuntimeError):
    """DDP ranks hold different parameters or gradients: a bug in the step, never noise."""


class Trainer:
    """One run: `Trainer(config, output_dir).fit()` is `train(config, output_dir)`."""

    def __init__(self, config: TrainConfig, output_dir: str | Path):
        self.config = config
        self.rank, self.world_size = distributed.rank_and_world_size()
        self.main = self.rank == 0
        self.run = RunFolder(output_dir, config, self.main)
        part = config.batch_size // self.world_size
        self.rows = slice(self.rank * part, (self.rank + 1) * part)  # this rank's of each batch

        self.device = rank_device(config.device)
        self.experiment = experiments.get(config.experiment)(
            config.options, seed=config.seed, device=self.device
        )
        self.train_set = self.experiment.load_data()

        n = self.train_set.size  # items an epoch
        # each item's group as a number: TrainSet.groups (class, video, module), else duplicate keys
        groups = self.train_set.groups  # a list, or an integer array (MIL-NCE's video numbers)
        named = self.train_set.duplicate_keys if groups is None else groups
        self.group_codes = None
        if named is not None:
            self.group_codes = torch.from_numpy(np.unique(named, return_inverse=True)[1].ravel())
        if config.one_per_group:  # as MIL-NCE's loader draws one clip of each video
            require(groups is not None, f"one_per_group: {config.experiment} names no groups")
            n = int(self.group_codes.max()) + 1

        for key in ("mask_same_group", "gcbs_prune_groups"):
            require(
                named is not None or not getattr(config, key),
                f"{key}: {config.experiment} names no groups",
            )
        require(
            (config.gcbs_neighbours or 0) <= n,
            f"gcbs_neighbours must be at most N = {n}, the items of an epoch",
        )
        queue = f"mask_same_group: {config.experiment}'s negatives are a queue (ungrouped)"
        require(self.experiment.in_batch_negatives or not config.mask_same_group, queue)

        self.steps_per_epoch = n // config.batch_size
        self.total_steps = min(
            config.epochs * self.steps_per_epoch, config.max_steps or float("inf")
        )
        require(
            config.batch_size % self.world_size == 0,
            f"batch_size {config.batch_size} must divide over {self.world_size} ranks",
        )
        require(
            self.total_steps > 0,
            f"batch_size {config.batch_size} must be ≤ {n}, the items of an epoch",
        )
        if config.sampler == "hard_negatives" and not self.experiment.supports_mining:
            raise ValueError(f"experiment {config.experiment!r} does not take mined negatives")

        # every arm of a seed starts from the same weights
        torch.manual_seed(seeding.stream_seed(config.seed, 0, "init"))
        dtype = getattr(torch, config.dtype)
        self.model = self.experiment.build_model().to(self.device, dtype)
        self.scale = config.scale
        self.stateful = {"model": self.model}  # what checkpoint.pt restores (more below)
        if config.learnable_scale:
            self.scale = losses.LogitScale(config.scale, config.max_scale).to(self.device, dtype)
            self.stateful["scale"] = self.scale
        self.parameters = [
            p for part in self.stateful.values() for p in part.parameters() if p.requires_grad
        ]

        modules = self.experiment.branches(self.model)  # each distinct trainable one goes in DDP
        inside = {id(p) for module in modules for p in module.parameters()}
        # their gradients: all_reduce_gradients
        self.outside_ddp = [p for p in self.parameters if id(p) not in inside]
        wrapped = {
            id(m): DistributedDataParallel(m)  # on the module's device
            for m in {id(m): m for m in modules}.values()
            if self.world_size > 1 and any(p.requires_grad for p in m.parameters())
        }
        self.branch_modules = [wrapped.get(id(m), m) for m in modules]

        optimizers = {"adamw": torch.optim.AdamW, "sgd": partial(torch.optim.SGD, momentum=0.9)}
        self.optimizer = optimizers[config.optimizer](
            self.parameters, lr=config.lr, weight_decay=config.weight_decay
        )
        schedule = "constant_with_warmup" if config.schedule == "constant" else config.schedule
        self.scheduler = get_scheduler(
            schedule, self.optimizer, config.warmup_steps, self.total_steps
        )
        # fp16: scales the loss, skips a step whose gradients overflowed (disabled: does nothing)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.stateful.update(optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler)

        self.step = 0
        self.epoch = 0
        self.position = 0  # the batches of the epoch's plan taken
        self.plan = None  # the epoch's batches (and mined negatives), the same on every rank
        self.best = {"value": None}  # the best dev score so far, and its step

    def fit(self) -> dict | None:
        """Resume; plan each epoch; collate, step, log, evaluate, save; score best.pt (rank 0)."""
        config = self.config
        vars(self).update(self.run.resume(self.stateful, self.total_steps, self.world_size))
        if self.main and self.step == 0:  # the untrained model: the dev curve's first point
            self._evaluate_dev()

        shown = config.progress and self.main
        batches = None  # the epoch's batches from `position` on
        for _ in tqdm(range(self.step, self.total_steps), disable=not shown):
            if self.plan is None or self.position == self.steps_per_epoch:  # a new epoch
                batches = None  # the last epoch's workers end before the next plan
                if self.plan is not None:
                    self.epoch += 1
                self.position = 0
                self.plan = self._plan_epoch()
            if batches is None:
                batches = iter(self._loader())

            # reseeded at each step, so a resumed run draws the masks an unbroken one would
            dropout = f"dropout/rank{self.rank}/step{self.step}"
            torch.manual_seed(seeding.stream_seed(config.seed, self.epoch, dropout))
            record = self._train_step(next(batches))
            self.step += 1
            self.position += 1
            self.run.log({"kind": "step", "step": self.step, "epoch": self.epoch, **record})

            done = self.step == self.total_steps
            epoch_end = self.position == self.steps_per_epoch
            due = config.eval_every and self.step % config.eval_every == 0
            if self.main and (due or done or epoch_end):
                self._evaluate_dev()
            if self.step % config.checkpoint_every == 0 or done:
                self.run.save(self.stateful, {key: getattr(self, key) for key in STATE})

        del batches  # its workers end before the test scoring
        return self._summary() if self.main else None

    def _evaluate_dev(self) -> None:
        """Score the model on dev and log it; rank 0 keeps the best so far as best.pt."""
        scores = self.experiment.scores(self._in_eval_mode(self.experiment.evaluate, "dev"))
        value = scores[self.experiment.dev_metric]

        if self.best["value"] is None or value > self.best["value"]:
            self.best = {"value": value, "step": self.step}
            state = {"model": self.model.state_dict(), **self.best}
            write_atomic(self.run.dir / "best.pt", partial(torch.save, state))
        self.run.log(dict(kind="eval", split="dev", step=self.step, epoch=self.epoch, **scores))

    def _plan_epoch(self) -> dict:
        """Each rank embeds its share of the epoch's items (all, or one per group drawn afresh) and
        gathers every rank's; rank 0 plans, every rank gets the plan and sums its share of the loss
        gap, and rank 0 logs cost and diagnostics."""
        config = self.config
        start = time.perf_counter()
        items = self._items(self.epoch)
        z1 = z2 = None
        # a random order needs no embeddings: with a diagnostic sample, it is drawn first and
        # only the sample is embedded (every rank draws both alike)
        planned = None
        sample = None
        sampled = config.diagnostic_sample is not None and config.diagnostic_sample < len(items)
        if config.sampler == "random" and config.log_loss_gap and sampled:
            planned = self._sample(None, None, items)
            sample = self._diagnostic_sample(planned[0]["batches"])

        # GCBS on several ranks: each scans its rows of S for the graph, rank 0 orders it
        shared = config.sampler == "gcbs" and self.world_size > 1
        if config.sampler != "random" or config.log_loss_gap:  # one embedding serves both
            embedded_items = items if sample is None else items[sample[0]]
            share = embedded_items.tensor_split(self.world_size)[self.rank]
            embed = partial(self._in_eval_mode, self.experiment.pair_embeddings)
            pairs = [embed(part) for part in share.split(config.embed_batch_size)]
            z1, z2 = (distributed.gather_ragged(torch.cat(z).float()) for z in zip(*pairs))

        embedded = time.perf_counter()
        graph = None
        if shared:
            graph = gcbs.published_graph(z1, z2, self._quantile(len(items)), shared=True)

        plan = [None]  # as positions in items
        record = {}
        if self.main:
            if planned is None:
                planned = self._sample(z1, z2, items, graph)
            positions, diagnostics = planned  # rows of z1, z2
            plan = [positions]
            sampled = time.perf_counter()
            record = dict(kind="epoch", epoch=self.epoch, step=self.step, sampler=config.sampler)
            record.update(embed_seconds=embedded - start, sampler_seconds=sampled - embedded)

            groups = self._groups(items)
            if groups is not None:
                record["same_group_pairs"] = gcbs.same_group_pairs(positions["batches"], groups)

            dropped = set(items.tolist()) - set(items[positions["batches"]].view(-1).tolist())
            if self.plan is not None and dropped:  # the last epoch's plan: what it left out
                before = set(self._items(self.epoch - 1).tolist())
                before -= set(self.plan["batches"].view(-1).tolist())
                diagnostics["dropped_again"] = len(dropped & before) / len(dropped)

        if self.world_size > 1:
            dist.broadcast_object_list(plan, src=0)
        positions = plan[0]
        if config.log_loss_gap:  # each rank sums its share of the terms, rank 0 gets the gap
            record["loss_gap"] = self._loss_gap(z1, z2, positions["batches"], sample)
        if self.main:
            self.run.log({**record, **diagnostics})
        return {k: None if v is None else items[v] for k, v in positions.items()}

    def _diagnostic_sample(self, batches: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The items the loss gap of the planned `batches` measures, as positions in the epoch's
        items, and how many of them are batches' measured in full: every planned item, unless
        `diagnostic_sample` is smaller; then the items of m = diagnostic_sample // B (at least 1)
        batches, then a reference sample R of diagnostic_sample items of the other batches. Drawn
        by seed and epoch alone: every arm draws the same batch numbers and places in the rest."""
        size = self.config.diagnostic_sample
        if size is None or size >= batches.numel():
            return batches.reshape(-1), batches.numel()

        draw = seeding.generator(self.config.seed, self.epoch, "diagnostic-sample")
        shuffled = batches[torch.randperm(len(batches), generator=draw)]
        count = max(1, size // self.config.batch_size)
        measured = shuffled[:count].reshape(-1)
        rest = shuffled[count:].reshape(-1)
        reference = rest[torch.randperm(len(rest), generator=draw)[:size]]
        return torch.cat([measured, reference]), len(measured)

    def _loss_gap(self, z1, z2, batches: torch.Tensor, embedded=None) -> float | None:
        """L^Global − L^Train of the epoch's planned `batches`: exact, or over the batches of the
        `_diagnostic_sample`, the other batches' items estimated from R. z1, z2: every item's, or
        only those of the sample `embedded` where the random arm embedded just that. Each rank
        sums its share of the terms; rank 0 gets the gap (the other ranks None)."""
        sample = embedded
        if sample is None:  # z1, z2 hold every item
            sample = self._diagnostic_sample(batches)
            z1 = z1[sample[0]]
            z2 = z2[sample[0]]
        measured = sample[1]

        reference = None  # R, standing for the other batches' items (none: all are measured)
        if len(z2) > measured:
            reference = (z2[measured:], batches.numel() - measured)
        order = torch.arange(measured)
        tau = 1 / self._scale()
        batch_size = self.config.batch_size
        first, last = (measured * r // self.world_size for r in (self.rank, self.rank + 1))
        rows = range(first, last)
        part = gcbs.loss_gap(z1[:measured], z2[:measured], order, batch_size, tau, reference, rows)
        parts = torch.tensor([part], dtype=torch.float64, device=z1.device)
        parts = distributed.gather_ragged(parts, main_only=True)
        return None if parts is None else parts.sum().item()

    def _items(self, epoch: int) -> torch.Tensor:
        """The items of `epoch`: all of the training set, or one per group drawn afresh."""
        if not self.config.one_per_group:
            return torch.arange(self.train_set.size)

        draw = seeding.generator(self.config.seed, epoch, "one-per-group")
        return seeding.one_per_group(self.group_codes, draw)

    def _groups(self, items: torch.Tensor) -> list | None:
        """The group code of each of `items` (`group_codes`), or None."""
        return None if self.group_codes is None else self.group_codes[items].tolist()

    def _quantile(self, n: int) -> float:
        """GCBS's quantile q for an epoch of n items: gcbs_quantile, or 1 − k / n for k given."""
        k = self.config.gcbs_neighbours
        return self.config.gcbs_quantile if k is None else 1 - k / n

    def _sample(self, z1, z2, items: torch.Tensor, graph=None) -> tuple[dict, dict]:
        """Batches of `items` (z1, z2: theirs, or None) and any mined negatives, as positions in
        `items`: the published GCBS order (with its controls; of `graph` where the ranks built it)
        or a seeded random one, read into batches alike, their order shuffled with `batch_order`;
        and the GCBS graph's diagnostics."""
        config = self.config
        keys = self.train_set.duplicate_keys
        if keys is not None and len(items) < self.train_set.size:  # a sampled epoch
            keys = [keys[i] for i in items.tolist()]
        diagnostics = {}
        if config.sampler == "gcbs":
            quantile = self._quantile(len(items))
            if graph is None:
                graph = gcbs.published_graph(z1, z2, quantile)
            if config.gcbs_prune_groups:
                graph = gcbs.without_group_edges(graph, self._groups(items))
            diagnostics = {"neighbours": (1 - quantile) * len(items)}
            diagnostics.update(gcbs.graph_diagnostics(graph))  # of the graph RCM orders
            relabel = None
            if config.gcbs_ties == "random":  # RCM's ties then fall at random, not by storage
                ties = seeding.generator(config.seed, self.epoch, "gcbs-ties")
                relabel = torch.randperm(len(items), generator=ties)
            order = gcbs.graph_order(graph, relabel)
        else:
            shuffle = seeding.generator(config.seed, self.epoch, "shuffle")
            order = torch.randperm(len(items), generator=shuffle)
        batches = gcbs.consecutive_batches(order, config.batch_size, keys)
        if config.batch_order == "shuffled":
            shuffle = seeding.generator(config.seed, self.epoch, "batch-order")
            batches = batches[torch.randperm(len(batches), generator=shuffle)]
        if config.sampler != "hard_negatives":
            return {"batches": batches, "negatives": None}, diagnostics
        rng = seeding.generator(config.seed, self.epoch, "mining")
        top = dict(top_k=config.mine_top_k, skip=config.mine_skip)
        negatives = mining.mine_hard_negatives(z1, z2, batches, keys=keys, generator=rng, **top)
        return {"batches": batches, "negatives": negatives}, diagnostics

    def _loader(self) -> DataLoader:
        """This rank's batches of the epoch's plan from `position` on, collated in `loader_workers`
        forked processes ahead of the step (or in this one), pinned on a GPU."""

        def collate(position: int) -> experiments.Batch:
            # this rank's items (and their negatives)
            rows = [
                None if part is None else part[position, self.rows].tolist()
                for part in self.plan.values()
            ]
            return self._collate(*rows)

        workers = self.config.loader_workers
        return DataLoader(
            range(self.position, self.steps_per_epoch),
            batch_size=None,  # each position is one planned batch
            collate_fn=collate,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            multiprocessing_context="fork" if workers else None,
        )

    def _collate(self, indices: list[int], negatives: list[int] | None) -> experiments.Batch:
        """The experiment's batch; with `mask_same_group`, `extra["groups"]` holds the group id of
        each document: an item's, then its mined negative's (the documents' layout)."""
        batch = self.experiment.collate(indices, negatives)
        if not self.config.mask_same_group:
            return batch

        documents = [indices] if negatives is None else [indices, negatives]
        groups = self.group_codes[torch.tensor(documents).T.reshape(-1)]
        return batch._replace(extra={**(batch.extra or {}), "groups": groups})

    def _train_step(self, batch: experiments.Batch) -> dict:
        """Forward and backward (GradCache with `chunk_size`), all-reduce, clip, check, step."""
        start = time.perf_counter()
        global_loss = self._backward(batch)
        self.scaler.unscale_(self.optimizer)  # clipped and checked: the true gradients
        clip = self.config.clip_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, clip)

        # the step's one read of the device (the scaler's `step` reads once more): logged, checked
        loss, norm = torch.stack([global_loss, grad_norm.double()]).tolist()
        checked = self._check(loss, norm)
        lr = self.scheduler.get_last_lr()[0]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        torch.no_grad()(self.experiment.after_step)(self.model)  # e.g. a momentum encoder's update
        if math.isfinite(norm):  # fp16: a skipped step keeps its learning rate (as HF's Trainer)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.config.learnable_scale:
            self.scale.clamp_()
        seconds = time.perf_counter() - start
        return dict(
            loss=loss, lr=lr, grad_norm=norm, scale=self._scale(), seconds=seconds, **checked
        )

    def _backward(self, batch: experiments.Batch) -> torch.Tensor:
        """The batch's loss backward (scaled under fp16), gradients summed over the ranks; the
        loss over all ranks' shares, as a float64 tensor on the device."""
        batch = experiments.Batch(*experiments.to_device([batch.inputs, batch.extra], self.device))
        loss_fn = lambda *embeddings: self.experiment.loss(embeddings, batch, self.scale)  # noqa: E731
        autocast = AUTOCAST.get(self.config.precision)
        chunk_size = self.config.chunk_size

        # GradCache's replays take up the autocast state `cached_loss` was called in
        with torch.autocast(self.device.type, autocast, enabled=autocast is not None):
            if chunk_size is not None:
                loss = gradcache.cached_loss(loss_fn, self.branch_modules, batch.inputs, chunk_size)
            else:
                loss = loss_fn(*[module(x) for module, x in zip(self.branch_modules, batch.inputs)])

        global_loss = distributed.gather_with_grad(loss.detach().double().reshape(1)).mean()
        self.scaler.scale(loss).backward()
        distributed.all_reduce_gradients(self.outside_ddp)
        return global_loss

    def _check(self, loss: float, norm: float) -> dict:
        """Raise before the optimizer step on a non-finite loss or gradient norm (fp16: an overflow
        only skips its step), or on ranks out of sync (checked every `sync_check_every` steps)."""
        config = self.config
        judged = {"the loss": loss, "the gradient norm": norm}
        if self.scaler.is_enabled():
            del judged["the gradient norm"]

        for what, value in judged.items():  # nothing changed yet: the checkpoint is still good
            if not math.isfinite(value):
                raise TrainingDiverged(
                    f"{what} is not finite at step {self.step + 1} (scale {self._scale():g}, lr "
                    f"{config.lr}): too low a temperature, too high a learning rate, NaN inputs?"
                )

        # after the finiteness checks: inf − inf would read as out of sync
        every = config.sync_check_every
        if self.world_size == 1 or not every or (self.step + 1) % every or not math.isfinite(norm):
            return {}

        grads = [p.grad for p in self.parameters if p.grad is not None]
        difference = distributed.rank_difference([*self.parameters, *grads])
        if difference != 0:  # NaN included
            raise RanksOutOfSync(
                f"ranks out of sync at step {self.step + 1}: parameters or gradients differ "
                f"between the {self.world_size} ranks by up to {difference:.3g}"
            )
        return {"rank_difference": difference}

    def _scale(self) -> float:
        return self.scale().item() if self.config.learnable_scale else self.scale

    @torch.no_grad()
    def _in_eval_mode(self, function, *args):  # function(model, *args)
        result = function(self.model.eval(), *args)
        self.model.train()
        return result

    def score(self, prefix: str = "test_") -> tuple[list[dict], experiments.Outputs]:
        """The model's per-item test outputs, and their scores as result rows `<prefix><metric>`."""
        outputs = self._in_eval_mode(self.experiment.evaluate, "test")
        return self.result_rows(self.experiment.scores(outputs), prefix), outputs

    def result_rows(self, scores: dict[str, float], prefix: str, suffix: str = "") -> list[dict]:
        """`scores` as result rows of this run, metrics `<prefix><name><suffix>`."""
        config = self.config
        experiment = self.experiment
        model = experiment.model_name
        fields = dict(experiment=config.experiment, arm=config.arm or config.sampler)
        fields.update(seed=config.seed, profile=config.profile, data=experiment.data_name)
        return [
            result_row(metric=f"{prefix}{m}{suffix}", value=v, model=model, **fields)
            for m, v in scores.items()
        ]

    def _summary(self) -> dict:
        """Score the last step's model and best.pt on test (per-item outputs in outputs.json) into
        results.json, with best.pt's dev score and each epoch's diagnostics; return a summary."""
        # the last step's model first: loading best.pt replaces it
        last_rows, last = self.score("last_test_")
        best = load_checkpoint(self.run.dir / "best.pt")
        self.model.load_state_dict(best["model"])
        rows, outputs = self.score()

        rows += self.result_rows({self.experiment.dev_metric: best["value"]}, "dev_") + last_rows
        for epoch in self.run.records("epoch"):  # the diagnostics: loss_gap@epoch0, ...
            diagnostics = {k: v for k, v in epoch.items() if k in DIAGNOSTICS}
            rows += self.result_rows(diagnostics, "", f"@epoch{epoch['epoch']}")

        write_rows(self.run.dir / "results.json", rows)
        write_atomic(self.run.dir / "outputs.json", json.dumps({"best": outputs, "last": last}))

        return {
            "output_dir": str(self.run.dir),
            "steps": self.step,
            "best_step": self.best.get("step"),
            "rows": rows,
            "outputs": {"best": outputs, "last": last},
            "epochs": self.run.records("epoch"),
            "dev": self.run.records("eval"),
            "test": {r["metric"][5:]: r["value"] for r in rows if r["metric"].startswith("test_")},
        }


def rank_device(kind: str) -> torch.device:
    """The CPU, the GPU `kind` names ("cuda:3"), or for "cuda" this rank's (cuda:LOCAL_RANK); a GPU
    is made current, with TF32 matmuls and convs."""
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if kind == "cuda" else kind)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return device


def train(config: TrainConfig, output_dir: str | Path) -> dict | None:
    """Train `config` into `output_dir`, resuming its checkpoint.pt; rank 0 returns the summary."""
    return Trainer(config, output_dir).fit()


def launched(config: dict, output_dir: str) -> dict | None:
    """`train` from `asdict(config)` (JSON): the target of `gcbs_lib.launcher.launch`."""
    options = experiments.get(config["experiment"]).Options(**config["options"])
    return train(TrainConfig(**{**config, "options": options}), output_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        "python -m gcbs_lib.train", description="Train, resuming from OUTPUT_DIR."
    )
    add = parser.add_argument
    add("--experiment", required=True, help=", ".join(experiments.available()))
    add("--output-dir", help="default: runs/EXPERIMENT-PROFILE-SAMPLER-seedSEED")
    add("--profile", default="ci")
    add("--seed", type=int)
    add("--sampler", choices=get_args(get_type_hints(TrainConfig)["sampler"]))
    add("--print-config", action="store_true", help="print the settings as YAML")
    add(
        "--prepare-data",
        action="store_true",
        help="build the data in one process (before torchrun)",
    )
    add(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a TrainConfig field or an option of the experiment (repeatable)",
    )

    arguments = parser.parse_args(argv)
    overrides = {
        k: getattr(arguments, k) for k in ("seed", "sampler") if getattr(arguments, k) is not None
    }
    try:  # bad settings, a bad output directory or bad data: one line, no traceback
        require(all("=" in pair for pair in arguments.overrides), "--set takes KEY=VALUE")
        overrides = {**dict(pair.split("=", 1) for pair in arguments.overrides), **overrides}
        config = load_config(arguments.experiment, arguments.profile, overrides)
        if arguments.print_config:
            print(yaml.safe_dump(asdict(config), sort_keys=False), end="")
            return
        if arguments.prepare_data:
            experiment = experiments.get(config.experiment)(
                config.options, seed=config.seed, device="cpu"
            )
            print(f"{experiment.load_data().size} training items ready")
            return

        # Without --output-dir, one folder per run under ./runs, named by what tells runs apart.
        name = f"{config.experiment}-{arguments.profile}-{config.sampler}-seed{config.seed}"
        output_dir = arguments.output_dir or Path("runs") / name

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
            timeout = collective_timeout(config.collective_timeout)
            dist.init_process_group("nccl" if config.device == "cuda" else "gloo", timeout=timeout)
        trainer = Trainer(config, output_dir)
    except (KeyError, ValueError, OSError) as error:
        parser.error(error.args[0] if isinstance(error, KeyError) else str(error))

    summary = trainer.fit()
    if summary is not None:
        print(json.dumps({key: summary[key] for key in ("test", "best_step", "output_dir")}))

    if dist.is_initialized():  # torchrun's: DDP's reducers freed, then all ranks leave together
        del trainer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
