"""Rounding or real: how far each side of a divergence is from the float64 reference.

Each side's error at an op is measured in **ulps of its own dtype**: the largest difference from
the reference over the output, divided by the spacing of that dtype at the output's largest
reference magnitude. Measured against the largest magnitude, not element by element: an element
that is the small difference of large terms (an attention score, a matmul whose terms cancel)
carries the rounding of those terms, which an element-wise relative error blows up into
"93x off" while nothing is wrong.

A divergence is **rounding** when both sides are within what rounding allows at that op:

    allowance = max(FLOOR_ULPS * sqrt(terms), SPREAD * nearer)

- `terms` is the op's reduction length (`reference.reduction_terms`): a sum of K terms rounded in
  a lower precision is off from float64 by about sqrt(K) ulps of the sum's scale when errors are
  random, K ulps at worst; the floor allows FLOOR_ULPS per sqrt(term).
- `nearer` is the error of the side nearer the reference, in its own ulps. Rounding accumulates
  from op to op, so deep in a model both sides are many ulps from float64; an implementation
  that only rounds (reassociates, fuses, keeps more precision in registers) accumulates the same
  order of error as another, measured here within a factor of a few (see docs/compare.md). A side
  SPREAD times farther than the nearer one is off by more than its rounding.

Otherwise it is **real**: one side (the farther) computes something else. A side with a NaN or an
infinity where the reference has a finite value (or the reverse) is infinitely far; both sides
infinitely far is real too, with neither nearer. Bf16 and fp16 sides are measured in their own
ulps, so a bf16 run is held to bf16's rounding, not float32's.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["DRAWN_APART", "FLOOR_ULPS", "REAL", "ROUNDING", "SPREAD", "UNJUDGED", "Error", "Judgement", "allowance",
           "drew_alike", "error", "judge", "ulp"]

FLOOR_ULPS = 4.0
SPREAD = 16.0
ROUNDING, REAL, UNJUDGED = "rounding", "real", "unjudged"
DRAWN_APART = 0.1  # a random op's output this far off float64 (of its largest magnitude) drew other numbers


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude` (at the smallest normal for smaller ones)."""
    info = torch.finfo(dtype)
    magnitude = max(abs(magnitude), info.tiny)
    if math.isinf(magnitude):
        return math.inf
    _, exponent = math.frexp(magnitude)  # magnitude = m * 2**exponent, 0.5 <= m < 1
    return math.ldexp(info.eps, exponent - 1)


class Error:
    """One side's distance from the reference over an op's outputs: `absolute` (largest |x - ref|)
    and `ulps` (of the side's dtype, at the output's largest reference magnitude)."""

    __slots__ = ("absolute", "ulps")

    def __init__(self, absolute: float, ulps: float):
        self.absolute = absolute
        self.ulps = ulps


def error(values: Sequence[torch.Tensor], references: Sequence[torch.Tensor]) -> Error:
    """How far `values` (one side's outputs of an op) are from the reference's, output by output."""
    absolute, ulps = 0.0, 0.0
    for value, ref in zip(values, references):
        if not (value.is_floating_point() or value.is_complex()):
            continue
        dtype = value.dtype if value.is_floating_point() else _real_dtype(value.dtype)
        x, r = _wide(value), _wide(ref)
        if x.numel() == 0:
            continue
        same = (x == r) | (x.isnan() & r.isnan())
        both_finite = x.isfinite() & r.isfinite()
        if bool((~same & ~both_finite).any()):
            return Error(math.inf, math.inf)
        diff = torch.where(same, 0.0, (x - r).abs())
        largest = float(diff.max())
        finite_ref = r[r.isfinite()]
        scale = float(finite_ref.abs().max()) if finite_ref.numel() else 0.0
        absolute = max(absolute, largest)
        if largest:
            ulps = max(ulps, largest / ulp(dtype, scale))
    return Error(absolute, ulps)


def _wide(value: torch.Tensor) -> torch.Tensor:
    """`value` on the CPU in float64 (complex128 for a complex one), where both sides and the
    reference are compared."""
    return value.detach().to("cpu", torch.complex128 if value.is_complex() else torch.float64)


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex32: torch.float16, torch.complex64: torch.float32}.get(dtype, torch.float64)


def allowance(terms: int, nearer_ulps: float) -> float:
    """The most ulps rounding may put a side from float64 at an op of `terms` terms, when the
    other side is `nearer_ulps` from it."""
    return max(FLOOR_ULPS * math.sqrt(max(1, terms)), SPREAD * nearer_ulps)


class Judgement:
    """A divergence judged against the reference: `verdict` ("rounding" or "real"), `closer`
    ("a", "b", or None when both are as far), each side's `Error`, and the `allowed` ulps."""

    __slots__ = ("verdict", "closer", "a", "b", "allowed")

    def __init__(self, verdict: str, closer: Optional[str], a: Error, b: Error, allowed: float):
        self.verdict = verdict
        self.closer = closer
        self.a = a
        self.b = b
        self.allowed = allowed


def judge(values_a, values_b, references, terms: int) -> Judgement:
    """Judge one op's divergence: each side's error, which is nearer, rounding or real."""
    a, b = error(values_a, references), error(values_b, references)
    closer = "a" if a.absolute < b.absolute else "b" if b.absolute < a.absolute else None
    nearer, farther = sorted((a.ulps, b.ulps))
    allowed = allowance(terms, nearer)
    verdict = REAL if math.isinf(farther) or farther > allowed else ROUNDING
    return Judgement(verdict, closer, a, b, allowed)


def drew_alike(values, references) -> bool:
    """Whether a side's outputs of a random op (dropout, randn) are the reference's up to
    rounding: off by less than `DRAWN_APART` of the output's largest magnitude. Other random
    draws differ by whole values (an element kept on one side, zeroed on the other), never by
    rounding."""
    for value, ref in zip(values, references):
        if value is None or ref is None or not (value.is_floating_point() or value.is_complex()):
            continue
        x, r = _wide(value), _wide(ref)
        if x.shape != r.shape:
            return False
        if x.numel() == 0:
            continue
        finite = x.isfinite() & r.isfinite()
        if bool((x.isfinite() != r.isfinite()).any()):
            return False
        scale = float(r[finite].abs().max()) if bool(finite.any()) else 0.0
        if bool(finite.any()) and float((x[finite] - r[finite]).abs().max()) > DRAWN_APART * scale:
            return False
    return True
