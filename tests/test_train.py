"""Specification of the training loop: typed configs, CLI errors, atomic checkpoints, bitwise resume
after SIGKILL, the NaN stop, 2 gloo processes = 1 process and the rank-sync check. Runs the
code-search experiment with the tiny encoder on planted pairs written in CodeSearchNet's jsonl
layout (the `data_root` fixture)."""

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from test_gcbs import pairs

import gcbs_lib.check
import gcbs_lib.train
from gcbs_lib import distributed
from gcbs_lib.data import write_atomic
from gcbs_lib.experiments.codesearch import CodeSearch
from gcbs_lib.gcbs import (
    consecutive_batches,
    graph_diagnostics,
    graph_order,
    loss_gap,
    published_graph,
    published_permutation,
    without_group_edges,
)
from gcbs_lib.launcher import LaunchError, launch
from gcbs_lib.losses import info_nce
from gcbs_lib.seeding import generator
from gcbs_lib.train import (
    TrainConfig,
    Trainer,
    TrainingDiverged,
    launched,
    load_checkpoint,
    load_config,
    main,
    train,
)

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
}


def settings(data_root, **overrides):
    """A CI-sized codesearch run on the planted data (strings, as --set passes them)."""
    values = {
        "data": "csn",
        "data_root": str(data_root),
        "batch_size": 16,
        "epochs": 2,
        "lr": 1e-3,
        "query_length": 16,
        "code_length": 24,
        "tiny_dim": 16,
        "tiny_layers": 1,
        "embed_batch_size": 64,
        "progress": False,
        **overrides,
    }
    return {k: str(v) for k, v in values.items()}


def records(output_dir, kind="step") -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# ---- config
# ------------------------------------------------------------------------------------------------


def test_overrides_are_typed_by_the_config_field_they_set(data_root):
    config = load_config(
        "codesearch",
        "ci",
        settings(
            data_root,
            lr="3e-5",
            chunk_size=8,
            max_steps="none",
            learnable_scale="true",
            eval_limit=10,
            prefix="none",
        ),
    )
    assert (config.lr, config.chunk_size, config.max_steps, config.learnable_scale) == (
        3e-5,
        8,
        None,
        True,
    )
    assert isinstance(config.options, CodeSearch.Options) and config.options.eval_limit == 10
    assert config.options.prefix is None and config.options.data == "csn"
    # the ci profile's value kept
    assert config.profile == "ci" and config.options.encoder == "tiny"


@pytest.mark.parametrize(
    "name, kind, momentum", [("adamw", torch.optim.AdamW, None), ("sgd", torch.optim.SGD, 0.9)]
)
def test_the_optimizer_is_adamw_or_sgd_with_momentum_0_9(tmp_path, data_root, name, kind, momentum):
    config = load_config(
        "codesearch", "ci", settings(data_root, optimizer=name, weight_decay=5e-4, lr=0.06)
    )
    optimizer = gcbs_lib.train.Trainer(config, tmp_path / "run").optimizer
    group = optimizer.param_groups[0]
    assert (type(optimizer), group.get("momentum"), group["weight_decay"], group["lr"]) == (
        kind,
        momentum,
        5e-4,
        0.06,
    )


def test_the_paper_profiles_follow_the_original_recipes_and_ci_keeps_adamw():
    # the MoCo CIFAR-10 demo: τ = 0.1, SGD, lr 0.06 at batch 512, wd 5e-4
    moco = load_config("moco", "paper")
    assert (moco.scale, moco.optimizer, moco.lr, moco.batch_size, moco.weight_decay) == (
        10.0,
        "sgd",
        0.06,
        512,
        5e-4,
    )
    assert load_config("moco", "ci").optimizer == load_config("moco", "cpu").optimizer == "adamw"
    milnce = load_config("milnce", "paper")  # official MIL-NCE: batch 256, warmup then cosine
    assert (milnce.batch_size, milnce.schedule, milnce.warmup_steps > 0) == (256, "cosine", True)
    advtest, csn = load_config("codesearch", "paper-advtest"), load_config("codesearch", "paper")
    assert (advtest.options.data, advtest.epochs, csn.options.data, csn.epochs) == (
        "advtest",
        2,
        "csn",
        10,
    )
    assert {
        k: v for k, v in vars(advtest).items() if k not in ("epochs", "options", "profile")
    } == {k: v for k, v in vars(csn).items() if k not in ("epochs", "options", "profile")}


def test_the_paper_profiles_train_in_their_recipes_precision_and_the_cpu_ones_in_fp32():
    """SimCSE's and PromCSE's scripts pass --fp16; UniXcoder's run.py, the MoCo CIFAR-10 demo and
    MIL-NCE train in float32. The ci and cpu profiles keep fp32: their committed results stand."""
    paper = {"simcse": "fp16", "promcse": "fp16", "codesearch": "fp32", "moco": "fp32"}
    paper["milnce"] = "fp32"
    assert {name: load_config(name, "paper").precision for name in paper} == paper
    assert load_config("codesearch", "paper-advtest").precision == "fp32"
    cpu = {load_config(name, profile).precision for name in paper for profile in ("ci", "cpu")}
    assert cpu == {"fp32"}


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (
            {"learning_rate": "1e-3"},
            KeyError,
            "unknown config key 'learning_rate'; training keys: arm, batch_order, batch_size",
        ),
        ({"bf16": "true"}, KeyError, "unknown config key 'bf16'"),
        ({"precision": "fp8"}, ValueError, r"precision must be Literal\['fp32', 'bf16', 'fp16'\]"),
        ({"batch_size": "sixty-four"}, ValueError, "batch_size must be int, got 'sixty-four'"),
        ({"batch_size": "6.5"}, ValueError, "batch_size must be int"),
        ({"max_steps": "many"}, ValueError, r"max_steps must be int \| None"),
        ({"lr": "fast"}, ValueError, "lr must be float"),
        (
            {"sampler": "hard"},
            ValueError,
            r"sampler must be Literal\['random', 'gcbs', 'hard_negatives'\], got 'hard'",
        ),
        ({"learnable_scale": "maybe"}, ValueError, "learnable_scale must be bool"),
        ({"batch_size": "0", "lr": "-1"}, ValueError, "batch_size, lr must be positive"),
        ({"clip_norm": "-1", "scale": "0"}, ValueError, "clip_norm, scale must be positive"),
        ({"collective_timeout": "0"}, ValueError, "collective_timeout must be positive"),
    ],
)
def test_unknown_keys_and_ill_typed_values_are_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        load_config("codesearch", "ci", overrides)


def cli(*arguments):
    return subprocess.run(
        [sys.executable, "-m", "gcbs_lib.train", *arguments],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--experiment", "nope"], "unknown experiment 'nope'; known: codesearch, milnce"),
        (
            ["--experiment", "codesearch", "--profile", "huge"],
            "unknown profile 'huge' for codesearch; known: ['ci'",
        ),
        (
            ["--experiment", "codesearch", "--set", "learning_rate=1"],
            "unknown config key 'learning_rate'",
        ),
        (
            ["--experiment", "codesearch", "--set", "batch_size=many"],
            "batch_size must be int, got 'many'",
        ),
        (["--experiment", "codesearch", "--set", "lr"], "--set takes KEY=VALUE"),
        (["--experiment", "codesearch", "--sampler", "hard"], "invalid choice: 'hard'"),
    ],
)
def test_command_line_errors_exit_2_with_one_message_and_no_traceback(
    tmp_path, capsys, arguments, message
):
    """argparse's `parser.error`: usage, then `error: <message>`, exit status 2 (no traceback,
    nothing written)."""
    with pytest.raises(SystemExit) as exit:
        main([*arguments, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("usage:") and "error: " in err and message in err
    assert not any(tmp_path.iterdir())


class Joined(Exception):
    """Raised in place of joining a process group."""


@pytest.mark.parametrize(
    "key, environment, seconds",
    [(None, None, 1800), (None, "90", 90), ("7", "90", 7), ("7", "ten", 7)],
)
def test_under_torchrun_the_ranks_wait_the_config_keys_timeout_else_the_environments(
    tmp_path, monkeypatch, key, environment, seconds
):
    """`collective_timeout` (a config key), else GCBS_COLLECTIVE_TIMEOUT, else 30 minutes: how
    long each rank waits in a collective, set where torchrun's rank joins its process group."""
    joined = []

    def join(backend, timeout):
        joined.append((backend, timeout))
        raise Joined

    monkeypatch.setattr(dist, "init_process_group", join)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("GCBS_COLLECTIVE_TIMEOUT", raising=False)
    if environment is not None:
        monkeypatch.setenv("GCBS_COLLECTIVE_TIMEOUT", environment)
    overrides = [] if key is None else ["--set", f"collective_timeout={key}"]
    with pytest.raises(Joined):
        main(["--experiment", "codesearch", "--output-dir", str(tmp_path), *overrides])
    assert joined == [("gloo", timedelta(seconds=seconds))]


def test_under_torchrun_a_timeout_that_is_not_seconds_exits_2_naming_it(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("GCBS_COLLECTIVE_TIMEOUT", "ten")
    arguments = ["--experiment", "codesearch", "--output-dir", str(tmp_path)]
    assert "GCBS_COLLECTIVE_TIMEOUT must be seconds, got 'ten'" in refused(capsys, arguments)
    monkeypatch.delenv("GCBS_COLLECTIVE_TIMEOUT")
    overrides = ["--set", "collective_timeout=.inf"]
    message = "a collective timeout must be positive seconds, got inf"
    assert message in refused(capsys, [*arguments, *overrides])
    assert not any(tmp_path.iterdir())


def test_print_config_prints_the_resolved_settings_as_yaml_and_loads_nothing(
    tmp_path, capsys, monkeypatch
):
    """The paper recipe as it would run, checked before spending GPU hours: no data (its folder
    does not exist), no model, nothing written; without --print-config, a run needs a folder:
    --output-dir, or runs/EXPERIMENT-PROFILE-SAMPLER-seedSEED under the working directory."""
    run, missing = tmp_path / "run", tmp_path / "no-data"
    arguments = ["--experiment", "simcse", "--profile", "paper", "--seed", "4"]
    main([*arguments, "--output-dir", str(run), f"--set=data_root={missing}", "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    config = load_config("simcse", "paper", {"seed": 4, "data_root": str(missing)})
    assert printed == asdict(config) and not run.exists()
    assert (printed["precision"], printed["seed"], printed["options"]["encoder"]) == (
        "fp16",
        4,
        "bert-base-uncased",
    )
    main([*arguments, "--print-config"])  # no --output-dir needed
    assert yaml.safe_load(capsys.readouterr().out) == asdict(
        load_config("simcse", "paper", {"seed": 4})
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "simcse-paper-random-seed4").touch()  # a file where the folder would go
    message = "output directory runs/simcse-paper-random-seed4 is a file"
    assert message in refused(capsys, arguments)


def test_print_config_shows_the_gcbs_regime_and_controls_which_default_to_the_published_order(
    capsys,
):
    keys = ["gcbs_quantile", "gcbs_neighbours", "gcbs_ties", "gcbs_prune_groups", "batch_order"]
    for overrides, expected in (
        ([], [0.999, None, "index", False, "planned"]),
        (
            ["--set=gcbs_neighbours=20", "--set=gcbs_ties=random"],
            [0.999, 20, "random", False, "planned"],
        ),
    ):
        main(["--experiment", "codesearch", "--print-config", *overrides])
        printed = yaml.safe_load(capsys.readouterr().out)
        assert [printed[key] for key in keys] == expected


def refused(capsys, arguments) -> str:
    """What `main(arguments)` printed to stderr, having exited with status 2 and no traceback."""
    with pytest.raises(SystemExit) as exit:
        main(arguments)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err
    return err


def test_an_output_directory_that_is_a_file_or_an_empty_training_set_is_named_in_the_error(
    tmp_path, capsys, data_root
):
    (tmp_path / "a-file").write_text("")
    err = refused(capsys, command(tmp_path / "a-file", data_root))
    assert f"error: output directory {tmp_path / 'a-file'} is a file" in err
    empty = tmp_path / "empty" / "codesearch" / "CSN" / "python"
    empty.mkdir(parents=True)
    (empty / "train.jsonl").write_text("")
    err = refused(capsys, command(tmp_path / "run", tmp_path / "empty"))
    assert (
        f"error: {empty / 'train.jsonl'}: no code-search examples" in err
        and not (tmp_path / "run").exists()
    )


def test_missing_data_is_named_in_a_one_line_error(tmp_path, capsys):
    (tmp_path / "no-data").mkdir()
    err = refused(capsys, command(tmp_path / "run", tmp_path / "no-data"))
    assert f"error: no code-search file at {tmp_path / 'no-data'}" in err


def test_a_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, data_root):
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="checkpoint.pt is unreadable .*: delete it"):
        train(load_config("codesearch", "ci", settings(data_root)), tmp_path)


# ---- checkpoints
# -------------------------------------------------------------------------------------------


def test_an_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "checkpoint.pt"
    write_atomic(path, lambda file: torch.save({"step": 1, "model": {"w": torch.ones(2)}}, file))
    with pytest.raises((pickle.PicklingError, AttributeError)):  # a lambda cannot be pickled
        write_atomic(path, lambda file: torch.save({"step": 2, "unpicklable": lambda: None}, file))
    assert load_checkpoint(path)["step"] == 1


def command(output_dir, data_root, **overrides):
    pairs = [f"--set={k}={v}" for k, v in settings(data_root, **overrides).items()]
    return [
        "--experiment",
        "codesearch",
        "--profile",
        "ci",
        "--output-dir",
        str(output_dir),
        "--sampler",
        "gcbs",
        "--seed",
        "3",
        *pairs,
    ]


@pytest.mark.parametrize("sampler", ["random", "gcbs", "hard_negatives"])
def test_every_arm_reads_its_order_into_batches_alike(tmp_path, data_root, sampler):
    trainer = Trainer(
        load_config("codesearch", "ci", settings(data_root, sampler=sampler)), tmp_path
    )
    n, b = trainer.train_set.size, trainer.config.batch_size
    keys = [i % (n // 2) for i in range(n)]  # every item has one duplicate
    trainer.train_set = trainer.train_set._replace(duplicate_keys=keys)
    z1, z2 = torch.randn(2, n, 8, generator=torch.Generator().manual_seed(0))
    plan, _ = trainer._sample(z1, z2, torch.arange(n))
    # gcbs: the published order, read sequentially (not shuffled); the others: the run's shuffle
    order = torch.randperm(n, generator=generator(trainer.config.seed, 0, "shuffle"))
    if sampler == "gcbs":
        order = published_permutation(z1, z2, trainer.config.gcbs_quantile)
    assert torch.equal(plan["batches"], consecutive_batches(order, b, keys))
    assert plan["batches"].shape == (n // b, b)  # the short last batch dropped
    assert all(len({keys[i] for i in batch}) == b for batch in plan["batches"].tolist())
    assert (plan["negatives"] is not None) == (sampler == "hard_negatives")


def test_shuffled_batch_order_keeps_every_planned_batch_and_changes_only_their_order(
    tmp_path, data_root
):
    z1, z2 = torch.randn(2, 192, 8, generator=torch.Generator().manual_seed(0))
    plans = {}
    for order in ("planned", "shuffled"):
        config = load_config("codesearch", "ci", settings(data_root, sampler="gcbs"))
        config.batch_order = order
        plans[order] = Trainer(config, tmp_path)._sample(z1, z2, torch.arange(192))[0]["batches"]
    planned, shuffled = plans["planned"].tolist(), plans["shuffled"].tolist()
    assert planned != shuffled and sorted(planned) == sorted(shuffled)


def test_a_pruned_arm_orders_and_reports_the_graph_without_its_same_group_edges(
    tmp_path, data_root
):
    config = load_config("codesearch", "ci", settings(data_root, sampler="gcbs", gcbs_neighbours=8))
    config.gcbs_prune_groups = True
    trainer = Trainer(config, tmp_path)
    groups = trainer._groups(torch.arange(192))  # 48 source files, as numbers
    noise = torch.randn(192, 8, generator=torch.Generator().manual_seed(0))
    # six files share each of 8 directions: edges within a file and across files
    z = torch.nn.functional.normalize(torch.eye(8)[torch.tensor(groups) % 8] + 0.1 * noise, dim=1)
    graph = published_graph(z, z, trainer._quantile(192))
    pruned = without_group_edges(graph, groups)
    plan, diagnostics = trainer._sample(z, z, torch.arange(192))
    assert graph_diagnostics(pruned)["edges_per_item"] < graph_diagnostics(graph)["edges_per_item"]
    assert {k: diagnostics[k] for k in graph_diagnostics(pruned)} == graph_diagnostics(pruned)
    assert torch.equal(
        plan["batches"],
        consecutive_batches(graph_order(pruned), 16, trainer.train_set.duplicate_keys),
    )


def test_more_gcbs_neighbours_than_items_are_refused_naming_n(tmp_path, data_root):
    config = load_config("codesearch", "ci", settings(data_root, gcbs_neighbours=193))
    with pytest.raises(ValueError, match="gcbs_neighbours must be at most N = 192"):
        Trainer(config, tmp_path)


def test_gcbs_arms_log_their_graph_and_every_arm_what_it_drops_again_as_result_rows(
    tmp_path, data_root, monkeypatch
):
    """192 items in batches of 20: 12 left out each epoch. `gcbs_neighbours` k = 4 sets q = 1 −
    k/N; the controls (random ties, pruned groups, shuffled batches) run through a whole run."""
    quantiles, planned = [], []
    graph, sample = gcbs_lib.gcbs.published_graph, Trainer._sample

    def recorded_graph(z1, z2, quantile):
        quantiles.append(quantile)
        return graph(z1, z2, quantile)

    def recorded_sample(self, z1, z2, items, graph=None):
        plan, diagnostics = sample(self, z1, z2, items, graph)
        planned.append(set(range(192)) - set(plan["batches"].view(-1).tolist()))
        return plan, diagnostics

    monkeypatch.setattr(gcbs_lib.gcbs, "published_graph", recorded_graph)
    monkeypatch.setattr(Trainer, "_sample", recorded_sample)
    controls = dict(gcbs_ties="random", gcbs_prune_groups=True, batch_order="shuffled")
    names = {}
    for sampler in ("random", "gcbs"):
        planned.clear()
        overrides = dict(sampler=sampler, batch_size=20, max_steps=10, gcbs_neighbours=4)
        config = load_config("codesearch", "ci", settings(data_root, **overrides, **controls))
        epochs = train(config, tmp_path / sampler)["epochs"]
        rows = json.loads((tmp_path / sampler / "results.json").read_text())
        names[sampler] = {r["metric"] for r in rows if "@epoch" in r["metric"]}
        dropped, again = planned  # the items each epoch left out
        assert len(dropped) == len(again) == 12
        assert epochs[1]["dropped_again"] == len(dropped & again) / 12
    assert quantiles == [1 - 4 / 192] * 2
    assert [e["neighbours"] for e in epochs] == pytest.approx([4, 4])
    diagnostics = ["loss_gap", "same_group_pairs"]
    assert names["random"] == {
        *(f"{d}@epoch{e}" for d in diagnostics for e in (0, 1)),
        "dropped_again@epoch1",
    }
    graphs = ["edges_per_item", "isolated_share", "neighbours"]
    assert names["gcbs"] == names["random"] | {f"{d}@epoch{e}" for d in graphs for e in (0, 1)}


@pytest.mark.parametrize("sampler", ["random", "gcbs"])
def test_one_item_per_group_is_what_each_epoch_embeds_plans_trains_on_and_measures(
    tmp_path, monkeypatch, sampler
):
    """MIL-NCE's official sampling: one clip of each training video an epoch, drawn afresh."""
    overrides = {"data_dir": str(tmp_path / "data"), "sampler": sampler, "one_per_group": True}
    trainer = Trainer(load_config("milnce", "ci", overrides), tmp_path)
    videos = torch.tensor(trainer.train_set.groups)
    embedded, measured = [], []
    embed = trainer.experiment.pair_embeddings
    gap = gcbs_lib.gcbs.loss_gap

    def embedding(model, items):
        embedded.extend(items.tolist())
        return embed(model, items)

    def measuring(z1, *args):
        measured.append(len(z1))
        return gap(z1, *args)

    monkeypatch.setattr(trainer.experiment, "pair_embeddings", embedding)
    monkeypatch.setattr(gcbs_lib.gcbs, "loss_gap", measuring)
    count = len(videos.unique())
    assert len(videos) > 2 * count and trainer.steps_per_epoch == count // trainer.config.batch_size
    draws = []
    for epoch in (0, 1):
        trainer.epoch = epoch
        embedded.clear()
        plan = trainer._plan_epoch()
        draws.append(embedded.copy())
        assert sorted(videos[embedded].tolist()) == sorted(videos.unique().tolist())
        trained = plan["batches"].flatten()
        assert set(trained.tolist()) <= set(embedded) and len(videos[trained].unique()) == len(
            trained
        )
    assert draws[0] != draws[1]  # a fresh clip of each video
    full = trainer.steps_per_epoch * trainer.config.batch_size
    assert measured == [full, full]
    epochs = records(tmp_path, "epoch")
    assert [r["same_group_pairs"] for r in epochs] == [0.0, 0.0]


def test_a_diagnostic_sample_of_at_least_the_epoch_logs_the_exact_loss_gap(tmp_path, data_root):
    """192 planted pairs: a sample of 192 items or more is the whole epoch, measured exactly."""
    gaps = []
    for size in ("none", 192, 1000):
        (tmp_path / str(size)).mkdir()
        config = load_config("codesearch", "ci", settings(data_root, diagnostic_sample=size))
        trainer = Trainer(config, tmp_path / str(size))
        trainer._plan_epoch()
        gaps += [r["loss_gap"] for r in records(tmp_path / str(size), "epoch")]
    assert gaps[0] == gaps[1] == gaps[2] > 0


def test_the_random_arm_embeds_only_the_diagnostic_sample_drawn_alike_for_every_arm(
    tmp_path, data_root, monkeypatch
):
    """192 items, B = 16, diagnostic_sample 48: the items of 3 of the 12 planned batches and 48
    reference items outside them. The GCBS arm embeds all 192 (to plan); both draw the same batch
    numbers and reference items from the same batches, drawn afresh the next epoch."""
    trainers = {}
    plans = {}
    embedded = {"random": [], "gcbs": []}
    for sampler, seen in embedded.items():
        (tmp_path / sampler).mkdir()
        overrides = settings(data_root, sampler=sampler, diagnostic_sample=48)
        trainer = Trainer(load_config("codesearch", "ci", overrides), tmp_path / sampler)
        trainers[sampler] = trainer
        embed = trainer.experiment.pair_embeddings

        def embedding(model, items, seen=seen, embed=embed):
            seen.extend(items.tolist())
            return embed(model, items)

        monkeypatch.setattr(trainer.experiment, "pair_embeddings", embedding)
        plans[sampler] = trainer._plan_epoch()
        assert records(tmp_path / sampler, "epoch")[0]["loss_gap"] > 0

    assert [len(seen) for seen in embedded.values()] == [96, 192]
    for sampler, trainer in trainers.items():
        batches = plans[sampler]["batches"]
        positions, measured = trainer._diagnostic_sample(batches)
        assert measured == 48 and len(positions) == 96
        # the same batch numbers for every arm: stream "diagnostic-sample" of seed and epoch
        draw = generator(trainer.config.seed, 0, "diagnostic-sample")
        numbers = torch.randperm(12, generator=draw)[:3]
        assert torch.equal(positions[:48], batches[numbers].reshape(-1))
        assert not set(positions[48:].tolist()) & set(positions[:48].tolist())
        if sampler == "random":
            assert sorted(embedded["random"]) == sorted(positions.tolist())
        trainer.epoch = 1
        assert not torch.equal(positions, trainer._diagnostic_sample(batches)[0])


@pytest.mark.parametrize("sampler", ["random", "gcbs"])
def test_the_sampled_loss_gap_is_near_the_exact_one_on_planted_clusters(
    tmp_path, data_root, sampler
):
    """4,096 planted pairs around 256 centres, B = 32, τ = 0.05, diagnostic_sample 1,024 (32 of the
    128 batches, 1,024 reference items). Measured over 200 draws (epochs 0-199): the estimate
    erred by 2.3 % of the exact gap at the median, 6.2 % at the 95th percentile and 7.5 % at most
    on random batches (exact 0.356); 3.2 %, 9.9 % and 15.0 % on the published GCBS order (0.263).
    Over these 20 draws the mean error is −0.010 and −0.004 (the log of a sampled sum runs low).
    Allowed: 20 % at most, a mean within 0.02 nats."""
    z1, z2 = pairs(4096, 32, clusters=256)
    order = torch.randperm(4096, generator=generator(0, 0, "test"))
    if sampler == "gcbs":
        order = published_permutation(z1, z2, 0.99)
    batches = consecutive_batches(order, 32)
    items = batches.flatten()
    config = load_config(
        "codesearch", "ci", settings(data_root, batch_size=32, diagnostic_sample=1024)
    )
    trainer = Trainer(config, tmp_path)
    exact = loss_gap(z1[items], z2[items], torch.arange(len(items)), 32, 1 / trainer._scale())
    errors = []
    for epoch in range(20):
        trainer.epoch = epoch
        errors.append(trainer._loss_gap(z1, z2, batches) - exact)
    assert max(map(abs, errors)) <= 0.2 * exact and abs(sum(errors) / len(errors)) <= 0.02


def test_mask_same_group_hands_the_loss_each_documents_source_module(tmp_path, data_root):
    """The step's loss with `mask_same_group`: InfoNCE whose denominators leave out the code (the
    positives' and the mined negatives') of the query's source module, through GradCache."""
    overrides = dict(sampler="hard_negatives", mask_same_group=True, chunk_size=5)
    config = load_config(
        "codesearch", "ci", settings(data_root, dropout=0.0, dtype="float64", **overrides)
    )
    trainer = Trainer(config, tmp_path)
    indices, negatives = (part[0].tolist() for part in trainer._plan_epoch().values())
    batch = trainer._collate(indices, negatives)
    codes = [k for pair in zip(indices, negatives) for k in pair]  # the documents' order
    modules = [trainer.experiment.train[k]["key"].partition("#")[0] for k in codes]
    groups = batch.extra["groups"]
    assert (groups[:, None] == groups[None, :]).tolist() == [
        [a == b for b in modules] for a in modules
    ]
    assert len(set(modules)) < len(modules)  # some code shares its query's module
    query, code = (trainer.model(x) for x in batch.inputs)
    masked = info_nce(query, code, config.scale, groups=groups)
    assert trainer._train_step(batch)["loss"] == pytest.approx(masked.item(), rel=1e-12)
    assert masked.item() != pytest.approx(info_nce(query, code, config.scale).item(), rel=1e-3)


def test_mask_same_group_shows_in_the_config_and_needs_an_experiment_with_groups(
    tmp_path, data_root, capsys, monkeypatch
):
    main(["--experiment", "codesearch", "--print-config", "--set", "mask_same_group=true"])
    assert yaml.safe_load(capsys.readouterr().out)["mask_same_group"] is True
    assert load_config("codesearch").mask_same_group is False
    load = CodeSearch.load_data

    def ungrouped(experiment):
        return load(experiment)._replace(duplicate_keys=None, groups=None)

    monkeypatch.setattr(CodeSearch, "load_data", ungrouped)
    config = load_config("codesearch", "ci", settings(data_root, mask_same_group=True))
    with pytest.raises(ValueError, match="mask_same_group: codesearch names no groups"):
        Trainer(config, tmp_path)


def plan_on_a_rank(config: dict, output_dir: str) -> dict:
    """This rank's plan of the first epoch, and the shapes of what each rank gathered."""
    held = []
    gather = distributed.gather_ragged

    def recording(rows, main_only=False):
        gathered = gather(rows, main_only)
        held.append(None if gathered is None else tuple(gathered.shape))
        return gathered

    distributed.gather_ragged = recording  # in this launched process only
    options = CodeSearch.Options(**config["options"])
    plan = Trainer(TrainConfig(**{**config, "options": options}), output_dir)._plan_epoch()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    return {"held": everyone, "batches": plan["batches"].tolist()}


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("sampler, sample", [("gcbs", None), ("random", None), ("random", 12)])
def test_ranks_plan_an_epoch_and_sum_its_loss_gap_as_one_process_does(
    tmp_path, data_root, nproc, sampler, sample
):
    """Every rank holds the epoch's embeddings (or the random arm's diagnostic sample alone: here
    one batch of 12 measured and 12 items standing for the other three): under GCBS each scans its
    rows of S for the graph, which rank 0 orders; each sums its share of the loss gap's terms,
    rank 0 logs the whole. The plan is one process's, the gap too to rounding (float64)."""
    overrides = dict(sampler=sampler, one_per_group=True, dropout=0.0, dtype="float64")
    config = load_config("codesearch", "ci", settings(data_root, **overrides, batch_size=12))
    config = replace(config, diagnostic_sample=sample)
    one = Trainer(config, tmp_path)._plan_epoch()
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    shared = launch(
        f"{__name__}:plan_on_a_rank",
        nproc=nproc,
        backend="gloo",
        echo=False,
        timeout=120,
        args={"config": asdict(config), "output_dir": str(ranks)},
    )
    embeddings = [(48 if sample is None else 24, config.options.tiny_dim)] * 2
    parts = [(nproc,)] + [None] * (nproc - 1)  # the loss gap's, to rank 0
    assert shared["held"] == [[*embeddings, part] for part in parts]
    assert shared["batches"] == one["batches"].tolist()
    gaps = [records(folder, "epoch")[0]["loss_gap"] for folder in (tmp_path, ranks)]
    assert gaps[1] == pytest.approx(gaps[0], rel=1e-12, abs=0) and gaps[0] > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_run_killed_mid_epoch_resumes_to_bitwise_the_parameters_of_an_uninterrupted_run(
    tmp_path, data_root, precision
):
    """GCBS sampler, dropout on, checkpoints every 5 steps; the kill lands after step 17 of 24, in
    the second epoch, whose GCBS order came from the model trained in the first: the resumed run
    must restore that order. In float32, and under bf16 autocast."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    options = {"checkpoint_every": 5, "eval_every": 4, "precision": precision}
    assert cli(*command(whole, data_root, **options)).returncode == 0
    job = subprocess.Popen(
        [sys.executable, "-m", "gcbs_lib.train", *command(killed, data_root, **options)],
        env=ENV,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    log = killed / "metrics.jsonl"
    while (
        job.poll() is None
        and time.monotonic() < deadline
        and (
            # a line may be half written
            not log.exists() or log.read_text().count('"kind": "step"') < 17
        )
    ):
        time.sleep(0.005)
    job.send_signal(signal.SIGKILL)
    job.wait()
    interrupted = load_checkpoint(killed / "checkpoint.pt")
    assert 12 < interrupted["step"] < 24, (
        "the kill must land in the second epoch, before the run ended"
    )
    result = cli(*command(killed, data_root, **options))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        f"resuming {killed / 'checkpoint.pt'} at step {interrupted['step']} of 24\n"
        in result.stdout
    )
    a, b = load_checkpoint(whole / "checkpoint.pt"), load_checkpoint(killed / "checkpoint.pt")
    assert a["step"] == b["step"] == 24 and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["plan"]["batches"], b["plan"]["batches"])
    assert [r["step"] for r in records(killed)] == list(range(1, 25))  # no step logged twice
    assert json.loads((killed / "results.json").read_text()) == json.loads(
        (whole / "results.json").read_text()
    )


def test_batches_collated_by_worker_processes_train_bitwise_the_model_collated_in_process(
    tmp_path, data_root
):
    """The loader's workers collate the plan's batches ahead of the step; the batches, so the
    losses and the trained parameters, are those of collating in the training process."""
    for workers in (0, 2):
        overrides = settings(
            data_root, sampler="gcbs", mask_same_group=True, loader_workers=workers
        )
        train(load_config("codesearch", "ci", overrides), tmp_path / f"workers{workers}")
    in_process, by_workers = (tmp_path / f"workers{w}" for w in (0, 2))
    assert [r["loss"] for r in records(in_process)] == [r["loss"] for r in records(by_workers)]
    a, b = (
        load_checkpoint(folder / "checkpoint.pt")["model"] for folder in (in_process, by_workers)
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_rerun_of_a_finished_run_says_it_reuses_it_returns_its_summary_and_logs_nothing_more(
    tmp_path, data_root, capsys
):
    config = load_config(
        "codesearch", "ci", settings(data_root, max_steps=4, warmup_steps=2, log_loss_gap="false")
    )
    first = train(config, tmp_path)
    # warmup, then linear decay
    assert [r["lr"] for r in records(tmp_path)] == pytest.approx([0, 5e-4, 1e-3, 5e-4])
    log, made = (
        (tmp_path / "metrics.jsonl").read_text(),
        load_checkpoint(tmp_path / "checkpoint.pt")["code"],
    )
    capsys.readouterr()
    assert train(config, tmp_path) == first and (tmp_path / "metrics.jsonl").read_text() == log
    assert capsys.readouterr().out == (
        f"reusing {tmp_path}: finished at step 4, made {made['date']}, commit {made['commit']}\n"
    )
    assert (
        first["rows"] == json.loads((tmp_path / "results.json").read_text()) and first["steps"] == 4
    )
    assert set(first) >= {
        "output_dir",
        "steps",
        "best_step",
        "rows",
        "test",
        "epochs",
        "dev",
    }
    assert set(first["test"]) == {"mrr", "recall@1", "recall@10"}
    other = load_config(
        "codesearch",
        "ci",
        settings(
            data_root, max_steps=4, warmup_steps=2, log_loss_gap="false", lr=2e-3, progress=True
        ),
    )
    with pytest.raises(ValueError, match=r"written with other settings \(lr\)"):
        train(other, tmp_path)  # progress may change on resume; lr may not


def test_a_run_made_by_other_code_is_redone_from_scratch_to_the_result_of_a_fresh_run(
    tmp_path, data_root, capsys, monkeypatch
):
    config = load_config("codesearch", "ci", settings(data_root, max_steps=4, log_loss_gap="false"))
    first, made = train(config, tmp_path), load_checkpoint(tmp_path / "checkpoint.pt")["code"]
    assert set(made) == {"sha256", "commit", "date"} and len(made["sha256"]) == 64
    changed = {**made, "sha256": "0" * 64, "commit": "changed"}
    monkeypatch.setattr(gcbs_lib.train, "code_fingerprint", lambda: changed)
    capsys.readouterr()
    again = train(config, tmp_path)
    assert capsys.readouterr().out == (
        f"redoing {tmp_path}: its checkpoint was made by other code (commit "
        f"{made['commit']}, {made['date']})\n"
    )
    # retrained: the fresh run's results
    assert again["rows"] == first["rows"] and again["dev"] == first["dev"]
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]
    assert load_checkpoint(tmp_path / "checkpoint.pt")["code"] == changed

    # settings are compared only with a run this code made: other code's is redone, whatever
    # its settings (here an option it may not have had)
    monkeypatch.setattr(gcbs_lib.train, "code_fingerprint", lambda: made)
    assert train(replace(config, lr=2 * config.lr), tmp_path)["steps"] == 4
    assert capsys.readouterr().out.startswith(f"redoing {tmp_path}")


# ---- failure
# -----------------------------------------------------------------------------------------------


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path, data_root, monkeypatch
):
    calls = {"n": 0}
    original = CodeSearch.loss

    def loss_that_breaks_at_step_5(self, embeddings, batch, scale):
        calls["n"] += 1
        loss = original(self, embeddings, batch, scale)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(CodeSearch, "loss", loss_that_breaks_at_step_5)
    config = load_config(
        "codesearch", "ci", settings(data_root, checkpoint_every=2, log_loss_gap="false")
    )
    with pytest.raises(
        TrainingDiverged, match=r"the loss is not finite at step 5.*temperature.*learning rate"
    ):
        train(config, tmp_path)
    last = load_checkpoint(tmp_path / "checkpoint.pt")
    assert last["step"] == 4
    assert all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())
    assert max(r["step"] for r in records(tmp_path)) == 4


# ---- host reads
# --------------------------------------------------------------------------------------------

# a tensor's value read into Python: on a GPU, the host waits for the device
READS = ("item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__")


def reading(method, reads: list):
    """`method`, recording the file of each call made by the kit's code (`require(tensor)`'s: the
    file that called `require`)."""

    def read(tensor, *args, **kwargs):
        frame = sys._getframe(1)
        if frame.f_code.co_filename == gcbs_lib.check.__file__:
            frame = frame.f_back
        caller = Path(frame.f_code.co_filename)
        if caller.is_relative_to(REPO / "gcbs_lib"):
            reads.append(caller.name)
        return method(tensor, *args, **kwargs)

    return read


@pytest.mark.parametrize(
    "chunk_size, reads",
    [("none", ["train.py"]), (4, ["gradcache.py", "train.py"])],
    ids=["plain", "gradcache"],
)
def test_a_training_step_reads_the_device_once_and_gradcache_once_for_all_its_chunks(
    tmp_path, data_root, monkeypatch, chunk_size, reads
):
    """A stand-in for a GPU's host reads: the kit's own code reading a tensor's value into Python
    during one step. The step reads the loss and the gradient norm together (logged and checked
    for finiteness on the host); `cached_loss` checks its 8 chunks' embeddings in one read; the
    loss `info_nce` reads none (torch's GradScaler reads once more under fp16). The ci's tiny
    encoder checks its token ids on each forward, a read each (2 plain, 15 through GradCache: 8
    chunks, 7 replays), which the paper's Hugging Face encoders do not. On 2 gloo ranks (measured,
    not tested here) gather_with_grad's layout check adds a read a call: 3 a codesearch step (the
    global loss and the loss's two gathers). Without a GPU, ops whose output size depends on
    values (`nonzero`, `unique`) would go unseen here."""
    config = load_config(
        "codesearch", "ci", settings(data_root, chunk_size=chunk_size, log_loss_gap="false")
    )
    trainer = Trainer(config, tmp_path)
    batch = trainer.experiment.collate(list(range(16)))
    seen = []
    with monkeypatch.context() as patch:
        for name in READS:
            method = getattr(torch.Tensor, name)
            patch.setattr(torch.Tensor, name, reading(method, seen))
        patch.setattr(torch, "equal", reading(torch.equal, seen))  # gather_with_grad's check
        record = trainer._train_step(batch)
    encoder = [file for file in seen if file == "models.py"]
    assert [file for file in seen if file != "models.py"] == reads
    assert len(encoder) == (2 if chunk_size == "none" else 15)
    assert record["loss"] > 0 and record["grad_norm"] > 0


# ---- data parallel
# -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"sampler": "gcbs", "chunk_size": 4, "learnable_scale": "true", "sync_check_every": 1},
        {"sampler": "hard_negatives", "chunk_size": "none", "sync_check_every": 2},
    ],
    ids=["gcbs-gradcache-learnable-scale", "mined-negatives-plain-backward"],
)
def test_two_gloo_processes_train_the_one_process_model_at_the_same_global_batch(
    tmp_path, data_root, overrides
):
    """In float64 (AdamW divides by √v + 1e-8, so float32 rounding in a near-zero gradient moves a
    parameter by up to ~lr·1e-9/1e-8) and without dropout, 4 steps on 2 ranks match 1 rank to
    rounding error. One process has no ranks to compare: its sync check does nothing."""
    config = load_config(
        "codesearch",
        "ci",
        settings(data_root, dropout=0.0, max_steps=4, eval_every=2, dtype="float64", **overrides),
    )
    one = train(config, tmp_path / "one")
    two = launch(
        "gcbs_lib.train:launched",
        nproc=2,
        backend="gloo",
        echo=False,
        timeout=240,
        args={"config": asdict(config), "output_dir": str(tmp_path / "two")},
    )
    a, b = (
        load_checkpoint(tmp_path / "one" / "checkpoint.pt"),
        load_checkpoint(tmp_path / "two" / "checkpoint.pt"),
    )
    assert torch.equal(a["plan"]["batches"], b["plan"]["batches"])
    for key in a["model"]:
        torch.testing.assert_close(b["model"][key], a["model"][key], rtol=1e-9, atol=1e-11)
    if config.learnable_scale:
        torch.testing.assert_close(b["scale"], a["scale"], rtol=1e-9, atol=1e-11)
    assert two["test"] == pytest.approx(one["test"], abs=1e-9)
    losses = [[r["loss"] for r in records(tmp_path / run)] for run in ("one", "two")]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-9)
    every = config.sync_check_every
    assert [r.get("rank_difference") for r in records(tmp_path / "two")] == [
        # the sync check: ranks bitwise equal
        0.0 if step % every == 0 else None
        for step in range(1, 5)
    ]
    assert all("rank_difference" not in r for r in records(tmp_path / "one"))


def train_with_rank_1_drifting_after_step_2(config: dict, output_dir: str) -> dict | None:
    """`launched`, but rank 1 nudges a parameter after step 2, behind DDP's back (a torchrun
    target)."""
    steps = []

    def drift(self, model):
        steps.append(1)
        if dist.get_rank() == 1 and len(steps) == 2:
            next(model.parameters()).add_(1e-3)

    CodeSearch.after_step = drift
    return launched(config, output_dir)


def train_with_a_nan_gradient_at_step_2(config: dict, output_dir: str) -> dict | None:
    """`launched`, but the second loss adds sqrt(0·Σ embeddings): the same finite value, NaN
    gradients."""
    original, calls = CodeSearch.loss, []

    def loss(self, embeddings, batch, scale):
        calls.append(1)
        value = original(self, embeddings, batch, scale)
        return value + (0 * embeddings[0].sum()).sqrt() if len(calls) == 2 else value

    CodeSearch.loss = loss
    return launched(config, output_dir)


@pytest.mark.parametrize(
    "target, error, logged",
    [
        (
            train_with_rank_1_drifting_after_step_2,
            r"RanksOutOfSync: ranks out of sync at step 4: .* differ between the "
            r"2 ranks by up to 0\.001",
            [(1, None), (2, 0.0), (3, None)],
        ),
        (
            train_with_a_nan_gradient_at_step_2,
            r"TrainingDiverged: the gradient norm is not finite at step 2",
            [(1, None)],
        ),
    ],
    ids=["drift-caught-at-the-next-check", "nan-gradient-is-divergence-not-drift"],
)
def test_the_sync_check_stops_drifted_ranks_naming_the_step_and_a_nan_stops_as_diverged(
    tmp_path, data_root, monkeypatch, target, error, logged
):
    """Checked every 2nd step: the drift after step 2 (checked and logged in sync) is caught at step
    4; a NaN gradient is reported as a divergence, before the sync check could read inf − inf as
    drift."""
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    config = load_config(
        "codesearch",
        "ci",
        settings(
            data_root, max_steps=6, sync_check_every=2, chunk_size="none", log_loss_gap="false"
        ),
    )
    with pytest.raises(LaunchError, match=error):
        launch(
            f"{__name__}:{target.__name__}",
            nproc=2,
            backend="gloo",
            echo=False,
            timeout=240,
            args={"config": asdict(config), "output_dir": str(tmp_path)},
        )
    assert [(r["step"], r.get("rank_difference")) for r in records(tmp_path)] == logged


def train_in_a_folder_of_its_own(config: dict, output_dirs: list[str]) -> dict | None:
    """`launched` into `output_dirs[rank]` (as a relative --output-dir on two nodes); a rank that
    refuses writes why into its folder (a torchrun target)."""
    folder = output_dirs[dist.get_rank()]
    try:
        return launched(config, folder)
    except ValueError as error:
        Path(folder, "refused.txt").write_text(str(error))
        raise


def test_ranks_that_would_resume_from_different_steps_all_refuse_naming_folders_and_steps(
    tmp_path, data_root, monkeypatch
):
    """Node 0's folder holds a checkpoint at step 2, node 1's none: every rank stops with one
    message (not a hang or a crash in mismatched collectives). In one shared folder, both resume
    from rank 0's checkpoint."""
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    config = load_config(
        "codesearch",
        "ci",
        settings(data_root, max_steps=4, checkpoint_every=2, log_loss_gap="false"),
    )
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    original = Trainer._train_step

    def stop_before_step_3(self, batch):
        if self.step == 2:
            raise InterruptedError("stopped")
        return original(self, batch)

    with monkeypatch.context() as patch, pytest.raises(InterruptedError):
        patch.setattr(Trainer, "_train_step", stop_before_step_3)
        train(config, node0)
    ranks = partial(launch, f"{__name__}:train_in_a_folder_of_its_own", echo=False, timeout=120)
    with pytest.raises(LaunchError, match="the ranks would resume from different steps"):
        ranks(nproc=2, args={"config": asdict(config), "output_dirs": [str(node0), str(node1)]})
    host = socket.gethostname()
    message = (
        f"the ranks would resume from different steps (rank 0 {host}:{node0.resolve()} at step 2, "
        f"rank 1 {host}:{node1.resolve()} at step 0): --output-dir must be one folder shared by "
        "every node"
    )
    assert message in (node0 / "refused.txt").read_text()
    assert message in (node1 / "refused.txt").read_text()
    assert load_checkpoint(node0 / "checkpoint.pt")["step"] == 2
    assert not (node1 / "checkpoint.pt").exists()
    summary = ranks(nproc=2, args={"config": asdict(config), "output_dirs": [str(node0)] * 2})
    assert summary["steps"] == 4 and [r["step"] for r in records(node0)] == [1, 2, 3, 4]
