# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     notebook_metadata_filter: kernelspec,jupytext
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · MIL-NCE: caption bags, a streamed denominator, DDP
#
# HowTo100M pairs 1.2 M instructional videos with their automatic speech transcripts. Miech et al. (*End-to-End
# Learning of Visual Representations from Uncurated Instructional Videos*, CVPR 2020) observe that narration
# is often out of step with what is shown: people say what they will do before doing it, or explain it after.
# A clip paired with the single caption spoken at the same time is then often a wrong pair. What **MIL-NCE** adds
# to InfoNCE is the *bag*: each clip's positive is a set of neighbouring captions, and a log-sum-exp over the bag
# lets the loss decide which of them match (multiple-instance learning), while every other caption in the batch
# is a negative. The loss exists in two forms: the article's "v2t" (a clip against every caption) and the official
# code's "both" (also every clip against the clip's bag).
#
# This notebook is the lesson: it shows why bags help, derives both forms, writes the loss in a few lines and
# checks the library against it, streams the denominator in chunks (exact, bounded memory), runs the data
# pipeline on files in the real HowTo100M formats, trains with real DDP, and measures retrieval against bag size
# K and narration noise σ. Everything here runs on planted videos, whose truth is known by construction. The
# experiment, random against GCBS batches on the offline stand-in or real features, is the next notebook,
# `07_milnce_howto100m`.

# %% tags=["parameters"]
device = "cpu"
seed = 0  # seed of the demonstration cells and the DDP run
profile = "ci"  # profile of gcbs_lib/configs/milnce.yaml behind every run, and of the result rows
seeds = [0]  # seeds of the K × σ sweep
nproc = 2  # DDP ranks launched with torchrun
backend = "gloo"  # "nccl" on GPUs
output_dir = (
    "../runs/07_milnce_bags_and_ddp"  # one folder per run; a finished run is loaded, not retrained
)
overrides = {}  # further config keys for every training run, e.g. {"max_steps": 100}
epochs = 40  # the DDP run and the sweep: epochs of one clip per planted video
batch_size = 16
bag_sizes = [1, 3, 5]  # K in the sweep
sigmas = [0.0, 8.0]  # narration misalignment σ in seconds in the sweep (planted segments last 6 s)
ddp_bag_size = 3  # K of the DDP run
ddp_sigma = 8.0  # its narration noise
memory_clips = [256, 512, 1024]  # clips in the memory plot (K captions each)
memory_bag_size = 4
memory_dim = 64
memory_chunk_size = 128

# %%
import inspect
import json
import math
from dataclasses import asdict
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

# %%
from gcbs_lib import seeding
from gcbs_lib.check import cmp_table, compare
from gcbs_lib.data import run_data_script
from gcbs_lib.data.howto100m import (
    FeatureStore,
    build_bags,
    caption_path,
    features_of,
    read_captions,
)
from gcbs_lib.distributed import gather_ragged
from gcbs_lib.experiments.milnce import gradient_check
from gcbs_lib.launcher import launch
from gcbs_lib.losses import mil_nce
from gcbs_lib.measure import step_bytes
from gcbs_lib.metrics import median_rank, ranks, recall_at
from gcbs_lib.rows import record, result_row
from gcbs_lib.train import TrainingDiverged, load_config, train

torch.manual_seed(seed)
work = Path(output_dir) / profile
planted_options = {"source": "planted", "bag_size": ddp_bag_size, "planted_sigma": ddp_sigma}
training = {
    **overrides,
    **planted_options,
    "epochs": epochs,
    "batch_size": batch_size,
    "device": device,
}
print(f"profile={profile}  device={device}  nproc={nproc}  torch={torch.__version__}")

# %% [markdown]
# ## 1 · Why bags: narration drifts from the pictures
#
# The planted generator (`data_scripts/howto100m_planted.py`) writes videos in the real formats (per-video `.npy`
# features, `caption.json`): each video is six steps of 6 s, a step is a (verb, object) topic with its own
# direction in feature space, its caption names verb and object among filler words, and filler-only captions
# ("so now we just…") come in between. Narration is then shifted by Gaussian noise of σ seconds. A training clip
# is a caption's window (widened to 5 s, as the MIL-NCE loader does); its bag holds the K captions around it,
# grown toward the shorter time span. How often does the bag hold the caption that describes what the clip *shows*?


# %%
def planted(folder, *options):
    """Planted videos in `folder` (built once by the data script) and their ground truth."""
    run_data_script("howto100m_planted.py", folder, "--seed", seed, *options)
    return json.loads((Path(folder) / "truth.json").read_text())


def bag_hit_rate(sigma, k):
    """Share of training clips whose bag holds the true caption of the step shown at the clip's middle."""
    folder = work / f"hits-sigma{sigma:g}"
    truth = planted(folder, "--videos", 40, "--dim", 8, "--sigma", sigma)
    bags = build_bags(read_captions(caption_path(folder)), FeatureStore(folder), k)
    hits = []
    for video, window, bag in zip(bags["clip_video"], bags["clip_window"], bags["bag_idx"]):
        steps = truth[bags["video_ids"][video]]
        shown = steps[min(int(window.mean() // 6.0), len(steps) - 1)]["text"].encode()
        hits.append(shown in bags["caption_text"][bag[bag >= 0]].tolist())
    return float(np.mean(hits))


# %%
hit_rates = {(s, k): bag_hit_rate(s, k) for s in sigmas for k in bag_sizes}
print("σ \\ K " + "".join(f"{k:>7}" for k in bag_sizes))
for s in sigmas:
    print(f"{s:>5g} " + "".join(f"{hit_rates[s, k]:>7.2f}" for k in bag_sizes))

# %% [markdown]
# Even without noise a single caption often misses (filler captions are clips too), and with σ = 8 s most
# single captions describe another step, while a bag of K = 3 still holds the right one more often than not.
#
# ## 2 · The loss, in its two published forms
#
# Clip embeddings $v_i$ ($B$ of them), caption embeddings $t_j$ ($N$), scores $S_{ij} = v_i^\top t_j/\tau$ and
# $P_i$ the bag of clip $i$. InfoNCE would take one caption as the positive; MIL-NCE aggregates the bag with a
# log-sum-exp, a soft maximum, so the loss is low as soon as *one* caption of the bag matches the clip:
#
# $$\ell_i^{\text{v2t}} = \log \sum_{j \le N} e^{S_{ij}} \;-\; \log \sum_{j\in P_i} e^{S_{ij}}
# \qquad\text{(the article's form: clip } i \text{ against every caption)}$$
#
# $$\ell_i^{\text{both}} = \log\Big(\sum_{j \le N} e^{S_{ij}} + \sum_{k \le B}\sum_{j\in P_i} e^{S_{kj}}\Big)
#   \;-\; \log \sum_{j\in P_i} e^{S_{ij}} \qquad\text{(the official code: also every clip against } i\text{'s bag)}$$
#
# The gradient of the positive term spreads over the bag by the softmax weights $e^{S_{ij}}/\sum_{j'\in P_i}
# e^{S_{ij'}}$: the caption that already matches best is pulled hardest, the others barely. In "both" the
# positive bag appears in the denominator twice (once in each sum), so $\ell_i \ge \ln 2$. With $K=1$ they reduce
# to cross-entropies: "v2t" over the rows of $S$, "both" over the rows of $[S,\,S^\top]$. With all scores equal
# and $N = BK$ captions in disjoint bags: $\ell^{\text{v2t}} = \ln(BK) - \ln K = \ln B$ and
# $\ell^{\text{both}} = \ln(2BK) - \ln K = \ln 2B$.
#
# The definitions, written out for bags given as a `[B, A]` index matrix padded with −1:


# %%
def mil_nce_in_a_few_lines(video, text, bag_idx, tau, direction):
    S = video @ text.T / tau  # [B, N]
    in_bag = torch.zeros_like(S, dtype=torch.bool).scatter_(1, bag_idx.clamp(min=0), bag_idx >= 0)
    positive = S.masked_fill(~in_bag, -math.inf).logsumexp(1)  # log Σ_{j∈P_i} e^{S_ij}
    denominator = S.logsumexp(1)  # log Σ_j e^{S_ij}
    if direction == "both":  # + log Σ_{j∈P_i} Σ_k e^{S_kj}
        columns = S.logsumexp(0).expand_as(S).masked_fill(~in_bag, -math.inf)
        denominator = torch.logaddexp(denominator, columns.logsumexp(1))
    return (denominator - positive).mean()


# %%
g = torch.Generator().manual_seed(seed)
B, K, D, tau = 6, 3, 16, 0.1
video = torch.randn(B, D, generator=g, dtype=torch.float64)
text = torch.randn(B * K, D, generator=g, dtype=torch.float64)
bags = torch.arange(B * K).view(B, K)
ragged = torch.tensor(
    [[0, 1, 2], [3, 4, -1], [5, -1, -1], [6, 7, 8], [9, 2, 10], [11, 12, 13]]
)  # shares 2
few_rows = [
    compare(
        f"library = few lines, {d}",
        mil_nce(video, text, ragged, tau, d),
        mil_nce_in_a_few_lines(video, text, ragged, tau, d),
    )
    for d in ("v2t", "both")
]
print(cmp_table(few_rows))

# %% [markdown]
# `gcbs_lib.losses.mil_nce` computes the same (plus exclusions and a streamed denominator, section 3). Its
# special cases, and the official MIL-NCE code, which takes $B$ clips with $BK$ captions in disjoint bags:


# %%
def official_milnce(video, text):
    """The official MIL-NCE loss (antoine77340/MIL-NCE_HowTo100M, loss.py) for B clips and B·K captions."""
    x = (video @ text.T).view(video.shape[0], video.shape[0], -1)
    nominator = (x * torch.eye(x.shape[0])[:, :, None]).sum(dim=1).logsumexp(dim=1)
    denominator = torch.cat((x, x.permute(1, 0, 2)), dim=1).view(x.shape[0], -1).logsumexp(dim=1)
    return (denominator - nominator).mean()


# %%
single = torch.arange(B)[:, None]
S1 = video @ text[:B].T / tau
ones = (torch.ones(B, D), torch.ones(B * K, D))
form_rows = [
    compare(
        "K=1 v2t = CE(S/τ)",
        mil_nce(video, text[:B], single, tau, "v2t"),
        F.cross_entropy(S1, torch.arange(B)),
    ),
    compare(
        "K=1 both = CE([S, Sᵀ])",
        mil_nce(video, text[:B], single, tau, "both"),
        F.cross_entropy(torch.cat([S1, S1.T], 1), torch.arange(B)),
    ),
    compare(
        "both = official code",
        mil_nce(video, text, bags, 1.0, "both"),
        official_milnce(video, text),
    ),
]

# %%
form_rows += [
    compare(
        "K copies of a caption = K=1",
        mil_nce(video, text[:B].repeat_interleave(K, 0), bags, tau, "both"),
        mil_nce(video, text[:B], single, tau, "both"),
    ),
    compare(
        "equal scores, v2t = ln B", mil_nce(*ones, bags, tau, "v2t"), torch.tensor(math.log(B))
    ),
    compare(
        "equal scores, both = ln 2B",
        mil_nce(*ones, bags, tau, "both"),
        torch.tensor(math.log(2 * B)),
    ),
]
print(cmp_table(form_rows))

# %% [markdown]
# Side by side on the same scores, as the temperature sharpens them: "v2t" can approach 0 once every clip
# prefers its own bag; "both" bottoms out at ln 2 because the bag is counted twice. The official code's
# minimum is therefore not 0, a useful fact when reading its loss curves.

# %%
temperatures = [1.0, 0.3, 0.1, 0.03, 0.01]
aligned = F.normalize(
    text.view(B, K, D).mean(1) + 0.1 * video, dim=1
)  # clips close to their bag's mean
forms = {
    d: [mil_nce(aligned, F.normalize(text, dim=1), bags, t, d).item() for t in temperatures]
    for d in ("v2t", "both")
}
print("τ     " + "".join(f"{t:>8g}" for t in temperatures))
for d, values in forms.items():
    print(f"{d:<5} " + "".join(f"{v:>8.3f}" for v in values))
print(f"ln 2 = {math.log(2):.3f}")

# %% [markdown]
# ## 3 · A streamed denominator: exact values and gradients in bounded memory
#
# The full loss holds the $B\times N$ score matrix, and autograd keeps it (and its softmax) for the backward.
# With `chunk_size=c`, `mil_nce` walks the scores in blocks of $c$ rows × $c$ columns (for "both" also the
# column sums $\log\sum_k e^{S_{kj}}$ over the bag captions), combining the running log-sum-exps with `logaddexp`,
# and its backward recomputes each block's softmax $e^{S_{ij} - \mathrm{lse}_i}$ instead of storing it: peak
# memory is one $c \times c$ block besides the inputs and their gradients. Values and gradients equal the full
# computation to rounding:

# %%
v = video.clone().requires_grad_()
t = text.clone().requires_grad_()
chunk_rows = []
for direction in ("v2t", "both"):
    results = []
    for chunk in (None, 4):
        loss = mil_nce(v, t, ragged, tau, direction, chunk)
        results.append((loss, *torch.autograd.grad(loss, (v, t))))
    chunk_rows += [
        compare(f"{direction} chunk 4: {name}", c, f)
        for name, f, c in zip(("loss", "d/dvideo", "d/dtext"), *results)
    ]
print(cmp_table(chunk_rows))
chunk_exact = all(r.within_tolerance for r in chunk_rows)

# %% [markdown]
# Peak memory of one forward and backward, each setting measured in a fresh Python process (so no setting
# reuses pages an earlier one left resident): the peak resident set on a CPU, the allocator's peak on CUDA.
# The step is `gcbs_lib.measure.mil_nce_step`, run by `python -m gcbs_lib.measure mil_nce SETTING`.

# %%
settings = [
    dict(clips=b, bag_size=memory_bag_size, dim=memory_dim, chunk_size=c, device=device)
    for b in memory_clips
    for c in (None, memory_chunk_size)
]
peaks = np.array([step_bytes("mil_nce", s) for s in settings]).reshape(-1, 2) / 2**20
captions_n = [b * memory_bag_size for b in memory_clips]

# %% tags=["figure:memory-vs-captions"]
plt.figure(figsize=(5, 3.2))
plt.plot(captions_n, peaks[:, 0], "o-", label="full B×N scores")
plt.plot(captions_n, peaks[:, 1], "s-", label=f"chunked, c = {memory_chunk_size}")
plt.xlabel("captions N (B = N / K)")
plt.ylabel("peak memory (MiB)")
plt.xscale("log", base=2)
plt.title("MIL-NCE forward + backward: peak memory")
plt.legend()
plt.tight_layout()
plt.show()
for n, (full, chunked) in zip(captions_n, peaks):
    print(f"N={n:>5}: full {full:7.1f} MiB   chunked {chunked:6.1f} MiB")

# %% [markdown]
# The full loss grows with $B\cdot N$ (quadratically here, since $N = BK$); the chunked one with the inputs
# and their gradients only.
#
# ## 4 · The data pipeline, on files in the real formats
#
# `gcbs_lib.data.howto100m` reads captions from `caption.json`, `caption.pickle` (through an unpickler that
# accepts plain containers, numbers, strings and numpy arrays only: unpickling a downloaded file could
# otherwise run its code) or a folder of per-video `<video_id>.csv`; features from `features_2d/<id>.npy`
# (1 row/s) and `features_3d/<id>.npy` (1.5 rows/s), memory-mapped. A clip feature is the max over the rows
# inside its window, L2-normalised per stream, 2D and 3D concatenated. Below: the three caption formats read back
# identically, and broken feature files are skipped and listed.

# %%
demo = {fmt: work / f"formats-{fmt}" for fmt in ("json", "pickle", "csv")}
for fmt, folder in demo.items():
    planted(folder, "--videos", 6, "--dim", 16, "--sigma", 2.0, "--format", fmt)
read = [read_captions(caption_path(folder)) for folder in demo.values()]
formats_agree = read[0] == read[1] == read[2]
features = demo["json"]
(features / "features_3d" / "v00001.npy").write_bytes(
    (features / "features_3d" / "v00001.npy").read_bytes()[:200]
)
np.save(features / "features_2d" / "v00002.npy", np.full((36, 16), np.nan, np.float16))
store = FeatureStore(features)
demo_bags = build_bags(read[0], store, k=3)
print(
    "caption formats agree:",
    formats_agree,
    "| clips:",
    len(demo_bags["clip_video"]),
    "| videos kept:",
    len(demo_bags["video_ids"]),
)
for video_id, reason in store.skipped.items():
    print(f"skipped {video_id}: {reason[:90]}")

# %% [markdown]
# The bags are index arrays, written once as plain `.npy` files and memory-mapped by the experiment: clip $m$
# is its video, its window, its bag and its exclusions, caption numbers into one text array. A batch's clip
# features are pooled from the memory-mapped video files when the batch is made, so no array of every clip's
# features exists (HowTo100M's 136 M clips would need 2.2 TB of them). One clip:

# %%
m = 7
texts, video_of = demo_bags["caption_text"], demo_bags["video_ids"][demo_bags["clip_video"][m]]
print("clip", m, "window", demo_bags["clip_window"][m].round(1).tolist(), "video", video_of)
for j in demo_bags["bag_idx"][m][demo_bags["bag_idx"][m] >= 0]:
    print("  bag     ", texts[j].decode())
for j in demo_bags["exclude_idx"][m][demo_bags["exclude_idx"][m] >= 0]:
    print("  excluded", texts[j].decode())
print(
    "its feature:",
    features_of(store, demo_bags, np.array([m])).shape,
    "from",
    {k: (type(a).__name__, a.shape) for k, a in store.open(str(video_of)).items()},
)

# %% [markdown]
# As the official loader does, an epoch trains on **one clip (with its bag) of every training video**, drawn
# afresh each epoch (`one_per_group`, the video id as the group): an epoch has as many items as there are
# videos, and no batch holds two clips of one video, whose captions would be false negatives of each other. The
# draw, on six clips of three videos: each epoch's stream (`seeding.generator`) picks one clip of every video,
# sorted.
# %%
videos = torch.tensor([0, 0, 0, 1, 2, 2])
streams = {epoch: seeding.generator(seed, epoch, "one-per-group") for epoch in (0, 1)}
drawn = {epoch: seeding.one_per_group(videos, stream) for epoch, stream in streams.items()}
one_each = all(sorted(videos[d].tolist()) == [0, 1, 2] for d in drawn.values())
print({epoch: d.tolist() for epoch, d in drawn.items()}, "| one clip of each video:", one_each)

# %% [markdown]
# ## 5 · DDP training through the launcher
#
# Each rank encodes its clips and the captions of their bags, gathers the clip embeddings with
# `gather_with_grad` and the captions with `gather_ragged` (ranks hold different counts), and keeps one copy
# of a caption that sits on several ranks, so every rank sees exactly the single-process batch. Its loss is the
# mean over its own clips; DDP's average then gives the full-batch gradient (notebook 02). The official code's
# `AllGather` instead drops the other ranks' gradient contributions. `gather_ragged` pads each rank's rows to
# the longest, gathers, and drops the padding again:

# %%
print(inspect.getsource(gather_ragged))

# %% [markdown]
# First the check, in float64 with GradCache:

# %%
reference = gradient_check(planted_options, batch_size=16, seed=seed)
ranked = launch(
    gradient_check,
    nproc=nproc,
    backend=backend,
    echo=False,
    args={"options": planted_options, "batch_size": 16, "seed": seed, "chunk_size": 4},
)
ddp_rows = [
    compare(
        name,
        torch.tensor(ranked[key], dtype=torch.float64),
        torch.tensor(reference[key], dtype=torch.float64),
    )
    for name, key in (("loss", "loss"), ("gradient", "grad"))
]
print(cmp_table(ddp_rows))
print("largest gradient difference between ranks (the rank-sync check):", ranked["rank_difference"])

# %% [markdown]
# Then a real run on planted videos: `gcbs_lib.train` under torchrun on `nproc` ranks (sharded batches, the
# epoch seeding the order), next to the same config in one process, both at this lesson's small size:

# %%
config = load_config("milnce", profile, {**training, "seed": seed})
ddp_summary = launch(
    "gcbs_lib.train:launched",
    nproc=nproc,
    backend=backend,
    echo=False,
    args={"config": asdict(config), "output_dir": str(work / "ddp")},
)
one_summary = train(config, work / "one-process")
for name, summary in (("DDP", ddp_summary), ("1 process", one_summary)):
    print(f"{name:<10}", {k: round(v, 3) for k, v in summary["test"].items()})

# In float32 the two runs add the same terms in different orders, so rounding can make their trajectories drift
# apart over many steps (and the best-dev checkpoint land on another step); the float64 check above is the
# exactness test.
#
# ## 6 · Retrieval against bag size K and narration noise σ
#
# Text → video retrieval on held-out planted videos: each step's true caption is the query, the clips of all
# held-out steps the candidates; R@K counts a candidate that ties the match as ranked above it (pessimistic).


# %%
def run(changes, name):
    """Train the milnce experiment (`profile`, `overrides`, then `changes`) in `work / name`; the run's summary."""
    return train(
        load_config("milnce", profile, {**overrides, "device": device, **changes}), work / name
    )


planted_runs = {"source": "planted", "epochs": epochs, "batch_size": batch_size}
sweep = {
    (s, k, sd): run(
        {**planted_runs, "planted_sigma": s, "bag_size": k, "seed": sd}, f"sweep-{s}-{k}-{sd}"
    )["test"]
    for s in sigmas
    for k in bag_sizes
    for sd in seeds
}
r10 = {(s, k): np.mean([sweep[s, k, sd]["r10"] for sd in seeds]) for s in sigmas for k in bag_sizes}

# %% tags=["figure:recall-vs-bag-size"]
plt.figure(figsize=(5, 3.2))
for s in sigmas:
    plt.plot(bag_sizes, [r10[s, k] for k in bag_sizes], "o-", label=f"σ = {s:g} s")
plt.axhline(10 / 144, color="gray", ls=":", label="chance")
plt.xlabel("bag size K")
plt.ylabel("test R@10 (text → video)")
plt.legend()
plt.title("retrieval against bag size K and narration noise σ")
plt.tight_layout()
plt.show()

# %%
print("σ    K   R@1    R@5    R@10   MedR")
for (s, k, _seed), metrics in sweep.items():
    print(
        f"{s:<4g} {k:<3} {metrics['r1']:.3f}  {metrics['r5']:.3f}  {metrics['r10']:.3f}  "
        f"{metrics['median_rank']:g}"
    )


# %% [markdown]
# ## 7 · Ties: why the official metrics code can count a query several times
#
# The HowTo100M / MIL-NCE evaluation finds each query's rank with `np.where(sorted_row - diagonal == 0)`. When
# candidates tie the match, that query appears once per tied position, so it is counted several times, at
# optimistic positions. `gcbs_lib.metrics.ranks` counts each query once, with every tie ranked above the match.


# %%
def official_compute_metrics(x):
    """The official evaluation (howto100m / MIL-NCE metrics.py) on a [queries, candidates] score matrix."""
    sx = np.sort(-x, axis=1)
    ind = np.where(sx - np.diag(-x)[:, None] == 0)[1]
    return {
        "R1": np.sum(ind == 0) / len(ind),
        "R5": np.sum(ind < 5) / len(ind),
        "MR": np.median(ind) + 1,
        "counted": len(ind),
    }


# %%
tied = np.eye(4) * 0.5 + 0.1
tied[0] = 0.3  # query 0 scores all four candidates equally: a collapsed embedding
ours = ranks(torch.tensor(tied), torch.arange(4))
print("official:", {k: float(v) for k, v in official_compute_metrics(tied).items()})
print(
    "ours:    ",
    {
        "R1": recall_at(ours, 1),
        "R5": recall_at(ours, 5),
        "MR": median_rank(ours),
        "counted": len(ours),
    },
    "ranks",
    ours.tolist(),
)

# %% [markdown]
# ## 8 · Troubleshooting with the checks
#
# * **Errors instead of garbage.** A bag index outside the captions (a CUDA gather would silently read
#   garbage), an empty bag, NaN embeddings: each refused with a message.

# %%
for bad, why in (
    (torch.tensor([[0, 1], [2, 99]]), "out of range"),
    (torch.tensor([[0, 1], [-1, -1]]), "empty bag"),
):
    try:
        mil_nce(video[:2], text, bad)
    except ValueError as error:
        print(f"{why:<13} → {error}")
try:
    mil_nce(video[:2] * float("nan"), text, torch.tensor([[0], [1]]))
except ValueError as error:
    print(f"{'NaN input':<13} → {error}")

# %% [markdown]
# * **The NaN guard.** A logit scale far too high overflows float32; the trainer stops at the first non-finite
#   loss, names the likely causes and leaves the last good checkpoint in place.

# %%
try:
    run({**planted_runs, "scale": 1e39, "epochs": 1}, "diverge")
    diverged = ""
except TrainingDiverged as error:
    diverged = str(error)
print(diverged)

# %% [markdown]
# * **The gradient norm.** Every step's gradient norm (before clipping) is in `metrics.jsonl`; a norm that jumps
#   far above its recent values is the first sign of a too-high learning rate or temperature.
# * **The rank-sync check.** After a DDP backward, the largest difference between ranks must be exactly 0
#   (section 5); anything else means ranks trained on different batches or a parameter escaped DDP. The trainer
#   compares parameters and gradients every `sync_check_every` steps (the milnce profiles: 10) and logs
#   `rank_difference`; with one rank there is nothing to compare.
# * **Chance level.** With uninformative embeddings the loss starts near ln B ("v2t") or ln 2B ("both") for
#   B clips in the global batch with disjoint bags; a loss that stays there is not learning.

# %% tags=["figure:ddp-loss-and-gradient-norm"]
steps = [json.loads(line) for line in (work / "ddp" / "metrics.jsonl").read_text().splitlines()]
norms = np.array([r["grad_norm"] for r in steps if r["kind"] == "step"])
losses = np.array([r["loss"] for r in steps if r["kind"] == "step"])
synced = [
    r["rank_difference"] for r in steps if "rank_difference" in r
]  # the trainer's rank-sync checks
fig, axes = plt.subplots(1, 2, figsize=(8, 3))
axes[0].plot(losses)
axes[0].axhline(math.log(2 * batch_size), color="gray", ls=":", label="ln 2B")
axes[0].set_xlabel("step")
axes[0].set_ylabel("loss")
axes[0].legend()
axes[1].plot(norms)
axes[1].set_xlabel("step")
axes[1].set_ylabel("gradient norm")
axes[0].set_title("DDP run: training loss")
axes[1].set_title("DDP run: gradient norm")
plt.tight_layout()
plt.show()
print(f"first loss {losses[0]:.2f} vs ln 2B = {math.log(2 * batch_size):.2f}")
print(
    f"rank-sync checks in the DDP run: {len(synced)}, largest difference between ranks: "
    f"{max(synced, default=0.0)}"
)

# %% [markdown]
# ## Result rows

# %%
model_name = one_summary["rows"][0]["model"]
result_rows = []
for (s, k, sd), metrics in sweep.items():
    result_rows += [
        result_row(
            experiment=f"milnce-planted-sigma{s:g}",
            arm=f"K{k}",
            seed=sd,
            metric=f"test_{name}",
            value=metrics[name],
            profile=profile,
            data=f"planted-sigma{s:g}",
            model=model_name,
        )
        for name in ("r1", "r5", "r10", "median_rank")
    ]
# %%
result_rows += [
    result_row(
        experiment="milnce-loss-memory",
        arm=arm,
        seed=seed,
        metric=f"peak_mib_N{n}",
        value=p,
        profile=profile,
        data="random",
        model="-",
    )
    for n, pair in zip(captions_n, peaks)
    for arm, p in zip(("full", "chunked"), pair)
]
record(result_rows, "07_milnce_bags_and_ddp")
print(len(result_rows), "result rows")

# %% [markdown]
# ## Checks

# %%
assert all(r.within_tolerance for r in [*few_rows, *form_rows, *ddp_rows]) and chunk_exact
assert ranked["rank_difference"] == 0.0 and all(d == 0.0 for d in synced) and (nproc == 1 or synced)
assert formats_agree and set(store.skipped) == {"v00001", "v00002"}
assert all(f >= math.log(2) for f in forms["both"]) and forms["v2t"][-1] < forms["both"][-1]
full_scores_mib = memory_clips[-1] ** 2 * memory_bag_size * 4 / 2**20
assert full_scores_mib >= 8, (
    f"the B×N scores of {memory_clips[-1]} clips ({full_scores_mib:.1f} MiB) are too small to tell "
    "from allocator noise: measure memory with memory_clips whose scores take 8 MiB or more"
)
assert peaks[-1, 1] < peaks[-1, 0] / 2, "the chunked denominator should need far less memory"
assert hit_rates[max(sigmas), max(bag_sizes)] > hit_rates[max(sigmas), min(bag_sizes)]
assert "max_steps" in overrides or r10[min(sigmas), max(bag_sizes)] > 5 * 10 / 144, (
    "training should lift R@10 far above chance"
)  # unless a dry run cut training to a few steps
assert "not finite" in diverged
assert one_each, "an epoch draws one clip of each video"
assert official_compute_metrics(tied)["counted"] > len(tied) and ours[0] == 4

# %%
# NBVAL_CHECK_OUTPUT
print(
    "MIL-NCE forms match the few-line definition, cross-entropy, the official code and ln B / "
    "ln 2B:",
    all(r.within_tolerance for r in [*few_rows, *form_rows]),
)
print(
    "chunked = full (values and gradients):",
    chunk_exact,
    "| chunked peak < half of full at the largest N:",
    bool(peaks[-1, 1] < peaks[-1, 0] / 2),
)
print(
    "DDP on",
    nproc,
    "ranks = one process:",
    all(r.within_tolerance for r in ddp_rows),
    "| ranks in sync:",
    ranked["rank_difference"] == 0.0,
)
print("caption formats agree:", formats_agree, "| skipped:", sorted(store.skipped))
print(
    "bags hold the shown step more often as K grows:",
    all(
        hit_rates[s, a] <= hit_rates[s, b] for s in sigmas for a, b in zip(bag_sizes, bag_sizes[1:])
    ),
)
print(
    "R@10 far above chance:",
    bool(r10[min(sigmas), max(bag_sizes)] > 5 * 10 / 144),
    "| NaN guard fired:",
    "not finite" in diverged,
    "| official metrics count the tied query",
    official_compute_metrics(tied)["counted"] - len(tied) + 1,
    "times",
)
