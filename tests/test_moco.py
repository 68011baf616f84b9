"""Specification of the MoCo experiment: the queue is a ring buffer, the momentum encoder follows
the query encoder by an exact moving average after each optimizer step and gets no gradients, the
views are seeded and reproducible, split BatchNorm and the shuffled key batch keep a query and its
key apart, a few steps lower the loss, both arms train through gcbs_lib.train and a crashed run
resumes its queue bitwise. Runs on planted images written as Fashion-MNIST IDX files."""

import copy

import numpy as np
import pytest
import torch
from test_data_images import write_idx

from gcbs_lib.experiments import get
from gcbs_lib.experiments.moco import MoCo, MoCoModel, RandomViews, SplitBatchNorm2d
from gcbs_lib.seeding import stream_seed
from gcbs_lib.train import load_checkpoint, load_config, train

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


def test_the_queue_is_a_ring_buffer_of_the_latest_keys():
    model = MoCoModel(1, 4, 1, 1, dim=2, queue_size=6, views=RandomViews(1))
    for start in (0, 2, 4, 6):
        model.enqueue(torch.full((2, 2), float(start)))
    assert model.queue[:, 0].tolist() == [6, 6, 2, 2, 4, 4] and int(model.queue_ptr) == 2
    assert {"queue", "queue_ptr"} <= set(model.state_dict())  # checkpoints hold it
    with pytest.raises(ValueError, match="multiple of the global batch"):
        model.enqueue(torch.zeros(4, 2))


def test_the_momentum_update_is_the_exact_moving_average(float64_default):
    model = MoCoModel(1, 4, 1, 1, dim=4, queue_size=8, views=RandomViews(1))
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
    full = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]).repeat(3, 1, 1)
    torch.testing.assert_close(views(x, full), views(x), atol=1e-5, rtol=0)
    full[:, 0, 0] = -1
    torch.testing.assert_close(views(x, full), views(x).flip(-1), atol=1e-5, rtol=0)


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
    for summary in summaries.values():
        assert (
            summary["steps"] == 8
            and len(summary["epochs"]) == 2
            and "loss_gap" in summary["epochs"][0]
        )
        assert {r["metric"] for r in summary["rows"]} == {"test_knn_accuracy", "dev_knn_accuracy"}
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
    with pytest.raises(ValueError, match="bn_splits=4 must divide the batch"):
        split.train()(x[:10])


def test_the_key_branch_normalises_each_positive_key_with_other_images_than_its_query():
    """Plain BatchNorm would give query i and key i the statistics of the same images. The key
    branch encodes the batch in a shuffled order (drawn after its views from the step's stream) and
    unshuffles the keys, so key i sits in a split of other images than query i; the keys are those
    of the shuffled batch, put back in order."""
    model = MoCoModel(1, 4, 1, 1, dim=8, queue_size=64, views=RandomViews(1), bn_splits=4).train()
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


def test_bad_options_are_refused(image_root):
    for overrides, message in (
        ({"dev_size": -1}, "dev_size >= 0"),
        ({"momentum": 1.0}, r"momentum in \[0, 1\)"),
        ({"bn_splits": 0}, "bn_splits must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            experiment_and_model(image_root, **overrides)
    experiment, model, config = experiment_and_model(image_root, bn_splits=3)
    with pytest.raises(ValueError, match="bn_splits=3 must divide the batch"):
        model.query(experiment.collate(list(range(16))).inputs[0])
