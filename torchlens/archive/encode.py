"""A recording as plain data: the document `save` writes.

The document is JSON all the way down (no pickles, no class names that a reader would import):
scopes as a table, events as rows that name their scope by index, statistics as numbers (with
"nan", "inf" and "-inf" spelled as strings, which JSON has no numbers for), findings and the
attempted op by the index of their event. Tensors travel beside it, named `op/5/0` (op #5's first
output), `backward/0/7/1`, `output/2` and `repro/0` (the inputs of the call a repro replays:
`archive.calls`); `tensors()` gathers the first three.

What cannot be written as data is said, never guessed: a selector that is a Python function is
stored as what it selected (one flag per event), a forward output that is not tensors, numbers,
strings and containers of them is left out with a note, a sparse value is stored dense, and a
kept value in a layout the tensor format has no slot for (nested) is left out with a note that
names it.

Reads recordings by their attributes only, so that `results` can import it without a cycle.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional, Tuple

import torch

from ..events import BackwardAttempt, ShardedMeta, Stats, StatsGroup, TensorMeta
from ..measure.stats import is_dtensor, unwrapped
from ..selectors import InModule, _AllOf, _AnyOf, _Not

__all__ = ["FORMAT", "READABLE_VERSIONS", "VERSION", "document", "number", "put", "tensors"]

FORMAT = "torchlens-trace"
# 2: a DTensor's placement and local shape, an engine op's engine; 3: the call a repro replays
# (`archive.calls`). Files of the earlier versions still load.
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)

_STATS_FIELDS = Stats.__slots__


def number(value):
    """A statistic as JSON: finite numbers as themselves, the others as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return value


def meta_doc(meta: TensorMeta) -> list:
    shape, dtype, device = meta[:3]
    row = [[size if isinstance(size, (int, str)) else str(size) for size in shape],
           str(dtype).replace("torch.", ""), str(device)]
    if isinstance(meta, ShardedMeta):  # a DTensor: its placement and this rank's local shape too
        row += [meta.placements, list(meta.local_shape)]
    return row


def stats_doc(stats) -> Optional[object]:
    if stats is None:
        return None
    if isinstance(stats, StatsGroup):
        return [stats_doc(part) for part in stats.parts]
    return {name: number(getattr(stats, name)) for name in _STATS_FIELDS}


class _Scopes:
    """Interns `Scope`s as rows `[path, type name, parent row or null, key]`."""

    def __init__(self):
        self.rows: List[list] = []
        self._index: Dict[int, int] = {}

    def index(self, scope) -> int:
        found = self._index.get(id(scope))
        if found is not None:
            return found
        parent = None if scope.parent is None else self.index(scope.parent)
        self._index[id(scope)] = len(self.rows)
        self.rows.append([scope.path, scope.type_name, parent, scope.key])
        return self._index[id(scope)]


def selector_doc(selector):
    """A selector as data, or None when part of it is a Python function (saved as its result)."""
    if isinstance(selector, InModule):
        return {"in_module": list(selector.paths)}
    if isinstance(selector, _AllOf):  # (a subclass of _AnyOf: test it first)
        parts = [selector_doc(part) for part in selector.parts]
        return None if None in parts else {"all": parts}
    if isinstance(selector, _AnyOf):
        parts = [selector_doc(part) for part in selector.parts]
        return None if None in parts else {"any": parts}
    if isinstance(selector, _Not):
        inner = selector_doc(selector.inner)
        return None if inner is None else {"not": inner}
    return None  # a Predicate, or a Selector subclass of the user's


def narration_doc(options) -> Optional[dict]:
    if options is None:
        return None
    return {
        "sites": options.sites,
        "max_lines": options.max_lines,
        "prefix": options.prefix,
        "depth": options.depth,
        "normalize": options.normalize,
        "tail_on_error": options.tail_on_error,
        "on_error_only": options.on_error_only,
        "symbolic_shapes": options.symbolic_shapes,
        "engine_ops": options.engine_ops,
        "select": None if options.select is None else selector_doc(options.select),
        "select_saved_as_flags": options.select is not None and selector_doc(options.select) is None,
    }


def settings_doc(settings) -> dict:
    return {
        "narration": narration_doc(settings.narration),
        "value_stats": settings.value_stats,
        "on_nonfinite": settings.on_nonfinite,
        "keep_values": bool(settings.keep_values),
        "keep_on_cpu": bool(settings.keep_on_cpu),
        "max_bytes": settings.max_bytes,
        "backward": bool(settings.backward),
        "dtensor_stats": settings.dtensor_stats,
    }


def _selected_by_function(settings):
    options = settings.narration
    if options is None or options.select is None or selector_doc(options.select) is not None:
        return None
    return options.select


def event_doc(event, scopes: _Scopes, findings: Dict[int, int], select) -> dict:
    row = {"kind": event.kind.value, "ordinal": event.ordinal, "op": event.op, "scope": scopes.index(event.scope),
           "outputs": [meta_doc(meta) for meta in event.outputs]}
    for name in ("site", "label", "engine"):
        value = getattr(event, name)
        if value is not None:
            row[name] = value
    if event.stats is not None:
        row["stats"] = stats_doc(event.stats)
    if event.finding is not None and id(event.finding) in findings:
        row["finding"] = findings[id(event.finding)]
    forward = getattr(event, "forward", None)
    if forward is not None:
        row["forward"] = forward
    if select is not None and not select(event):
        row["selected"] = False
    return row


def findings_doc(findings, events) -> Tuple[list, Dict[int, int]]:
    """The findings as rows (their event by index), and finding id -> row."""
    position = {id(event): index for index, event in enumerate(events)}
    rows: List[dict] = []
    index: Dict[int, int] = {}
    for finding in findings:
        index[id(finding)] = len(rows)
        rows.append({"text": finding.text, "event": position.get(id(finding.event)), "live": bool(finding.live),
                     "birth": bool(finding.birth), "kind": finding.kind.name if finding.kind is not None else None,
                     "source": finding.source})
    return rows, index


def attempt_doc(attempt, scopes: _Scopes) -> Optional[dict]:
    if attempt is None:
        return None
    doc = {"op": attempt.op, "ordinal": attempt.ordinal, "scope": scopes.index(attempt.scope), "site": attempt.site,
           "inputs": None if attempt.inputs is None else [meta_doc(meta) for meta in attempt.inputs],
           "notes": list(attempt.notes)}
    if attempt.values is not None:  # what its integer inputs held
        doc["values"] = [None if v is None else {"unread": v.unread} if v.unread is not None else
                         {"low": v.low, "high": v.high} for v in attempt.values]
    if isinstance(attempt, BackwardAttempt):
        doc["forward"] = attempt.forward
    return doc


def _events_doc(events, findings, scopes: _Scopes, select) -> Tuple[list, list]:
    finding_rows, index = findings_doc(findings, events)
    return [event_doc(event, scopes, index, select) for event in events], finding_rows


def document(recording) -> dict:
    """The recording (a `Recording`, `Trace` or `PartialTrace`) as JSON-ready data.

    The events are under "events" and each backward's under its "events"; `save` moves them to
    files of their own, one JSON object per line."""
    scopes = _Scopes()
    select = _selected_by_function(recording.settings)
    events, findings = _events_doc(recording.events, recording.findings, scopes, select)
    backwards = []
    failed = getattr(recording, "failed_backward", None)
    for run in getattr(recording, "backward", ()):
        run_events, run_findings = _events_doc(run.events, run.findings, scopes, select)
        backwards.append({"header": run.header, "footer_extra": list(run.footer_extra), "finished": run.finished,
                          "verdict": getattr(run, "verdict", None),
                          "error": run.error, "attempt": attempt_doc(run.attempt, scopes),
                          "findings": run_findings, "events": run_events})
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "class": type(recording).__name__ if type(recording).__name__ in ("Recording", "Trace", "PartialTrace")
        else "Recording",
        "torch": torch.__version__,
        "header": recording.header,
        "footer_extra": list(recording.footer_extra),
        "verdict": getattr(recording, "verdict", None),  # (absent from a recording pickled before it existed)
        "settings": settings_doc(recording.settings),
        "findings": findings,
        "events": events,
        "backward": backwards,
    }
    if doc["class"] == "PartialTrace":
        doc["error"] = recording.error
        doc["attempt"] = attempt_doc(recording.attempt, scopes)
        doc["failed_backward"] = next((i for i, run in enumerate(recording.backward) if run is failed), None)
    doc["scopes"] = scopes.rows  # last: every scope above has been interned
    return doc


# -- tensors -------------------------------------------------------------------------------------

def tensors(recording) -> Tuple[Dict[str, torch.Tensor], Dict[str, str], dict]:
    """(name -> tensor to store, name -> how it was stored when not as itself, output document).

    Kept values of a `Trace` (`op/N/i`), of its backwards (`backward/K/N/i`) and the forward's
    output (`output/i`). Values that cannot be stored are left out; the notes say which and why."""
    stored: Dict[str, torch.Tensor] = {}
    how: Dict[str, str] = {}
    values = getattr(recording, "_values", None)
    for ordinal, kept in (values or {}).items():
        for i, tensor in enumerate(kept):
            put(stored, how, f"op/{ordinal}/{i}", tensor)
    for k, run in enumerate(getattr(recording, "backward", ())):
        for ordinal, kept in (run.values or {}).items():
            for i, tensor in enumerate(kept):
                put(stored, how, f"backward/{k}/{ordinal}/{i}", tensor)
    output = _output_doc(getattr(recording, "output", None), stored, how, itertools.count())
    return stored, how, output


def put(stored, how, name: str, value) -> None:
    """Store `value` as tensor `name` (as a tensor the file can hold), or say in `how` why not."""
    if not isinstance(value, torch.Tensor):
        how[name] = "left out: not a tensor"
        return
    tensor = value.detach()
    if is_dtensor(tensor):  # the values this rank holds: each rank saves its own file
        tensor, how[name] = unwrapped(tensor), "local shard of a DTensor"
    elif hasattr(tensor, "trigger_wait"):  # a functional collective's output: its values, once arrived
        tensor = tensor.trigger_wait()
    if tensor.layout is not torch.strided or tensor.is_nested:
        if tensor.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
            tensor, how[name] = tensor.to_dense(), "dense"
        else:
            how[name] = f"left out: a {tensor.layout} tensor has no place in the tensor file"
            return
    if tensor.device.type == "meta":
        how[name] = "left out: a meta tensor has no values"
        return
    tensor = tensor.to("cpu")
    if tensor.dtype in (torch.complex128, torch.complex32):
        tensor, how[name] = torch.view_as_real(tensor.to(torch.complex128)), "view_as_real:" + str(tensor.dtype)
    elif tensor.dtype not in STORABLE:  # a dtype the tensor file has no name for: its bytes, and how to read them
        shape = ",".join(str(size) for size in tensor.shape)
        how[name] = f"bytes:{str(tensor.dtype).replace('torch.', '')}:{shape}"
        tensor = tensor.contiguous().reshape(-1).view(torch.uint8)
    stored[name] = tensor


_PLAIN = (int, float, bool, str, type(None))

# dtypes the safetensors format names (others are stored as their bytes, see `_put`)
STORABLE = {getattr(torch, name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
    "float32", "float64", "float8_e4m3fn", "float8_e5m2", "complex64") if hasattr(torch, name)}


def _output_doc(value, stored, how, numbers):
    """The forward's output as data: tensors by name, plain values as themselves, containers as
    lists and dicts ({"tuple": [...]} keeps a tuple a tuple; a named tuple or a dict subclass notes
    its type and loads as the plain container); anything else as {"left_out": why}."""
    if isinstance(value, torch.Tensor):
        name = f"output/{next(numbers)}"
        put(stored, how, name, value)
        return {"tensor": name} if name in stored else {"left_out": how.get(name, "not stored")}
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and not math.isfinite(value):
            return {"float": number(value)}  # JSON has no such number; a string would read as a str
        return {"value": value}
    doc: Optional[Dict[str, object]]
    if isinstance(value, tuple):
        doc = {"tuple": [_output_doc(item, stored, how, numbers) for item in value]}
    elif isinstance(value, list):
        doc = {"list": [_output_doc(item, stored, how, numbers) for item in value]}
    elif isinstance(value, dict) and all(isinstance(key, str) for key in value):
        doc = {"dict": {key: _output_doc(item, stored, how, numbers) for key, item in value.items()}}
    else:
        doc = None
    if doc is not None:
        if type(value) not in (tuple, list, dict):
            doc["type"] = f"{type(value).__module__}.{type(value).__qualname__}"  # (loads as the plain container)
        return doc
    return {"left_out": f"a {type(value).__qualname__} is not tensors, numbers, strings or containers of them"}

