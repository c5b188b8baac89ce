"""`CompareReport`: a comparison's rows, their counts and first divergences, and the report's text.

The text leads with the verdict against float64 (with a reference), then the first divergence,
the counts, and one line per row, runs of rows within tolerance folded; `plot` and `to_html` draw
the same rows.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

from ..narration.grammar import plural
from .rounding import CARRIED, REAL, ROUNDING, UNJUDGED
from .rows import BOTH, DIVERGED, NOT_COMPARABLE, ONLY_A, ONLY_B, UNCHECKED, WITHIN, CompareRow

__all__ = ["CompareReport"]


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
        verdicts, statuses = Counter(row.verdict for row in self.rows), Counter(row.status for row in self.rows)
        judgements = Counter(row.judgement for row in self.rows) if self.judged else None
        return {"matched": statuses[BOTH], "within_tolerance": verdicts[WITHIN], "diverged": verdicts[DIVERGED],
                "not_comparable": verdicts[NOT_COMPARABLE], "unchecked": verdicts[UNCHECKED],
                "only_a": statuses[ONLY_A], "only_b": statuses[ONLY_B],
                **({"rounding": judgements[ROUNDING], "real": judgements[REAL], "carried": judgements[CARRIED],
                    "unjudged": judgements[UNJUDGED]} if judgements is not None else {})}

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
            lines_left = plural(len(body) - max_rows - 1, "more line")
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
    return f"  ... {plural(count, 'op' if tag == '#' else 'node')} within tolerance"


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
