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
# # 07 · GCBS on MIL-NCE: random against GCBS batches of noisy caption bags
#
# The MIL-NCE loss, its bags of captions, its streamed denominator and its DDP training are the lesson of
# `07_milnce_bags_and_ddp`. This notebook is the experiment: does GCBS (notebook 03), which orders each
# epoch's clips so that batches hold each other's hard negatives, help when the positives are noisy bags? Both
# arms train on the same seeds from the same model; the GCBS paper has no MIL-NCE experiment, so there is no
# paper Δ. The `ci` profile (the defaults) uses planted videos, a smoke test whose numbers mean nothing about
# GCBS; `cpu` trains on the offline stand-in built from Python's documentation (code blocks as clips, prose as
# narration: `apt-get install python3.11-doc`); `paper` points `data_dir` at real HowTo100M features.

# %% tags=["parameters"]
device = "cpu"
seed = 0  # seed of the data cells
profile = "ci"  # profile of gcbs_lib/configs/milnce.yaml behind every run, and of the result rows
seeds = [0]  # seeds of the random-vs-GCBS comparison
arms = {"random": {"sampler": "random"}, "gcbs": {"sampler": "gcbs"}}  # arm: its settings
nproc = 2  # DDP ranks launched with torchrun for each run
backend = "gloo"  # "nccl" on GPUs
source = "planted"  # planted | python-doc | howto100m
data_dir = ""  # empty: the kit data root; howto100m: the folder of features and captions
output_dir = (
    "../runs/07_milnce_howto100m"  # one folder per run; a finished run is loaded, not retrained
)
overrides = {}  # further config keys for every training run, e.g. {"max_steps": 100}
epochs = 40  # epochs of one clip per video
batch_size = 16
bag_size = 3  # K of both arms
sigma = 8.0  # their narration noise when source is planted

# %%
from pathlib import Path

import torch

from gcbs_lib import seeding
from gcbs_lib.comparison import (
    arms_table,
    committed_plan,
    first_gap_no_larger,
    plot_comparison,
    record_runs,
    run_arms,
)
from gcbs_lib.experiments.milnce import MilNce
from gcbs_lib.train import load_config

torch.manual_seed(seed)
base = {"data_dir": data_dir} if data_dir else {}
source_options = {**base, "source": source, "bag_size": bag_size, "planted_sigma": sigma}
training = {
    **overrides,
    **source_options,
    "epochs": epochs,
    "batch_size": batch_size,
    "device": device,
}
print(
    f"profile={profile}  device={device}  source={source}  nproc={nproc}  torch={torch.__version__}"
)

# %% [markdown]
# ## 1 · The data: one clip of every video an epoch
#
# The experiment prepares `source` once: caption bags as memory-mapped index arrays, the clips' features pooled
# from the video files when a batch is made (the lesson's section 4). As the official loader does, an epoch
# trains on **one clip (with its bag) of every training video**, drawn afresh each epoch (`one_per_group`, the
# video id as the group): an epoch has as many items as there are videos, and no batch holds two clips of one
# video, whose captions would be false negatives of each other.

# %%
options = load_config("milnce", profile, source_options).options
experiment = MilNce(options, seed=seed, device=device)
train_set = experiment.load_data()
n_clips, n_videos = train_set.size, len(set(train_set.groups))
print(
    f"{n_clips} training clips in {n_videos} videos under {experiment.root.name}: an epoch of "
    f"{n_videos} clips; {len(experiment.eval_sets['test']['clip_video'])} test queries"
)
videos = torch.tensor(train_set.groups)  # a copy of the mapped array
drawn = seeding.one_per_group(videos, seeding.generator(seed, 0, "one-per-group"))
one_each = sorted(videos[drawn].tolist()) == sorted(set(train_set.groups))
print(f"epoch 0 draws {len(drawn)} clips, one of each video: {one_each}")

# %% [markdown]
# ## 2 · How many seeds
#
# Text → video retrieval on held-out videos: each caption is a query, the held-out clips the candidates; R@K
# counts a candidate that ties the match as ranked above it (pessimistic; the lesson's section 7 shows why the
# official metrics code does not). Δ = mean over seeds of (GCBS − random) test R@10.
#
# The verdict follows notebook 04's protocol (section 3), resampling seeds × test clips (by video); here chance
# is each caption's clip drawn at random, and the trivial baseline, where the features come from a frozen text
# encoder, that encoder's own caption → clip retrieval. The seed count was fixed before the run from the last
# committed `cpu` run (its sd of Δ and seconds a seed), as printed below.

# %%
half_width = committed_plan("07_milnce_howto100m", "milnce", "test_r10")

# %% [markdown]
# ## 3 · Random vs GCBS batches
#
# GCBS orders each epoch's clips by the similarity of clip embeddings to bag-mean caption embeddings
# (`MilNce.pair_embeddings`), so batches hold each other's hard negatives. Both arms on the same seeds, each
# seed's untrained model scored too (`start`), each run on `nproc` DDP ranks; *GCBS better* where Δ's interval
# lies above 0, *GCBS worse* below, else *not resolved*, where the gate passes. The `cpu` profile adds GCBS at
# k = 20 neighbours an item (`gcbs-k20`): at the published q = 0.999 an epoch's 546 clips give k ≈ 0.5, a graph
# that, once training has spread the embeddings apart, holds under one edge an item and leaves most clips
# isolated (notebook 10 derives what k / B controls).

# %%
print(f"arms: {arms}")
summaries = run_arms(
    "milnce",
    profile,
    arms,
    seeds,
    Path(output_dir) / profile / "arms",
    training,
    nproc=nproc,
    backend=backend,
)
comparison = arms_table(summaries)  # the GCBS paper has no MIL-NCE experiment: no paper Δ

# %% [markdown]
# Left: each arm's dev R@10, mean over seeds with a band of ± 1 sd (step 0: the untrained model). Middle: the
# loss gap of the clips each arm trained on, at each epoch start. Right: the test Δ with its 95 % bootstrap
# interval (no paper Δ: the GCBS paper has no MIL-NCE experiment).

# %% tags=["figure:dev-r10-and-delta"]
shown = [comparison[f"{arm}/test_r10"] for arm in arms if arm != "random"]
plot_comparison(summaries, list(arms), "r10", shown, f"MIL-NCE dev R@10 ({profile} profile)")

# %% [markdown]
# **What the committed `cpu` run says** (ten pre-registered seeds, three arms, judged under protocol v2; the full
# table in `docs/results.md`, from `results/07_milnce_howto100m.cpu.json`; 31 min on 2 cores). Training lifts
# test R@10 from 0.014 (an untrained model, at chance by design) to 0.160 in the random arm, 0.151 in GCBS's
# and 0.161 in `gcbs-k20`'s. But the stand-in's clip features are all-MiniLM-L6-v2 embeddings of the code
# shown, and ranking clips by their cosine with the same frozen encoder's caption embeddings, with no training
# at all, reaches R@10 0.628 (median rank 5): random − this baseline is −0.468 [−0.516, −0.424], so every
# verdict reads *not measurable here*: on this stand-in, training the heads does not beat the features they
# start from. Nor does the graph decide anything (the pre-registered reading, false): GCBS's Δ at the published
# q is −0.009 [−0.030, +0.013] on best-dev checkpoints and at k = 20 +0.001 [−0.020, +0.023] (test clips
# resampled by their 182 videos), both unresolved, with the same call.
#
# What the regime changes is the batches. At the published q the graph holds 13 to 29 edges an item in the
# first five epochs, while the untrained embeddings are alike, then about one from the ninth epoch and 0.27 at
# the last, with half to 71 % of the clips isolated; at k = 20 it holds 19 to 38 edges an item and isolates at
# most 0.5 % of the clips. The loss gap
# of the planned batches falls faster the more edges there are: at the last epoch 1.02 nats for random, 0.82
# at the published q and 0.72 at k = 20 (all 2.08 to 2.09 at epoch 0). No batch of any arm pairs two clips of
# one video: each epoch draws one clip per video, the video id the group key.

# %% [markdown]
# ## Result rows

# %%
result_rows = record_runs(summaries, "07_milnce_howto100m")
print(len(result_rows), "result rows")

# %% [markdown]
# ## Checks

# %%
gcbs_gap_smaller = first_gap_no_larger(summaries)
assert one_each, "an epoch draws one clip of each video"
assert {row["arm"] for row in result_rows} >= {"start", *arms}

# %%
# NBVAL_CHECK_OUTPUT
print(
    f"profile {profile}: arms {list(arms)}, seeds {seeds}, {len(result_rows)} result rows on {result_rows[0]['data']}"
)
print(f"an epoch draws one clip of each video: {one_each}")
# measured, not asserted: at the ci profile's size a smoke test, not a claim about GCBS
print(f"GCBS epoch-0 loss gap <= random's on every seed: {gcbs_gap_smaller}")
