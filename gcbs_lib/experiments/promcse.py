"""PromCSE (Jiang, Zhang and Wang, 2022) as the GCBS paper trains it: SimCSE's unsupervised recipe
on a frozen encoder where only deep prefix prompts (`gcbs_lib.prefix`) and SimCSE's MLP learn; lr
3e-2, batch 256 (on a CPU, through GradCache: `chunk_size`)."""

from dataclasses import dataclass

from torch import nn

from gcbs_lib.experiments.simcse import SimCSE
from gcbs_lib.prefix import PrefixPromptedEncoder


class PromCSE(SimCSE):
    """SimCSE with a frozen encoder: the deep prompt and the MLP learn."""

    @dataclass
    class Options(SimCSE.Options):
        pre_seq_len: int = 16  # prefix length per layer (PromCSE's default for BERT-base)

    def build_model(self) -> nn.Module:
        """SimCSE's encoder, its backbone behind the prompt (dropped out as the backbone's hidden
        states, as PromCSE)."""
        encoder = super().build_model()
        encoder.backbone = PrefixPromptedEncoder(encoder.backbone, self.options.pre_seq_len)
        return encoder
