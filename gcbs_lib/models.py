"""Tiny teaching encoders: small enough to run on a laptop CPU in float64, shaped like the real ones.

`TinyTextEncoder` is a pre-LayerNorm transformer over token ids with attention written out in plain tensor
ops (no fused kernels or inference fast paths, so a no-grad pass and a replay with grad run the same
arithmetic). It returns one pooled, L2-normalised vector per text, or the token vectors and their mask for
ColBERT-style late interaction.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

PAD_ID = 0


class SelfAttentionBlock(nn.Module):
    """x + Attention(LN(x)), then x + MLP(LN(x)); dropout on attention weights and on both residual branches."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, head_dim]
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(dim // self.heads)
        weights = logits.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(dim=-1)
        attended = (self.drop(weights) @ v).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.drop(self.out(attended))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyTextEncoder(nn.Module):
    """Token ids → embeddings. Input: ids `[B, L]` (0 = padding) or a tokenizer-style dict with `input_ids`
    and optionally `attention_mask` (other entries are ignored).

    Output: `[B, dim]` mean-pooled over real tokens (L2-normalised when `normalize`), or with
    `multi_vector=True` the pair `(token vectors [B, L, dim], mask [B, L])`.
    """

    def __init__(self, vocab_size: int = 1000, dim: int = 32, heads: int = 4, layers: int = 2,
                 max_length: int = 64, dropout: float = 0.1, normalize: bool = True, multi_vector: bool = False):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_length, dim)
        self.blocks = nn.ModuleList(SelfAttentionBlock(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.normalize, self.multi_vector = normalize, multi_vector

    def forward(self, batch: torch.Tensor | Mapping[str, torch.Tensor]):
        ids, mask = _ids_and_mask(batch)
        if ids.shape[1] > self.positions.num_embeddings:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_length {self.positions.num_embeddings}")
        x = self.drop(self.tokens(ids) + self.positions.weight[: ids.shape[1]])
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        if self.multi_vector:
            return (F.normalize(x, dim=-1) if self.normalize else x), mask
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled


def _ids_and_mask(batch: torch.Tensor | Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a batch into ids and a boolean mask of real tokens; every text needs at least one token."""
    if isinstance(batch, Mapping):
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = ids != PAD_ID if mask is None else mask.bool()
    else:
        ids, mask = batch, batch != PAD_ID
    if ids.dim() != 2:
        raise ValueError(f"expected token ids [batch, length], got shape {tuple(ids.shape)}")
    if not mask.any(dim=1).all():
        raise ValueError("a text in the batch has no real token (all padding)")
    return ids, mask


def random_token_batch(n: int, length: int, vocab_size: int = 1000, generator: torch.Generator | None = None,
                       min_length: int = 1) -> dict[str, torch.Tensor]:
    """A tokenizer-style batch of random texts with random lengths in [min_length, length], right-padded."""
    ids = torch.randint(1, vocab_size, (n, length), generator=generator)
    lengths = torch.randint(min_length, length + 1, (n,), generator=generator)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return {"input_ids": ids.masked_fill(~mask, PAD_ID), "attention_mask": mask.long()}
