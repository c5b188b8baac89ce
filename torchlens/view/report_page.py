"""The page of a comparison (`CompareReport.to_html`): both traces aligned row by row.

One table per report (the forward's ops, then the backward's nodes when both traces kept
gradients), each row with its ordinal on each side, its verdict and two error bars: the largest
absolute difference against `atol` and the largest relative one against `rtol`. A row passes when
`|a - b| <= atol + rtol * |b|` holds element by element, which one number per side cannot
reconstruct; the bars show how far each measure is from its own tolerance, and the verdict is the
report's.

Row keys (absent when empty): `a`, `b` ordinals, `o` op, `p` module path, `dp` its depth, `v` verdict ("within",
"diverged", "not comparable", "unchecked", or "only in a" / "only in b"), `d` max abs difference,
`r` max rel difference, `at` atol, `rt` rtol, `why` the reason a row is not comparable or unchecked;
with a float64 reference, `j` the judgement ("rounding", "real", "carried", or "unjudged", `why` saying why),
`c` the side nearer float64, `f` the side whose own op is off (a real row's), `ua`, `ub` each side's ulps
from float64, `oa`, `ob` each side's ulps from the float64 op replayed on its own inputs, `al` the ulps
rounding allows. A table with a reference has
`verdict` (the report's leading line) and `real` (the index of the first real divergence, or null).
"""

from __future__ import annotations

from ..archive.encode import number
from .page import page

__all__ = ["SCRIPTS", "report_data", "report_page"]

_ONE_SIDED = {"only_a": "only in a", "only_b": "only in b"}
SCRIPTS = ("common.js", "compare.js")


def report_page(report) -> str:
    """The HTML page of a `CompareReport` (and of its `gradients` report, when there is one)."""
    title, data = report_data(report)
    return page(title, data, SCRIPTS)


def report_data(report):
    """(title, data): what the page of `report` shows, as the page's script reads it."""
    tables = [_table(report, "forward ops" if report.tag == "#" else "backward nodes (gradients)")]
    if report.gradients is not None:
        tables.append(_table(report.gradients, "backward nodes (gradients)"))
    title = "torchlens: compare"
    return title, {"title": title, "tables": tables}


def _table(report, title: str) -> dict:
    counts = report.counts
    noun = "op" if report.tag == "#" else "node"
    tally = (f"{len(report.rows)} aligned {noun}s: {counts['matched']} in both ({counts['within_tolerance']} within "
             f"tolerance, {counts['diverged']} diverged, {counts['not_comparable']} not comparable, "
             f"{counts['unchecked']} unchecked), {counts['only_a']} only in a, {counts['only_b']} only in b")
    if report.judged:
        tally += (f"; against float64: {counts['rounding']} rounding, {counts['real']} real, "
                  f"{counts['carried']} carried, {counts['unjudged']} unjudged")
    first = report.first_divergence
    table = {
        "title": title,
        "tag": report.tag,
        "summary": report.summary(),
        "tally": tally,
        "first": None if first is None else report.rows.index(first),
        "rows": [_row(row) for row in report.rows],
    }
    if report.judged:
        real = report.first_real
        table["verdict"] = report.verdict()
        table["real"] = None if real is None else report.rows.index(real)
    return table


def _row(row) -> dict:
    out = {"o": row.op, "v": row.verdict or _ONE_SIDED.get(row.status, row.status)}
    for key, value in (("a", row.ordinal_a), ("b", row.ordinal_b)):
        if value is not None:
            out[key] = value
    for key, value in (("p", row.module), ("why", row.reason)):
        if value:
            out[key] = value
    if getattr(row, "depth", None):
        out["dp"] = row.depth
    if row.judgement is not None:
        out["j"] = row.judgement
        if row.closer:
            out["c"] = row.closer
        if row.off:
            out["f"] = row.off
    for key, value in (("d", row.max_abs), ("r", row.max_rel), ("at", row.atol), ("rt", row.rtol),
                       ("ua", row.ulps_a), ("ub", row.ulps_b), ("oa", row.own_a), ("ob", row.own_b),
                       ("al", row.allowed)):
        if value is not None:
            out[key] = number(value)  # whole (the page rounds once, as the text report does); JSON has no inf
    return out
