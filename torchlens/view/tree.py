"""A run's events as the page's module tree: module calls nesting the rows of what ran inside them.

The page folds and unfolds modules, so it needs calls, not lines. A forward's `ENTER`/`EXIT` events
open and close calls; an event whose module call is not open (a backward, which has no enter or
exit events, or a recording that kept only a tail of its events) opens the calls of its module's
chain itself, so consecutive events of one module share one call. The result is plain JSON-able
dicts with short keys, because a large model has thousands of rows and the page embeds them all.

Row keys (absent when empty): `t` kind (omitted for an op; "in", "out", "try", "node", "grad"),
`i` ordinal, `o` op, `m` output metas (for an attempt, what it was given), `l` label, `b` the
forward op a backward node differentiates, `s` site, `v` statistics, `w` notes shown under the row
(a finding, the attempted-op marker), `f` flags (`NONFINITE`, `HIGHLIGHT`, `ATTEMPT`).
Call keys: `p` module path, `c` class name, `n` rows inside (outputs and attempts excluded), `x`
non-finite rows inside, `k` children (rows and calls, in order).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..events import ENTER, EXIT, GRAD, INPUT, NODE, OUTPUT, Attempt, BackwardAttempt
from ..narration.grammar import attempt_inputs_text, metas_text, render_attempt, site_text

__all__ = ["Tree"]

NONFINITE = 1  # its statistics hold NaN or an infinity
HIGHLIGHT = 2  # the first non-finite row, which the page opens and leads to
ATTEMPT = 4  # the call in flight when the run failed, which the page opens and leads to first

_KINDS = {INPUT: "in", OUTPUT: "out", NODE: "node", GRAD: "grad"}


def _same_call(a, b) -> bool:
    """Whether two scopes name the same module call site (scopes are interned, but a recording
    loaded from disk may hold equal copies)."""
    return a is b or (a.key == b.key and a.depth == b.depth and a.type_name == b.type_name)


def _lineage(scope) -> list:
    """The scopes from the root down to `scope`, both included."""
    chain = []
    while scope is not None:
        chain.append(scope)
        scope = scope.parent
    return chain[::-1]


def _call(scope) -> dict:
    return {"p": scope.path, "c": scope.type_name, "k": []}


class Tree:
    """The module tree of `events`, with `attempt` (a failed run's call in flight) placed in the
    call it was made from. `highlight` is the first non-finite event. `path(event)` gives where a
    row sits: the child indices from the root, which the page follows to open its ancestors."""

    def __init__(self, events: Sequence, attempt: Optional[Attempt] = None, highlight=None,
                 normalize: bool = False):
        self._highlight = highlight
        self._normalize = normalize  # sites as narration showed them (`normalize=True`: base names)
        self._paths: Dict[int, List[int]] = {}
        self.attempt_path: Optional[List[int]] = None
        first = events[0].scope if events else (attempt.scope if attempt else None)
        root_scope = _lineage(first)[0] if first is not None else None
        self.root: Dict[str, Any] = _call(root_scope) if root_scope is not None else {"p": "", "c": "", "k": []}
        self._stack = [(root_scope, self.root)]
        self._indices: List[int] = []  # index of each open call (below the root) in its parent's children
        for event in events:
            self._add(event)
        if attempt is not None:
            self.attempt_path = self._append(attempt.scope, _attempt_row(attempt))
        _count(self.root)

    def path(self, event) -> Optional[List[int]]:
        return None if event is None else self._paths.get(id(event))

    def _add(self, event) -> None:
        kind = event.kind
        if kind is ENTER:
            if event.scope.parent is not None:
                parent = self._open(event.scope.parent)
                node = _call(event.scope)
                self._indices.append(len(parent["k"]))
                parent["k"].append(node)
                self._stack.append((event.scope, node))
        elif kind is EXIT:
            depth = event.scope.depth
            if depth and depth < len(self._stack) and _same_call(self._stack[depth][0], event.scope):
                del self._stack[depth:]
                del self._indices[depth - 1:]
        else:
            self._paths[id(event)] = self._append(event.scope, self._row(event))

    def _append(self, scope, row: dict) -> List[int]:
        call = self._open(scope)
        path = self._indices + [len(call["k"])]
        call["k"].append(row)
        return path

    def _open(self, scope) -> dict:
        """The open call of `scope`: closes calls below the deepest open one on its chain, then
        opens the rest of the chain."""
        chain = _lineage(scope)
        depth = 0
        while (depth + 1 < len(self._stack) and depth + 1 < len(chain)
               and _same_call(self._stack[depth + 1][0], chain[depth + 1])):
            depth += 1
        del self._stack[depth + 1:]
        del self._indices[depth:]
        for link in chain[depth + 1:]:
            parent = self._stack[-1][1]
            node = _call(link)
            self._indices.append(len(parent["k"]))
            parent["k"].append(node)
            self._stack.append((link, node))
        return self._stack[-1][1]

    def _row(self, event) -> dict:
        row = {"i": event.ordinal, "o": event.op, "m": metas_text(event.outputs)}
        kind = _KINDS.get(event.kind)
        if kind:
            row["t"] = kind
        if event.label:
            row["l"] = event.label
        forward = getattr(event, "forward", None)
        if forward:
            row["b"] = forward
        if event.site:
            row["s"] = site_text(event.site, self._normalize)
        flags = 0
        if event.stats is not None:
            stats = str(event.stats)
            if event.stats.nonfinite:
                flags |= NONFINITE
                stats = stats or _counts(event.stats)  # tracking alone prints no statistics: say why it is marked
            if stats:
                row["v"] = stats
        if event is self._highlight:
            flags |= HIGHLIGHT
        if event.finding is not None:
            row["w"] = ["!! " + event.finding.text]
        if flags:
            row["f"] = flags
        return row


def _counts(stats) -> str:
    """`nan=8 +inf=1`: the non-finite counts tracking measured."""
    total = {"nan": 0, "+inf": 0, "-inf": 0}
    for part in getattr(stats, "parts", (stats,)):
        total["nan"] += part.nan or 0
        total["+inf"] += part.posinf or 0
        total["-inf"] += part.neginf or 0
    return " ".join(f"{name}={count}" for name, count in total.items() if count)


def _attempt_row(attempt: Attempt) -> dict:
    """The call in flight, as a row: what it was given (it produced nothing), and its marker lines."""
    backward = isinstance(attempt, BackwardAttempt)
    if attempt.op is None:  # the error came from Python code: its marker line says so
        given = ""
    elif attempt.inputs is None:
        given = "inputs not read"
    elif not attempt.inputs:
        given = "no gradients received" if backward else "no tensor inputs"
    else:
        given = ("received " if backward else "inputs ") + attempt_inputs_text(attempt)
    row = {"t": "try", "o": attempt.op or "(Python code)", "m": given, "f": ATTEMPT,
           "w": render_attempt(attempt, normalize=False)}
    if attempt.op is not None:  # else no torch call was in flight: no op would have had the number
        row["i"] = attempt.ordinal
    if isinstance(attempt, BackwardAttempt) and attempt.forward:  # (a backward's: its forward op)
        row["b"] = attempt.forward
    if attempt.site:
        row["s"] = attempt.site
    return row


def _count(call: dict) -> tuple:
    """Fill in each call's row count and non-finite row count; returns the root's."""
    rows = nonfinite = 0
    for child in call["k"]:
        if "k" in child:
            inner_rows, inner_nonfinite = _count(child)
        else:
            inner_rows = 0 if child.get("t") in ("out", "try") else 1
            inner_nonfinite = 1 if child.get("f", 0) & NONFINITE else 0
        rows += inner_rows
        nonfinite += inner_nonfinite
    call["n"] = rows
    if nonfinite:
        call["x"] = nonfinite
    return rows, nonfinite
