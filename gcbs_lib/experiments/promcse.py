"""PromCSE (Jiang, Zhang and Wang, 2022) as the GCBS paper trains it (Table 2): SimCSE with a frozen backbone.

Only deep prefix prompts (`gcbs_lib.prefix`: `pre_seq_len` trainable keys and values per layer and head, with
dropout, in front of every attention layer) and SimCSE's training-time MLP learn; the pretrained encoder stays
frozen. Everything else is SimCSE's recipe (`gcbs_lib.experiments.simcse`): the unsupervised dropout pairs,
cos/τ with τ = 0.05, cls pooling with the MLP at training time only. PromCSE's example script trains with lr
3e-2 and batch 256; on a CPU that batch is GradCache's natural case (`chunk_size`).

The supervised form (`supervised=True`, NLI triples) may add PromCSE's energy-based hinge term
(`energy_hinge=True`, `gcbs_lib.losses.energy_hinge`): λ · mean max(0, m − cos(h, h⁺) + max cos(h, h⁻)) on
raw cosines, m = 0.2 and λ = 10 as in its example script.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gcbs_lib.distributed import gather_with_grad, rank_and_world_size, rank_info_nce
from gcbs_lib.experiments import Batch, register
from gcbs_lib.experiments.simcse import SimCSE
from gcbs_lib.losses import energy_hinge
from gcbs_lib.prefix import PrefixPromptedEncoder


@register("promcse")
class PromCSE(SimCSE):
    """SimCSE with a frozen encoder: deep prefix prompts and the MLP learn (see the module docstring)."""

    @dataclass
    class Options(SimCSE.Options):
        pre_seq_len: int = 16             # prefix length per layer (PromCSE's default for BERT-base)
        prefix_dropout: float | None = None   # None: the backbone's hidden dropout, as PromCSE
        energy_hinge: bool = False        # PromCSE's --do_eh_loss
        hinge_margin: float = 0.2         # --eh_loss_margin
        hinge_weight: float = 10.0        # --eh_loss_weight

    def build_model(self) -> nn.Module:
        encoder = super().build_model()
        encoder.backbone = PrefixPromptedEncoder(encoder.backbone, self.options.pre_seq_len, self.options.prefix_dropout)
        return encoder

    def loss(self, embeddings: Sequence, batch: Batch, scale) -> torch.Tensor:
        anchors, docs = (gather_with_grad(z) for z in embeddings)
        loss = rank_info_nce(anchors, docs, scale)
        if self.options.energy_hinge:
            rank, world_size = rank_and_world_size()
            own = len(anchors) // world_size
            hinge = energy_hinge(anchors, docs, self.options.hinge_margin, self.options.hinge_weight, reduction="none")
            loss = loss + hinge[rank * own:(rank + 1) * own].mean()
        return loss
