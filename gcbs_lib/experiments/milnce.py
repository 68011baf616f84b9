"""MIL-NCE on cached HowTo100M-format features: the `milnce` experiment of `gcbs_lib.train`.

The model is two small heads over cached inputs, as in training on pre-extracted features: a linear video head
on 2D+3D clip features, and the official MIL-NCE sentence head on words (embedding → linear → ReLU → max over
words → linear). Both end L2-normalised; scores are scaled by the trainer's logit scale (1/τ).

A step on rank r: its clips and the captions of their bags (each caption once) are encoded; clip embeddings are
gathered with `gather_with_grad`, captions with `gather_ragged` (ranks hold different counts) and deduplicated
by caption id across ranks, so every rank sees exactly the single-process batch. Its loss is the mean MIL-NCE
over its own clips (the share L_r): DDP's gradient average is then the full-batch gradient (notebook 02).
Captions from other clips' bags that overlap a clip's window are excluded from its negatives.

Evaluation: text → video retrieval on held-out videos (R@1/5/10, median rank; ties counted pessimistically).
Planted data query with each segment's true caption; the python-doc stand-in and HowTo100M with the caption a
clip's bag grows from (a proxy: HowTo100M has no clean evaluation captions, the paper evaluates on YouCook2 and
MSR-VTT).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gcbs_lib.data import data_root
from gcbs_lib.data.howto100m import (MIN_TIME, FeatureStore, PlantedConfig, build_bags, caption_path, clip_features,
                                     open_cache, read_captions, read_video_list, write_cache, write_planted)
from gcbs_lib.distributed import gather_ragged, gather_with_grad, gradient_rank_difference, rank_and_world_size
from gcbs_lib.experiments import Batch, Experiment, TrainSet, register
from gcbs_lib.gradcache import cached_loss
from gcbs_lib.losses import mil_nce
from gcbs_lib.measure import fresh_process_bytes, memory_method, memory_rise
from gcbs_lib.metrics import median_rank, recall_at, retrieval_ranks
from gcbs_lib.models import PAD_ID, HashingTokenizer
from gcbs_lib.seeding import generator, stream_seed

SOURCES = ("planted", "python-doc", "howto100m")


@dataclass
class MilNceOptions:
    """The experiment's settings (profiles in gcbs_lib/configs/milnce.yaml)."""

    source: str = "planted"             # planted | python-doc (the offline stand-in) | howto100m (real features)
    data_dir: str | None = None         # default: <data root>/howto100m/<source name>
    bag_size: int = 3                   # K captions per clip
    direction: str = "both"             # mil_nce form: "v2t" (the article's) or "both" (the official code's)
    loss_chunk_size: int | None = None  # stream the MIL-NCE denominators this many columns at a time
    min_time: float = MIN_TIME          # clip windows are widened to this many seconds
    embed_dim: int = 64
    word_dim: int = 64
    hidden_dim: int = 128
    vocab_size: int = 4096
    max_words: int = 20
    eval_fraction: float = 0.2          # of the videos for dev, and as many for test
    planted_videos: int = 120
    planted_sigma: float = 0.0          # seconds of caption misalignment in planted data
    planted_dim: int = 32               # feature width per stream of planted data (real: 2048)
    planted_seed: int = 0

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.bag_size < 1 or not 0 < self.eval_fraction < 0.5:
            raise ValueError(f"need bag_size ≥ 1 and 0 < eval_fraction < 0.5, got {self.bag_size}, {self.eval_fraction}")


class SentenceHead(nn.Module):
    """The official MIL-NCE sentence model on word ids: embedding → linear → ReLU → max over words → linear."""

    def __init__(self, vocab_size: int, word_dim: int, hidden_dim: int, embed_dim: int):
        super().__init__()
        self.words = nn.Embedding(vocab_size, word_dim, padding_idx=PAD_ID)
        self.fc1, self.fc2 = nn.Linear(word_dim, hidden_dim), nn.Linear(hidden_dim, embed_dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = F.relu(self.fc1(self.words(batch["input_ids"])))
        hidden = hidden.masked_fill(~batch["attention_mask"].bool()[..., None], float("-inf")).amax(dim=1)
        return F.normalize(self.fc2(hidden), dim=-1)


class VideoHead(nn.Module):
    """A linear map of cached clip features, L2-normalised."""

    def __init__(self, feature_dim: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Linear(feature_dim, embed_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(features.to(self.proj.weight.dtype)), dim=-1)


class MilNceModel(nn.Module):
    def __init__(self, feature_dim: int, options: MilNceOptions):
        super().__init__()
        self.video = VideoHead(feature_dim, options.embed_dim)
        self.text = SentenceHead(options.vocab_size, options.word_dim, options.hidden_dim, options.embed_dim)


# ------------------------------------------------------------------------------------------------ gathering

def _positions(ids: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Position of each id in the sorted `known`; -1 for padding and ids not there."""
    where = torch.searchsorted(known, ids.clamp(min=0)).clamp(max=len(known) - 1)
    return torch.where((ids >= 0) & (known[where] == ids), where, -1)


# ------------------------------------------------------------------------------------------------ experiment

@register("milnce")
class MilNce(Experiment):
    """MIL-NCE with bags of neighbouring captions on cached clip features (see the module docstring)."""

    Options = MilNceOptions
    dev_metric = "r10"

    # ---- data -------------------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        o = self.options
        name = {"planted": f"planted-v{o.planted_videos}-s{o.planted_sigma:g}-d{o.planted_dim}-seed{o.planted_seed}",
                "python-doc": "python-doc", "howto100m": "howto100m"}[o.source]
        return Path(o.data_dir) if o.data_dir else data_root() / "howto100m" / name

    @property
    def data_name(self) -> str:
        return {"planted": f"planted-sigma{self.options.planted_sigma:g}", "python-doc": "python3.11-doc",
                "howto100m": "paper"}[self.options.source]

    @property
    def model_name(self) -> str:
        return f"linear-video+maxpool-words-d{self.options.embed_dim}"

    def load_data(self) -> TrainSet:
        rank, world_size = rank_and_world_size()
        if rank == 0:
            prepare(self.options, self.root)
        if world_size > 1:
            dist.barrier()
        self.bags = open_cache(self.root / _bag_cache_name(self.options))
        self.eval_sets = {split: np.load(self.root / f"eval-{split}.npz") for split in ("dev", "test")}
        self.tokenize = HashingTokenizer(self.options.vocab_size, self.options.max_words)
        return TrainSet(len(self.bags))

    # ---- model ------------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return MilNceModel(self.bags.features.shape[1], self.options)

    def branches(self, model: nn.Module) -> list[nn.Module]:
        return [model.video, model.text]

    # ---- steps ------------------------------------------------------------------------------------------
    def collate(self, indices: Sequence[int], negatives: Sequence[int] | None = None) -> Batch:
        clips = np.asarray(indices, dtype=np.int64)
        bags = torch.from_numpy(np.array(self.bags.bag_idx[clips]))
        captions = bags[bags >= 0].unique()
        tokens = self.tokenize([str(t) for t in self.bags.caption_text[captions.numpy()]])
        video = torch.from_numpy(np.array(self.bags.features[clips], dtype=np.float32))
        return Batch([video, tokens], {"caption_ids": captions, "bag_ids": bags,
                                       "exclude_ids": torch.from_numpy(np.array(self.bags.exclude_idx[clips]))})

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        video, text = embeddings
        all_video = gather_with_grad(video)
        all_text, all_ids = gather_ragged(text), gather_ragged(batch.extra["caption_ids"])
        captions, inverse = torch.unique(all_ids, return_inverse=True)  # a caption on several ranks: keep one copy
        first = torch.full_like(captions, len(all_ids)).scatter_reduce(0, inverse, torch.arange(len(all_ids),
                                                                       device=all_ids.device), "amin")
        bags, exclude = (_positions(gather_with_grad(batch.extra[k]), captions) for k in ("bag_ids", "exclude_ids"))
        s = scale() if callable(scale) else scale
        losses = mil_nce(all_video, all_text[first], bags, 1 / s, self.options.direction,
                         self.options.loss_chunk_size, reduction="none", exclude_idx=exclude)
        rank, _ = rank_and_world_size()
        return losses[rank * len(video):(rank + 1) * len(video)].mean()

    def pair_embeddings(self, model: nn.Module, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip embeddings and the mean embedding of each clip's bag (what GCBS orders by)."""
        batch = self.collate(indices.tolist())
        video = model.video(batch.inputs[0].to(self.device))
        text = model.text({k: v.to(self.device) for k, v in batch.inputs[1].items()})
        bags = batch.extra["bag_ids"].to(self.device)
        members = (bags >= 0)[..., None]
        positions = _positions(bags, batch.extra["caption_ids"].to(self.device)).clamp(min=0)
        return video, (text[positions] * members).sum(1) / members.sum(1)

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Text → video retrieval on the split's clips: R@1/5/10 and median rank (ties pessimistic)."""
        ranks = self.retrieval_ranks(model, split)
        return {"r1": recall_at(ranks, 1), "r5": recall_at(ranks, 5), "r10": recall_at(ranks, 10),
                "median_rank": median_rank(ranks)}

    def retrieval_ranks(self, model: nn.Module, split: str) -> torch.Tensor:
        data = self.eval_sets[split]
        video = model.video(torch.from_numpy(data["features"]).to(self.device))
        text = model.text({k: v.to(self.device) for k, v in self.tokenize(data["texts"].tolist()).items()})
        return retrieval_ranks(text, video, torch.arange(len(video), device=self.device))


# ------------------------------------------------------------------------------------------------ preparation

def _bag_cache_name(options: MilNceOptions) -> str:
    return f"bags-train-k{options.bag_size}-t{options.min_time:g}.npz"


def split_videos(video_ids: Sequence[str], eval_fraction: float) -> dict[str, list[str]]:
    """A fixed split of the videos (the same for every run seed): dev and test get `eval_fraction` each."""
    order = torch.randperm(len(video_ids), generator=generator(0, 0, "milnce-video-split")).tolist()
    n_eval = max(1, round(eval_fraction * len(video_ids)))
    ids = [sorted(video_ids)[i] for i in order]
    return {"dev": sorted(ids[:n_eval]), "test": sorted(ids[n_eval:2 * n_eval]), "train": sorted(ids[2 * n_eval:])}


def _raw_data(options: MilNceOptions, root: Path) -> None:
    """Write the source's raw files in the HowTo100M layout unless they are there (into a temporary folder
    renamed into place, so a crash never leaves half a data set)."""
    if (root / "videos.csv").exists():
        return
    if options.source == "howto100m":
        raise FileNotFoundError(f"{root}: expected HowTo100M features_2d/, features_3d/, captions and videos.csv "
                                f"(see data_scripts/howto100m_download.md)")
    staging = root.with_name(root.name + f".tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    if options.source == "planted":
        write_planted(staging, PlantedConfig(videos=options.planted_videos, sigma=options.planted_sigma,
                                             dim=options.planted_dim, seed=options.planted_seed))
    else:
        from gcbs_lib.data.howto100m import python_doc_pages, standin_encoders, write_python_doc_standin

        write_python_doc_standin(staging, python_doc_pages(), standin_encoders())
    root.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(root)


def prepare(options: MilNceOptions, root: Path) -> None:
    """Raw data, the training bag cache and the dev/test retrieval sets under `root` (each built once)."""
    _raw_data(options, root)
    clips = json.loads((root / "clips.json").read_text()) if (root / "clips.json").exists() else None
    captions = read_captions(caption_path(root))
    split = split_videos([v for v in read_video_list(root / "videos.csv") if v in captions], options.eval_fraction)
    cache = root / _bag_cache_name(options)
    if not cache.exists():
        store = FeatureStore(root)
        write_cache(build_bags(captions, store, options.bag_size, split["train"], clips, options.min_time), cache)
    truth = json.loads((root / "truth.json").read_text()) if (root / "truth.json").exists() else None
    for name in ("dev", "test"):
        path = root / f"eval-{name}.npz"
        if not path.exists():
            features, texts = _retrieval_set(captions, FeatureStore(root), split[name], clips, truth, options.min_time)
            temporary = path.with_name(path.name + ".tmp.npz")
            np.savez(temporary, features=features, texts=np.array(texts))
            temporary.replace(path)


def _retrieval_set(captions, store, video_ids, clips, truth, min_time) -> tuple[np.ndarray, list[str]]:
    """Clip features and one query caption per clip: planted data's true segment captions, else each clip's
    anchor caption."""
    if truth is None:
        bags = build_bags(captions, store, 1, video_ids, clips, min_time)
        return np.asarray(bags.features), bags.caption_text[bags.anchor].tolist()
    features, texts = [], []
    for video_id in video_ids:
        streams = store.load(video_id)
        if streams is None:
            continue
        pooled, present = clip_features(streams, np.array([s["window"] for s in truth[video_id]]))
        features += [f for f, ok in zip(pooled, present) if ok]
        texts += [s["text"] for s, ok in zip(truth[video_id], present) if ok]
    return np.stack(features), texts


# ------------------------------------------------------------------------------------------------ checks

def gradient_check(options: dict, batch_size: int, seed: int = 0, scale: float = 20.0,
                   chunk_size: int | None = None) -> dict:
    """One MIL-NCE step on this rank (a torchrun target, or in one process): float64 DDP heads, rank r's share
    of a seeded global batch, GradCache if `chunk_size`. Returns the mean loss over ranks, the flat gradient,
    its norm and the largest difference between ranks (the rank-sync check: 0.0 means bitwise in sync)."""
    rank, world_size = rank_and_world_size()
    experiment = MilNce(MilNceOptions(**options), seed=seed, device=torch.device("cpu"))
    train_set = experiment.load_data()
    torch.manual_seed(stream_seed(seed, 0, "init"))
    model = experiment.build_model().double()
    branches = experiment.branches(model)
    if world_size > 1:
        branches = [DistributedDataParallel(m) for m in branches]
    if batch_size % world_size or batch_size > train_set.size:
        raise ValueError(f"batch_size {batch_size} must divide over {world_size} ranks and fit {train_set.size} clips")
    order = torch.randperm(train_set.size, generator=generator(seed, 0, "shuffle"))[:batch_size]
    part = batch_size // world_size
    batch = experiment.collate(order[rank * part:(rank + 1) * part].tolist())

    def loss_fn(*embeddings):
        return experiment.loss(embeddings, batch, scale)

    if chunk_size:
        loss = cached_loss(loss_fn, branches, batch.inputs, chunk_size)
    else:
        loss = loss_fn(*[m(x) for m, x in zip(branches, batch.inputs)])
    loss.backward()
    mean_loss = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(mean_loss)
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"loss": mean_loss.item() / world_size, "grad": grad.tolist(), "grad_norm": grad.norm().item(),
            "rank_difference": gradient_rank_difference(model.parameters())}


def _loss_step(setting: dict, device: str):
    """One `mil_nce` forward and backward on random inputs: `clips` clips with disjoint bags of `bag_size`."""
    g = torch.Generator().manual_seed(0)
    clips, k, dim = setting["clips"], setting["bag_size"], setting["dim"]
    video = torch.randn(clips, dim, generator=g).to(device).requires_grad_()
    text = torch.randn(clips * k, dim, generator=g).to(device).requires_grad_()
    bags = torch.arange(clips * k, device=device).view(clips, k)
    return lambda: mil_nce(video, text, bags, 0.07, setting["direction"], setting["chunk_size"]).backward()


def loss_peak_memory(settings: list[dict], device: str = "cpu") -> list[int]:
    """Peak bytes of one `mil_nce` forward and backward above its inputs, for each setting `{"clips",
    "bag_size", "dim", "chunk_size", "direction"}`: the CUDA allocator's peak, or on CPU the peak resident set
    of a fresh process per setting (`gcbs_lib.measure.memory_method`), so no setting reuses pages an earlier
    one left resident."""
    if device.startswith("cuda"):
        return [memory_rise(_loss_step(setting, device), "cuda") for setting in settings]
    return [fresh_process_bytes(["-m", "gcbs_lib.experiments.milnce", json.dumps(setting)], setting)
            for setting in settings]


def _cpu_peak(setting: dict) -> int:
    """The setting's peak in this (fresh) process, after a tiny warm-up step (lazily allocated state)."""
    _loss_step({"clips": 4, "bag_size": 2, "dim": 4, "chunk_size": 2, "direction": "both"}, "cpu")()
    return memory_rise(_loss_step(setting, "cpu"), memory_method("cpu"))


if __name__ == "__main__":  # the fresh process behind loss_peak_memory on CPU
    print(_cpu_peak(json.loads(sys.argv[1])))
