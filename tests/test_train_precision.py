"""Specification of the trainer's `precision`: bf16 and fp16 autocast around the forward and the
loss, through GradCache's replays; fp16's GradScaler (the loss scaled, gradients unscaled before
clipping, a step whose gradients overflowed skipped, its state in checkpoint.pt so a resumed run
ends bitwise where an uninterrupted one does); each rank's device, with TF32 on CUDA. CPU autocast
runs the same code paths as CUDA's (torch 2.13 supports float16 autocast on the CPU); the
gradients an fp16 step takes are fp32's, to fp16's rounding."""

import math
import sys
from pathlib import Path

import pytest
import torch
from test_train import records, settings

import gcbs_lib.train
from gcbs_lib.check import relative_error
from gcbs_lib.experiments.codesearch import CodeSearch
from gcbs_lib.train import Trainer, TrainingDiverged, load_checkpoint, load_config, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gpu_check import FP16_GRADIENTS, taken_gradients  # noqa: E402  (tools/ is not a package)

ORIGINAL_LOSS = CodeSearch.loss


class Stopped(Exception):
    """The stand-in for a kill: the run stops before a step, its last checkpoint kept."""


def poisoned_loss(self, embeddings, batch, scale):
    """The loss, plus sqrt(0·Σ embeddings) at a poisoned step: the same finite value, NaN
    gradients (an fp16 overflow's outcome)."""
    loss = ORIGINAL_LOSS(self, embeddings, batch, scale)
    return loss + (0 * embeddings[0].sum()).sqrt() if self.poisoned else loss


def run(monkeypatch, config, folder, poisoned=(), stop_before=None, autocast_seen=None):
    """`train(config, folder)` with NaN gradients at the steps `poisoned`, stopped before step
    `stop_before`; `autocast_seen` collects (enabled, dtype) of every encoder call in a step."""
    original = Trainer._train_step

    def seen(module, inputs, output):
        autocast_seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    def step(self, batch):
        if self.step + 1 == stop_before:
            raise Stopped
        self.experiment.poisoned = self.step + 1 in poisoned
        modules = {id(m): m for m in self.branch_modules}.values()  # codesearch: one, shared
        hooks = [m.register_forward_hook(seen) for m in modules if autocast_seen is not None]
        try:
            return original(self, batch)
        finally:
            for hook in hooks:
                hook.remove()

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_train_step", step)
        patch.setattr(CodeSearch, "loss", poisoned_loss)
        return train(config, folder)


def ci(data_root, **overrides):
    """6 steps of 16 pairs, GradCache chunks of 4 (4 chunks a branch), a checkpoint every 2."""
    values = {"max_steps": 6, "chunk_size": 4, "checkpoint_every": 2, "log_loss_gap": "false"}
    return load_config("codesearch", "ci", settings(data_root, **{**values, **overrides}))


@pytest.mark.parametrize("clip_norm", ["none", 0.01], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("chunk_size", ["none", 4], ids=["plain", "gradcache"])
def test_an_fp16_step_takes_the_fp32_gradients_unscaled_and_clipped_to_fp16_rounding(
    tmp_path, data_root, chunk_size, clip_norm
):
    """Autocast float16 with its GradScaler, against the same step in fp32 (same weights, batch and
    dropout masks): the gradients the optimizer takes and the logged norm (the unclipped one) agree
    within FP16_GRADIENTS, through a plain backward and through GradCache's replays. Clipped to
    0.01 (the norm is ≈ 5), a step that clipped the scaled gradients would take 2^-15 of them.
    Measured: 1.0e-3 to 1.2e-3 here; a scaler factor left in ≈ 1 (clipping before `unscale_`
    0.99997, GradCache's replayed chunks scaled by 1/1024 under fp16 1.03)."""
    taken = {
        precision: taken_gradients(
            ci(data_root, precision=precision, chunk_size=chunk_size, clip_norm=clip_norm),
            tmp_path / precision,
        )
        for precision in ("fp32", "fp16")
    }
    (fp32, fp32_norm), (fp16, fp16_norm) = taken["fp32"], taken["fp16"]
    assert relative_error(fp16, fp32) <= FP16_GRADIENTS
    assert fp16_norm == pytest.approx(fp32_norm, rel=FP16_GRADIENTS)
    if clip_norm == 0.01:
        assert fp32_norm > 1 and float(fp32.norm()) == pytest.approx(0.01, rel=1e-4)


def test_bf16_autocast_covers_every_forward_and_replay_and_trains_finite_near_fp32(
    tmp_path, data_root, monkeypatch
):
    seen = []
    run(monkeypatch, ci(data_root, precision="bf16"), tmp_path / "bf16", autocast_seen=seen)
    run(monkeypatch, ci(data_root), tmp_path / "fp32")
    # per step: 2 branches of 4 chunks without a graph, then 7 replays (the last kept its graph)
    assert seen == [(True, torch.bfloat16)] * 6 * (8 + 7)
    bf16, fp32 = (load_checkpoint(tmp_path / name / "checkpoint.pt") for name in ("bf16", "fp32"))
    assert bf16["step"] == fp32["step"] == 6 and bf16["scaler"] == fp32["scaler"] == {}
    losses = [[r["loss"] for r in records(tmp_path / name)] for name in ("bf16", "fp32")]
    assert all(map(math.isfinite, losses[0])) and losses[0] != losses[1]
    assert losses[0] == pytest.approx(losses[1], rel=0.05)
    assert any(not torch.equal(bf16["model"][k], fp32["model"][k]) for k in fp32["model"])
    for key, value in bf16["model"].items():  # parameters stay float32: autocast casts per op
        assert value.dtype == fp32["model"][key].dtype and torch.isfinite(value).all()


def test_fp16_skips_a_step_whose_gradients_overflowed_and_halves_the_loss_scale(
    tmp_path, data_root, monkeypatch
):
    """As torch.amp.GradScaler does: NaN gradients at step 3 do not stop an fp16 run (in fp32 they
    do); the optimizer and the learning-rate schedule skip that step (as transformers' Trainer), and
    the scale halves for each skipped step, 65536 at the start."""
    with pytest.raises(TrainingDiverged, match="the gradient norm is not finite at step 3"):
        run(monkeypatch, ci(data_root), tmp_path / "fp32", poisoned={3})
    seen = []
    config = ci(data_root, precision="fp16", warmup_steps=6)
    run(monkeypatch, config, tmp_path / "fp16", poisoned={3}, autocast_seen=seen)
    assert set(seen) == {(True, torch.float16)}
    steps = records(tmp_path / "fp16")
    skipped = [r["step"] for r in steps if not math.isfinite(r["grad_norm"])]
    assert 3 in skipped and len(skipped) < 6 and all(math.isfinite(r["loss"]) for r in steps)
    last = load_checkpoint(tmp_path / "fp16" / "checkpoint.pt")
    assert last["scaler"]["scale"] == 65536.0 * 0.5 ** len(skipped)
    taken = 6 - len(skipped)
    assert {s["step"].item() for s in last["optimizer"]["state"].values()} == {taken}
    assert last["scheduler"]["last_epoch"] == taken
    # linear warmup over 6 steps: the lr moves on only after a step the optimizer took
    taken_before = [len([s for s in range(1, step) if s not in skipped]) for step in range(1, 7)]
    assert [r["lr"] for r in steps] == pytest.approx([1e-3 * n / 6 for n in taken_before])
    assert all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_run_stopped_mid_way_resumes_to_bitwise_the_uninterrupted_run_with_its_scaler(
    tmp_path, data_root, monkeypatch, precision
):
    """Stopped before step 6 (its checkpoint at step 4), rerun: the model, the optimizer and the
    loss scaler's state (fp16: halved at the poisoned step 3) end as in one uninterrupted run."""
    config = ci(data_root, precision=precision, max_steps=8, eval_every=3)
    poisoned = {3} if precision == "fp16" else set()  # in bf16, as in fp32, a NaN stops the run
    whole = run(monkeypatch, config, tmp_path / "whole", poisoned)
    with pytest.raises(Stopped):
        run(monkeypatch, config, tmp_path / "cut", poisoned, stop_before=6)
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["step"] == 4
    assert run(monkeypatch, config, tmp_path / "cut", poisoned)["rows"] == whole["rows"]
    a, b = (load_checkpoint(tmp_path / name / "checkpoint.pt") for name in ("whole", "cut"))
    assert a["step"] == b["step"] == 8 and a["scaler"] == b["scaler"]
    if precision == "fp16":
        assert a["scaler"]["scale"] < 65536.0  # the poisoned step halved it before the stop
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert all(
            torch.equal(a["optimizer"]["state"][i][key], b["optimizer"]["state"][i][key])
            for i in a["optimizer"]["state"]
        )
    logged = [
        [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records(tmp_path / name)]
        for name in ("whole", "cut")
    ]
    assert logged[0] == logged[1] and len(logged[0]) == 8


def test_each_rank_takes_its_local_gpu_or_the_one_named_with_tf32_and_the_cpu_is_left_as_it_is(
    monkeypatch,
):
    """The CUDA branch, run on a CPU machine with torch.cuda.set_device stubbed."""
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    flags = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        assert gcbs_lib.train.rank_device("cpu") == torch.device("cpu") and current == []
        assert not matmul.allow_tf32 and not cudnn.allow_tf32
        assert gcbs_lib.train.rank_device("cuda") == torch.device("cuda:3") == current[0]
        assert matmul.allow_tf32 and cudnn.allow_tf32
        # a GPU named (run_arms' side-by-side runs), whatever the rank
        assert gcbs_lib.train.rank_device("cuda:5") == torch.device("cuda:5") == current[1]
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = flags
