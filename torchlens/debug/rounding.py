"""Rounding or real: how far each side of a divergence is from the float64 reference, and how
much of that its op added.

Each side's error at an op is measured in **ulps of its own dtype**: the largest difference from
the reference over the output, divided by the spacing of that dtype at the output's largest
reference magnitude. Measured against the largest magnitude, not element by element: an element
that is the small difference of large terms (an attention score, a matmul whose terms cancel)
carries the rounding of those terms, which an element-wise relative error blows up into
"93x off" while nothing is wrong.

A side's error at an op has two parts: what its inputs already carried in, and what the op added.
The reference replays the op in float64 on the side's own inputs (`Reference.replay`); the side's
distance from that replay is its **own** error, in ulps of the dtype the op computed in, and the
replay's distance from the reference is what was **carried** in. Judged on its own error, an op
is held to the precision it actually computed in, whatever came before: a float32 `add` of a
bf16 matmul's output carries bf16's rounding (2^16 float32 ulps) without adding any.

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

That two-sided rule holds when both sides compute in one precision. Beyond it, a side is **real**
at an op only where the op itself computes something else: its own error is beyond

    own allowance = max(FLOOR_ULPS * sqrt(terms), GROWTH * carried)

(a fused kernel that keeps an intermediate in registers rounds it once, not at each op: the
rounding it saves or moves is bounded by what its inputs carried, `carried`). An op whose sides
are beyond the two-sided rule while each adds only rounding **carried** its divergence in from its
inputs (`judging` tells rounding carried from a lower precision from a real op's consequence).
Where an op cannot be replayed on a side, the two-sided rule decides alone, but only between sides
that computed in the same precisions. A side with a NaN or an infinity where the reference has a
finite value (or the reverse) is infinitely far; both sides infinitely far is real too, with
neither nearer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, NamedTuple, Optional, Sequence

import torch

__all__ = ["CARRIED", "COMPLEX_PARTS", "DRAWN_APART", "FLOOR_ULPS", "GROWTH", "INHERITED", "REAL", "ROUNDING", "SPREAD",
           "UNJUDGED", "Error", "Judgement", "allowance", "carries_rounding", "drew_alike", "error", "judge",
           "own_allowance", "ulp", "wide"]

FLOOR_ULPS = 4.0
SPREAD = 16.0
GROWTH = 2.0
ROUNDING, REAL, UNJUDGED, CARRIED = "rounding", "real", "unjudged", "carried"
INHERITED = "inherited"  # a judgement's: the op added only rounding; what it carries, `judging` tells
DRAWN_APART = 0.1  # a random op's output this far off float64 (of its largest magnitude) drew other numbers
# a complex dtype's real and imaginary parts: what its rounding and tolerances are those of
COMPLEX_PARTS = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
_OTHER_SIDE: Dict[Optional[str], Optional[str]] = {"a": "b", "b": "a"}  # None: neither side is off


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude` (at the smallest normal for smaller ones)."""
    info = torch.finfo(dtype)
    magnitude = max(abs(magnitude), info.tiny)
    if math.isinf(magnitude):
        return math.inf
    _, exponent = math.frexp(magnitude)  # magnitude = m * 2**exponent, 0.5 <= m < 1
    return math.ldexp(info.eps, exponent - 1)


class Error(NamedTuple):
    """One side's distance from the reference over an op's outputs: `absolute` (largest |x - ref|)
    and `ulps` (of the side's dtype, at the output's largest reference magnitude)."""

    absolute: float
    ulps: float


def error(values: Sequence[torch.Tensor], references: Sequence[torch.Tensor], dtypes=None) -> Error:
    """How far `values` (one side's outputs of an op) are from the reference's, output by output,
    in ulps of each value's dtype (or of `dtypes`, one per output, when given)."""
    absolute, ulps = 0.0, 0.0
    for position, (value, ref) in enumerate(zip(values, references)):
        if not (value.is_floating_point() or value.is_complex()):
            continue
        dtype = value.dtype if dtypes is None else dtypes[position]
        dtype = COMPLEX_PARTS.get(dtype, dtype)
        x, r = wide(value), wide(ref)
        if x.numel() == 0:
            continue
        largest, scale = _largest_difference(x, r)
        if math.isinf(largest):
            return Error(math.inf, math.inf)
        absolute = max(absolute, largest)
        if largest:
            ulps = max(ulps, largest / ulp(dtype, scale))
    return Error(absolute, ulps)


def _largest_difference(x: torch.Tensor, r: torch.Tensor):
    """(the largest |x - r|, inf where a NaN or infinity is on one side only; the largest finite
    |r|). Equal NaNs and equal infinities are no difference."""
    diff = (x - r).abs()
    if bool(diff.isfinite().all()):  # the common case: no NaN or infinity anywhere
        return float(diff.max()), float(r.abs().max())
    same = (x == r) | (x.isnan() & r.isnan())
    if bool((~same & ~(x.isfinite() & r.isfinite())).any()):
        return math.inf, math.inf
    finite_ref = r[r.isfinite()]
    return float(torch.where(same, 0.0, diff).max()), float(finite_ref.abs().max()) if finite_ref.numel() else 0.0


def wide(value: torch.Tensor) -> torch.Tensor:
    """`value` on the CPU in float64 (complex128 for a complex one), where both sides and the
    reference are compared."""
    return value.detach().to("cpu", torch.complex128 if value.is_complex() else torch.float64)


def allowance(terms: int, nearer_ulps: float) -> float:
    """The most ulps rounding may put a side from float64 at an op of `terms` terms, when the
    other side is `nearer_ulps` from it."""
    return max(FLOOR_ULPS * math.sqrt(max(1, terms)), SPREAD * nearer_ulps)


def own_allowance(terms: int, carried_ulps: float) -> float:
    """The most ulps an op may add to what its inputs carried in, by rounding alone."""
    return max(FLOOR_ULPS * math.sqrt(max(1, terms)), GROWTH * carried_ulps)


@dataclasses.dataclass(eq=False, slots=True)
class Judgement:
    """A divergence judged against the reference: `verdict` (REAL, INHERITED or UNJUDGED, see
    `judge`), `closer` ("a", "b", or None when both are
    as far), each side's total `Error` (`a`, `b`), each side's own error at the op (`own_a`,
    `own_b`: against the op replayed on its own inputs; None where it was not replayed), the
    `allowed` ulps of the rule that decided, and `off`: the side whose op computes something else
    (None unless real by its own error)."""

    verdict: str
    closer: Optional[str]
    a: Error
    b: Error
    allowed: float
    own_a: Optional[Error] = None
    own_b: Optional[Error] = None
    off: Optional[str] = None
    # an INHERITED one's: whether what it carries is as far as rounding goes (a call: measured on demand)
    rounding_carried: Callable[[], bool] = dataclasses.field(default=lambda: True, init=False)


def judge(values_a, values_b, references, terms: int, replay_a=None, replay_b=None,
          same_precision: bool = True, coarsest: Optional[torch.dtype] = None) -> Judgement:
    """Judge one op's divergence: each side's error, which is nearer, and whether a side's op
    computes something else (REAL); otherwise INHERITED (the op added only rounding: what it
    carries came in, `judging` says from what) or UNJUDGED.

    `replay_a` / `replay_b`: what gives the reference's op replayed on each side's own inputs (a
    call returning its outputs, or None where it cannot be replayed; called only where the two-
    sided rule cannot decide alone); `same_precision`: whether the two runs computed in the same dtypes;
    `coarsest`: the coarsest dtype either computed in (see `carries_rounding`). Between
    runs of one precision a side is real only where the two-sided rule says so too (as it alone
    did before replays); between precisions that rule measures a side against another unit, and
    only a side's own error can call it real."""
    a, b = error(values_a, references), error(values_b, references)
    closer = "a" if a.absolute < b.absolute else "b" if b.absolute < a.absolute else None
    nearer, farther = sorted((a.ulps, b.ulps))
    allowed = allowance(terms, nearer)
    two_sided = math.isinf(farther) or farther > allowed
    if same_precision and not two_sided:
        return Judgement(INHERITED, closer, a, b, allowed)  # within rounding, as far as either side adds
    own = {side: _own(values, replay, references, terms)
           for side, values, replay in (("a", values_a, replay_a), ("b", values_b, replay_b))}
    own_a, own_b = (own[side][0] if own[side] else None for side in ("a", "b"))
    beyond = [side for side in ("a", "b") if own[side] is not None and own[side][0].ulps > own[side][1]]
    if beyond and (two_sided or not same_precision):
        off = beyond[0] if len(beyond) == 1 else ("a" if closer == "b" else "b" if closer == "a" else None)
        near = _OTHER_SIDE.get(off, closer)
        return Judgement(REAL, near, a, b, own[off or beyond[0]][1], own_a, own_b, off)
    if own_a is not None and own_b is not None:
        judgement = Judgement(INHERITED, closer, a, b, max(own["a"][1], own["b"][1]), own_a, own_b)
    elif same_precision:
        judgement = Judgement(REAL if two_sided else INHERITED, closer, a, b, allowed, own_a, own_b)
    else:
        return Judgement(UNJUDGED, closer, a, b, allowed, own_a, own_b)
    if two_sided:  # (asked only where no real op upstream explains what it carries)
        judgement.rounding_carried = lambda: carries_rounding(values_a, values_b, references, terms, coarsest)
    return judgement


def carries_rounding(values_a, values_b, references, terms: int, coarsest: Optional[torch.dtype]) -> bool:
    """Whether both sides are as near float64 as rounding carried from op to op leaves them:
    within SPREAD times the floor, in ulps of the coarsest precision either run computed in.
    Measured here, healthy runs in bf16 or fp16 against fp32 (transformers models of 2 and 8
    layers, a conv net) stayed within a quarter of that; a value that took another path (a
    mask applied on one side only) is off by its whole magnitude, hundreds of those ulps."""
    if coarsest is None:
        return False
    dtypes = [coarsest] * len(references)
    farther = max(error(values_a, references, dtypes).ulps, error(values_b, references, dtypes).ulps)
    return farther <= SPREAD * FLOOR_ULPS * math.sqrt(max(1, terms))


def _own(values, replay, references, terms: int):
    """(the side's own error at the op, what rounding allows it) or None without a replay: the
    side against the op replayed on its own inputs, in ulps of the side's dtypes. `replay(nearest)`
    gives the replay; asked again with `nearest=values` only where the first would call the op
    off, it may try the parameters and buffers in the side's lower precisions (`judging`)."""
    replayed = replay() if replay is not None else None
    if replayed is None or len(replayed) != len(values):
        return None
    own, limit = _measured(values, replayed, references, terms)
    if own.ulps > limit:
        nearer = replay(nearest=values)
        if nearer is not replayed and nearer is not None and len(nearer) == len(values):
            own, limit = _measured(values, nearer, references, terms)
    return own, limit


def _measured(values, replayed, references, terms: int):
    dtypes = [value.dtype for value in values]
    own = error(values, replayed)
    return own, own_allowance(terms, error(replayed, references, dtypes).ulps)


def drew_alike(values, references) -> bool:
    """Whether a side's outputs of a random op (dropout, randn) are the reference's up to
    rounding: off by less than `DRAWN_APART` of the output's largest magnitude. Other random
    draws differ by whole values (an element kept on one side, zeroed on the other), never by
    rounding."""
    for value, ref in zip(values, references):
        if value is None or ref is None or not (value.is_floating_point() or value.is_complex()):
            continue
        x, r = wide(value), wide(ref)
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
