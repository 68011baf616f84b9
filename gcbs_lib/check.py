"""Visible verification: compare tensors the way nn-zero-to-hero's `cmp` does, as table rows.

`compare(name, ours, reference)` measures one pair; `cmp_table(rows)` prints many as a table:

    name            exact  allclose  rel err
    encoder.weight  False  True      3.1e-16
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Comparison:
    """One measured pair: bitwise equal, close at the dtype's tolerance, and the relative error."""

    name: str
    exact: bool
    allclose: bool
    rel_err: float


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """‖ours − reference‖ / ‖reference‖ in float64 (0 when both are zero)."""
    ours, reference = ours.detach().double(), reference.detach().double()
    if ours.shape != reference.shape:
        raise ValueError(f"shape mismatch: {tuple(ours.shape)} vs reference {tuple(reference.shape)}")
    scale = reference.norm()
    diff = (ours - reference).norm()
    return 0.0 if diff == 0 else float(diff / scale) if scale > 0 else float("inf")


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance the kit promises for a dtype: 1e-12 in float64, 1e-5 otherwise."""
    return 1e-12 if dtype == torch.float64 else 1e-5


def compare(name: str, ours: torch.Tensor, reference: torch.Tensor, rtol: float | None = None) -> Comparison:
    """Compare two tensors: exact (bitwise), allclose (relative error ≤ rtol), and the relative error ‖Δ‖/‖ref‖."""
    rtol = tolerance(reference.dtype) if rtol is None else rtol
    rel = relative_error(ours, reference)
    return Comparison(name, bool(torch.equal(ours, reference)), rel <= rtol, rel)


def cmp_table(rows: list[Comparison]) -> str:
    """Format comparisons as a fixed-width table (one line per row) and return it."""
    width = max([len("name")] + [len(r.name) for r in rows])
    lines = [f"{'name':<{width}}  exact  allclose  rel err"]
    lines += [f"{r.name:<{width}}  {r.exact!s:<5}  {r.allclose!s:<8}  {r.rel_err:.1e}" for r in rows]
    return "\n".join(lines)
