"""gcbs_lib: the one shared package behind the gcbs-kit notebooks.

Modules, one idea each:
  losses       InfoNCE/CLIP (hard negatives, symmetric, learnable LogitScale), ColBERT late interaction
  gradcache    RandContext and cached_loss, the exact 3-step GradCache
  distributed  gather_with_grad, gradient all-reduce, virtual ranks, torchrun launcher
  ddp_experiments  one DDP contrastive step under six gradient-scaling conventions (torchrun targets)
  gcbs         global contrastive batch sampling (similarity graph, RCM order, sampler, diagnostics)
  models       tiny teaching encoders
  measure      peak memory and step time, on CPU and CUDA
  check        cmp-style comparison tables for visible verification
"""
__version__ = "0.1.0"
