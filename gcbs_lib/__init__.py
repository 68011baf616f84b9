"""gcbs_lib: the one shared package behind the gcbs-kit notebooks.

Modules, one idea each:
  losses       InfoNCE/CLIP (hard negatives, symmetric, learnable LogitScale), ColBERT late interaction,
               MIL-NCE (v2t and both forms, streamed denominator), the PromCSE energy hinge
  gradcache    RandContext and cached_loss, the exact 3-step GradCache
  distributed  gather_with_grad, gradient all-reduce, virtual ranks, torchrun launcher
  ddp_experiments  one DDP contrastive step under six gradient-scaling conventions (torchrun targets)
  gcbs         global contrastive batch sampling (similarity graph, RCM order, sampler, diagnostics)
  models       tiny teaching encoders and the Hugging Face encoder adapter (pooling, normalisation)
  prefix       PromCSE deep prefix prompts on a frozen encoder
  mining       hard negatives mined with the current model
  train        the one training loop every experiment trains through (python -m gcbs_lib.train)
  experiments  what train trains: codesearch, simcse, promcse, milnce, moco
  arms         random vs GCBS (and other) arms on the same seeds, paired Δ
  data         real-format readers and offline stand-ins: codesearch, sts, howto100m, images
  metrics      ranks (ties pessimistic), MRR, R@K, median rank, Spearman, weighted kNN accuracy
  seeding      independent random streams named by (seed, epoch, purpose)
  results      result rows and the paper-vs-kit table
  reproduce    the papermill runner behind `make reproduce`
  measure      peak memory and step time, on CPU and CUDA
  check        cmp-style comparison tables for visible verification
"""
__version__ = "0.1.0"
