"""Specification of the `milnce` experiment: DDP gives the full-batch gradient, on the device of the
process group's backend; bags help on misaligned data."""

from dataclasses import asdict

import pytest
import torch

from gcbs_lib.check import relative_error
from gcbs_lib.experiments.milnce import MilNce, device_for, gradient_check
from gcbs_lib.launcher import launch
from gcbs_lib.seeding import generator
from gcbs_lib.train import load_config, train


@pytest.mark.parametrize("mask_same_group", [False, True])
def test_two_gloo_ranks_give_the_single_process_full_batch_gradient(tmp_path, mask_same_group):
    options = asdict(load_config("milnce", "gradient-check", {"data_dir": str(tmp_path)}).options)
    check = dict(options=options, batch_size=16, mask_same_group=mask_same_group)
    single = gradient_check(**check, device="cpu")
    experiment = MilNce(MilNce.Options(**options), seed=0, device="cpu")
    experiment.load_data()
    order = torch.randperm(
        len(experiment.bags["clip_video"]), generator=generator(0, 0, "shuffle")
    )[:16]
    halves = [experiment.collate(order[r * 8 : (r + 1) * 8].tolist()).extra for r in range(2)]
    shared = set(halves[0]["caption_ids"].tolist()) & set(halves[1]["caption_ids"].tolist())
    # cross-rank duplicates and exclusions occur
    assert shared and any((h["exclude_ids"] >= 0).any() for h in halves)
    # clips of one video on both ranks: masking changes the loss
    videos = experiment.bags["clip_video"][order.numpy()]
    assert len(set(videos[:8]) & set(videos[8:]))
    if mask_same_group:
        unmasked = gradient_check(options, batch_size=16, device="cpu")
        assert single["loss"] != pytest.approx(unmasked["loss"], rel=1e-6)
    ddp = launch(gradient_check, nproc=2, args={**check, "chunk_size": 3}, echo=False)
    assert ddp["rank_difference"] == 0.0
    assert ddp["loss"] == pytest.approx(single["loss"], rel=1e-13)
    assert relative_error(torch.tensor(ddp["grad"]), torch.tensor(single["grad"])) < 1e-12


def test_the_gradient_check_runs_where_the_backend_computes(monkeypatch):
    """NCCL ranks compute on their GPU (cuda:LOCAL_RANK), gloo ranks and a single process on the
    CPU."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_for("nccl") == torch.device("cuda:3")
    assert device_for("gloo") == device_for() == torch.device("cpu")  # no process group here


def planted_r10(tmp_path, sigma, bag_size):
    config = load_config(
        "milnce",
        "ci",
        {"data_dir": str(tmp_path / f"sigma{sigma}"), "planted_sigma": sigma, "bag_size": bag_size},
    )
    return train(config, tmp_path / f"run-{sigma}-{bag_size}")["test"]["r10"]


def test_training_on_planted_data_lifts_r10_far_above_chance(tmp_path):
    chance = 10 / 144  # 24 test videos × 6 segments
    assert planted_r10(tmp_path, 0.0, 3) > 8 * chance


def test_bags_of_three_beat_single_captions_when_narration_is_misaligned(tmp_path):
    assert planted_r10(tmp_path, 8.0, 3) > planted_r10(tmp_path, 8.0, 1) + 0.05


def test_each_test_clip_is_clustered_by_its_video_and_planted_features_have_no_baseline(tmp_path):
    config = load_config("milnce", "ci", {"data_dir": str(tmp_path / "planted")})
    experiment = MilNce(config.options, seed=0, device="cpu")
    experiment.load_data()
    outputs = experiment.evaluate(experiment.build_model(), "test")["clips"]
    # the bootstrap resamples videos: a video's clips are not independent test items
    assert outputs["cluster"] == experiment.eval_sets["test"]["clip_video"].tolist()
    assert len(outputs["rank"]) == 144 and len(set(outputs["cluster"])) == 24
    # planted features are no text encoder's: no zero-training caption retrieval to compare with
    assert experiment.baseline() is None
