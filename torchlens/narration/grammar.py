"""The one line grammar: how an `Event` (and the notes around it) becomes a line of text.

Rules every renderer here keeps:

- Op lines (input sources and ops) start with `#N` after their indentation; module lines start with
  `>` (enter) and `<` (exit); result lines with `=>`; notes and the footer with `--`; failure lines
  with `!!`. Only op lines start with `#`, so counting them counts ops.
- Indentation is two spaces per *module* depth: an op inside a depth-d module is indented 2*d; the
  enter/exit lines of a depth-d module are indented 2*(d-1), so they sit one level out from the ops
  they enclose.
- Byte-stable: nothing on a line depends on addresses, ids, time or dictionary order. With
  `normalize=True` what still differs between machines (directories in sites, device indices) is
  removed too.

Column layout of an op line::

    {indent}{#N:<6}{op:<14}{shapes dtype device}  {@module | input name}  {site}  | {stats}

A backward, narrated after its forward's footer under its own `-- backward ...` header, has two
more line kinds: `~N` lines, one per autograd node in the order it ran, indented by the module
depth of the forward op it differentiates, and `<=` lines, the gradient that reached a forward
output from outside (the loss)::

    {indent}{~N:<6}{node:<14}{gradients}  {leaf name}  <- {#N op @module}  {site}  | {stats}
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..events import ENTER, EXIT, GRAD, INPUT, NODE, OP, OUTPUT, Attempt, BackwardAttempt, Event, TensorMeta
from .stats_text import stats_text

__all__ = ["RECOUNTED_FINITE_NOTE", "UNFINISHED_NOTE", "attempt_inputs_text", "backward_footer_parts",
           "compiled_run_note", "device_name", "dtype_name", "footer_parts", "forward_counts", "measurement_notes",
           "meta_text", "metas_text", "op_ref", "opaque_calls_note", "plural", "render_attempt",
           "render_dropped_events_note", "render_earlier_lines_note", "render_event", "render_failure",
           "render_failure_header", "render_footer", "render_limit_note", "render_note", "shape_text", "site_text",
           "values_text"]

TAG_WIDTH = 6
OP_WIDTH = 14
MAX_OUTPUTS_SHOWN = 4

_DTYPE_NAMES: Dict[torch.dtype, str] = {}
_DEVICE_NAMES: Dict[Tuple[torch.device, bool], str] = {}
_META_TEXTS: Dict[Tuple[TensorMeta, bool], str] = {}
_OP_COLUMNS: Dict[str, str] = {}
_OP_BODIES: Dict[tuple, str] = {}  # (op, outputs, module path, depth, label, site, normalize, engine) -> body
_MODULE_LINES: Dict[Tuple[str, str, int], Tuple[str, str]] = {}  # (path, class, depth) -> (enter, exit)
_CACHE_LIMIT = 1 << 16
_INDENTS = ["  " * d for d in range(256)]  # deeper than any real module tree
_TAGGED = 1 << 14
_ORDINAL_TAGS = ["#%-4d " % n for n in range(_TAGGED)]  # the `#N` column of a forward's first ops


def dtype_name(dtype: torch.dtype) -> str:
    """Short dtype names in the usual shorthand: f32, bf16, f8_e4m3fn, i64, c64, bool."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        full = str(dtype).replace("torch.", "")
        for long, short in (("bfloat", "bf"), ("float", "f"), ("complex", "c"), ("uint", "u"), ("int", "i")):
            if full.startswith(long):
                full = short + full[len(long):]
                break
        name = _DTYPE_NAMES[dtype] = full
    return name


def device_name(device, normalize: bool = False) -> str:
    """`cpu`, `cuda:0`, `meta`; with `normalize` the index is dropped (`cuda`)."""
    key = (device, normalize)
    name = _DEVICE_NAMES.get(key)
    if name is None:
        name = _DEVICE_NAMES[key] = device.type if normalize else str(device)
    return name


def shape_text(shape) -> str:
    return "[" + ",".join([str(size) for size in shape]) + "]"


def meta_text(meta: TensorMeta, normalize: bool = False) -> str:
    """`[1,2] f32 cpu` (memoised: a forward repeats a few shapes many times)."""
    key = (meta, normalize)
    try:
        return _META_TEXTS[key]
    except KeyError:
        text = shape_text(meta.shape) + " " + dtype_name(meta.dtype) + " " + device_name(meta.device, normalize)
        if len(meta) > 3:  # a DTensor: `Shard(1) local [3,8]`
            text += f" {meta[3]} local {shape_text(meta[4])}"
        if len(_META_TEXTS) < 65536:
            _META_TEXTS[key] = text
        return text
    except TypeError:  # an unhashable size (a symbolic one): format it every time
        return shape_text(meta.shape) + " " + dtype_name(meta.dtype) + " " + device_name(meta.device, normalize)


def metas_text(metas, normalize: bool = False) -> str:
    """All outputs of an op, comma-separated; long tuples are cut after a few with a count."""
    if len(metas) == 1:
        return meta_text(metas[0], normalize)
    if not metas:
        return "(no tensors)"
    shown = [meta_text(m, normalize) for m in metas[:MAX_OUTPUTS_SHOWN]]
    if len(metas) > MAX_OUTPUTS_SHOWN:
        shown.append(f"... (+{len(metas) - MAX_OUTPUTS_SHOWN} more)")
    return ", ".join(shown)


def site_text(site: Optional[str], normalize: bool) -> str:
    """A call site as `path:line`; `normalize` keeps only the file's base name."""
    if not site:
        return ""
    if normalize:
        return site.rsplit("/", 1)[-1].rsplit("\\", 1)[-1]
    return site


def _tag(tag: str) -> str:
    return tag.ljust(TAG_WIDTH - 1) + " "


def _op_column(op: str) -> str:
    column = _OP_COLUMNS.get(op)
    if column is None:
        column = _OP_COLUMNS[op] = op.ljust(OP_WIDTH - 1) + " "
    return column


def render_event(event: Event, sites: bool = False, normalize: bool = False, folded: int = 0) -> str:
    """One event as one line (without prefix or newline)."""
    kind = event.kind
    if kind is OP or kind is INPUT:
        return render_op(event, sites, normalize)
    scope = event.scope
    if kind is ENTER:
        return _module_lines(scope)[0]
    if kind is EXIT:
        line = _module_lines(scope)[1]
        if folded:
            line += f"  [{folded} op{'s' if folded != 1 else ''} folded]"
        return line
    if kind is OUTPUT:
        return _tag("=>") + _op_column("output") + metas_text(event.outputs, normalize) + "  " + event.label
    if kind is NODE:
        return render_node(event, sites, normalize)
    if kind is GRAD:
        return _with_stats(_tag("<=") + _op_column("grad") + metas_text(event.outputs, normalize) + "  " + event.label,
                           event)
    raise ValueError(f"unknown event kind {kind!r}")


def _module_lines(scope) -> tuple:
    """A module's enter and exit lines, rendered once per (path, class, depth of the call) and
    kept on the scope, which every event of the call shares."""
    lines = getattr(scope, "lines", None)  # (absent from a scope pickled before it existed)
    if lines is not None:
        return lines
    key = (scope.path, scope.type_name, scope.depth)
    lines = _MODULE_LINES.get(key)
    if lines is None:
        indent = _INDENTS[scope.depth - 1] if scope.depth > 0 else ""
        lines = (f"{indent}> {scope.path} ({scope.type_name})", f"{indent}< {scope.path}")
        if len(_MODULE_LINES) < _CACHE_LIMIT:
            _MODULE_LINES[key] = lines
    scope.lines = lines
    return lines


def render_op(event: Event, sites: bool, normalize: bool) -> str:
    """`#N op shapes @module site | stats`. Everything after the ordinal depends only on the op,
    its outputs' metadata, its module and site: memoised, since a forward repeats them."""
    site = event.site if sites else None
    key = (event.op, event.outputs, event.scope.path, event.scope.depth, event.label, site, normalize, event.engine)
    try:
        body = _OP_BODIES[key]
    except KeyError:
        body = _op_body(event, site, normalize)
        if len(_OP_BODIES) < _CACHE_LIMIT:
            _OP_BODIES[key] = body
    except TypeError:  # an unhashable (symbolic) size
        body = _op_body(event, site, normalize)
    ordinal = event.ordinal
    tag = _ORDINAL_TAGS[ordinal] if 0 <= ordinal < _TAGGED else "#%-4d " % ordinal
    return _with_stats(_INDENTS[event.scope.depth] + tag + body, event)


def render_node(event, sites: bool, normalize: bool) -> str:
    """`~N AddmmBackward0 [4] f32 cpu, [2,8] f32 cpu  <- #5 linear @fc2 | stats`: a backward node
    and the gradients it produced (an `AccumulateGrad` shows the leaf it accumulated into)."""
    ordinal = event.ordinal
    line = (_INDENTS[event.scope.depth] + "~%-4d " % ordinal + _op_column(event.op)
            + metas_text(event.outputs, normalize))
    if event.label:
        line += "  " + event.label
    if event.forward:
        line += "  <- " + event.forward
    if sites and event.site:
        line += "  " + site_text(event.site, normalize)
    return _with_stats(line, event)


def _with_stats(line: str, event) -> str:
    if event.stats is not None:
        stats = stats_text(event.stats)
        if stats:
            line += "  | " + stats
    return line


def _op_body(event: Event, site, normalize: bool) -> str:
    body = _op_column(event.op) + metas_text(event.outputs, normalize)
    if event.kind is INPUT:
        body += "  " + event.label
    elif event.scope.depth:
        body += "  @" + event.scope.path
    if event.kind is not INPUT and event.label:  # a collective's group (`group of 2, async`)
        body += "  " + event.label
    if event.engine is not None:  # shown only with `engine_ops=True`
        body += f"  [{event.engine}]"
    if site:
        body += "  " + site_text(site, normalize)
    return body


def op_ref(ordinal: int, op: str, path: str) -> str:
    """`#57 log @blocks.1`: how notes, errors and footers point at an op."""
    return f"#{ordinal} {op} @{path}" if path else f"#{ordinal} {op}"


def render_note(text: str) -> str:
    return "-- " + text


def render_failure(text: str) -> str:
    return "!! " + text


def render_failure_header(error: str, what: str = "forward") -> str:
    """The first line of a failure block: what the forward (or a backward) raised."""
    return render_failure(f"{what} failed: {error}")


def render_earlier_lines_note(count: int) -> str:
    """In a failure block: how many lines before its window are not shown again."""
    return render_note(f"... {plural(count, 'earlier line')}")


def render_dropped_events_note(count: int, pass_number: int) -> str:
    """In a `Recorder` tail: how many events of a pass the tail buffer no longer holds."""
    return render_note(f"... {count} earlier events of pass {pass_number} not kept")


def render_attempt(attempt: Attempt, normalize: bool) -> list:
    """The attempted-op marker: the call that raised (so produced nothing), never over-claimed.

    A second line follows when CUDA tensors were involved, because a CUDA kernel error is reported
    at a later synchronisation point and the named call may only be where it surfaced. How the call
    was located (and that method's caveats) comes first, as notes.
    """
    notes = [render_note(note) for note in attempt.notes]
    return notes + _attempt_lines(attempt, normalize)


def _attempt_lines(attempt: Attempt, normalize: bool) -> list:
    if isinstance(attempt, BackwardAttempt):
        return _backward_attempt_lines(attempt, normalize)
    if attempt.op is None:
        where = f" in @{attempt.scope.path}" if attempt.scope.path else ""
        line = (f"attempted: no torch call was in flight; the error came from Python code{where} after "
                f"#{attempt.ordinal - 1}")
        if attempt.site:
            line += "  " + site_text(attempt.site, normalize)
        return [render_failure(line)]
    if attempt.inputs is None:  # located without seeing its arguments
        inputs = "not read"
    else:
        inputs = attempt_inputs_text(attempt, normalize) or "no tensor inputs"
    head = f"#{attempt.ordinal} {attempt.op}" + (f" @{attempt.scope.path}" if attempt.scope.path else "")
    return _attempted(head, attempt, f"inputs: {inputs}", "op", normalize)


def attempt_inputs_text(attempt: Attempt, normalize: bool = False) -> str:
    """`[1,3] i64 cpu (min=1 max=200), [128,8] f32 cpu`: the attempted call's tensor inputs, an
    integer one with what it held (`Attempt.values`)."""
    values = attempt.values if attempt.values is not None else ()
    return ", ".join(meta_text(meta, normalize) + (f" ({values_text(values[i])})" if i < len(values) and values[i]
                                                   else "") for i, meta in enumerate(attempt.inputs or ()))


def values_text(values) -> str:
    """`min=1 max=200`, or `values not read: the device faulted` (`integer_values.Values`)."""
    if values.unread is not None:
        return f"values not read: {values.unread}"
    return f"min={values.low} max={values.high}"


def _backward_attempt_lines(attempt: BackwardAttempt, normalize: bool) -> list:
    received = ", ".join(meta_text(m, normalize) for m in attempt.inputs or ()) or "no gradients"
    head = f"~{attempt.ordinal} {attempt.op}" + (f" <- {attempt.forward}" if attempt.forward else "")
    return _attempted(head, attempt, f"received: {received}", "node", normalize)


def _attempted(head: str, attempt: Attempt, tensors: str, earlier: str, normalize: bool) -> list:
    """`!! attempted {head}  {site}  {tensors}  (not proven culprit)`, and the CUDA caveat."""
    line = f"attempted {head}"
    if attempt.site:
        line += "  " + site_text(attempt.site, normalize)
    lines = [render_failure(f"{line}  {tensors}  (not proven culprit)")]
    if attempt.on_cuda:
        lines.append(render_failure(f"CUDA errors are asynchronous: the failing kernel may have been launched by an "
                                    f"earlier {earlier}; rerun with CUDA_LAUNCH_BLOCKING=1 to make them synchronous"))
    return lines


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def forward_counts(events) -> str:
    """`2 inputs, 14 ops, 5 module calls`: what a forward ran (its inputs counted as the footer counts)."""
    return ", ".join(plural(sum(1 for e in events if e.kind is kind), noun)
                     for kind, noun in ((INPUT, "input"), (OP, "op"), (ENTER, "module call")))


# -- footer notes: how a forward ran ------------------------------------------------------------

def opaque_calls_note(scripted: int, graph_calls: int) -> List[str]:
    """Calls an eager capture narrated as one op each, their insides unseen."""
    notes = []
    if scripted:
        notes.append(f"{plural(scripted, 'TorchScript call')} narrated as one op each (`scripted`): "
                     f"their insides are not visible")
    if graph_calls:
        notes.append(f"{plural(graph_calls, 'compiled graph call')} narrated as one op each (`compiled`): "
                     f"narrate their ops with backend=\"torchlens\" or tl.compile")
    return notes


def compiled_run_note(graph_calls: int, ops_between: int) -> str:
    """How a compiled forward ran: its graph calls, and the ops dynamo ran eagerly between them."""
    note = plural(graph_calls, "compiled graph call")
    if ops_between:
        note += f", {plural(ops_between, 'op')} run eagerly between graphs"
    return note


UNFINISHED_NOTE = "the call ended without torchlens seeing it end"
# A screened compiled graph's screens found a NaN or an infinity, and its second run held none: the
# first run held a value the second, compiled otherwise and rounding otherwise, did not.
RECOUNTED_FINITE_NOTE = ("a compiled graph's screen found a non-finite value, but its second run held none "
                         "(the two runs rounding apart): nothing is claimed of what the first held")


def measurement_notes(value_stats: str, verdict: Optional[str], incomplete: Optional[str]) -> List[str]:
    """The footer's words on what a pass (forward or backward) measured: the statistics rung, then
    tracking's `verdict` (which says in its own words what went unrecorded), or, without tracking,
    that not everything after `incomplete` was recorded."""
    notes = [f"value_stats={value_stats}"] if value_stats != "off" else []
    if verdict is not None:
        notes.append(verdict)
    elif incomplete:
        notes.append(f"not everything after {incomplete} was recorded")
    return notes


def footer_parts(counts, depth: Optional[int], max_lines: Optional[int], extra: Iterable[str] = ()) -> List[str]:
    """The footer's parts from a narrator's `PassCounts`: what ran, what was not shown and why,
    then `extra` (notes of how the forward ran, statistics, the tracking verdict)."""
    ran = f"{plural(counts.inputs, 'input')}, {plural(counts.ops, 'op')}, {plural(counts.module_calls, 'module call')}"
    return [ran] + _unshown_parts(counts, depth, max_lines) + list(extra)


def backward_footer_parts(counts, depth: Optional[int], max_lines: Optional[int],
                          extra: Iterable[str] = ()) -> List[str]:
    """The footer of a backward: the nodes that ran, the gradients accumulated into leaves, what
    was not shown and why, then `extra` (statistics, the gradient verdict)."""
    ran = f"{plural(counts.nodes, 'node')}, {plural(counts.leaves, 'gradient')} accumulated"
    if counts.grads:
        ran += f", {plural(counts.grads, 'output gradient')} received"
    return [ran] + _unshown_parts(counts, depth, max_lines) + list(extra)


def _unshown_parts(counts, depth: Optional[int], max_lines: Optional[int]) -> List[str]:
    """What a narration did not show, and why: selection, depth folding, `max_lines`."""
    parts = []
    if counts.unselected:
        parts.append(f"{counts.unselected} not selected")
    if counts.folded_total:
        parts.append(f"{counts.folded_total} folded (depth={depth})")
    if counts.lines_suppressed:
        parts.append(f"{counts.lines_suppressed} lines not printed (max_lines={max_lines})")
    engines = getattr(counts, "engine_folded", None)
    if engines:
        shown = " and ".join(f"{count} of {engine}" for engine, count in engines.items())
        parts.append(f"{sum(engines.values())} engine ops folded ({shown}; engine_ops=True shows them)")
    return parts


def render_limit_note(max_lines: int) -> str:
    """The one note printed when `max_lines` is reached."""
    return render_note(f"max_lines={max_lines} reached: narration stops here; the run goes on")


def render_footer(parts: Iterable[str]) -> str:
    return render_note("end: " + "; ".join(parts))
