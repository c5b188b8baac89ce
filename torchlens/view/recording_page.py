"""The page of one run (`Recording.to_html`): the forward as a module tree, then each backward.

Each part of the run is a *section*: its summary lines, its tree (see `tree.py`), where its first
non-finite row and its failure sit, and its footer as narration printed it. The summary says what
was measured before saying what was found: with neither statistics nor tracking on, a run with NaN
everywhere would show no non-finite row, and the page says it cannot tell rather than "no NaN".
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional

from ..events import GRAD, INPUT, NODE, OP
from ..measure.tracking import held, unmeasured_reason
from ..narration.grammar import forward_counts, op_ref, plural
from .page import page
from .tree import Tree

__all__ = ["SCRIPTS", "recording_data", "recording_page"]

TAIL_LINES = 20  # a failure's tail, as `partial_trace.narrate(last=20)` prints it
SCRIPTS = ("common.js", "tree.js")


def recording_page(recording) -> str:
    """The HTML page of a `Recording`, `Trace` or `PartialTrace`."""
    title, data = recording_data(recording)
    return page(title, data, SCRIPTS)


def recording_data(recording):
    """(title, data): what the page of `recording` shows, as the page's script reads it."""
    kind = type(recording).__name__
    failed_backward = getattr(recording, "failed_backward", None)
    forward_failed = hasattr(recording, "error") and failed_backward is None
    sections = [_forward(recording, forward_failed)]
    sections += [_backward(run, recording.settings, recording.narrate(last=TAIL_LINES, prefix="")
                           if run is failed_backward else None)
                 for run in getattr(recording, "backward", ())]
    title = f"torchlens: {kind}" + (f" ({recording.header})" if recording.header else "")
    if forward_failed or failed_backward is not None:
        title += ", failed"
    return title, {"title": title, "sections": sections}


def _first(run, settings):
    """The row to lead to as the first non-finite one: none when finiteness was not measured
    (sampled statistics without tracking see only the tensors small enough to read whole)."""
    if settings.on_nonfinite is None and settings.value_stats != "exact":
        return None
    return run.first_nonfinite


def _forward(recording, failed: bool) -> dict:
    events = recording.events
    first = _first(recording, recording.settings)
    normalize = _normalized(recording.settings)
    tree = Tree(events, recording.attempt if failed else None, highlight=first, normalize=normalize)
    lines = [_line(("before the failure: " if failed else "") + forward_counts(events))]
    lines += _nonfinite_lines(recording.settings, tree, recording.findings, first, "values", "op", "#",
                              [e for e in events if e.kind is OP or e.kind is INPUT], failed)
    section: Dict[str, Any] = {"title": "forward", "tag": "#", "unit": "ops", "lines": lines, "tree": tree.root,
               "first": tree.path(first)}
    if failed:
        error = f"forward failed: {recording.error}"
        lines.insert(0, _line(error, "bad", tree.attempt_path))
        section["failure"] = {"error": error, "at": tree.attempt_path,
                              "tail": str(recording.narrate(last=TAIL_LINES, prefix=""))}
    else:
        section["footer"] = _footer(recording.narrate(prefix="").lines)
    return section


def _normalized(settings) -> bool:
    return settings.narration is not None and settings.narration.normalize


def _backward(run, settings, tail: Optional[str]) -> dict:
    """A backward's section; `tail` is the failure's tail when it is the run's failed backward."""
    events = run.events
    first = _first(run, settings)
    failed = run.error is not None
    tree = Tree(events, run.attempt if failed else None, highlight=first, normalize=_normalized(settings))
    nodes = [e for e in events if e.kind is NODE]
    ran = plural(len(nodes), "node") + ", " + plural(sum(1 for e in nodes if e.label), "gradient") + " accumulated"
    grads = sum(1 for e in events if e.kind is GRAD)
    if grads:
        ran += ", " + plural(grads, "output gradient") + " received"
    lines = [_line(("before the failure: " if failed else "") + ran)]
    lines += _nonfinite_lines(settings, tree, run.findings, first, "gradients", "node", "~",
                              [e for e in events if e.kind is NODE or e.kind is GRAD], failed)
    section = {"title": run.header, "tag": "~", "unit": "nodes", "lines": lines, "tree": tree.root,
               "first": tree.path(first)}
    narrated = run.narrate(prefix="").lines
    if failed:
        error = f"backward failed: {run.error}"
        lines.insert(0, _line(error, "bad", tree.attempt_path))
        section["failure"] = {"error": error, "at": tree.attempt_path,
                              "tail": tail if tail is not None else "".join(line + "\n" for line in
                                                                          narrated[-TAIL_LINES:])}
    else:
        section["footer"] = _footer(narrated)
    return section


def _nonfinite_lines(settings, tree: Tree, findings, first, values: str, noun: str, tag: str,
                     measurable, failed: bool) -> List[dict]:
    """What is known of NaN and infinity in this section, qualified by what was measured: rows
    whose values were not measured are counted, with why, and "no non-finite" is never said
    over them."""
    tracking = settings.on_nonfinite is not None
    if not tracking and settings.value_stats == "off":
        return [_line(f"{values} not measured (value_stats='off', on_nonfinite=None): this page cannot tell "
                      f"whether any was NaN or infinite; record with on_nonfinite='track' to know", "muted")]
    if not tracking and settings.value_stats != "exact":
        return [_line(f"finiteness not measured: value_stats={settings.value_stats!r} does not count NaN or "
                      f"infinity; value_stats='exact' or on_nonfinite='track' does", "muted")]
    held = tree.root.get("x", 0)
    unmeasured = _unmeasured(measurable)
    if not held:
        if unmeasured:
            return [_line(f"no non-finite {values} among those measured; {unmeasured}", "warn")]
        return [_line(f"no non-finite {values}", "ok")]
    lines = [_line(f"{held} of {plural(tree.root['n'], 'row')} held NaN or infinity", "warn")]
    if unmeasured:
        lines.append(_line(unmeasured, "muted"))
    if tracking:
        # (a consequence of a value the forward read or produced is no headline: that value is)
        lines += [_line("!! " + finding.text, "warn" if finding.consequence else "bad", tree.path(finding.event))
                  for finding in findings]
        if not findings and failed:
            lines.append(_line("non-finite tracking made no finding before the failure: an infinity is judged by "
                               "what becomes of it, and this run failed before its output", "warn"))
        elif not findings:
            lines.append(_line("non-finite tracking made no finding: it judged each one harmless (absorbed "
                               "before the output, as a causal mask's -inf is)", "muted"))
    elif first is not None:
        if first.kind is GRAD:
            where = f"the gradient received at the output {first.label}"
        else:
            where = op_ref(first.ordinal, first.op, first.scope.path).replace("#", tag, 1)
        among = " among those measured" if unmeasured else ""
        lines.append(_line(f"first non-finite {noun}{among}: {where}", "bad", tree.path(first)))
    return lines


def _unmeasured(events) -> str:
    """`3 rows not measured (uninitialized: 2, a sparse tensor: 1)`, or "" when every one was."""
    reasons = collections.Counter(unmeasured_reason(event) for event in events if held(event) is None)
    if not reasons:
        return ""
    count = sum(reasons.values())
    return (f"{plural(count, 'row')} not measured ("
            + ", ".join(f"{reason}: {n}" for reason, n in sorted(reasons.items())) + ")")


def _footer(narrated: List[str]) -> List[str]:
    """The first footer line of a transcript (`-- end: ...`): a recording's is its forward's, which
    its backwards' transcripts follow."""
    return [line for line in narrated if line.startswith("-- end: ")][:1]


def _line(text: str, cls: str = "", at: Optional[list] = None) -> dict:
    """A summary line; `at` (a row's path) makes it a link to the row."""
    line: Dict[str, Any] = {"text": text}
    if cls:
        line["cls"] = cls
    if at is not None:
        line["at"] = at
    return line
