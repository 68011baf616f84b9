"""PromCSE's deep prefix prompts: trainable keys and values in front of every attention layer of a frozen encoder.

P-tuning v2 (Liu et al., 2022), as PromCSE (Jiang et al., 2022) trains it: each layer l of a transformer gets
`pre_seq_len` = P extra key and value vectors per head, P_l^K and P_l^V, learned while the backbone stays frozen.
Every token of layer l then attends over the prefix and the sentence together,

    Attn_l(q) = softmax( q [P_l^K; K_l]ᵀ / √d + [0; padding mask] ) [P_l^V; V_l],

so the prefix acts as P always-visible tokens whose keys and values are free parameters at every depth. As in
PromCSE, dropout (the backbone's `hidden_dropout_prob` by default) is applied to the prefix keys and values,
with its own mask for each example of the batch.

In transformers 5 a BERT-style encoder takes the prefixes as `past_key_values`: a fresh `DynamicCache` filled
with them (each layer's cache puts the prefix in front of that layer's own keys and values) plus a 2-D
attention mask P columns longer, the route `transformers.masking_utils` keeps for prefix tuning. As in
PromCSE (and the old `BertModel` it ran on), the model counts the prefix as past tokens, so the sentence's
position ids start at P.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache


class DeepPrefix(nn.Module):
    """The trainable prompt: for each of `layers` layers, `pre_seq_len` key and value vectors per head.

    `forward(batch_size)` returns one `(keys, values)` pair per layer, each `[batch, heads, pre_seq_len,
    head_dim]`, with dropout drawn independently for every example. Initialised N(0, 1), as P-tuning v2's
    prefix embedding is.
    """

    def __init__(self, layers: int, heads: int, head_dim: int, pre_seq_len: int = 16, dropout: float = 0.1):
        super().__init__()
        for name, value in (("layers", layers), ("heads", heads), ("head_dim", head_dim),
                            ("pre_seq_len", pre_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"prefix dropout must lie in [0, 1), got {dropout}")
        self.prompt = nn.Parameter(torch.randn(layers, 2, heads, pre_seq_len, head_dim))
        self.dropout = nn.Dropout(dropout)

    @property
    def pre_seq_len(self) -> int:
        return self.prompt.shape[3]

    def forward(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        prompt = self.dropout(self.prompt.unsqueeze(2).expand(-1, -1, batch_size, -1, -1, -1))
        return [(layer[0], layer[1]) for layer in prompt]


class PrefixPromptedEncoder(nn.Module):
    """A Hugging Face encoder, frozen, with deep prefix prompts: a drop-in replacement for the backbone.

    `forward(input_ids, attention_mask, **kwargs)` returns what the backbone returns for the same inputs, now
    attending to the prefix at every layer. Only `prefix` has trainable parameters; the backbone keeps its
    train/eval mode, so its dropout still draws SimCSE's two views of a sentence.
    """

    def __init__(self, backbone: nn.Module, pre_seq_len: int = 16, dropout: float | None = None):
        super().__init__()
        config = backbone.config
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"hidden size {config.hidden_size} is not divisible by "
                             f"{config.num_attention_heads} attention heads")
        self.backbone = backbone.requires_grad_(False)
        self.prefix = DeepPrefix(config.num_hidden_layers, config.num_attention_heads,
                                 config.hidden_size // config.num_attention_heads, pre_seq_len,
                                 config.hidden_dropout_prob if dropout is None else dropout)
        reference = next(backbone.parameters())
        self.prefix.to(reference.device, reference.dtype)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **kwargs):
        if "past_key_values" in kwargs:
            raise ValueError("PrefixPromptedEncoder supplies past_key_values itself (the prefix)")
        tokens = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if tokens is None or tokens.dim() < 2:
            raise ValueError("expected input_ids [batch, length] (or inputs_embeds [batch, length, hidden])")
        batch, length = tokens.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.long, device=tokens.device)
        if attention_mask.shape != (batch, length):
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match the tokens {(batch, length)}")
        prefix_mask = torch.ones(batch, self.prefix.pre_seq_len, dtype=attention_mask.dtype, device=tokens.device)
        cache = DynamicCache(self.prefix(batch))  # a fresh cache per call: each layer's cache grows in place
        return self.backbone(input_ids=input_ids, attention_mask=torch.cat([prefix_mask, attention_mask], dim=1),
                             past_key_values=cache, **kwargs)
