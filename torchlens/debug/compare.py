"""`tl.debug.compare`: align two traces op by op and find where their values first part.

Two runs of "the same" forward (a patched model against the original, fp32 against bf16 autocast,
one machine against another) are compared in three steps:

1. **Align.** Every input source and op has graph coordinates: the module it ran in, its op name,
   and its occurrence of that (module, op) pair in the trace. Ops are matched in order on
   (module, op) with a longest-common-subsequence alignment (`difflib.SequenceMatcher`), so an op
   inserted into one version, or missing from it, leaves every other op paired with its
   counterpart. Occurrence numbers are not part of the matching key on purpose: an extra `mul` in a
   module renumbers every later `mul` there, and keying on the numbers would mis-pair all of them.
2. **Measure.** Each pair of matched ops has its outputs compared in float64 on the CPU:
   the largest absolute difference, the largest relative difference (relative to trace_b's value,
   as `torch.allclose` does with `other`), and whether `|a - b| <= atol + rtol * |b|` holds
   everywhere. NaN against NaN in the same place counts as equal, and so do equal infinities.
   Integer and bool outputs must be equal. Outputs whose shapes, counts or kinds (floating, complex,
   exact) differ are "not comparable": nothing is broadcast.
3. **Report.** A `CompareReport` holds one `CompareRow` per aligned op, the counts, and the first
   row, in trace order, that is out of tolerance or not comparable.

   Ops present in one trace only are counted and listed, but they are structure, not numerics:
   they never make a first divergence.

With `reference=` (a float64 run, `tl.debug.reference`), each row whose two sides differ is also
judged against it: which side is nearer float64, by how many ulps of each side's dtype, and
whether the divergence is rounding or real (`torchlens.debug.rounding`); `first_real` is the first
real one.

Tolerances default per dtype (see `DEFAULT_TOLERANCES`). When the two sides differ in floating
precision (fp32 against bf16 autocast), the looser dtype's tolerance applies, to that op and to
every floating op after it, since the rounding the lower precision brings in is what such a
comparison expects to see, and it travels downstream (see `_Tolerance`).
"""

from __future__ import annotations

import difflib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CompareInputError, OptionTypeError, OptionValueError
from ..events import Event
from ..grammar import dtype_name, shape_text
from ..results import PartialTrace, Recording, Trace
from .judging import judge_rows
from .reference import Reference
from .rounding import CARRIED, REAL, ROUNDING, UNJUDGED

__all__ = ["DEFAULT_TOLERANCES", "CompareReport", "CompareRow", "align", "compare", "tolerance_for"]

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

_COMPLEX_PARTS = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}

BOTH, ONLY_A, ONLY_B = "both", "only_a", "only_b"
WITHIN, DIVERGED, NOT_COMPARABLE, UNCHECKED = "within", "diverged", "not comparable", "unchecked"
EXACT = "exact"


def tolerance_for(dtype: torch.dtype) -> Tuple[float, float]:
    """The default (rtol, atol) for values of `dtype`; (0, 0) for integers and bool (exact)."""
    dtype = _COMPLEX_PARTS.get(dtype, dtype)
    if dtype in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[dtype]
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps * _EPSILONS_FOR_UNLISTED
        return eps, eps
    return 0.0, 0.0


class CompareRow:
    """One aligned op: where it is in each trace and how its values compare.

    - `status`: "both" (matched), "only_a" or "only_b" (present in one trace only).
    - `module`, `op`: the op's module path ("" for the root) and name.
    - `ordinal_a`, `ordinal_b`: its `#N` in each trace (None where absent); `ordinal` is trace_b's,
      or trace_a's for an op only in a.
    - `shapes_match`, `dtypes_match`: whether the outputs agree in shape / dtype (None unless both).
    - `max_abs`, `max_rel`: the largest absolute and relative difference over all outputs (None
      unless the values were compared); `inf` where a NaN or an infinity is on one side only.
    - `rtol`, `atol`: the tolerance the values were held to.
    - `depth`: the op's module depth, as narration indents it.
    - `verdict`: "within", "diverged", "not comparable" or "unchecked" (a side kept no value);
      None for one-sided rows. `reason` says why a row is not comparable or unchecked.
    - With a reference (`compare(..., reference=)`), for a row whose sides differ: `judgement`
      ("rounding", "real", or "unjudged" with `reason` saying why: no float64 op to pair it with,
      integer outputs, or after a random op where float64 drew other numbers), `closer` ("a", "b",
      or None when both are as far from float64),
      `ulps_a`, `ulps_b` (each side's distance from float64 in ulps of its own dtype), `allowed`
      (the most ulps rounding allows there). None otherwise.
    """

    __slots__ = ("status", "module", "op", "ordinal_a", "ordinal_b", "shapes_match", "dtypes_match",
                 "max_abs", "max_rel", "rtol", "atol", "verdict", "reason", "depth", "judgement", "closer",
                 "ulps_a", "ulps_b", "allowed", "own_a", "own_b", "off")

    def __init__(self, status: str, module: str, op: str, ordinal_a: Optional[int], ordinal_b: Optional[int],
                 shapes_match: Optional[bool] = None, dtypes_match: Optional[bool] = None,
                 max_abs: Optional[float] = None, max_rel: Optional[float] = None,
                 rtol: Optional[float] = None, atol: Optional[float] = None,
                 verdict: Optional[str] = None, reason: str = ""):
        self.status = status
        self.module = module
        self.op = op
        self.ordinal_a = ordinal_a
        self.ordinal_b = ordinal_b
        self.shapes_match = shapes_match
        self.dtypes_match = dtypes_match
        self.max_abs = max_abs
        self.max_rel = max_rel
        self.rtol = rtol
        self.atol = atol
        self.verdict = verdict
        self.reason = reason
        self.depth = 0  # the module depth narration indents the op by (module calls from the root)
        self.judgement: Optional[str] = None
        self.closer: Optional[str] = None
        self.ulps_a: Optional[float] = None
        self.ulps_b: Optional[float] = None
        self.allowed: Optional[float] = None
        self.own_a: Optional[float] = None
        self.own_b: Optional[float] = None
        self.off: Optional[str] = None

    @property
    def ordinal(self) -> int:
        ordinal = self.ordinal_b if self.ordinal_b is not None else self.ordinal_a
        assert ordinal is not None  # (a row has one side at least)
        return ordinal

    @property
    def within_tolerance(self) -> Optional[bool]:
        """True or False for compared rows; None where there was nothing to compare."""
        return None if self.verdict in (None, UNCHECKED) else self.verdict == WITHIN

    @property
    def diverged(self) -> bool:
        """Out of tolerance or not comparable: what `first_divergence` looks for."""
        return self.verdict in (DIVERGED, NOT_COMPARABLE)

    @property
    def where(self) -> str:
        """The op as narration names it: `linear @blocks.1.fc`, or just `add` at the root."""
        return f"{self.op} @{self.module}" if self.module else self.op

    def to_dict(self) -> dict:
        row = {name: getattr(self, name) for name in self.__slots__}
        row["within_tolerance"] = self.within_tolerance
        return row

    def __repr__(self) -> str:
        return f"CompareRow({self.status} #{self.ordinal} {self.where}: {self.verdict})"


class CompareReport:
    """The result of `tl.debug.compare(trace_a, trace_b)`.

    - `rows`: one `CompareRow` per aligned op, in trace order.
    - `first_divergence`: the first row out of tolerance or not comparable, or None.
    - `counts`: matched, within_tolerance, diverged, not_comparable, unchecked, only_a, only_b
      (and, with a reference, rounding, real and unjudged).
    - `str(report)` / `table(...)`: the text report, led by the first divergence.
    - `to_rows()`: the rows as plain dicts; `plot(path)`: max abs difference per op.
    - `first_real`: with `reference=`, the first row judged real (one side far beyond rounding of
      float64), or None when no row judged is (`verdict()` says how many could not be judged);
      `judged` says whether there was a reference.
    - `gradients`: when both traces kept a backward (`tl.trace(..., backward=True)`), the same
      report for their first backwards, node by node in the order they ran (`~N`), None
      otherwise; `first_gradient_divergence` is its first divergence.
    """

    def __init__(self, rows: List[CompareRow], gradients: Optional["CompareReport"] = None, tag: str = "#",
                 judged: bool = False):
        self.rows = rows
        self.first_divergence: Optional[CompareRow] = next((row for row in rows if row.diverged), None)
        self.judged = judged
        self.first_real: Optional[CompareRow] = next((row for row in rows if row.judgement == REAL), None)
        self.gradients = gradients
        self.tag = tag  # how a row's position is written: `#N` for ops, `~N` for backward nodes
        self.noun = "op" if tag == "#" else "node"

    @property
    def first_gradient_divergence(self) -> Optional[CompareRow]:
        return self.gradients.first_divergence if self.gradients is not None else None

    @property
    def counts(self) -> Dict[str, int]:
        verdicts = [row.verdict for row in self.rows]
        statuses = [row.status for row in self.rows]
        return {
            "matched": statuses.count(BOTH),
            "within_tolerance": verdicts.count(WITHIN),
            "diverged": verdicts.count(DIVERGED),
            "not_comparable": verdicts.count(NOT_COMPARABLE),
            "unchecked": verdicts.count(UNCHECKED),
            "only_a": statuses.count(ONLY_A),
            "only_b": statuses.count(ONLY_B),
            **({"rounding": sum(row.judgement == ROUNDING for row in self.rows),
                "real": sum(row.judgement == REAL for row in self.rows),
                "carried": sum(row.judgement == CARRIED for row in self.rows),
                "unjudged": sum(row.judgement == UNJUDGED for row in self.rows)} if self.judged else {}),
        }

    def to_rows(self) -> List[dict]:
        """Every row as a plain dict (the `CompareRow` fields plus `within_tolerance`)."""
        return [row.to_dict() for row in self.rows]

    def verdict(self) -> str:
        """With a reference, the line that leads the report: the first real divergence, which side
        is off and by how much, or that every divergence judged is rounding, and how many could
        not be judged (never "no real divergence" over rows nobody measured). '' without one."""
        if not self.judged:
            return ""
        rounding, real, unjudged = self.counts["rounding"], self.counts["real"], self.counts["unjudged"]
        row = self.first_real
        not_judged = ""
        if unjudged:
            first = next(r for r in self.rows if r.judgement == UNJUDGED)
            not_judged = (f"{unjudged} {self.noun}{'s' if unjudged != 1 else ''} whose sides differ could not be "
                          f"judged (the first: {self.tag}{first.ordinal} {first.where}: {first.reason})")
        if row is None:
            if not rounding:
                if unjudged:
                    return f"not judged against float64: {not_judged}"
                return "no real divergence: the two sides are equal wherever float64 was compared"
            first = next(r for r in self.rows if r.judgement == ROUNDING)
            every = f"all {rounding}" if not unjudged else f"the {rounding} judged"
            return (f"no real divergence: {every} {self.noun}s whose sides differ are within rounding of "
                    f"float64 (the first: {self.tag}{first.ordinal} {first.where}, a {_ulps(first.ulps_a)}, "
                    f"b {_ulps(first.ulps_b)})" + (f"; but {not_judged}" if unjudged else ""))
        carried = self.counts["carried"]
        return (f"first real divergence: {self.tag}{row.ordinal} {row.where}: {_real_text(row)}; {rounding} other "
                f"divergence{'s' if rounding != 1 else ''} judged rounding, {real - 1} more real, {carried} carrying a "
                f"real one's divergence" + (f"; {not_judged}" if unjudged else ""))

    def summary(self) -> str:
        """One line naming the first divergence: op, module, ordinals and how far apart."""
        row, tag = self.first_divergence, self.tag
        which = "" if tag == "#" else "gradient "
        if row is None:
            counts = self.counts
            unchecked = f", {counts['unchecked']} unchecked" if counts["unchecked"] else ""
            within = counts["within_tolerance"]
            return f"no {which}divergence: {within} matched {self.noun}s within tolerance{unchecked}"
        head = (f"first {which}divergence: {tag}{row.ordinal} {row.where} (a {_ordinal(row.ordinal_a, tag)}, "
                f"b {_ordinal(row.ordinal_b, tag)})")
        if row.verdict == NOT_COMPARABLE:
            return f"{head}: not comparable, {row.reason}"
        return (f"{head}: max abs diff {_number(row.max_abs)}, max rel diff {_number(row.max_rel)} "
                f"(rtol {row.rtol:g}, atol {row.atol:g})")

    def table(self, elide: bool = True, max_rows: Optional[int] = 100) -> str:
        """The text report: the summary line, the counts, then one line per row.

        `elide=True` folds runs of within-tolerance rows into one count line (keeping the row on
        each side of a divergence), so a model of thousands of ops stays readable; `max_rows=N`
        stops after N row lines with a note of how many were left out (None shows them all).
        """
        counts = self.counts
        lines = ([self.verdict()] if self.judged else []) + [
            self.summary(),
            f"{len(self.rows)} aligned {self.noun}s: {counts['matched']} in both ({counts['within_tolerance']} within "
            f"tolerance, {counts['diverged']} diverged, {counts['not_comparable']} not comparable, "
            f"{counts['unchecked']} unchecked), {counts['only_a']} only in a, {counts['only_b']} only in b",
        ]
        body = _row_lines(self.rows, elide, self.tag)
        if max_rows is not None and len(body) > max_rows + 1:
            left_out = len(body) - max_rows - 1
            lines_left = f"{left_out} more line{'s' if left_out != 1 else ''}"
            body = body[:max_rows + 1] + [f"... {lines_left} (report.table(max_rows=None) shows all)"]
        text = "\n".join(lines + body) + "\n"
        if self.gradients is not None:
            text += "\ngradients (the backwards, node by node in the order they ran):\n"
            text += self.gradients.table(elide, max_rows)
        return text

    def plot(self, path=None):
        """Plot the max abs difference per aligned op (log scale), the first divergence marked.

        The x axis is the row's position in the alignment (1-based, so it is the ordinal while the
        two traces have the same structure). Rows out of tolerance are red. A log scale cannot show
        0 or inf: exact matches sit on a dotted floor line below the smallest difference, infinite
        differences on a ceiling above the largest. Saves to `path` when given; returns the
        matplotlib `Figure`. Needs matplotlib, the optional extra `plot`.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError(
                "CompareReport.plot needs matplotlib: pip install matplotlib "
                "(or pip install 'torchlens[plot]')") from exc
        compared = [(position, row.max_abs, row.diverged) for position, row in enumerate(self.rows, 1)
                    if row.max_abs is not None]
        floor, ceiling = _plot_range([difference for _, difference, _ in compared])
        figure = Figure(figsize=(10, 4))
        axes = figure.subplots()
        axes.set_yscale("log")
        axes.axhline(floor, color="gray", linestyle=":", linewidth=1, label="equal (0)")
        for diverged, color, label in ((False, "tab:blue", "within tolerance"), (True, "tab:red", "diverged")):
            points = [(position, min(max(difference, floor), ceiling))
                      for position, difference, row_diverged in compared if row_diverged == diverged]
            axes.plot([x for x, _ in points], [y for _, y in points], ".", color=color, label=label)
        axes.set_xlabel("aligned op")
        axes.set_ylabel("max abs difference")
        if self.first_divergence is not None:
            at = self.rows.index(self.first_divergence) + 1
            axes.axvline(at, color="tab:red", linestyle="--", linewidth=1)
            axes.annotate(f" first divergence: #{self.first_divergence.ordinal} {self.first_divergence.where}",
                          xy=(at, 0.97), xycoords=("data", "axes fraction"), color="tab:red", fontsize=8,
                          ha="left", va="top")
        axes.legend(loc="lower right", fontsize=8)
        figure.tight_layout()
        if path is not None:
            figure.savefig(path)
        return figure

    def to_html(self, path) -> str:
        """Write a self-contained HTML page of this comparison: both sides aligned row by row, the
        first divergence highlighted, each row's error against its tolerance; returns the path."""
        from ..results import _write_page
        from ..view import report_page

        return _write_page(path, report_page(self))

    def _repr_html_(self) -> str:
        """The `to_html` page as a notebook cell shows it, bounded in rows (docs/html-view.md)."""
        from ..view import report_view

        return report_view(self)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        counts = self.counts
        first = f"first divergence {self.tag}{self.first_divergence.ordinal} {self.first_divergence.where}" \
            if self.first_divergence else "no divergence"
        if self.first_real is not None:
            first += f"; first real {self.tag}{self.first_real.ordinal} {self.first_real.where}"
        elif self.judged:
            first += "; no real divergence"
        if self.gradients is not None:
            first += f"; gradients: {self.gradients!r}"
        return (f"<CompareReport: {counts['matched']} matched, {counts['diverged'] + counts['not_comparable']} "
                f"diverged, {counts['only_a']} only in a, {counts['only_b']} only in b; {first}>")


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
    rtol, atol = _check_tolerance(rtol, "rtol"), _check_tolerance(atol, "atol")
    tolerance = _Tolerance(rtol, atol)
    rows = []
    for event_a, event_b in align(trace_a.ops, trace_b.ops):
        shown = event_b or event_a  # (the side a row shows: an aligned pair has one at least)
        assert shown is not None
        if event_b is None:
            rows.append(CompareRow(ONLY_A, shown.module, shown.op, shown.ordinal, None))
        elif event_a is None:
            rows.append(CompareRow(ONLY_B, shown.module, shown.op, None, shown.ordinal))
        else:
            tolerance.observe(event_a.outputs, event_b.outputs)
            rows.append(_compare_matched(event_a, event_b, values_a, values_b, tolerance))
        rows[-1].depth = shown.scope.depth
    if reference is not None:
        judge_rows(rows, trace_a, trace_b, values_a, values_b, reference,
                   _reference_pairs(trace_a.ops, reference.trace.ops),
                   _reference_pairs(trace_b.ops, reference.trace.ops))
    return CompareReport(rows, _compare_gradients(trace_a, trace_b, rtol, atol, tolerance.floor),
                         judged=reference is not None)


def _reference_pairs(ops: Sequence[Event], reference_ops: Sequence[Event]) -> Dict[int, Event]:
    pairs = _align(list(ops), list(reference_ops), (_shape_key, _name_key))
    return {op.ordinal: ref for op, ref in pairs if op is not None and ref is not None}


def _shape_key(event: Event) -> tuple:
    return (event.module, event.op, tuple(tuple(meta.shape) for meta in event.outputs))


def _compare_gradients(trace_a, trace_b, rtol: Optional[float], atol: Optional[float],
                       floor: Tuple[float, float]) -> Optional[CompareReport]:
    """The first backward of each trace, node by node, when both kept their gradients.

    Nodes are aligned in the order they ran on the module of their forward op and the node's name;
    leaves' accumulators are paired by the leaf's name, wherever they ran (a compiled graph's
    backward is one node, and accumulates its parameters in an order of its own). Rows follow
    trace_b's backward; the first divergence is the one nearest the loss, where the two backwards
    first part. Gradients are held to the tolerance the forwards ended with: the rounding a lower
    precision brought into the forward travels into every gradient (`floor`).
    """
    backward_a, backward_b = _kept_backward(trace_a), _kept_backward(trace_b)
    if backward_a is None or backward_b is None:
        return None
    tolerance = _Tolerance(rtol, atol)
    tolerance.floor = floor
    nodes_a = [e for e in backward_a.nodes if not e.label]
    nodes_b = [e for e in backward_b.nodes if not e.label]
    leaves_a, leaves_b = _leaves(backward_a), _leaves(backward_b)
    pairs = _align(nodes_a, nodes_b, (_gradient_full_key, _gradient_name_key))
    pairs += [(leaves_a.get(key), leaves_b.get(key)) for key in {**leaves_a, **leaves_b}]
    rows = []
    for event_a, event_b in sorted(pairs, key=_backward_position):
        shown = event_b or event_a  # (the side a row shows: an aligned pair has one at least)
        assert shown is not None
        if event_b is None:
            rows.append(CompareRow(ONLY_A, shown.module, _node_name(shown), shown.ordinal, None))
        elif event_a is None:
            rows.append(CompareRow(ONLY_B, shown.module, _node_name(shown), None, shown.ordinal))
        else:
            tolerance.observe(event_a.outputs, event_b.outputs)
            row = _compare_matched(event_a, event_b, backward_a.values, backward_b.values, tolerance)
            row.op = _node_name(event_b)
            rows.append(row)
        rows[-1].depth = shown.scope.depth
    return CompareReport(rows, tag="~")


def _backward_position(pair) -> tuple:
    """Where a pair sits in trace_b's backward (a node only in a sits at its own position in a)."""
    a, b = pair
    return (b.ordinal, 0) if b is not None else (a.ordinal, 1)


def _leaves(backward) -> dict:
    """(label, occurrence) -> the accumulator's event: leaves of the same name (unnamed tensors)
    pair in the order they ran, none dropped."""
    leaves: Dict[Tuple[str, int], Event] = {}
    seen: Dict[str, int] = {}
    for event in backward.nodes:
        if event.label:
            seen[event.label] = seen.get(event.label, 0) + 1
            leaves[(event.label, seen[event.label])] = event
    return leaves


def _kept_backward(trace):
    backwards = getattr(trace, "backward", None) or ()
    return next((b for b in backwards if b.values is not None), None)


def _node_name(event: Event) -> str:
    return f"{event.op} {event.label}" if event.label else event.op


def _gradient_full_key(event: Event) -> tuple:
    return (event.module, event.op, tuple((tuple(meta.shape), meta.dtype) for meta in event.outputs))


def _gradient_name_key(event: Event) -> tuple:
    return (event.module, event.op)


def align(ops_a: Sequence[Event], ops_b: Sequence[Event]) -> List[Tuple[Optional[Event], Optional[Event]]]:
    """Pair the ops of two traces in order: (a, b) when matched, (a, None) / (None, b) otherwise.

    Ops are matched on everything the two sides share: module, op name and each output's shape
    and dtype. What that leaves unmatched is matched again on module, op and shapes (a run in
    another precision: its bf16 ops keep their shapes), then on module and op alone, so an op
    whose shape really changed still pairs with its twin (and is reported not comparable), but
    never in place of a twin that matches more: when one side has an extra `getitem`, its
    same-named neighbour is not paired with the wrong one.
    """
    return _align(list(ops_a), list(ops_b), (_full_key, _shape_key, _name_key))


def _full_key(event: Event) -> tuple:
    return (event.module, event.op, tuple((tuple(meta.shape), meta.dtype) for meta in event.outputs))


def _name_key(event: Event) -> tuple:
    return (event.module, event.op)


def _align(ops_a: List[Event], ops_b: List[Event], key_functions) -> List[Tuple[Optional[Event], Optional[Event]]]:
    """`align` with the first key function; what it leaves unmatched, with the next ones.

    The common head and tail are paired directly, which makes the usual cases (identical
    structure, a few ops inserted or removed in one place) linear; only the part between goes
    through `difflib.SequenceMatcher`, with `autojunk=False` because difflib would otherwise treat
    any key that fills more than 1% of a long trace (every `view` in an attention module) as noise.
    """
    if not key_functions:
        return [(event, None) for event in ops_a] + [(None, event) for event in ops_b]
    key, rest = key_functions[0], key_functions[1:]
    keys_a, keys_b = [key(event) for event in ops_a], [key(event) for event in ops_b]
    head = _common_length(zip(keys_a, keys_b))
    tail = _common_length(zip(reversed(keys_a[head:]), reversed(keys_b[head:])))
    middle_a, middle_b = ops_a[head:len(ops_a) - tail], ops_b[head:len(ops_b) - tail]
    pairs: List[Tuple[Optional[Event], Optional[Event]]] = list(zip(ops_a[:head], ops_b[:head]))
    matcher = difflib.SequenceMatcher(None, keys_a[head:len(keys_a) - tail], keys_b[head:len(keys_b) - tail],
                                      autojunk=False)
    for tag, a_start, a_end, b_start, b_end in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(middle_a[a_start:a_end], middle_b[b_start:b_end]))
        else:
            pairs.extend(_align(middle_a[a_start:a_end], middle_b[b_start:b_end], rest))
    pairs.extend(zip(ops_a[len(ops_a) - tail:], ops_b[len(ops_b) - tail:]))
    return pairs


def _common_length(pairs) -> int:
    """How many leading pairs have equal members."""
    count = 0
    for left, right in pairs:
        if left != right:
            break
        count += 1
    return count


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


def _check_tolerance(value, name: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionTypeError(f"tl.debug.compare({name}=...) takes a number >= 0 or None (per-dtype "
                              f"default), got {value!r}")
    if not value >= 0 or math.isinf(value):
        raise OptionValueError(f"tl.debug.compare({name}=...) takes a finite number >= 0, got {value!r}")
    return float(value)


class _Tolerance:
    """The (rtol, atol) each pair of outputs is held to, op by op along the alignment.

    Integer and bool outputs must be equal. For floating outputs a given `rtol=` / `atol=` wins;
    otherwise the default is the looser of the two dtypes' (`tolerance_for`). Once the two traces
    have differed in floating precision at some op, no later floating op is held tighter than that
    looser dtype: rounding error travels downstream, and autocast runs `add` and `layer_norm` in
    fp32 on values that came out of bf16 matmuls.
    """

    def __init__(self, rtol: Optional[float], atol: Optional[float]):
        self.rtol = rtol
        self.atol = atol
        self.floor = (0.0, 0.0)

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


def _compare_matched(event_a: Event, event_b: Event, values_a: dict, values_b: dict,
                     tolerance: _Tolerance) -> CompareRow:
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


class _Difference:
    """How far apart one output is between the two traces, and the tolerance it was held to."""

    __slots__ = ("max_abs", "max_rel", "rtol", "atol", "within")

    def __init__(self, max_abs: float, max_rel: float, rtol: float, atol: float, within: bool):
        self.max_abs = max_abs
        self.max_rel = max_rel
        self.rtol = rtol
        self.atol = atol
        self.within = within


def _difference(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> _Difference:
    """Compare two same-shape tensors in float64 (complex128) on the CPU, allclose-style.

    Positions that are equal (including equal infinities) or NaN on both sides differ by 0; a NaN
    or infinity on one side only differs by inf and is never within tolerance. Integer and bool
    tensors are within tolerance only when equal (float64 could round large integers together).
    """
    a, b = _dense(a), _dense(b)
    wide = torch.complex128 if a.dtype.is_complex else torch.float64
    a64, b64 = a.detach().to("cpu", wide), b.detach().to("cpu", wide)
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


def _row_lines(rows: List[CompareRow], elide: bool, tag: str = "#") -> List[str]:
    """The column header and one line per row, runs of within-tolerance rows folded when eliding."""
    ordinal_width = max([2] + [len(str(o)) for row in rows for o in (row.ordinal_a, row.ordinal_b) if o])
    op_width = max([2] + [len(row.op) for row in rows])

    def line(a, b, verdict, max_abs, max_rel, op, module, reason=""):
        text = (f"{a:>{ordinal_width + 2}}  {b:>{ordinal_width + 2}}  {verdict:<14}  {max_abs:<9}  {max_rel:<9}  "
                f"{op:<{op_width}}  {module}")
        return (text + "  " + reason if reason else text).rstrip()

    lines = [line("a" + tag, "b" + tag, "verdict", "max_abs", "max_rel", "op" if tag == "#" else "node", "module")]
    shown = _rows_to_show(rows) if elide else [True] * len(rows)
    hidden = 0
    for row, show in zip(rows, shown):
        if not show:
            hidden += 1
            continue
        if hidden:
            lines.append(_elision(hidden, tag))
            hidden = 0
        lines.append(line(
            _ordinal(row.ordinal_a, tag), _ordinal(row.ordinal_b, tag),
            row.verdict or ("only in a" if row.status == ONLY_A else "only in b"),
            _number(row.max_abs), _number(row.max_rel), row.op, row.module or "(root)",
            _judgement_text(row) or row.reason))
    if hidden:
        lines.append(_elision(hidden, tag))
    return lines


def _real_text(row: CompareRow) -> str:
    """Why a row is real: the side whose op computes something else and by how much, or, where
    the op could not be replayed, how far each side is from float64."""
    if row.off is not None and row.own_a is None and row.own_b is None:
        return f"{row.off}'s input differs from the float64 run's (integer values: no ulps, no rounding)"
    if row.off is not None:
        own, other = (row.own_a, row.own_b) if row.off == "a" else (row.own_b, row.own_a)
        near = {"a": "b", "b": "a"}[row.off]
        also = f" ({near}'s: {_ulps(other)})" if other is not None else ""
        far, close = (row.ulps_a, row.ulps_b) if row.off == "a" else (row.ulps_b, row.ulps_a)
        return (f"{row.off}'s op computes something else: {_ulps(own)} from the float64 op on {row.off}'s own "
                f"inputs, where rounding allows {_ulps(row.allowed)}{also}; {row.off} is off float64 by "
                f"{_ulps(far)}, {near} by {_ulps(close)}")
    off = _OTHER_SIDE.get(row.closer)
    if off is None:
        return (f"both sides are off float64 (a {_ulps(row.ulps_a)}, b {_ulps(row.ulps_b)}), where rounding allows "
                f"{_ulps(row.allowed)}")
    far, nearer = (row.ulps_a, row.ulps_b) if off == "a" else (row.ulps_b, row.ulps_a)
    return (f"{off} is off float64 by {_ulps(far)}, {row.closer} by {_ulps(nearer)}, where rounding allows "
            f"{_ulps(row.allowed)}")


_OTHER_SIDE: Dict[Optional[str], str] = {"a": "b", "b": "a"}  # (None: neither side is nearer)


def _judgement_text(row: CompareRow) -> str:
    """`rounding: a 3.2 ulps, b 5 ulps` (`real` rows name the nearer side and the side whose op is
    off, `carried` ones that their divergence came in), `unjudged: why`, or ''."""
    if row.judgement is None:
        return ""
    if row.judgement == UNJUDGED:
        return f"unjudged: {row.reason}"
    if row.judgement == REAL and row.ulps_a is None:
        return f"real: {row.reason}"
    text = f"{row.judgement}: a {_ulps(row.ulps_a)}, b {_ulps(row.ulps_b)}"
    if row.judgement != REAL and (row.own_a is not None or row.own_b is not None):
        # (from float64, each side carries what came before; what the op itself added is the verdict's)
        text += f" (each op's own: a {_ulps(row.own_a)}, b {_ulps(row.own_b)})"
    if row.judgement == REAL:
        text += f", {row.closer} nearer" if row.closer else ""
        if row.off is not None:
            own = row.own_a if row.off == "a" else row.own_b
            text += f"; {row.off}'s op {_ulps(own)} off on its own inputs (allowed {_ulps(row.allowed)})"
    elif row.judgement == CARRIED:
        text += ", carried in from a real op"
    return text


def _rows_to_show(rows: List[CompareRow]) -> List[bool]:
    """Which rows a folded table shows: every row not within tolerance, and its neighbours.

    A single hidden row between two shown ones is shown anyway: a count line would take its place
    and say less.
    """
    notable = [row.verdict != WITHIN or row.judgement == REAL for row in rows]
    shown = [notable[i] or (i > 0 and notable[i - 1]) or (i + 1 < len(rows) and notable[i + 1])
             for i in range(len(rows))]
    for i in range(1, len(rows) - 1):
        if not shown[i] and shown[i - 1] and shown[i + 1]:
            shown[i] = True
    return shown


def _elision(count: int, tag: str = "#") -> str:
    noun = "op" if tag == "#" else "node"
    return f"  ... {count} {noun}{'s' if count != 1 else ''} within tolerance"


def _ordinal(ordinal: Optional[int], tag: str = "#") -> str:
    return "-" if ordinal is None else f"{tag}{ordinal}"


def _ulps(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf ulps"
    return f"{value:.3g} ulps" if value < 1e4 else f"{value:.2e} ulps"


def _number(value: Optional[float]) -> str:
    """A difference as the table prints it: '-' when absent, '0' when exact, else 3 significant digits."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if math.isinf(value):
        return "inf"
    return f"{value:.2e}"


def _plot_range(diffs: Sequence[float]) -> Tuple[float, float]:
    """Where a log-scale plot puts exact zeros (floor) and infinite differences (ceiling)."""
    finite = [d for d in diffs if d > 0 and not math.isinf(d)]
    if not finite:
        return 1e-12, 1.0
    return min(finite) / 10, max(finite) * 10
