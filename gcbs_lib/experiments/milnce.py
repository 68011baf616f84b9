"""MIL-NCE on cached HowTo100M-format features (the `milnce` experiment): a linear video head on
pooled clip features and the official MIL-NCE sentence head. Rank r gathers all clips and their
bags' captions (each once), so it scores the single-process batch, and returns the mean over its own
clips (notebook 02). Evaluation: text → video retrieval on held-out videos (R@1/5/10, median rank;
the paper evaluates on YouCook2 and MSR-VTT instead)."""

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gcbs_lib import distributed
from gcbs_lib.check import require
from gcbs_lib.data import build_once, built, data_root, ensure_built, howto100m, read_json
from gcbs_lib.distributed import gather_ragged, gather_with_grad, rank_and_world_size
from gcbs_lib.experiments import Batch, Experiment, Outputs, TrainSet, embed_in_batches, to_device
from gcbs_lib.gradcache import cached_loss
from gcbs_lib.losses import mil_nce
from gcbs_lib.metrics import median_rank, recall_at, retrieval_ranks
from gcbs_lib.models import PAD_ID, HashingTokenizer, text_encoder
from gcbs_lib.seeding import fixed_subset, generator, stream_seed

NAMES = {"python-doc": "python3.11-doc-sections", "howto100m": "paper"}  # planted: planted-sigma<σ>


class SentenceHead(nn.Module):
    """MIL-NCE's official sentence model: embedding → linear → ReLU → max over words → linear."""

    def __init__(self, vocab_size: int, word_dim: int, hidden_dim: int, embed_dim: int):
        super().__init__()
        self.words = nn.Embedding(vocab_size, word_dim, padding_idx=PAD_ID)
        self.fc1, self.fc2 = nn.Linear(word_dim, hidden_dim), nn.Linear(hidden_dim, embed_dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = F.relu(self.fc1(self.words(batch["input_ids"])))
        padding = ~batch["attention_mask"].bool()[..., None]
        hidden = hidden.masked_fill(padding, float("-inf")).amax(dim=1)
        return F.normalize(self.fc2(hidden), dim=-1)


class VideoHead(nn.Linear):
    """A linear map of cached clip features, L2-normalised."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(super().forward(features.to(self.weight.dtype)), dim=-1)


def _positions(ids: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Position of each id in the sorted `known`; -1 for padding and ids not there."""
    where = torch.searchsorted(known, ids.clamp(min=0)).clamp(max=len(known) - 1)
    return torch.where((ids >= 0) & (known[where] == ids), where, -1)


class MilNce(Experiment):
    """MIL-NCE on cached clip features (see the module docstring)."""

    @dataclass
    class Options:
        source: Literal["planted", "python-doc", "howto100m"] = "planted"  # python-doc: offline
        data_dir: str | None = None  # default: <data root>/howto100m/<source name>
        bag_size: int = 3  # K ≥ 1 captions per clip
        direction: str = "both"  # mil_nce form: "v2t" (the article's), "both" (the official code's)
        loss_chunk_size: int | None = None  # denominators streamed this many columns at a time
        embed_dim: int = 64
        word_dim: int = 64
        hidden_dim: int = 128
        vocab_size: int = 4096
        max_words: int = 20
        eval_fraction: float = 0.2  # of the videos for dev, and as many for test (< 0.5)
        eval_clips: int | None = None  # score a fixed subset of this many clips per split
        planted_videos: int = 120
        planted_sigma: float = 0.0  # seconds of caption misalignment in planted data
        planted_dim: int = 32  # feature width per stream of planted data (real: 2048)

    dev_metric = "r10"
    from_scratch = True
    data_name = property(
        lambda self: NAMES.get(self.options.source, f"planted-sigma{self.options.planted_sigma:g}")
    )
    model_name = property(lambda self: f"linear-video+maxpool-words-d{self.options.embed_dim}")

    def load_data(self) -> TrainSet:
        """Rank 0 builds the data once (a stand-in's script, `write_splits`); every rank maps it.
        HowTo100M's bags take hours: ranks that find them unbuilt stop at once, naming the command
        that builds them in one process."""
        o, (rank, world_size) = self.options, rank_and_world_size()
        planted = f"planted-v{o.planted_videos}-s{o.planted_sigma:g}-d{o.planted_dim}"
        name = {"planted": planted, "python-doc": "python-doc-sections"}.get(o.source, o.source)
        self.root = data_root() / "howto100m" / name
        if o.data_dir:
            self.root = data_root(o.data_dir, "data_dir", built_here=o.source != "howto100m")
        folder = self.root / f"bags-k{o.bag_size}"
        flags = ["--videos", o.planted_videos, "--sigma", o.planted_sigma, "--dim", o.planted_dim]
        scripts = {
            "planted": ["howto100m_planted.py", self.root, *flags],
            "python-doc": ["howto100m_standin.py", self.root],
        }
        settings = {"bag_size": o.bag_size, "eval_fraction": o.eval_fraction}
        require(
            world_size == 1 or o.source != "howto100m" or built(folder, settings),
            f"{folder} holds no bags of these settings: build them first, in one process, with "
            "python -m gcbs_lib.train --prepare-data and this run's --experiment, --profile, --set",
        )
        if rank == 0:
            if o.source in scripts:
                ensure_built(self.root, *scripts[o.source])
            build_once(folder, settings, partial(write_splits, o, self.root))
        if world_size > 1:  # a stand-in's build: minutes, under the collective timeout
            dist.barrier()
        self.store = howto100m.FeatureStore(self.root)
        self.tokenize = HashingTokenizer(o.vocab_size, o.max_words)
        self.bags = howto100m.open_arrays(folder / "train")
        self.eval_sets = {split: howto100m.open_arrays(folder / split) for split in ("dev", "test")}
        # the clips' video numbers as they are mapped: no Python list of 82M clips on every rank
        return TrainSet(len(self.bags["clip_video"]), groups=self.bags["clip_video"])

    def build_model(self) -> nn.Module:
        o, width = self.options, howto100m.features_of(self.store, self.bags, np.arange(1)).shape[1]
        video = VideoHead(width, o.embed_dim)
        text = SentenceHead(o.vocab_size, o.word_dim, o.hidden_dim, o.embed_dim)
        return nn.ModuleDict({"video": video, "text": text})

    def branches(self, model: nn.Module) -> list[nn.Module]:
        return [model.video, model.text]

    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        clips = np.asarray(indices, dtype=np.int64)
        bags, exclude = (
            torch.from_numpy(np.array(self.bags[key][clips])) for key in ("bag_idx", "exclude_idx")
        )
        captions = bags[bags >= 0].unique()
        tokens = self.tokenize([t.decode() for t in self.bags["caption_text"][captions.numpy()]])
        video = torch.from_numpy(howto100m.features_of(self.store, self.bags, clips))
        extra = {"caption_ids": captions, "bag_ids": bags, "exclude_ids": exclude}
        return Batch([video, tokens], extra)

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        (video, text), ids = embeddings, batch.extra["caption_ids"]
        all_ids = gather_ragged(ids)
        # a caption on several ranks: keep one copy
        captions, inverse = torch.unique(all_ids, return_inverse=True)
        first = torch.full_like(captions, len(all_ids)).scatter_reduce(
            0, inverse, torch.arange(len(all_ids), device=all_ids.device), "amin"
        )
        bags, exclude = (
            _positions(gather_with_grad(batch.extra[k]), captions)
            for k in ("bag_ids", "exclude_ids")
        )
        losses = mil_nce(
            gather_with_grad(video),
            gather_ragged(text)[first],
            bags,
            1 / (scale() if callable(scale) else scale),
            self.options.direction,
            self.options.loss_chunk_size,
            reduction="none",
            exclude_idx=exclude,
            groups=self.gathered_groups(batch),
        )
        # the mean over this rank's clips
        return losses.split(len(video))[rank_and_world_size()[0]].mean()

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple:
        """Clip embeddings and the mean embedding of each clip's bag (what GCBS orders by)."""
        (video, tokens), extra = to_device(list(self.collate(indices.tolist())), self.device)
        video, text = model.video(video), model.text(tokens)
        members = (extra["bag_ids"] >= 0)[..., None]
        positions = _positions(extra["bag_ids"], extra["caption_ids"]).clamp(min=0)
        return video, (text[positions] * members).sum(1) / members.sum(1)

    def evaluate(self, model: nn.Module, split: str) -> Outputs:
        """Text → video retrieval on the split's clips (`retrieval`)."""
        return self.retrieval(split, model.video, model.text, self.tokenize)

    def baseline(self) -> tuple[str, Outputs] | None:
        """Zero-training retrieval where the clip features are a text encoder's (the python-doc
        stand-in's 2d stream, all-MiniLM-L6-v2 of the code shown): each caption embedded by that
        frozen encoder against them; none for planted or HowTo100M's visual features."""
        if self.options.source != "python-doc":
            return None
        encoder = text_encoder("minilm", max_length=256)
        width = howto100m.features_of(self.store, self.bags, np.arange(1)).shape[1]
        # zeros against the 3d stream's columns: each score is the cosine with the 2d features
        pad = nn.ConstantPad1d((0, width - encoder.backbone.config.hidden_size), 0.0)
        text = nn.Sequential(encoder, pad)
        return "minilm-captions", self.retrieval("test", nn.Identity(), text, encoder.tokenize)

    def retrieval(self, split: str, encode_video: nn.Module, encode_text: nn.Module, tokenize):
        """Each caption's clip's rank among the split's clips by `encode_video` of their features
        and `encode_text` of the captions' `tokenize` tokens; its cluster, the clip's video."""
        data = self.eval_sets[split]
        limit = self.options.eval_clips
        rows = np.array(fixed_subset(len(data["clip_video"]), limit, f"milnce-eval-{split}"))
        chunks = np.array_split(rows, -(-len(rows) // 1024))  # embedded 1024 at a time
        features = (torch.from_numpy(howto100m.features_of(self.store, data, c)) for c in chunks)
        captions = (tokenize([t.decode() for t in data["text"][c]]) for c in chunks)
        video = embed_in_batches(encode_video, features, self.device)
        text = embed_in_batches(encode_text, captions, self.device)
        ranks = retrieval_ranks(text, video, torch.arange(len(rows), device=self.device))
        clips = {"rank": ranks.tolist(), "candidates": [len(rows)] * len(rows)}
        return {"clips": {**clips, "cluster": data["clip_video"][rows].tolist()}}

    @staticmethod
    def scores(outputs: Outputs) -> dict[str, float]:
        """R@1/5/10 and the median rank (ties pessimistic)."""
        ranks = outputs["clips"]["rank"]
        recalls = {f"r{k}": recall_at(ranks, k) for k in (1, 5, 10)}
        return {**recalls, "median_rank": median_rank(ranks)}


def write_splits(o: MilNce.Options, root: Path, folder: Path) -> dict:
    """Training bags; dev/test queries: a planted segment's true caption, else a bag's anchor."""
    store = howto100m.FeatureStore(root)
    # bad captions listed beside bad features
    captions = howto100m.read_captions(howto100m.caption_path(root), store.skipped)
    clips, truth = (
        read_json(root / f) if (root / f).exists() else None for f in ("clips.json", "truth.json")
    )
    ids = sorted(set(captions) & {p.stem for p in (root / "features_2d").glob("*.npy")})
    # the same every run
    order = torch.randperm(len(ids), generator=generator(0, 0, "milnce-video-split")).tolist()
    n = max(1, round(o.eval_fraction * len(ids)))  # dev and test videos each
    split = {
        name: sorted(ids[i] for i in order[a:b])
        for name, a, b in (("dev", 0, n), ("test", n, 2 * n), ("train", 2 * n, None))
    }
    train = howto100m.build_bags(captions, store, o.bag_size, split["train"], clips)
    howto100m.save_arrays(train, folder / "train")
    for name in ("dev", "test"):
        windows = {v: [s["window"] for s in truth[v]] for v in split[name]} if truth else clips
        bags = howto100m.build_bags(captions, store, 1, split[name], windows)
        text = bags["caption_text"][bags["anchor"]]
        if truth:
            text = [segment["text"].encode() for v in bags["video_ids"] for segment in truth[v]]
        arrays = {k: bags[k] for k in ("video_ids", "clip_video", "clip_window")}
        howto100m.save_arrays({**arrays, "text": text}, folder / name)
    return {"skipped": store.skipped}


def device_for(backend: str | None = None) -> torch.device:
    """Where a rank of a `backend` process group (default: the default group's, if any) computes:
    cuda:LOCAL_RANK under NCCL, else the CPU."""
    if backend is None and dist.is_initialized():
        backend = dist.get_backend()
    return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if backend == "nccl" else "cpu")


def gradient_check(
    options: dict,
    batch_size: int,
    seed: int = 0,
    scale: float = 20.0,
    chunk_size: int | None = None,
    device: str | None = None,
    mask_same_group: bool = False,
) -> dict:
    """One float64 step of DDP heads through GradCache on this rank's share of a seeded batch (a
    torchrun target) on `device` (default: `device_for` the process group), the captions of each
    clip's video outside its bag masked with `mask_same_group`: mean loss over ranks, flat
    gradient, its `rank_difference` (0.0: in sync)."""
    rank, world_size = rank_and_world_size()
    experiment = MilNce(MilNce.Options(**options), seed=seed, device=device or device_for())
    order = torch.randperm(experiment.load_data().size, generator=generator(seed, 0, "shuffle"))
    torch.manual_seed(stream_seed(seed, 0, "init"))
    model = experiment.build_model().double().to(experiment.device)
    branches = [
        DistributedDataParallel(m) if world_size > 1 else m for m in experiment.branches(model)
    ]
    part = batch_size // world_size
    rows = order[rank * part : (rank + 1) * part].tolist()
    batch = Batch(*to_device(list(experiment.collate(rows)), experiment.device))
    if mask_same_group:  # each clip's video, as the trainer's batches carry it
        videos = experiment.bags["clip_video"][rows]
        batch.extra["groups"] = torch.as_tensor(videos, device=experiment.device)
    loss = cached_loss(
        lambda *z: experiment.loss(z, batch, scale), branches, batch.inputs, chunk_size or part
    )
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {
        "loss": gather_with_grad(loss.detach()[None]).mean().item(),
        "grad": grad.tolist(),
        "rank_difference": distributed.rank_difference([grad]),
    }
