"""Specification of the MoCo experiment: the queue is a ring buffer, the momentum encoder follows
the query encoder by an exact moving average after each optimizer step and gets no gradients, the
views are seeded and reproducible, split BatchNorm and the shuffled key batch keep a query and its
key apart, a few steps lower the loss, both arms train through gcbs_lib.train and a crashed run
resumes its queue bitwise. Runs on planted images written as Fashion-MNIST IDX files."""

import colorsys
import copy
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_data_images import write_idx

from gcbs_lib.experiments import get, moco
from gcbs_lib.experiments.moco import (
    MoCo,
    MoCoModel,
    RandomViews,
    ReferenceBatchNorm2d,
    SplitBatchNorm2d,
    colour,
    hue,
)
from gcbs_lib.seeding import stream_seed
from gcbs_lib.train import Trainer, load_checkpoint, load_config, train

TINY = {
    "data": "fashion-mnist",
    "dev_size": 16,
    "width": 4,
    "stages": 2,
    "dim": 8,
    "queue_size": 32,
    "batch_size": 16,
    "epochs": 2,
    "lr": 3e-3,
    "knn_k": 10,
    "embed_batch_size": 64,
    "eval_batch_size": 64,
    "log_loss_gap": True,
}


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    """80 training and 20 test 28×28 images of 4 classes (a bright square in a class-specific
    quadrant)."""
    root = tmp_path_factory.mktemp("data")
    folder = root / "images" / "fashion-mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 80), ("t10k", 20)):
        labels = np.arange(n) % 4
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            r, k = 14 * (c // 2) + 2, 14 * (c % 2) + 2
            images[i, r : r + 10, k : k + 10] = 250
        write_idx(images, folder / f"{prefix}-images-idx3-ubyte.gz")
        write_idx(labels.astype(np.uint8), folder / f"{prefix}-labels-idx1-ubyte.gz")
    return root


def experiment_and_model(image_root, **overrides):
    config = load_config("moco", "ci", {**TINY, "data_root": str(image_root), **overrides})
    experiment = get("moco")(config.options, seed=0, device="cpu")
    experiment.load_data()
    torch.manual_seed(0)
    return experiment, experiment.build_model(), config


def small(dim: int, queue_size: int) -> MoCo.Options:
    return MoCo.Options(width=4, stages=1, blocks=1, dim=dim, queue_size=queue_size)


def test_the_queue_is_a_ring_buffer_of_the_latest_keys():
    model = MoCoModel(1, small(2, 6), RandomViews(1))
    for start in (0, 2, 4, 6):
        model.enqueue(torch.full((2, 2), float(start)))
    assert model.queue[:, 0].tolist() == [6, 6, 2, 2, 4, 4] and int(model.queue_ptr) == 2
    assert {"queue", "queue_ptr"} <= set(model.state_dict())  # checkpoints hold it
    with pytest.raises(ValueError, match="multiple of the global batch"):
        model.enqueue(torch.zeros(4, 2))


def test_the_momentum_update_is_the_exact_moving_average(float64_default):
    model = MoCoModel(1, small(4, 8), RandomViews(1))
    for p in model.query.parameters():
        p.data.add_(torch.randn_like(p))
    before = [k.clone() for k in model.key.parameters()]
    model.momentum_update(0.9)
    for k0, k1, q in zip(before, model.key.parameters(), model.query.parameters()):
        torch.testing.assert_close(k1, 0.9 * k0 + 0.1 * q, rtol=1e-15, atol=1e-15)


def test_the_key_encoder_gets_no_gradients_and_the_queue_takes_the_batch_keys(image_root):
    experiment, model, config = experiment_and_model(image_root)
    batch = experiment.collate(list(range(16)))
    query, key = (branch(x) for branch, x in zip(experiment.branches(model), batch.inputs))
    experiment.loss([query, key], batch, config.scale).backward()
    assert all(p.grad is None and not p.requires_grad for p in model.key.parameters())
    assert all(p.grad is not None for p in model.query.parameters())
    assert torch.equal(model.queue[:16], key.detach()) and int(model.queue_ptr) == 16


def test_the_loss_is_cross_entropy_over_the_positive_then_the_queue(image_root):
    experiment, model, config = experiment_and_model(image_root)
    query, key = torch.nn.functional.normalize(torch.randn(2, 16, 8), dim=-1)
    queue = model.queue.clone()
    loss = experiment.loss([query, key], None, 5.0)
    logits = 5.0 * torch.cat([(query * key).sum(1, keepdim=True), query @ queue.T], dim=1)
    expected = -(logits[:, 0] - logits.logsumexp(dim=1)).mean()
    torch.testing.assert_close(loss, expected)


def test_views_are_seeded_reproducible_and_replayable():
    views = RandomViews(3).train()
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    torch.manual_seed(stream_seed(0, 0, "dropout/rank0/step0"))
    first = views(x)
    torch.manual_seed(stream_seed(0, 0, "dropout/rank0/step0"))
    again, other = views(x), views(x)
    assert torch.equal(first, again) and not torch.equal(first, other)
    params = views.sample(4, torch.Generator().manual_seed(1))
    # explicit params: the same in eval mode
    assert torch.equal(views(x, params), views.eval()(x, params))
    # eval mode without params: normalise only
    assert torch.equal(views(x), (x / 255 - views.mean) / views.std)


def test_a_full_crop_is_the_image_and_a_flipped_full_crop_its_mirror():
    views = RandomViews(1).eval()
    x = torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8)
    # no jitter (factors 1, 1, 1, hue 0), no grayscale, the ops' order
    kept = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.1], [0.2, 0.3, 0.4]]
    full = torch.tensor(kept).repeat(3, 1, 1)
    torch.testing.assert_close(views(x, full), views(x), atol=1e-5, rtol=0)
    full[:, 0, 0] = -1
    torch.testing.assert_close(views(x, full), views(x).flip(-1), atol=1e-5, rtol=0)


def test_grey_views_jitter_brightness_and_contrast_as_torchvision_does_on_a_grey_image():
    """On one channel, saturation, hue and the grayscale flag leave an image as it is; brightness
    and contrast (blends with black and the mean grey) act in the drawn order, clamped to [0, 1]."""
    x = torch.rand(2, 1, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    b, c = 1.3, 0.7
    brightness_first = [b, c, 1.4, 0.1, 1.0, 0.1, 0.2, 0.3, 0.4]
    contrast_first = [b, c, 1.4, 0.1, 1.0, 0.2, 0.1, 0.3, 0.4]
    out = colour(x, torch.tensor([brightness_first, contrast_first], dtype=torch.float64))
    brighter = (b * x[0]).clamp(0, 1)
    expected = (c * brighter + (1 - c) * brighter.mean()).clamp(0, 1)
    torch.testing.assert_close(out[0], expected, rtol=0, atol=1e-12)
    contrasted = (c * x[1] + (1 - c) * x[1].mean()).clamp(0, 1)
    torch.testing.assert_close(out[1], (b * contrasted).clamp(0, 1), rtol=0, atol=1e-12)
    assert RandomViews(1).sample(3).shape == (3, 5, 3)


def flat_colours(n: int) -> torch.Tensor:
    """n 8×8 RGB images of one random colour each: crops leave them as they are."""
    rgb = torch.randint(0, 256, (n, 3, 1, 1), generator=torch.Generator().manual_seed(0))
    return rgb.to(torch.uint8).expand(-1, -1, 8, 8)


def test_rgb_views_jitter_colour_and_grayscale_from_the_views_stream():
    """RGB views also draw MoCo v2's colour jitter (p 0.8) and grayscale (p 0.2), after the crops,
    from the same generator: the colours change between draws, stay in [0, 1] and replay from the
    seed; a grayscale view has equal channels."""
    views, x = RandomViews(3).double().train(), flat_colours(64)
    colours = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        colours.append((views(x) * views.std + views.mean).mean((2, 3)))
    assert torch.equal(colours[0], colours[1])
    assert ((colours[0] - colours[2]).abs().amax(1) > 0.02).float().mean() > 0.5
    assert colours[0].min() > -1e-12 and colours[0].max() < 1 + 1e-12
    params = views.sample(64, torch.Generator().manual_seed(3))
    grayscale = params[:, 2:].flatten(1)[:, 4] == 1
    assert params.shape == (64, 5, 3) and 0 < grayscale.sum() < 32
    images = views.eval()(x, params) * views.std + views.mean
    torch.testing.assert_close(images[grayscale], images[grayscale][:, :1].expand(-1, 3, -1, -1))


def test_rgb_views_draw_moco_v2s_colour_ranges_and_probabilities():
    """Jitter factors in [0.6, 1.4] (brightness, contrast, saturation), hue shifts in [-0.1, 0.1],
    with probability 0.8 (else 1, 1, 1, 0); grayscale with probability 0.2."""
    draw = RandomViews(3).sample(20000, torch.Generator().manual_seed(0))[:, 2:].flatten(1)
    factors, shift, grayscale = draw[:, :3], draw[:, 3], draw[:, 4]
    kept = (factors == 1).all(1) & (shift == 0)
    assert kept.float().mean().item() == pytest.approx(0.2, abs=0.01)
    assert factors.min() >= 0.6 and factors.max() <= 1.4 and shift.abs().max() <= 0.1
    assert factors[~kept].std(0).min() > 0.22  # uniform on [0.6, 1.4]: 0.23
    assert set(grayscale.tolist()) == {0.0, 1.0}
    assert grayscale.mean().item() == pytest.approx(0.2, abs=0.01)


def hue_by_colorsys(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue (h ← h + shift through HSV) pixel by pixel, by the standard
    library."""
    pixels = x.permute(0, 2, 3, 1)
    out = [
        [colorsys.hsv_to_rgb((h + t) % 1, s, v) for h, s, v in map(colorsys.rgb_to_hsv, *zip(*p))]
        for p, t in zip(pixels.reshape(len(x), -1, 3).tolist(), shift.tolist())
    ]
    return torch.tensor(out, dtype=x.dtype).view(pixels.shape).permute(0, 3, 1, 2)


def test_hue_turns_the_colour_wheel_as_hsv_does():
    x = torch.rand(6, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[0] = 0.5  # grey: no hue
    shift = torch.tensor([0.3, -0.1, 0.1, 0.5, -0.5, 0.0], dtype=torch.float64)
    expected = hue_by_colorsys(x, shift)
    torch.testing.assert_close(hue(x, shift.view(-1, 1, 1, 1)), expected, rtol=0, atol=1e-12)
    red = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
    assert hue(red, torch.tensor(1 / 3)).flatten().tolist() == [0.0, 1.0, 0.0]


def test_colour_applies_torchvisions_ops_in_the_drawn_order_then_grayscale():
    """Brightness, contrast, saturation as torchvision blends them (with black, the mean grey, the
    grey image), hue through HSV, each clamped to [0, 1], in the order the sort keys give; then the
    grayscale flag."""
    x = torch.rand(3, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    b, c, s, h = 1.3, 0.7, 1.4, 0.1

    def luma(y):
        return 0.2989 * y[:, :1] + 0.587 * y[:, 1:2] + 0.114 * y[:, 2:]

    ops = {
        "brightness": lambda y: b * y,
        "contrast": lambda y: c * y + (1 - c) * luma(y).mean((1, 2, 3), keepdim=True),
        "saturation": lambda y: s * y + (1 - s) * luma(y),
        "hue": lambda y: hue_by_colorsys(y, torch.full((len(y),), h, dtype=torch.float64)),
    }

    def jitter(y, order):
        for name in order:
            y = ops[name](y).clamp(0, 1)
        return y

    names, forward, backward = list(ops), [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]
    params = torch.tensor(
        [[b, c, s, h, 0.0, *forward], [b, c, s, h, 0.0, *backward], [b, c, s, h, 1.0, *forward]],
        dtype=torch.float64,
    )
    out = colour(x, params)
    torch.testing.assert_close(out[0], jitter(x[:1], names)[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1], jitter(x[1:2], names[::-1])[0], rtol=0, atol=1e-12)
    assert not torch.allclose(out[0], colour(x[:1], params[1:2])[0])
    grey = luma(jitter(x[2:], names)).expand(-1, 3, -1, -1)
    torch.testing.assert_close(out[2:], grey, rtol=0, atol=1e-12)
    assert out.min() >= 0 and out.max() <= 1


def test_a_few_steps_against_a_fixed_queue_lower_the_loss(image_root):
    experiment, model, config = experiment_and_model(image_root, momentum=0.0)
    batch = experiment.collate(list(range(16)))
    with torch.no_grad():
        for start in (16, 32):
            model.enqueue(model.key(experiment.collate(list(range(start, start + 16))).inputs[1]))
    queue = model.queue.clone()
    optimizer = torch.optim.AdamW(model.query.parameters(), lr=3e-3)

    def step_loss() -> torch.Tensor:
        torch.manual_seed(0)  # the same views every time
        loss = experiment.loss(
            [model.query(batch.inputs[0]), model.key(batch.inputs[1])], batch, config.scale
        )
        model.queue.copy_(queue)
        return loss

    losses = []
    for _ in range(6):
        loss = step_loss()
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        experiment.after_step(model)
    assert losses[-1] < losses[0]


def test_both_arms_train_through_the_trainer_and_the_hook_updates_the_key_encoder(
    image_root, tmp_path
):
    summaries = {}
    for sampler in ("random", "gcbs"):
        config = load_config(
            "moco", "ci", {**TINY, "data_root": str(image_root), "sampler": sampler}
        )
        summaries[sampler] = train(config, tmp_path / sampler)
    for sampler, summary in summaries.items():
        # the GCBS arm's graph too (every batch full: nothing dropped again)
        graph = ["edges_per_item", "isolated_share", "neighbours"] if sampler == "gcbs" else []
        assert (
            summary["steps"] == 8
            and len(summary["epochs"]) == 2
            and "loss_gap" in summary["epochs"][0]
        )
        # best dev, last step, and per epoch the diagnostics
        assert {r["metric"] for r in summary["rows"]} == {
            "test_knn_accuracy",
            "dev_knn_accuracy",
            "last_test_knn_accuracy",
            *(
                f"{name}@epoch{e}"
                for name in ["loss_gap", "same_group_pairs", *graph]
                for e in (0, 1)
            ),
        }
        assert summary["rows"][0]["data"] == "fashion-mnist-not-cifar10"
    # one step from the initial model: the key encoder moved by exactly one moving-average update
    config = load_config(
        "moco", "ci", {**TINY, "data_root": str(image_root), "max_steps": 1, "dtype": "float64"}
    )
    train(config, tmp_path / "one-step")
    state = load_checkpoint(tmp_path / "one-step" / "checkpoint.pt")["model"]
    experiment, _, _ = experiment_and_model(image_root)
    torch.manual_seed(stream_seed(0, 0, "init"))
    initial = experiment.build_model().double()
    m = config.options.momentum
    for name, k0 in initial.key.named_parameters():
        expected = m * k0 + (1 - m) * state[f"query.{name}"]
        torch.testing.assert_close(state[f"key.{name}"], expected, rtol=1e-12, atol=1e-14)


def test_a_crashed_run_resumes_the_queue_and_ends_bitwise_as_an_uninterrupted_one(
    image_root, tmp_path, monkeypatch
):
    """Checkpoints every 3 steps; a crash in step 5 leaves the step-3 checkpoint, whose queue
    already holds trained keys: the rerun must restore it (and its pointer), not start from the
    random initial queue."""
    settings = {**TINY, "data_root": str(image_root), "sampler": "gcbs", "checkpoint_every": 3}
    train(load_config("moco", "ci", settings), tmp_path / "whole")
    original, steps = MoCo.after_step, []

    def crash_in_step_5(self, model):
        steps.append(1)
        if len(steps) == 5:
            raise RuntimeError("killed")
        original(self, model)

    monkeypatch.setattr(MoCo, "after_step", crash_in_step_5)
    with pytest.raises(RuntimeError, match="killed"):
        train(load_config("moco", "ci", settings), tmp_path / "resumed")
    at_crash = load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")
    _, initial, _ = experiment_and_model(image_root)
    assert at_crash["step"] == 3 and int(at_crash["model"]["queue_ptr"]) == 3 * 16 % 32
    assert not torch.equal(at_crash["model"]["queue"], initial.queue)
    monkeypatch.setattr(MoCo, "after_step", original)
    train(load_config("moco", "ci", settings), tmp_path / "resumed")
    a, b = (
        load_checkpoint(tmp_path / run / "checkpoint.pt")["model"] for run in ("whole", "resumed")
    )
    assert a.keys() == b.keys() and {"queue", "queue_ptr"} <= set(a)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_split_batchnorm_is_batchnorm_per_group_and_eval_uses_the_mean_running_stats(
    float64_default,
):
    split, plain = SplitBatchNorm2d(3, splits=4), torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        split.weight.uniform_(0.5, 2), split.bias.normal_()
    plain.load_state_dict(split.state_dict())
    x = torch.randn(16, 3, 5, 5) * 3 + 1
    groups = [copy.deepcopy(plain) for _ in range(4)]
    expected = torch.empty_like(x)
    for g, bn in enumerate(groups):  # group g: images g, g + 4, g + 8, ...
        expected[g::4] = bn(x[g::4])
    torch.testing.assert_close(split(x), expected, rtol=1e-12, atol=1e-12)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(
            getattr(split, name), torch.stack([getattr(bn, name) for bn in groups]).mean(0)
        )
    plain.running_mean.copy_(split.running_mean), plain.running_var.copy_(split.running_var)
    torch.testing.assert_close(split.eval()(x), plain.eval()(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="bn_splits / world size = 4 must divide the batch"):
        split.train()(x[:10])


def test_the_key_branch_normalises_each_positive_key_with_other_images_than_its_query():
    """Plain BatchNorm would give query i and key i the statistics of the same images. The key
    branch encodes the batch in a shuffled order (drawn after its views from the step's stream) and
    unshuffles the keys, so key i sits in a split of other images than query i; the keys are those
    of the shuffled batch, put back in order."""
    model = MoCoModel(1, small(8, 64), RandomViews(1), partial(SplitBatchNorm2d, splits=4))
    model.train()
    x = torch.randint(0, 256, (32, 1, 28, 28), dtype=torch.uint8)
    torch.manual_seed(7)
    keys = model.key(x)
    torch.manual_seed(7)
    params, order = model.key.views.sample(32), torch.randperm(32)
    model.key.shuffle = False
    unshuffled = model.key(x, params)
    torch.testing.assert_close(keys, model.key(x[order], params[order])[order.argsort()])
    query_split, key_split = torch.arange(32) % 4, order.argsort() % 4
    key_split_members = [set(order[g::4].tolist()) for g in range(4)]
    assert all(
        key_split_members[key_split[i]] != set(range(q, 32, 4)) for i, q in enumerate(query_split)
    )
    assert (key_split != query_split).float().mean() > 0.5 and not torch.allclose(keys, unshuffled)


def test_bn_splits_counts_the_groups_of_the_global_batch(image_root, monkeypatch):
    """On each of W ranks (batch / W images) split BatchNorm has bn_splits / W groups: a group holds
    as many images as in one process; a bn_splits that W does not divide, or below 2 groups a rank,
    is refused."""
    monkeypatch.setattr(moco, "rank_and_world_size", lambda: (0, 2))
    experiment, model, config = experiment_and_model(image_root, bn_splits=4)
    splits = {m.splits for m in model.modules() if isinstance(m, SplitBatchNorm2d)}
    share = config.batch_size // 2
    assert splits == {2} and share // 2 == config.batch_size // 4
    model.query(experiment.collate(list(range(share))).inputs[0])  # groups of the rank's share
    with pytest.raises(ValueError, match="bn_splits=3 is no multiple of 2 ranks"):
        experiment_and_model(image_root, bn_splits=3)
    # one group a rank: the in-rank key shuffle could not separate query i from key i
    with pytest.raises(ValueError, match="on 2 ranks bn_splits must be at least 4"):
        experiment_and_model(image_root, bn_splits=2)


def test_bad_options_are_refused(image_root):
    for overrides, message in (
        ({"dev_size": -1}, "dev_size >= 0"),
        ({"momentum": 1.0}, r"momentum in \[0, 1\)"),
        ({"bn_splits": 0}, "bn_splits must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            experiment_and_model(image_root, **overrides)
    experiment, model, config = experiment_and_model(image_root, bn_splits=3)
    with pytest.raises(ValueError, match="world size = 3 must divide the batch, got 16"):
        model.query(experiment.collate(list(range(16))).inputs[0])


def test_simclr_trains_both_views_through_the_query_encoder_against_the_batch(image_root, tmp_path):
    """The in-batch comparison: MoCo's profiles and encoder, InfoNCE over the batch's views, no
    queue and no momentum update; GCBS orders by f_q's embeddings of the fixed views."""
    config = load_config("simclr", "ci", {**TINY, "data_root": str(image_root), "max_steps": 1})
    assert (
        config.options == load_config("moco", "ci", {**TINY, "data_root": str(image_root)}).options
    )
    experiment = get("simclr")(config.options, seed=0, device="cpu")
    experiment.load_data()
    model = experiment.build_model()
    assert experiment.branches(model) == [model.query, model.query]
    # SimCLR's BatchNorm: no split groups whose statistics an image's two views would share
    norms = [m for m in model.modules() if isinstance(m, SplitBatchNorm2d)]
    assert config.options.bn_splits > 1 and norms and {m.splits for m in norms} == {1}
    batch = experiment.collate(list(range(16)))
    torch.manual_seed(0)
    z1, z2 = (model.query(x) for x in batch.inputs)
    logits = z1 @ z2.T * config.scale
    expected = F.cross_entropy(logits, torch.arange(16))
    torch.testing.assert_close(experiment.loss([z1, z2], batch, config.scale), expected)
    queue = model.queue.clone()
    key = copy.deepcopy(model.key.state_dict())
    experiment.after_step(model)
    assert torch.equal(model.queue, queue)
    assert all(torch.equal(v, model.key.state_dict()[k]) for k, v in key.items())
    pair = experiment.pair_embeddings(model.eval(), torch.arange(4))
    expected = model.query(experiment.train[:4], experiment.gcbs_views[0][:4])
    torch.testing.assert_close(pair[0], expected)
    summary = train(config, tmp_path / "run")
    assert summary["rows"][0]["model"].startswith("simclr-") and summary["steps"] == 1


def test_under_batchnorm_a_training_images_embedding_depends_on_the_rest_of_its_batch(image_root):
    """SimCLR's BatchNorm normalises a training image with its batch: GCBS's homogeneous batches
    change its embedding."""
    config = load_config("simclr", "ci", {**TINY, "data_root": str(image_root)})
    experiment = get("simclr")(config.options, seed=0, device="cpu")
    experiment.load_data()
    torch.manual_seed(0)
    model = experiment.build_model().train()
    views = experiment.gcbs_views[0]
    alone = model.query(experiment.train[:8], views[:8])
    beside = model.query(experiment.train[:16], views[:16])[:8]  # 8 other images beside
    assert (alone - beside).abs().max() > 1e-3
    assert experiment.model_name.startswith("simclr-resnet-w")


def test_mask_same_group_leaves_simclrs_same_class_views_out_and_moco_refuses_it(
    image_root, tmp_path
):
    """SimCLR's negatives are the batch's: those of the anchor's class leave its denominator.
    MoCo's are a queue of earlier keys, which carry no class: the key is refused there."""
    settings = {**TINY, "data_root": str(image_root), "mask_same_group": True}
    with pytest.raises(ValueError, match="mask_same_group: moco.s negatives are a queue"):
        Trainer(load_config("moco", "ci", settings), tmp_path / "moco")
    trainer = Trainer(load_config("simclr", "ci", settings), tmp_path / "simclr")
    batch = trainer._collate(list(range(16)), None)
    labels = trainer.experiment.train_labels[:16]
    assert torch.equal(batch.extra["groups"], labels)  # the classes 0…3 are their own ids
    torch.manual_seed(0)
    z1, z2 = (trainer.model.query(x) for x in batch.inputs)
    same_class = (labels[:, None] == labels[None, :]) & ~torch.eye(16, dtype=torch.bool)
    logits = (z1 @ z2.T * trainer.config.scale).masked_fill(same_class, float("-inf"))
    expected = F.cross_entropy(logits, torch.arange(16))
    torch.testing.assert_close(
        trainer.experiment.loss([z1, z2], batch, trainer.config.scale), expected
    )


def test_reference_batchnorm_normalises_the_batch_half_by_the_reference_halfs_statistics(
    float64_default,
):
    """The first half's batch statistics (biased variance), with their gradient, normalise both
    halves; the running statistics take them as BatchNorm takes a batch's; eval mode is
    BatchNorm's. With a batch that is its own reference, the batch half is BatchNorm's output."""
    reference, plain = ReferenceBatchNorm2d(3), torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 2), reference.bias.normal_()
    plain.load_state_dict(reference.state_dict())
    a = (torch.randn(8, 3, 5, 5) * 3 + 1).requires_grad_()
    b = torch.randn(8, 3, 5, 5) * 0.5 - 2
    torch.testing.assert_close(reference(torch.cat([a, a]))[8:], plain(a), rtol=1e-12, atol=1e-12)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(reference, name), getattr(plain, name))

    y = reference(torch.cat([a, b]))[8:]
    mean = a.mean((0, 2, 3), keepdim=True)
    var = a.var((0, 2, 3), unbiased=False, keepdim=True)
    weight, bias = (p.view(1, -1, 1, 1) for p in (reference.weight, reference.bias))
    torch.testing.assert_close(y, (b - mean) / (var + reference.eps).sqrt() * weight + bias)
    y.sum().backward()
    assert a.grad.abs().max() > 1e-3  # through the reference's statistics
    plain.running_mean.copy_(reference.running_mean), plain.running_var.copy_(reference.running_var)
    torch.testing.assert_close(reference.eval()(b), plain.eval()(b), rtol=0, atol=0)
    with pytest.raises(ValueError, match="a reference half and a batch half, got 7"):
        reference.train()(a[:7])


def test_bn_reference_collates_a_random_reference_batch_that_sets_batchnorm_and_leaves_the_loss(
    image_root, tmp_path
):
    """SimCLR's BatchNorm control: before each batch, as many training images drawn by the
    batch's items (the same batch draws the same ones, another batch others); the model's
    BatchNorm layers take their statistics, and the loss is the batch's alone. MoCo refuses it."""
    settings = {**TINY, "data_root": str(image_root), "bn_reference": True, "max_steps": 2}
    config = load_config("simclr", "ci", settings)
    experiment = get("simclr")(config.options, seed=0, device="cpu")
    experiment.load_data()
    model = experiment.build_model()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(isinstance(m, ReferenceBatchNorm2d) for m in norms)

    batch = experiment.collate(list(range(16)))
    images = batch.inputs[0]
    reference = images[:16]
    assert images.shape[0] == 32 and torch.equal(images[16:], experiment.train[:16])
    assert torch.equal(experiment.collate(list(range(16))).inputs[0], images)
    assert not torch.equal(experiment.collate(list(range(1, 17))).inputs[0][:16], reference)

    torch.manual_seed(0)
    z1, z2 = (model.query(x) for x in batch.inputs)
    expected = F.cross_entropy(z1[16:] @ z2[16:].T * config.scale, torch.arange(16))
    torch.testing.assert_close(experiment.loss([z1, z2], batch, config.scale), expected)
    assert train(config, tmp_path / "run")["steps"] == 2
    with pytest.raises(ValueError, match="bn_reference: simclr only"):
        experiment_and_model(image_root, bn_reference=True)
