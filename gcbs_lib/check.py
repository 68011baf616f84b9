"""Visible verification, as nn-zero-to-hero's `cmp`: `compare(name, ours, reference)` gives bitwise
equality and ‖Δ‖/‖ref‖ (norm-wise over the whole tensor, not `torch.allclose`'s element-wise test)
against a tolerance; `cmp_table(rows)` formats many. Input checks: `require`, `as_type`."""

import contextlib
from collections import namedtuple
from typing import Any, Literal, get_args, get_origin

import torch

# Norm-wise relative tolerances: ~1000s of float64 roundoffs, ~100 of float32, ~1 of 16-bit ones.
TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}
Comparison = namedtuple("Comparison", "name exact rel_err tolerance within_tolerance")  # a row


def require(condition, message: str) -> None:
    """Raise ValueError(message) unless `condition`: how public functions refuse bad input."""
    if not condition:
        raise ValueError(message)


def as_type(value, kind, error: str):
    """`value` if it is of type `kind` (a class, a Literal, a union of these, or Any), where a float
    also takes an int or a number's text (YAML reads 3e-5 as text); else ValueError(error)."""
    for choice in (get_args(kind) if get_origin(kind) is not Literal else ()) or (kind,):
        named = get_origin(choice) is Literal and value in get_args(choice)
        if choice is Any or named or type(value) is choice:
            return value
        if choice is float and type(value) in (int, str):
            with contextlib.suppress(ValueError):
                return float(value)
    raise ValueError(error)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """‖ours − reference‖ / ‖reference‖ (Frobenius, float64); 0 if both are 0, inf if only ours."""
    shapes = f"{tuple(ours.shape)} vs reference {tuple(reference.shape)}"
    require(ours.shape == reference.shape, f"shape mismatch: {shapes}")
    diff = (ours.detach().double() - reference.detach().double()).norm()
    return 0.0 if diff == 0 else float(diff / reference.detach().double().norm())


def tolerance(dtype: torch.dtype) -> float:
    """The norm-wise relative tolerance the kit promises for results in `dtype` (TOLERANCES)."""
    require(dtype in TOLERANCES, f"no tolerance for {dtype}: compare floating-point results")
    return TOLERANCES[dtype]


def compare(name: str, ours: torch.Tensor, reference: torch.Tensor, rtol=None) -> Comparison:
    """Bitwise equality, and the relative error against `rtol` (default: the reference dtype's)."""
    rtol = tolerance(reference.dtype) if rtol is None else rtol
    error = relative_error(ours, reference)
    return Comparison(name, bool(torch.equal(ours, reference)), error, rtol, error <= rtol)


def cmp_table(rows: list[Comparison]) -> str:
    """The comparisons as a fixed-width table, one line per row."""
    w = max([len("name")] + [len(r.name) for r in rows])
    lines = [f"{n:<{w}}  {e!s:<5}  {err:>9.1e}  {tol:>9.0e}  {ok}" for n, e, err, tol, ok in rows]
    return "\n".join([f"{'name':<{w}}  exact  ‖Δ‖/‖ref‖  tolerance  within", *lines])
