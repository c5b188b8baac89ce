"""How far apart two traces' values are at each matched op, and the tolerance each is held to.

Each pair of matched ops has its outputs compared in float64 on the CPU: the largest absolute
difference, the largest relative difference (relative to trace_b's value, as `torch.allclose` does
with `other`), and whether `|a - b| <= atol + rtol * |b|` holds everywhere. NaN against NaN in the
same place counts as equal, and so do equal infinities. Integer and bool outputs must be equal.
Outputs whose shapes, counts or kinds (floating, complex, exact) differ are "not comparable":
nothing is broadcast.

Tolerances default per dtype (`DEFAULT_TOLERANCES`). When the two sides differ in floating
precision (fp32 against bf16 autocast), the looser dtype's tolerance applies, to that op and to
every floating op after it, since the rounding the lower precision brings in is what such a
comparison expects to see, and it travels downstream (`Tolerance`).
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..errors import OptionTypeError, OptionValueError
from ..events import Event
from ..narration.grammar import dtype_name, shape_text
from .rounding import COMPLEX_PARTS, wide
from .rows import BOTH, DIVERGED, NOT_COMPARABLE, ONLY_A, ONLY_B, UNCHECKED, WITHIN, CompareRow

__all__ = ["DEFAULT_TOLERANCES", "Tolerance", "check_tolerance", "compare_pairs", "tolerance_for"]

# (rtol, atol) per dtype, used where compare() is not given rtol= / atol=. They are looser than
# torch.testing's single-op defaults because a trace compares values after many ops, and rounding
# differences accumulate along the way.
DEFAULT_TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

# Floating dtypes missing from the table (the float8 family) get this many machine epsilons.
_EPSILONS_FOR_UNLISTED = 2

EXACT = "exact"


def tolerance_for(dtype: torch.dtype) -> Tuple[float, float]:
    """The default (rtol, atol) for values of `dtype`; (0, 0) for integers and bool (exact)."""
    dtype = COMPLEX_PARTS.get(dtype, dtype)
    if dtype in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[dtype]
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps * _EPSILONS_FOR_UNLISTED
        return eps, eps
    return 0.0, 0.0


def check_tolerance(value, name: str) -> Optional[float]:
    """compare()'s `rtol=` / `atol=` as a float, or None (the per-dtype default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionTypeError(f"tl.debug.compare({name}=...) takes a number >= 0 or None (per-dtype "
                              f"default), got {value!r}")
    if not value >= 0 or math.isinf(value):
        raise OptionValueError(f"tl.debug.compare({name}=...) takes a finite number >= 0, got {value!r}")
    return float(value)


class Tolerance:
    """The (rtol, atol) each pair of outputs is held to, op by op along the alignment.

    Integer and bool outputs must be equal. For floating outputs a given `rtol=` / `atol=` wins;
    otherwise the default is the looser of the two dtypes' (`tolerance_for`). Once the two traces
    have differed in floating precision at some op, no later floating op is held tighter than that
    looser dtype: rounding error travels downstream, and autocast runs `add` and `layer_norm` in
    fp32 on values that came out of bf16 matmuls. `floor`: where an earlier comparison left it (the
    gradients start from the floor their forwards ended with).
    """

    def __init__(self, rtol: Optional[float], atol: Optional[float], floor: Tuple[float, float] = (0.0, 0.0)):
        self.rtol = rtol
        self.atol = atol
        self.floor = floor

    def observe(self, metas_a, metas_b) -> None:
        """Raise the floor when a matched op's outputs differ in floating precision."""
        for a, b in zip(metas_a, metas_b):
            if a.dtype != b.dtype and _kind(a.dtype) == _kind(b.dtype) and _kind(a.dtype) != EXACT:
                self.floor = _looser(self.floor, tolerance_for(a.dtype), tolerance_for(b.dtype))

    def of(self, dtype_a: torch.dtype, dtype_b: torch.dtype) -> Tuple[float, float]:
        if _kind(dtype_a) == EXACT:
            return 0.0, 0.0
        rtol, atol = _looser(self.floor, tolerance_for(dtype_a), tolerance_for(dtype_b))
        return (rtol if self.rtol is None else self.rtol), (atol if self.atol is None else self.atol)


def _looser(*tolerances: Tuple[float, float]) -> Tuple[float, float]:
    return max(rtol for rtol, _ in tolerances), max(atol for _, atol in tolerances)


def compare_pairs(pairs, values_a: dict, values_b: dict, tolerance: Tolerance,
                  name: Callable[[Event], str] = operator.attrgetter("op")) -> List[CompareRow]:
    """One row per aligned pair, in order: a one-sided row for what only one trace has, the values
    compared for what both have. `name(event)` is what a row calls its op."""
    rows = []
    for event_a, event_b in pairs:
        shown = event_b or event_a  # (the side a row shows: an aligned pair has one at least)
        assert shown is not None
        if event_a is None:
            row = CompareRow(ONLY_B, shown.module, shown.op, None, shown.ordinal)
        elif event_b is None:
            row = CompareRow(ONLY_A, shown.module, shown.op, shown.ordinal, None)
        else:
            tolerance.observe(event_a.outputs, event_b.outputs)
            row = _compare_matched(event_a, event_b, values_a, values_b, tolerance)
        row.op, row.depth = name(shown), shown.scope.depth
        rows.append(row)
    return rows


def _compare_matched(event_a: Event, event_b: Event, values_a: dict, values_b: dict,
                     tolerance: Tolerance) -> CompareRow:
    """The row for an op present in both traces: agreement of metadata, then of values."""
    metas_a, metas_b = event_a.outputs, event_b.outputs
    same_count = len(metas_a) == len(metas_b)
    shapes_match = same_count and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(metas_a, metas_b))
    dtypes_match = same_count and all(a.dtype == b.dtype for a, b in zip(metas_a, metas_b))
    row = CompareRow(BOTH, event_b.module, event_b.op, event_a.ordinal, event_b.ordinal, shapes_match, dtypes_match)
    reason = _incomparable(metas_a, metas_b)
    if reason:
        row.verdict, row.reason = NOT_COMPARABLE, reason
        return row
    missing = [side for side, values, event in (("a", values_a, event_a), ("b", values_b, event_b))
               if event.ordinal not in values or any(value is None for value in values[event.ordinal])]
    if missing:
        row.verdict, row.reason = UNCHECKED, "no kept value in " + " and ".join(missing)
        return row
    differences = [_difference(a, b, *tolerance.of(a.dtype, b.dtype))
                   for a, b in zip(values_a[event_a.ordinal], values_b[event_b.ordinal])]
    row.max_abs = max((d.max_abs for d in differences), default=0.0)
    row.max_rel = max((d.max_rel for d in differences), default=0.0)
    row.rtol, row.atol = _looser((0.0, 0.0), *[(d.rtol, d.atol) for d in differences])
    row.verdict = WITHIN if all(d.within for d in differences) else DIVERGED
    return row


def _incomparable(metas_a, metas_b) -> str:
    """Why two ops' outputs cannot be compared element by element, or '' when they can.

    Floating dtypes of different precision are comparable (in float64); anything else must share
    its dtype, and shapes must be equal: nothing is broadcast.
    """
    if len(metas_a) != len(metas_b):
        return f"{len(metas_a)} outputs vs {len(metas_b)}"
    for index, (a, b) in enumerate(zip(metas_a, metas_b)):
        output = f"output {index}: " if len(metas_a) > 1 else ""
        if tuple(a.shape) != tuple(b.shape):
            return f"{output}shapes {shape_text(a.shape)} vs {shape_text(b.shape)}"
        if a.dtype != b.dtype and (_kind(a.dtype) != _kind(b.dtype) or _kind(a.dtype) == EXACT):
            return f"{output}dtypes {dtype_name(a.dtype)} vs {dtype_name(b.dtype)}"
    return ""


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return EXACT


class _Difference(NamedTuple):
    """How far apart one output is between the two traces, and the tolerance it was held to."""

    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    within: bool


def _difference(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> _Difference:
    """Compare two same-shape tensors in float64 (complex128) on the CPU, allclose-style.

    Positions that are equal (including equal infinities) or NaN on both sides differ by 0; a NaN
    or infinity on one side only differs by inf and is never within tolerance. Integer and bool
    tensors are within tolerance only when equal (float64 could round large integers together).
    """
    a, b = _dense(a), _dense(b)
    a64, b64 = wide(a), wide(b)
    same = (a64 == b64) | (a64.isnan() & b64.isnan())
    finite = a64.isfinite() & b64.isfinite()
    magnitude = b64.abs()
    diff = torch.where(same, 0.0, torch.where(finite, (a64 - b64).abs(), math.inf))
    rel = torch.nan_to_num(torch.where(diff == 0, 0.0, diff / magnitude), nan=math.inf, posinf=math.inf)
    if _kind(a.dtype) == EXACT:
        within = torch.equal(a.detach().cpu(), b.detach().cpu())
    else:
        within = bool((same | (finite & (diff <= atol + rtol * magnitude))).all())
    if diff.numel() == 0:
        return _Difference(0.0, 0.0, rtol, atol, within)
    return _Difference(diff.max().item(), rel.max().item(), rtol, atol, within)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (`nn.Embedding(sparse=True)`) as the dense values it stands for."""
    return tensor.to_dense() if tensor.layout != torch.strided else tensor

