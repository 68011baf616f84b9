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
# # 05 · GCBS on SimCSE sentence embeddings
#
# SimCSE (Gao, Yao and Chen, *SimCSE: Simple Contrastive Learning of Sentence Embeddings*, EMNLP 2021) learns
# sentence embeddings from unlabelled text with one trick:
#
# > "we simply feed the same input to the encoder twice and get two embeddings with different dropout masks"
#
# and treats the two as a positive pair, every other sentence of the batch as a negative. The GCBS paper
# (Sachidananda, Yang and Zhu, ICML 2023, notebook 03) reorders the training sentences at each epoch start so
# that similar sentences share a batch, and reports **+1.03 points** of average STS Spearman (×100) for
# unsupervised SimCSE with BERT-base.
#
# This notebook runs SimCSE's recipe through the kit's one training loop (`gcbs_lib.train`, experiment
# `simcse`) with random and GCBS batches, in the same run, on the same seeds, and compares them.
#
# **Data.** The `paper` profile trains BERT-base on `wiki1m_for_simcse.txt` and evaluates on SentEval (STS12–16,
# STS-B, SICK-R). The `ci` and `cpu` profiles run offline on a stand-in that is **NOT STS**: sentences of the
# Wikipedia extract in the `gensim` wheel's test data to train, and Spearman against human judgements of the
# Lee corpus (news documents, split by document into dev and test halves), WordSim353 and SimLex-999 (word
# pairs) to evaluate. The `ci` profile (the defaults) trains a tiny randomly initialised BERT for seconds: its
# numbers only show that everything runs. The `cpu` profile fine-tunes the pretrained all-MiniLM-L6-v2.

# %% tags=["parameters"]
device = "cpu"
seed = 0                            # seed of the demonstration cells; the comparison runs `seeds`
profile = "ci"                      # profile of gcbs_lib/configs/simcse.yaml behind every run
seeds = [0, 1]
arms = ["random", "gcbs"]           # samplers compared; "random" is the baseline
output_dir = "../runs/05_gcbs_simcse"   # one folder per run; a finished run is loaded, not retrained

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from gcbs_lib.arms import arms_table, first_gap_no_larger, plot_over_seeds, rows_of, run_arms
from gcbs_lib.check import cmp_table, compare
from gcbs_lib.experiments import get, to_device
from gcbs_lib.results import record
from gcbs_lib.train import load_config

PAPER_DELTA = 0.0103                # +1.03 STS points, unsupervised SimCSE on BERT-base (GCBS paper, Table 2)
config = load_config("simcse", profile, {"device": device, "seed": seed})
torch.manual_seed(seed)
print(f"profile={profile}  device={device}  arms={arms}  seeds={seeds}  torch={torch.__version__}")

# %% [markdown]
# ## 1 · The recipe
#
# For a batch of $B$ sentences with embeddings $h_i$ and $h_i^+$ from two passes (two dropout masks), SimCSE
# minimises the cross-entropy of each sentence's second view among all second views, one direction:
#
# $$\ell_i = -\log \frac{e^{\cos(h_i, h_i^+)/\tau}}{\sum_{j=1}^{B} e^{\cos(h_i, h_j^+)/\tau}}, \qquad \tau = 0.05.$$
#
# With L2-normalised embeddings this is the kit's `info_nce` at scale $1/\tau = 20$. The embedding is the
# [CLS] state passed through an MLP (dense + tanh) during training only; evaluation takes the raw [CLS] state
# (`--pooler_type cls --mlp_only_train`). SimCSE evaluates STS-B dev every 125 steps and keeps the best model.

# %%
o = config.options
recipe = {"encoder": o.encoder, "pooling": o.pooling, "τ": 1 / config.scale, "max length": o.max_length,
          "batch": config.batch_size, "lr": config.lr, "schedule": config.schedule, "epochs": config.epochs,
          "training sentences": o.train_limit or "all", "dev eval every": config.eval_every or "epoch",
          "data": o.data}
for key, value in recipe.items():
    print(f"{key:>20}  {value}")

# %% [markdown]
# ## 2 · Dropout makes the positive pair
#
# The same token ids go through the encoder twice. In training mode the two dropout masks differ, so the two
# embeddings differ; in evaluation mode there is no dropout and no MLP, so both passes give the same raw [CLS]
# vector. With the pretrained MiniLM (`cpu` profile) the two views of a sentence are far closer than two
# different sentences; the `ci` profile's tiny random BERT cannot tell sentences apart yet, so there the two
# averages below are about equal: that is what training has to change.

# %%
experiment = get("simcse")(config.options, seed=seed, device=device)
experiment.load_data()
model = experiment.build_model().to(device)
batch = to_device(experiment.collate(list(range(8))).inputs, device)
with torch.no_grad():
    model.train()
    z1, z2 = model(batch[0]), model(batch[1])
    model.eval()
    e1, e2 = model(batch[0]), model(batch[1])
cosines = z1 @ z2.T
same, other = cosines.diagonal().mean().item(), cosines[~torch.eye(8, dtype=torch.bool)].mean().item()
print(f"cos(h_i, h_i+) two dropout masks: {same:.4f}   cos(h_i, h_j+) other sentences: {other:.4f}")
print(cmp_table([compare("eval: pass 1 vs pass 2", e1, e2),
                 compare("eval = normalised raw [CLS]", e1,
                         F.normalize(model.backbone(**batch[0]).last_hidden_state[:, 0], dim=-1))]))

# %% [markdown]
# ## 3 · Random vs GCBS batches
#
# At each epoch start the GCBS arm embeds every training sentence with the current model (evaluation mode, so
# both "views" are the same vector $z$), keeps the most similar pairs of sentences as a graph, orders the
# sentences by reverse Cuthill–McKee and cuts the order into batches (notebook 03). The training loop logs, for
# the batches each arm is about to train on, the **loss gap** $\mathcal{L}^{Global} - \mathcal{L}^{Train}$: how
# much easier the in-batch loss is than the loss against the whole training set. Both arms start from the same
# model for a given seed and differ only in the batches. A run whose folder already holds a finished checkpoint
# is loaded instead of retrained (the same arguments resume, `gcbs_lib.train`).

# %%
summaries = run_arms("simcse", profile, arms, seeds, Path(output_dir) / profile, {"device": device})

# %% [markdown]
# ## 4 · Scores: mean ± sd over seeds, and Δ against the paper
#
# Spearman's ρ as a fraction (the papers print ×100: the paper's +1.03 is +0.0103 here). Δ is the mean over
# seeds of (GCBS − random) on the same seed, ± the sd of those paired differences.

# %%
deltas = arms_table(summaries, "test_spearman", PAPER_DELTA, "STS avg, unsupervised SimCSE, BERT-base",
                    stand_in="NOT STS")

# %% [markdown]
# ## 5 · Dev Spearman during training
#
# The dev curve of each arm, mean over seeds (dev: the Lee pairs of the dev half of the documents on the
# stand-in, STS-B dev on paper data). The best dev step of each run is the model scored on test above.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
plot_over_seeds(ax, summaries, arms, "dev", "spearman")
ax.set(ylabel="dev Spearman ρ", title=f"SimCSE dev Spearman ({profile} profile)")
plt.show()

# %% [markdown]
# ## 6 · The loss gap per epoch
#
# $\mathcal{L}^{Global} - \mathcal{L}^{Train}$ of the batches each arm trained on, measured at each epoch start
# (temperature τ), mean over seeds. GCBS exists to make it smaller: its batches hold each other's hard negatives.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for arm, gaps in plot_over_seeds(ax, summaries, arms, "epochs", "loss_gap").items():
    print(f"{arm:>7} loss gap per epoch: " + "  ".join(f"{g:.4f}" for g in gaps))
ax.set(ylabel="loss gap (nats)", title="L_Global − L_Train of the planned batches")
plt.show()

# %% [markdown]
# ## 7 · Result rows
#
# Every run's rows (`gcbs_lib.results`): the test Spearman of its best dev model per task and averaged, and the
# best dev score. Run by `python -m gcbs_lib.reproduce`, they land in the run's results folder and its table;
# the committed `cpu` rows are in `results/05_gcbs_simcse.cpu.json`.

# %%
rows = rows_of(summaries)
data_name = rows[0]["data"]
record(rows, "05_gcbs_simcse")
print(f"{len(rows)} rows, metrics: {sorted({r['metric'] for r in rows})}")

# %%
steps = {summary["steps"] for summary in summaries.values()}
gcbs_gap_smaller = first_gap_no_larger(summaries)
assert len(steps) == 1 and {(r["arm"], r["seed"]) for r in rows} == set(summaries) == {(a, s) for a in arms for s in seeds}
assert all(torch.isfinite(torch.tensor(r["value"])) for r in rows)
assert torch.equal(e1, e2) and not torch.equal(z1, z2)
assert gcbs_gap_smaller

# %%
# NBVAL_CHECK_OUTPUT
print(f"profile {profile}: arms {arms}, seeds {seeds}, {len(rows)} result rows on {data_name}")
print(f"every run trained the same number of steps: {len(steps) == 1} ({steps.pop()})")
print(f"eval passes equal, training views differ: {torch.equal(e1, e2) and not torch.equal(z1, z2)}")
print(f"GCBS epoch-0 loss gap <= random's on every seed: {gcbs_gap_smaller}")
