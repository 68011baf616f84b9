"""PromCSE's deep prefix prompts (P-tuning v2): at every layer l of a frozen encoder, P =
`pre_seq_len` trainable keys and values per head go before the sentence's, Attn_l(q) = softmax(q
[P_l^K; K_l]ᵀ/√d + [0; mask]) [P_l^V; V_l]. As in PromCSE, dropout hits the prompt per example, and
the prompt enters BERT as `past_key_values` (a fresh `DynamicCache`: positions start at P)."""

import torch
from torch import nn
from transformers import DynamicCache

from gcbs_lib.check import require


class PrefixPromptedEncoder(nn.Module):
    """A frozen Hugging Face encoder behind a deep prompt, a drop-in backbone. Only `prompt` trains:
    `[layers, 2 (key, value), heads, pre_seq_len, head_dim]`, drawn N(0, initializer_range) as in
    PromCSE. The backbone keeps its train/eval mode: its dropout draws SimCSE's two views."""

    def __init__(self, backbone: nn.Module, pre_seq_len: int = 16, dropout: float | None = None):
        super().__init__()
        self.backbone = backbone.requires_grad_(False)
        self.config = backbone.config
        c = self.config
        dropout = c.hidden_dropout_prob if dropout is None else dropout
        require(pre_seq_len >= 1, f"need pre_seq_len >= 1, got {pre_seq_len}")
        require(0 <= dropout < 1, f"need a prefix dropout in [0, 1), got {dropout}")
        head_dim = c.hidden_size // c.num_attention_heads
        shape = (c.num_hidden_layers, 2, c.num_attention_heads, pre_seq_len, head_dim)
        prompt = torch.randn(shape) * getattr(c, "initializer_range", 0.02)
        self.prompt = nn.Parameter(prompt.to(next(backbone.parameters())))
        self.dropout = nn.Dropout(dropout)

    def prefix(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values [batch, heads, pre_seq_len, head_dim], dropped per example."""
        prompt = self.dropout(self.prompt.unsqueeze(2).expand(-1, -1, batch_size, -1, -1, -1))
        return [(layer[0], layer[1]) for layer in prompt]

    def forward(self, input_ids: torch.Tensor, attention_mask=None, **kwargs):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        got = f"{tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
        require(mask.shape == input_ids.shape, f"attention_mask {got}")
        mask = torch.cat([mask.new_ones(len(mask), self.prompt.shape[3]), mask], dim=1)
        prompt = DynamicCache(self.prefix(len(input_ids)))
        return self.backbone(input_ids, attention_mask=mask, past_key_values=prompt, **kwargs)
