"""A saved document back into a `Recording`, `Trace` or `PartialTrace`.

Everything read from the file is checked as data: names of dtypes must be torch dtypes, devices
must parse, every index must point into its table. Nothing from the file is imported, called or
unpickled, so a crafted file can only be refused (`TraceFileError`), never run.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from ..errors import TraceFileError
from ..events import (
    Attempt,
    BackwardAttempt,
    BackwardEvent,
    Event,
    EventKind,
    Scope,
    ShardedMeta,
    Stats,
    StatsGroup,
    TensorMeta,
)
from ..findings import Finding, FindingKind
from ..measure.integer_values import Values
from ..options import DTENSOR_STATS, NarrationOptions, Settings
from ..repro.kept import KeptCall
from ..results import Backward, PartialTrace, Recording, Trace
from ..selectors import InModule, Selector
from .calls import BY_NAME, loaded_call
from .encode import FORMAT, READABLE_VERSIONS

__all__ = ["SavedSelection", "recording"]

# (looked up with whatever the document names: anything else, or nothing, is no class)
_CLASSES: Dict[object, type] = {"Recording": Recording, "Trace": Trace, "PartialTrace": PartialTrace}
_KINDS = {kind.value: kind for kind in EventKind}
_BACKWARD_KINDS = (EventKind.NODE, EventKind.GRAD)
_STATS_KINDS = ("exact", "sampled", "counts", "bool", "na")
_LABELLED = (EventKind.INPUT, EventKind.OUTPUT, EventKind.GRAD)  # events whose line shows a name


def bad(what: str) -> TraceFileError:
    return TraceFileError(f"not a trace torchlens saved, or a damaged one: {what}")


def _expect(value, kinds, what: str):
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        names = " or ".join(kind.__name__ for kind in _as_tuple(kinds))
        raise bad(f"{what} should be {names}, found {type(value).__name__}")
    return value


def _as_tuple(kinds):
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _optional(value, kinds, what: str):
    return None if value is None else _expect(value, kinds, what)


def _number(value, what: str):
    if isinstance(value, str):
        try:
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[value]
        except KeyError:
            raise bad(f"{what}: {value!r} is no number") from None
    return _optional(value, (int, float, bool), what)


def dtype(name) -> torch.dtype:
    value = BY_NAME["dtype"].get(_expect(name, str, "a dtype"))
    if value is None:
        raise bad(f"{name!r} is no torch dtype")
    return value


def _index(value, length: int, what: str) -> int:
    """`value` as an index into a table of `length` rows (a bool is no index)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < length:
        raise bad(f"{what} {value!r} is not in its table")
    return value


def _row(value, fields: int, what: str) -> list:
    if not isinstance(value, list) or len(value) != fields:
        raise bad(f"{what} should be a list of {fields} fields")
    return value


def device(name) -> torch.device:
    try:
        return torch.device(_expect(name, str, "a device"))
    except RuntimeError:
        raise bad(f"{name!r} is no torch device") from None


def meta(doc) -> TensorMeta:
    sharded = isinstance(doc, list) and len(doc) == 5  # a DTensor's: placement and local shape follow
    shape, dtype_name, device_name = _row(doc[:3] if sharded else doc, 3, "a tensor description")
    described = (_shape(shape), dtype(dtype_name), device(device_name))
    if not sharded:
        return TensorMeta(*described)
    return ShardedMeta(*described, _expect(doc[3], str, "a placement"), tuple(_shape(doc[4])))


def _shape(doc):
    sizes = _expect(doc, list, "a shape")
    for size in sizes:
        _expect(size, (int, str), "a size")
    return torch.Size(sizes) if all(isinstance(size, int) for size in sizes) else tuple(sizes)


def stats(doc):
    if doc is None:
        return None
    if isinstance(doc, list):
        return StatsGroup([stats(_expect(part, dict, "a part's statistics")) for part in doc])
    _expect(doc, dict, "statistics")
    kind = doc.get("kind")
    if kind not in _STATS_KINDS:
        raise bad(f"statistics of kind {kind!r}")
    out = Stats(kind, _expect(doc.get("numel", 0), int, "numel"), bool(doc.get("shown", True)),
                _expect(doc.get("note", ""), str, "a note"))
    for name in ("min", "max", "mean", "sd", "nan", "posinf", "neginf", "true"):
        setattr(out, name, _number(doc.get(name), name))
    out.sampled = _expect(doc.get("sampled", 0), int, "sampled")
    return out


class _Tables:
    """The scopes of one document, and the loaded events' selection (a selector saved as flags)."""

    def __init__(self, rows):
        self.scopes: List[Scope] = []
        for row in _expect(rows, list, "the scope table"):
            path, type_name, parent, key = _row(row, 4, "a scope")
            if parent is not None:
                _index(parent, len(self.scopes), f"the parent of scope {path!r} (an earlier scope)")
            self.scopes.append(Scope(_expect(path, str, "a module path"), _expect(type_name, str, "a class name"),
                                     None if parent is None else self.scopes[parent], _expect(key, str, "a key")))
        self.unselected = set()

    def scope(self, index) -> Scope:
        return self.scopes[_index(index, len(self.scopes), "scope")]


def event(doc, tables: _Tables, backward: bool) -> Event:
    _expect(doc, dict, "an event")
    kind = _KINDS.get(doc.get("kind")) if isinstance(doc.get("kind"), str) else None
    if kind is None or (kind in _BACKWARD_KINDS) != backward:
        raise bad(f"an event of kind {doc.get('kind')!r} {'in a backward' if backward else 'in a forward'}")
    label = _optional(doc.get("label"), str, "a label")
    if kind in _LABELLED and label is None:
        raise bad(f"an {kind.value} event without its label")
    outputs = tuple(meta(m) for m in _expect(doc.get("outputs", []), list, "outputs"))
    args = (kind, _expect(doc.get("ordinal"), int, "an ordinal"), _expect(doc.get("op"), str, "an op name"),
            tables.scope(doc.get("scope")), outputs, _optional(doc.get("site"), str, "a site"),
            stats(doc.get("stats")), label)
    made: Event
    if backward:
        made = BackwardEvent(*args, forward=_optional(doc.get("forward"), str, "a forward op"))
    else:
        made = Event(*args)
    made.engine = _optional(doc.get("engine"), str, "an engine")
    if doc.get("selected", True) is False:
        tables.unselected.add(selection_key(made))
    return made


def _kind(name) -> Optional[FindingKind]:
    """A finding's kind by its name; None in a trace saved before kinds were recorded."""
    if name is None:
        return None
    try:
        return FindingKind[_expect(name, str, "a finding's kind")]
    except KeyError:
        known = ", ".join(kind.name for kind in FindingKind)
        raise bad(f"a finding's kind should be one of {known}, found {name!r}") from None


def events(rows, tables: _Tables, backward: bool) -> List[Event]:
    return [event(row, tables, backward) for row in _expect(rows, list, "the events")]


def findings(rows, made: List[Event], docs: list) -> tuple:
    out = []
    for row in _expect(rows, list, "the findings"):
        _expect(row, dict, "a finding")
        index = row.get("event")
        if index is not None:
            _index(index, len(made), "a finding's event")
        source = row.get("source")  # (absent from traces saved before findings named their source)
        finding = Finding(_expect(row.get("text"), str, "a finding's text"), None if index is None else made[index],
                          _kind(row.get("kind")), bool(row.get("birth", False)),
                          None if source is None else _expect(source, str, "a finding's source"))
        finding.live = bool(row.get("live", False))
        out.append(finding)
    for event_doc, made_event in zip(docs, made):
        at = event_doc.get("finding")
        if at is not None:
            made_event.finding = out[_index(at, len(out), "an event's finding")]
    return tuple(out)


def attempt(doc, tables: _Tables) -> Optional[Attempt]:
    if doc is None:
        return None
    _expect(doc, dict, "the attempted op")
    inputs = doc.get("inputs")
    args = (_optional(doc.get("op"), str, "an op name"), _expect(doc.get("ordinal"), int, "an ordinal"),
            tables.scope(doc.get("scope")), _optional(doc.get("site"), str, "a site"),
            None if inputs is None else tuple(meta(m) for m in _expect(inputs, list, "inputs")))
    notes = [_expect(note, str, "a note") for note in _expect(doc.get("notes", []), list, "notes")]
    if "forward" in doc:
        return BackwardAttempt(*args, _optional(doc.get("forward"), str, "a forward op"), notes)
    values = doc.get("values")
    return Attempt(*args, notes, values=None if values is None else tuple(
        _input_values(v) for v in _expect(values, list, "the values of its inputs")))


def _input_values(doc) -> Optional[Values]:
    """What an integer input of the attempted op held (`attempt_doc`'s "values")."""
    if doc is None:
        return None
    _expect(doc, dict, "an input's values")
    if "unread" in doc:
        return Values(None, None, _expect(doc["unread"], str, "why values were not read"))
    return Values(_expect(doc.get("low"), int, "a smallest value"), _expect(doc.get("high"), int, "a largest value"))


def selector(doc):
    _expect(doc, dict, "a selector")
    if "in_module" in doc:
        try:
            return InModule(*[_expect(path, str, "a module path") for path in _expect(doc["in_module"], list, "paths")])
        except (TypeError, ValueError) as exc:
            raise bad(f"a selector: {exc}") from None
    if "any" in doc or "all" in doc:
        parts = [selector(part) for part in _expect(doc.get("any", doc.get("all")), list, "selector parts")]
        if not parts:
            raise bad("a selector combining no selectors")
        combined = parts[0]
        for part in parts[1:]:
            combined = (combined | part) if "any" in doc else (combined & part)
        return combined
    if "not" in doc:
        return ~selector(doc["not"])
    raise bad(f"a selector {sorted(doc)!r}")


def settings(doc, tables: _Tables) -> Settings:
    _expect(doc, dict, "the settings")
    narration = doc.get("narration")
    options = None
    if narration is not None:
        _expect(narration, dict, "the narration options")
        fields = {name: narration[name] for name in ("sites", "max_lines", "prefix", "depth", "normalize",
                                                      "tail_on_error", "on_error_only", "symbolic_shapes",
                                                      "engine_ops")
                  if name in narration}
        if narration.get("select") is not None:
            fields["select"] = selector(narration["select"])
        elif narration.get("select_saved_as_flags"):
            fields["select"] = SavedSelection(tables.unselected)
        try:
            options = NarrationOptions(**fields)
        except (TypeError, ValueError) as exc:
            raise bad(f"narration options: {exc}") from None
    value_stats = doc.get("value_stats", "off")
    on_nonfinite = doc.get("on_nonfinite")
    if value_stats not in ("off", "sampled", "exact", "reuse") or on_nonfinite not in (None, "track", "raise"):
        raise bad(f"value_stats={value_stats!r}, on_nonfinite={on_nonfinite!r}")
    dtensor_stats = doc.get("dtensor_stats", "local")  # (version 1: DTensors were measured by their shard)
    if dtensor_stats not in DTENSOR_STATS:
        raise bad(f"dtensor_stats={dtensor_stats!r}")
    return Settings(options, value_stats, on_nonfinite, keep_values=bool(doc.get("keep_values")),
                    keep_on_cpu=bool(doc.get("keep_on_cpu")),
                    max_bytes=_optional(doc.get("max_bytes"), int, "max_bytes"), backward=bool(doc.get("backward")),
                    dtensor_stats=dtensor_stats)


def selection_key(event) -> tuple:
    """What tells events apart for a selection saved as flags (their identity does not survive a copy)."""
    return event.kind.value, event.ordinal, event.op, event.scope.key, event.label


class SavedSelection(Selector):
    """A selector that was a Python function, as what it selected: the events it left out, by key."""

    def __init__(self, unselected):
        self.unselected = frozenset(unselected)

    def __call__(self, event) -> bool:
        return selection_key(event) not in self.unselected

    def _identity(self) -> tuple:
        return (self.unselected,)

    def __repr__(self) -> str:
        return f"SavedSelection({len(self.unselected)} events left out)"


def recording(doc: dict, tensors: Dict[str, torch.Tensor], how: Dict[str, str]) -> Recording:
    """Build the recording a document describes; `tensors` are its stored values."""
    _expect(doc, dict, "the document")
    if doc.get("format") != FORMAT:
        raise bad(f"format {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("version") not in READABLE_VERSIONS:
        raise TraceFileError(f"this trace was saved in format version {doc.get('version')!r}; this torchlens "
                             f"reads versions {', '.join(map(str, READABLE_VERSIONS))}: load it with the "
                             f"torchlens release that saved it")
    cls = _CLASSES.get(doc.get("class"))
    if cls is None:
        raise bad(f"a recording of class {doc.get('class')!r}")
    tables = _Tables(doc.get("scopes"))
    forward_docs = _expect(doc.get("events"), list, "the events")
    forward = events(forward_docs, tables, backward=False)
    made_findings = findings(doc.get("findings", []), forward, forward_docs)
    backward_runs = [_backward(run, tables) for run in _expect(doc.get("backward", []), list, "the backwards")]
    run_settings = settings(doc.get("settings"), tables)
    values = _values(tensors, how, "op/") if cls is Trace or run_settings.keep_values else None
    kwargs = dict(header=_optional(doc.get("header"), str, "the header"),
                  footer_extra=[_expect(line, str, "a footer part") for line in _expect(doc.get("footer_extra", []),
                                                                                        list, "the footer")],
                  values=values, findings=made_findings, verdict=_optional(doc.get("verdict"), str, "the verdict"))
    output = _output(doc.get("output", {"value": None}), tensors, how)
    made: Recording
    if cls is PartialTrace:
        made = PartialTrace(forward, output, run_settings, attempt=attempt(doc.get("attempt"), tables),
                            error=_expect(doc.get("error", ""), str, "the error"), **kwargs)
        failed = doc.get("failed_backward")
        if failed is not None:
            made.failed_backward = backward_runs[_index(failed, len(backward_runs), "the failed backward")]
    else:
        made = cls(forward, output, run_settings, **kwargs)
    for k, run in enumerate(backward_runs):
        run.settings = run_settings
        if run_settings.keep_values:
            run.values = _values(tensors, how, f"backward/{k}/")
    made.backward = backward_runs
    _repro(made, doc.get("repro"), doc.get("version"), tensors, how)
    return made


def _repro(made: Recording, doc, version, tensors: Dict[str, torch.Tensor], how: Dict[str, str]) -> None:
    """Put back the call `repro()` replays, where the live recording held it."""
    if doc is None:
        if version in (1, 2):  # saved before the call was: `repro()` says so
            _placeholder(made, version)
        return
    role, ordinal, call = loaded_call(doc, tensors, lambda name: _restored(tensors[name], how.get(name)), bad)
    if role == "attempt":
        attempt_ = getattr(made, "attempt", None)
        if attempt_ is None or attempt_.ordinal != ordinal:
            raise bad(f"a repro's call for the attempted op #{ordinal}, which the trace does not have")
        attempt_.call = call
    else:
        made.kept_calls = {ordinal: call}


def _placeholder(made: Recording, version: int) -> None:
    note = (f"this trace was saved in format version {version}, which kept no inputs of the op to replay: "
            f"save the recording again with this release of torchlens")
    attempt_ = getattr(made, "attempt", None)
    if attempt_ is not None:
        if attempt_.op is not None:
            attempt_.call = KeptCall(None, (), {}, (note,), True, origins=())
    elif made.settings.on_nonfinite is not None and made.first_nonfinite is not None:
        made.kept_calls = {made.first_nonfinite.ordinal: KeptCall(None, (), {}, (note,), True, origins=())}


def _backward(doc, tables: _Tables) -> Backward:
    _expect(doc, dict, "a backward")
    run = Backward(_expect(doc.get("header"), str, "a backward's header"), Settings(None))
    docs = _expect(doc.get("events"), list, "a backward's events")
    run.events = events(docs, tables, backward=True)
    run.findings = findings(doc.get("findings", []), run.events, docs)
    run.verdict = _optional(doc.get("verdict"), str, "a backward's verdict")
    run.footer_extra = [_expect(line, str, "a footer part") for line in _expect(doc.get("footer_extra", []), list,
                                                                                  "a backward's footer")]
    run.finished = bool(doc.get("finished"))
    run.error = _optional(doc.get("error"), str, "a backward's error")
    run.attempt = attempt(doc.get("attempt"), tables)
    return run


def _values(tensors: Dict[str, torch.Tensor], how: Dict[str, str], prefix: str) -> Dict[int, tuple]:
    """Kept values by ordinal from names `prefix + "N/i"`, each restored to how it was kept."""
    grouped: Dict[int, Dict[int, Optional[torch.Tensor]]] = {}  # (None: an output left out)
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):].split("/")
        if len(rest) != 2 or not all(part.isascii() and part.isdigit() for part in rest):
            raise bad(f"a tensor named {name!r}")
        grouped.setdefault(int(rest[0]), {})[int(rest[1])] = _restored(tensor, how.get(name))
    for name, why in how.items():  # an output left out keeps its place: its siblings keep their index
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):].split("/")
        if len(rest) != 2 or not all(part.isascii() and part.isdigit() for part in rest):
            raise bad(f"a note for a tensor named {name!r}")
        if why.startswith("left out"):
            grouped.setdefault(int(rest[0]), {})[int(rest[1])] = None
    return {ordinal: tuple(parts[i] for i in sorted(parts)) for ordinal, parts in sorted(grouped.items())}


def _restored(tensor: torch.Tensor, how: Optional[str]) -> torch.Tensor:
    """A stored tensor as it was kept: a complex one from its real view, another from its bytes."""
    if how and how.startswith("view_as_real:"):
        return torch.view_as_complex(tensor).to(dtype(how.split(":", 1)[1].replace("torch.", "")))
    if how and how.startswith("bytes:"):
        _, name, shape = how.split(":")
        sizes = [int(size) for size in shape.split(",")] if shape else []
        return tensor.view(dtype(name)).reshape(sizes)
    return tensor


def _output(doc, tensors: Dict[str, torch.Tensor], how: Dict[str, str]):
    _expect(doc, dict, "the output")
    if "tensor" in doc:
        name = _expect(doc["tensor"], str, "an output tensor's name")
        if name not in tensors:
            raise bad(f"the output names tensor {name!r}, which is not in the file")
        return _restored(tensors[name], how.get(name))
    if "value" in doc:
        return _expect(doc["value"], (int, float, bool, str, type(None)), "an output value")
    if "float" in doc:
        return _number(_expect(doc["float"], str, "a non-finite output"), "an output")
    if "tuple" in doc:
        return tuple(_output(item, tensors, how) for item in _expect(doc["tuple"], list, "a tuple"))
    if "list" in doc:
        return [_output(item, tensors, how) for item in _expect(doc["list"], list, "a list")]
    if "dict" in doc:
        return {key: _output(item, tensors, how) for key, item in _expect(doc["dict"], dict, "a dict").items()}
    if "left_out" in doc:
        return None
    raise bad(f"an output {sorted(doc)!r}")
