"""Specification of the training loop: config, schedule, atomic checkpoints, bitwise resume after SIGKILL,
2 gloo processes = 1 process, the NaN stop, the gradient-norm watch and the rank-sync check. Runs the code-search
experiment with the tiny encoder on planted pairs written in CodeSearchNet's jsonl layout."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from gcbs_lib.distributed import LaunchError, launch
from gcbs_lib.experiments.codesearch import CodeSearch
from gcbs_lib.train import (Trainer, TrainingDiverged, atomic_save, config_from_dict, launched, load_checkpoint,
                            load_config, lr_factor, parse_overrides, train)

REPO = Path(__file__).resolve().parents[1]


def settings(data_root, **overrides):
    """A CI-sized codesearch run on the planted data (strings, as --set passes them)."""
    values = {"data": "csn", "data_root": str(data_root), "batch_size": 16, "epochs": 2, "lr": 1e-3,
              "query_length": 16, "code_length": 24, "tiny_dim": 16, "tiny_layers": 1, "embed_batch_size": 64,
              "progress": False, **overrides}
    return {k: str(v) for k, v in values.items()}


# ---- config ------------------------------------------------------------------------------------------------

def test_overrides_are_typed_by_the_config_field_they_set(data_root):
    config = load_config("codesearch", "ci", settings(data_root, lr="3e-5", chunk_size=8, max_steps="none",
                                                       learnable_scale="true", eval_limit=10))
    assert (config.lr, config.chunk_size, config.max_steps, config.learnable_scale) == (3e-5, 8, None, True)
    assert isinstance(config.options, CodeSearch.Options) and config.options.eval_limit == 10
    assert config.profile == "ci" and config.options.encoder == "tiny"  # the ci profile's value kept
    assert parse_overrides(["lr=3e-5", "data=csn"]) == {"lr": "3e-5", "data": "csn"}


@pytest.mark.parametrize("overrides, error, match", [
    ({"learning_rate": "1e-3"}, KeyError, "unknown config key 'learning_rate'"),
    ({"batch_size": "sixty-four"}, ValueError, "batch_size must be int"),
    ({"batch_size": "6.5"}, ValueError, "batch_size must be int"),
    ({"sampler": "hard"}, ValueError, "sampler must be one of"),
    ({"bf16": "maybe"}, ValueError, "bf16 must be bool"),
    ({"batch_size": "0"}, ValueError, "batch_size must be at least 1"),
    ({"sync_check_every": "-1"}, ValueError, "sync_check_every ≥ 0"),
    ({"grad_norm_watch": "0.5"}, ValueError, "grad_norm_watch must be above 1"),
])
def test_unknown_keys_and_ill_typed_values_are_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        load_config("codesearch", "ci", overrides)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_overrides(["lr"])


def test_a_config_survives_its_json_round_trip():
    config = load_config("codesearch", "cpu", {"seed": 3, "sampler": "gcbs"})
    assert config_from_dict(json.loads(json.dumps(asdict(config)))) == config


def test_the_schedule_warms_up_linearly_then_decays_to_zero():
    assert [lr_factor(s, 10, 2, "linear") for s in (0, 1, 2, 6, 10)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert lr_factor(6, 10, 2, "cosine") == pytest.approx(0.5) and lr_factor(10, 10, 2, "cosine") == 0.0
    assert lr_factor(9, 10, 0, "constant") == 1.0


# ---- checkpoints -------------------------------------------------------------------------------------------

def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "checkpoint.pt"
    atomic_save({"step": 1, "model": {"w": torch.ones(2)}}, path)
    with pytest.raises(Exception):
        atomic_save({"step": 2, "unpicklable": lambda: None}, path)
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def command(output_dir, data_root, **overrides):
    pairs = [f"--set={k}={v}" for k, v in settings(data_root, **overrides).items()]
    return [sys.executable, "-m", "gcbs_lib.train", "--experiment", "codesearch", "--profile", "ci",
            "--output-dir", str(output_dir), "--sampler", "gcbs", "--seed", "3", *pairs]


def run(cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)


def steps_logged(output_dir) -> int:
    path = output_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum('"kind": "step"' in line for line in lines)


def test_a_run_killed_mid_epoch_resumes_to_bitwise_the_parameters_of_an_uninterrupted_run(tmp_path, data_root):
    """GCBS sampler, dropout on, checkpoints every 5 steps; the kill lands after step 17 of 24, in the second
    epoch, whose GCBS order came from the model trained in the first: the resumed run must restore that order."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    options = {"checkpoint_every": 5, "eval_every": 4}
    assert run(command(whole, data_root, **options)).returncode == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(command(killed, data_root, **options), env=env, cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while steps_logged(killed) < 17 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    job.send_signal(signal.SIGKILL)
    job.wait()
    interrupted = load_checkpoint(killed / "checkpoint.pt")
    assert 12 < interrupted["step"] < 24, "the kill must land in the second epoch, before the run ended"
    result = run(command(killed, data_root, **options))
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = load_checkpoint(whole / "checkpoint.pt"), load_checkpoint(killed / "checkpoint.pt")
    assert a["step"] == b["step"] == 24
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["plan"]["batches"], b["plan"]["batches"])
    logged = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "step"] == list(range(1, 25))  # no step logged twice
    assert json.loads((killed / "results.json").read_text()) == json.loads((whole / "results.json").read_text())


def test_a_finished_run_is_read_back_and_a_rerun_with_other_settings_is_refused(tmp_path, data_root):
    config = load_config("codesearch", "ci", settings(data_root, max_steps=2, log_loss_gap="false"))
    first = train(config, tmp_path)
    log = (tmp_path / "metrics.jsonl").read_text()
    assert train(config, tmp_path) == first and (tmp_path / "metrics.jsonl").read_text() == log
    assert first["rows"] == json.loads((tmp_path / "results.json").read_text()) and first["steps"] == 2
    changed = load_config("codesearch", "ci", settings(data_root, max_steps=2, log_loss_gap="false", lr=0.1))
    with pytest.raises(ValueError, match="lr"):
        train(changed, tmp_path)


# ---- failure -----------------------------------------------------------------------------------------------

def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, data_root,
                                                                                           monkeypatch):
    calls = {"n": 0}
    original = CodeSearch.loss

    def loss_that_breaks_at_step_5(self, embeddings, batch, scale):
        calls["n"] += 1
        loss = original(self, embeddings, batch, scale)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(CodeSearch, "loss", loss_that_breaks_at_step_5)
    config = load_config("codesearch", "ci", settings(data_root, checkpoint_every=2, log_loss_gap="false"))
    with pytest.raises(TrainingDiverged, match=r"not finite at step 5.*temperature.*learning rate"):
        train(config, tmp_path)
    last = load_checkpoint(tmp_path / "checkpoint.pt")
    assert last["step"] == 4
    assert all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 4


def step_records(output_dir) -> list[dict]:
    return [r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def test_a_gradient_norm_spike_is_warned_about_once_naming_the_step_and_the_run_goes_on(tmp_path, data_root,
                                                                                       monkeypatch, capsys):
    calls = {"n": 0}
    original = CodeSearch.loss

    def loss_that_spikes_at_steps_12_and_15(self, embeddings, batch, scale):
        calls["n"] += 1
        loss = original(self, embeddings, batch, scale)
        return loss * 1000 if calls["n"] in (12, 15) else loss

    monkeypatch.setattr(CodeSearch, "loss", loss_that_spikes_at_steps_12_and_15)
    config = load_config("codesearch", "ci", settings(data_root, max_steps=16, log_loss_gap="false"))
    assert train(config, tmp_path)["steps"] == 16
    warned = [r for r in step_records(tmp_path) if "warning" in r]
    assert [r["step"] for r in warned] == [12]  # once: the spike at step 15 passes silently
    assert warned[0]["warning"].startswith("step 12: gradient norm") and "10× the median" in warned[0]["warning"]
    assert "warning: step 12: gradient norm" in capsys.readouterr().err


# ---- data parallel -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    {"sampler": "gcbs", "chunk_size": 4, "learnable_scale": "true", "sync_check_every": 1},
    {"sampler": "hard_negatives", "chunk_size": "none"},
], ids=["gcbs-gradcache-learnable-scale", "mined-negatives-plain-backward"])
def test_two_gloo_processes_train_the_one_process_model_at_the_same_global_batch(tmp_path, data_root, overrides):
    """In float64 (AdamW divides by √v + 1e-8, so float32 rounding in a near-zero gradient moves a parameter by
    up to ~lr·1e-9/1e-8) and without dropout, 4 steps on 2 ranks match 1 rank to rounding error."""
    values = settings(data_root, dropout=0.0, max_steps=4, eval_every=2, dtype="float64", **overrides)
    config = load_config("codesearch", "ci", values)
    one = train(config, tmp_path / "one")
    two = launch("gcbs_lib.train:launched", nproc=2, backend="gloo", echo=False, timeout=240,
                 args={"config": asdict(config), "output_dir": str(tmp_path / "two")})
    a, b = load_checkpoint(tmp_path / "one" / "checkpoint.pt"), load_checkpoint(tmp_path / "two" / "checkpoint.pt")
    assert torch.equal(a["plan"]["batches"], b["plan"]["batches"])
    for key in a["model"]:
        torch.testing.assert_close(b["model"][key], a["model"][key], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(b["scale"], a["scale"], rtol=1e-9, atol=1e-11)
    assert two["test"] == pytest.approx(one["test"], abs=1e-9)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
               if '"kind": "step"' in line] for run in ("one", "two")]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-9)
    checks = [r.get("rank_difference") for r in step_records(tmp_path / "two")]
    assert checks == ([0.0] * 4 if config.sync_check_every else [None] * 4)  # the sync check: ranks bitwise equal
    assert all("rank_difference" not in r for r in step_records(tmp_path / "one"))  # one process: nothing to compare


def train_with_rank_1_drifting_before_step_3(config: dict, output_dir: str) -> dict | None:
    """`launched`, but rank 1 nudges a parameter in place before step 3, behind DDP's back (a torchrun target)."""
    original = Trainer._train_step

    def drifting_step(self, batch):
        if self.rank == 1 and self.step == 2:
            with torch.no_grad():
                self.parameters[0].add_(1e-3)
        return original(self, batch)

    Trainer._train_step = drifting_step
    return launched(config, output_dir)


def test_the_sync_check_stops_a_run_whose_ranks_drifted_apart_naming_the_step(tmp_path, data_root, monkeypatch):
    """DDP averages the gradients, so the drifted ranks would train on, apart, for ever; checked every 2nd step,
    the drift before step 3 is caught at step 4, after step 2 was checked and logged in sync."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")])))
    config = load_config("codesearch", "ci", settings(data_root, max_steps=6, sync_check_every=2,
                                                      log_loss_gap="false"))
    with pytest.raises(LaunchError, match=r"RanksOutOfSync: ranks out of sync at step 4: .* differ between the 2 "
                                          r"ranks by up to 0\.001"):
        launch(f"{__name__}:train_with_rank_1_drifting_before_step_3", nproc=2, backend="gloo", echo=False,
               timeout=240, args={"config": asdict(config), "output_dir": str(tmp_path)})
    assert [(r["step"], r.get("rank_difference")) for r in step_records(tmp_path)] == [(1, None), (2, 0.0), (3, None)]


def train_with_a_nan_gradient_at_step_2(config: dict, output_dir: str) -> dict | None:
    """`launched`, but the second loss adds sqrt(0·Σ embeddings): the same finite value, NaN gradients."""
    original, calls = CodeSearch.loss, []

    def loss(self, embeddings, batch, scale):
        calls.append(1)
        value = original(self, embeddings, batch, scale)
        return value + (0 * embeddings[0].sum()).sqrt() if len(calls) == 2 else value

    CodeSearch.loss = loss
    return launched(config, output_dir)


def test_a_nan_gradient_under_the_sync_check_stops_as_diverged_not_as_ranks_out_of_sync(tmp_path, data_root,
                                                                                        monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")])))
    config = load_config("codesearch", "ci", settings(data_root, max_steps=4, sync_check_every=1, chunk_size="none",
                                                      log_loss_gap="false"))
    with pytest.raises(LaunchError, match=r"TrainingDiverged: the gradient norm is not finite at step 2"):
        launch(f"{__name__}:train_with_a_nan_gradient_at_step_2", nproc=2, backend="gloo", echo=False,
               timeout=240, args={"config": asdict(config), "output_dir": str(tmp_path)})
    assert [(r["step"], r.get("rank_difference")) for r in step_records(tmp_path)] == [(1, 0.0)]
