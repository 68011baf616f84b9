"""Visible verification: compare tensors the way nn-zero-to-hero's `cmp` does, as table rows.

`compare(name, ours, reference)` measures one pair; `cmp_table(rows)` prints many as a table:

    name            exact  ‖Δ‖/‖ref‖  tolerance  within
    encoder.weight  False    3.1e-16      1e-12  True

"exact" is bitwise equality; ‖Δ‖/‖ref‖ is the norm-wise relative error of the whole tensor (not the
element-wise test of `torch.allclose`); "within" says whether it is at most the tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Norm-wise relative tolerances: a few thousand float64 roundoffs; ~100 float32 roundoffs (sums over a few
# thousand terms in a different order); about one unit roundoff of the 8-bit (bfloat16) and 11-bit (float16)
# significands, which two computations that round differently reach but a computation in another precision
# or with a different autocast policy exceeds.
TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}


@dataclass(frozen=True)
class Comparison:
    """One measured pair: bitwise equal, the norm-wise relative error, the tolerance, and whether it holds."""

    name: str
    exact: bool
    rel_err: float
    tolerance: float

    @property
    def within_tolerance(self) -> bool:
        return self.rel_err <= self.tolerance


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """‖ours − reference‖ / ‖reference‖ (Frobenius norms) in float64; 0 when both are zero."""
    ours, reference = ours.detach().double(), reference.detach().double()
    if ours.shape != reference.shape:
        raise ValueError(f"shape mismatch: {tuple(ours.shape)} vs reference {tuple(reference.shape)}")
    scale = reference.norm()
    diff = (ours - reference).norm()
    return 0.0 if diff == 0 else float(diff / scale) if scale > 0 else float("inf")


def tolerance(dtype: torch.dtype) -> float:
    """The norm-wise relative tolerance the kit promises for results computed in `dtype` (see TOLERANCES)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for {dtype}: compare floating-point results ({list(TOLERANCES)})")
    return TOLERANCES[dtype]


def compare(name: str, ours: torch.Tensor, reference: torch.Tensor, rtol: float | None = None) -> Comparison:
    """Compare two tensors: bitwise equality and the norm-wise relative error against `rtol` (default: the
    tolerance of the reference's dtype)."""
    rtol = tolerance(reference.dtype) if rtol is None else rtol
    return Comparison(name, bool(torch.equal(ours, reference)), relative_error(ours, reference), rtol)


def cmp_table(rows: list[Comparison]) -> str:
    """Format comparisons as a fixed-width table (one line per row) and return it."""
    width = max([len("name")] + [len(r.name) for r in rows])
    lines = [f"{'name':<{width}}  exact  ‖Δ‖/‖ref‖  tolerance  within"]
    lines += [f"{r.name:<{width}}  {r.exact!s:<5}  {r.rel_err:>9.1e}  {r.tolerance:>9.0e}  {r.within_tolerance}"
              for r in rows]
    return "\n".join(lines)
