"""gcbs_lib: the one shared package behind the gcbs-kit notebooks, one idea per module: losses,
gradcache, distributed (gather_with_grad, all-reduce, virtual ranks, launcher), ddp_scaling
(notebook 02's conventions), gcbs (the batch order), mining (hard negatives), models, prefix
(PromCSE prompts), train (the one loop), experiments (what it trains), comparison (arms on the same
seeds), data (readers, stand-ins), metrics, seeding (named random streams), results (rows, the
paper-vs-kit table), reproduce (the papermill runner), measure (step memory), check (cmp tables)."""

__version__ = "0.1.0"
