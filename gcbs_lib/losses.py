"""Contrastive losses: InfoNCE/CLIP with hard negatives, a learnable logit scale, ColBERT late interaction.

All losses score every query against every document of the batch, so in-batch documents act as negatives:

    L = −(1/B) Σ_i log( exp(s·S[i, p(i)]) / Σ_j exp(s·S[i, j]) )

with S the score matrix, s the logit scale (1/temperature) and p(i) the column of query i's positive.
With k hard negatives per query the documents come interleaved `[pos_0, neg_0_1, …, neg_0_k, pos_1, …]`,
so p(i) = i·(k+1).
"""
from __future__ import annotations

import math
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn


class LogitScale(nn.Module):
    """A learnable logit scale kept in log space, as CLIP does: scale = exp(log_scale).

    Starts at 1/0.07. The forward applies no clamp, so its gradient is exact; call `clamp_()` after each
    optimizer step to keep the scale within [1, max_scale].
    """

    def __init__(self, init_scale: float = 1 / 0.07, max_scale: float = 100.0):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.max_log_scale = math.log(max_scale)

    def forward(self) -> torch.Tensor:
        return self.log_scale.exp()

    @torch.no_grad()
    def clamp_(self) -> None:
        """Clamp log_scale to [0, ln max_scale] in place (call after `optimizer.step()`)."""
        self.log_scale.clamp_(0.0, self.max_log_scale)


Scale = Union[float, torch.Tensor, Callable[[], torch.Tensor]]


def docs_per_query(n_queries: int, n_docs: int) -> int:
    """How many documents each query owns (1 + hard negatives); a clear error when the counts do not divide."""
    if n_queries == 0 or n_docs == 0:
        raise ValueError(f"empty batch: {n_queries} queries and {n_docs} documents")
    if n_docs % n_queries:
        raise ValueError(
            f"{n_docs} documents for {n_queries} queries: documents must come as [positive, hard negatives...] "
            f"per query, so their count must be a multiple of the query count"
        )
    return n_docs // n_queries


def contrastive_loss(scores: torch.Tensor, scale: Scale = 20.0, symmetric: bool = False) -> torch.Tensor:
    """Cross-entropy of each query row over all documents, positives at columns i·(docs per query).

    `symmetric=True` averages with the document→query direction over the positive documents (CLIP).
    `scale` is a number, a tensor, or a callable such as `LogitScale` returning one.
    """
    n_queries, n_docs = scores.shape
    group = docs_per_query(n_queries, n_docs)
    logits = scores * (scale() if callable(scale) else scale)
    targets = torch.arange(n_queries, device=scores.device)
    loss = F.cross_entropy(logits, targets * group)
    if symmetric:
        loss = (loss + F.cross_entropy(logits[:, ::group].T, targets)) / 2
    return loss


def _check_dims(query: torch.Tensor, docs: torch.Tensor) -> None:
    if query.shape[-1] != docs.shape[-1]:
        raise ValueError(f"embedding sizes differ: queries {tuple(query.shape)}, documents {tuple(docs.shape)}")


def info_nce(query: torch.Tensor, docs: torch.Tensor, scale: Scale = 20.0, symmetric: bool = False) -> torch.Tensor:
    """InfoNCE over dot-product scores: `query [B, D]`, `docs [B·(1+k), D]` (k hard negatives per query)."""
    if query.dim() != 2 or docs.dim() != 2:
        raise ValueError(f"expected 2-d embeddings, got queries {tuple(query.shape)}, documents {tuple(docs.shape)}")
    _check_dims(query, docs)
    return contrastive_loss(query @ docs.T, scale, symmetric)


def late_interaction_scores(query: tuple[torch.Tensor, torch.Tensor], docs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """ColBERT MaxSim: S[q, d] = Σ_{i real token of q} max_{j real token of d} <q_i, d_j>.

    `query = (vectors [Bq, Lq, D], mask [Bq, Lq])`, `docs = (vectors [Bd, Ld, D], mask [Bd, Ld])`; masks are
    True on real tokens. Returns `[Bq, Bd]`.
    """
    (q, q_mask), (d, d_mask) = query, docs
    _check_dims(q, d)
    if q.shape[:2] != q_mask.shape or d.shape[:2] != d_mask.shape:
        raise ValueError(f"masks {tuple(q_mask.shape)}, {tuple(d_mask.shape)} do not match vectors "
                         f"{tuple(q.shape)}, {tuple(d.shape)}")
    if not d_mask.any(dim=1).all():
        raise ValueError("a document has no real token: its MaxSim is undefined")
    q_mask, d_mask = q_mask.bool(), d_mask.bool()
    token_scores = torch.einsum("aid,bjd->abij", q, d)
    token_scores = token_scores.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    best = token_scores.amax(dim=-1).masked_fill(~q_mask[:, None, :], 0.0)
    return best.sum(dim=-1)


def late_interaction_loss(query: tuple[torch.Tensor, torch.Tensor], docs: tuple[torch.Tensor, torch.Tensor],
                          scale: Scale = 1.0, symmetric: bool = False) -> torch.Tensor:
    """InfoNCE over ColBERT MaxSim scores (multi-vector queries and documents with masks)."""
    return contrastive_loss(late_interaction_scores(query, docs), scale, symmetric)
