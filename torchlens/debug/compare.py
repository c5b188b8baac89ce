"""`tl.debug.compare`: align two traces op by op and find where their values first part.

Two runs of "the same" forward (a patched model against the original, fp32 against bf16 autocast,
one machine against another) are compared in three steps:

1. **Align** (`align`): each op is paired with its counterpart on graph coordinates (module, op,
   outputs), so an op inserted into one version, or missing from it, leaves the others paired.
2. **Measure** (`diff`): each matched pair's outputs are compared in float64, allclose-style, held
   to a per-dtype tolerance (`DEFAULT_TOLERANCES`) that loosens where the sides' precisions differ.
3. **Report** (`report`): a `CompareReport` holds one `CompareRow` per aligned op, the counts, and
   the first row, in trace order, that is out of tolerance or not comparable. Ops present in one
   trace only are counted and listed, but they are structure, not numerics: they never make a
   first divergence.

With `reference=` (a float64 run, `tl.debug.reference`), each row whose two sides differ is also
judged against it (`judging`): which side is nearer float64, by how many ulps of each side's dtype,
and whether the divergence is rounding or real (`rounding`); `first_real` is the first real one.
When both traces kept a backward, their gradients are compared too (`gradients`).
"""

from __future__ import annotations

from typing import Dict, Optional

from ..errors import CompareInputError
from ..results import PartialTrace, Recording, Trace
from .align import align, reference_pairs
from .diff import Tolerance, check_tolerance, compare_pairs
from .gradients import compare_gradients
from .judging import judge_rows
from .reference import Reference
from .report import CompareReport

__all__ = ["compare"]


def compare(trace_a, trace_b, rtol: Optional[float] = None, atol: Optional[float] = None,
            reference: Optional[Reference] = None) -> CompareReport:
    """Align two traces op by op and compare the values each op produced.

    Pass two results of `tl.trace(...)` (or partial traces of failed `tl.trace` runs, which kept
    values up to the failure). `rtol=` / `atol=` override the per-dtype defaults
    (`DEFAULT_TOLERANCES`); relative differences are taken against trace_b's values.
    `reference=tl.debug.reference(model, *inputs)` judges each row whose sides differ against
    float64: which side is nearer, and whether the divergence is rounding or real (`first_real`).
    """
    values_a = _kept_values(trace_a, "trace_a")
    values_b = _kept_values(trace_b, "trace_b")
    if reference is not None and not isinstance(reference, Reference):
        raise CompareInputError(f"tl.debug.compare(reference=...) takes what tl.debug.reference(model, *inputs) "
                                f"returns, got {type(reference).__name__}")
    rtol, atol = check_tolerance(rtol, "rtol"), check_tolerance(atol, "atol")
    tolerance = Tolerance(rtol, atol)
    rows = compare_pairs(align(trace_a.ops, trace_b.ops), values_a, values_b, tolerance)
    if reference is not None:
        judge_rows(rows, trace_a, trace_b, values_a, values_b, reference,
                   reference_pairs(trace_a.ops, reference.trace.ops),
                   reference_pairs(trace_b.ops, reference.trace.ops))
    return CompareReport(rows, compare_gradients(trace_a, trace_b, rtol, atol, tolerance.floor),
                         judged=reference is not None)


def _kept_values(trace, name: str) -> Dict[int, tuple]:
    """The trace's kept values, or a CompareInputError that says what to pass instead."""
    if not isinstance(trace, Recording):
        raise CompareInputError(
            f"tl.debug.compare: {name} is a {type(trace).__name__}, not a trace; pass what "
            f"tl.trace(model, *inputs) returns")
    values = trace.values if isinstance(trace, (Trace, PartialTrace)) else None
    if values is not None:
        return values
    if isinstance(trace, PartialTrace):
        raise CompareInputError(
            f"tl.debug.compare: {name} is a PartialTrace without kept values (the failed run was "
            f"tl.record); rerun the forward with tl.trace(...), whose partial trace keeps values up "
            f"to the failure")
    raise CompareInputError(
        f"tl.debug.compare: {name} is a Recording, which keeps no values; use tl.trace(...), which "
        f"keeps values")
