"""A one-op repro's call in a saved trace: its function by name, its arguments as data, its tensors
beside the kept values — and back, checked as data.

`save` stores the call the live recording's `repro()` replays (`repro.replay.replayed`: a failed
forward's attempted op, or the op that introduced the first non-finite value), so that
`tl.load(path).repro(directory)` writes the same script. Its tensors are stored up to
`max_repro_bytes` (`REPRO_BYTES` by default); past that the call is saved without them, with a note
that says so and how to save them, which the loaded trace's `repro()` raises as a `ReproError`.

Loading stays data-only: the function is stored as the dotted name a script imports it by, checked
against torch when it was saved, and a loaded trace only writes that name into a script (a name
outside torch, `operator` and `functools` is refused as a damaged file); arguments are numbers,
strings, dtypes, devices, sizes, slices and containers of them, and tensors by index.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional, Tuple

import torch

from ..errors import ReproError
from ..repro.kept import KeptCall, NamedFunction
from ..repro.replay import replayed
from ..repro.script import spell, strides
from .encode import put

__all__ = ["BY_NAME", "REPRO_BYTES", "call_doc", "loaded_call"]

REPRO_BYTES = 64 * 1024 * 1024  # the tensors of a repro a saved trace keeps, by default
PREFIX = "repro/"  # the tensors' names in the tensor file: `repro/0`, `repro/1`, ...
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a device type
_ROOTS = ("torch", "operator", "functools")  # where a saved call's function may come from


# -- saving ----------------------------------------------------------------------------------------

def call_doc(recording, max_bytes: int, stored: dict, how: dict) -> Optional[dict]:
    """The call `recording.repro()` replays, as data (None when it has none); its tensors are added
    to `stored` (and `how`, as `encode.put` stores a tensor)."""
    found = replayed(recording)
    if found is None or found.call is None:
        return None
    call = found.call
    name, why = _function_name(call)
    notes = list(call.notes) + ([why] if why else [])
    doc = {"for": found.role, "ordinal": found.ordinal, "function": name, "notes": notes, "error": call.error,
           "context": _context_doc(call.context)}
    if name is None:
        return doc  # (the live repro cannot be written either: the notes say why)
    tensors = call.tensors()
    size = sum(t.numel() * t.element_size() for t in tensors if t.layout is torch.strided)
    if size > max_bytes:
        notes.append(f"its inputs ({size} bytes) were over the {max_bytes}-byte bound save() keeps with a "
                            f"trace: save the recording again with save(path, max_repro_bytes={size}) or more")
        return doc
    try:
        index = {id(tensor): i for i, tensor in enumerate(tensors)}
        doc["args"] = _value_doc(tuple(call.args), index)
        doc["kwargs"] = _value_doc(dict(call.kwargs), index)
    except ReproError as exc:
        notes.append(str(exc))
        return doc
    origins = call.origins if len(call.origins) == len(tensors) else [(t.requires_grad, t.is_leaf) for t in tensors]
    places = call.places or [(str(t.device), strides(t)) for t in tensors]
    doc["tensors"] = [{"requires_grad": bool(grad), "leaf": bool(leaf), "device": device, "stride": stride}
                      for (grad, leaf), (device, stride) in zip(origins, places)]
    names = [f"{PREFIX}{i}" for i in range(len(tensors))]
    for name, tensor in zip(names, tensors):
        put(stored, how, name, tensor)
    left_out = [how[name] for name in names if name not in stored]
    if left_out:  # (a tensor the file has no place for: the call is saved without its inputs)
        for name in names:
            stored.pop(name, None)
            how.pop(name, None)
        for key in ("args", "kwargs", "tensors"):
            del doc[key]
        notes.append(f"its inputs could not be saved with the trace ({left_out[0]})")
    return doc


def _function_name(call: KeptCall) -> Tuple[Optional[str], Optional[str]]:
    """(the name a script calls the function by, or None and why not)."""
    if call.func is None:
        return None, None
    try:
        name = spell(call.func)
    except ReproError as exc:
        return None, str(exc)
    if not _NAME.fullmatch(name) or name.split(".")[0] not in _ROOTS:
        return None, f"{name} is not a function of torch a saved trace can name"
    return name, None


def _context_doc(context) -> dict:
    context = context or {}
    autocast = context.get("autocast")
    return {"grad": bool(context.get("grad", True)), "autocast": list(autocast) if autocast else None}


def _value_doc(value, index: Dict[int, int]):
    """An argument as JSON-ready data (the forms `_value` reads back); tensors by their index."""
    if isinstance(value, torch.Tensor):
        return {"tensor": index[id(value)]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, complex):
        return {"complex": [_value_doc(value.real, index), _value_doc(value.imag, index)]}
    for kind, cls in _KINDS.items():
        if isinstance(value, cls):
            return {kind: str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, slice):
        return {"slice": [_value_doc(part, index) for part in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, list):
        return [_value_doc(item, index) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"tuple": [_value_doc(item, index) for item in value]}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: _value_doc(item, index) for key, item in value.items()}}
    raise ReproError(f"an argument of type {type(value).__qualname__} cannot be saved with the trace")


_KINDS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
# torch's dtypes, layouts and memory formats by name: looked up here, never with getattr on torch
BY_NAME: Dict[str, Dict[str, Any]] = {
    kind: {str(value).replace("torch.", ""): value for value in vars(torch).values() if isinstance(value, cls)}
    for kind, cls in _KINDS.items()}


# -- loading ---------------------------------------------------------------------------------------

def loaded_call(doc, tensors: Dict[str, torch.Tensor], restored, bad) -> Tuple[str, int, KeptCall]:
    """(role, ordinal, the call) from a saved call's data; `restored(name)` gives a stored tensor as
    it was kept, `bad(what)` the error for a document that is not one `save` wrote."""
    if not isinstance(doc, dict) or doc.get("for") not in ("attempt", "nonfinite"):
        raise bad("a repro's call should say which op it is for")
    ordinal = doc.get("ordinal")
    if not isinstance(ordinal, int) or isinstance(ordinal, bool):
        raise bad("a repro's call without its op's ordinal")
    notes = doc.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
        raise bad("a repro's notes should be strings")
    error = doc.get("error")
    if error is not None and not isinstance(error, str):
        raise bad("a repro's error should be a string")
    name = doc.get("function")
    if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name) and name.split(".")[0] in _ROOTS):
        raise bad(f"a repro's function {name!r} is not a torch function's name")
    func = None if name is None else NamedFunction(name)
    context = _context(doc.get("context"), bad)
    if "args" not in doc:  # saved without its inputs: the notes say why
        return doc["for"], ordinal, KeptCall(func, (), {}, notes, True, error, context, ())
    specs = doc.get("tensors")
    if not isinstance(specs, list):
        raise bad("a repro's call without its tensors' descriptions")
    loaded = [_tensor(i, spec, tensors, restored, bad) for i, spec in enumerate(specs)]
    args, kwargs = _value(doc["args"], loaded, bad), _value(doc.get("kwargs", {"dict": {}}), loaded, bad)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise bad("a repro's arguments should be a tuple and a dict")
    origins = [(spec["requires_grad"], spec["leaf"]) for spec in specs]
    places = [(spec["device"], spec["stride"]) for spec in specs]
    call = KeptCall(func, args, kwargs, notes, True, error, context, origins, places)
    if len(call.tensors()) != len(loaded):
        raise bad("a repro's arguments do not use each of its tensors once")
    return doc["for"], ordinal, call


def _context(doc, bad) -> dict:
    if not isinstance(doc, dict) or not isinstance(doc.get("grad"), bool):
        raise bad("a repro's grad mode should be true or false")
    autocast = doc.get("autocast")
    if autocast is not None:
        if (not isinstance(autocast, list) or len(autocast) != 2 or not all(isinstance(part, str) for part in autocast)
                or autocast[1] not in BY_NAME["dtype"] or not _WORD.fullmatch(autocast[0])):
            raise bad(f"a repro's autocast state {autocast!r}")
        autocast = tuple(autocast)
    return {"grad": doc["grad"], "autocast": autocast}


def _tensor(i: int, spec, tensors, restored, bad) -> torch.Tensor:
    name = f"{PREFIX}{i}"
    if name not in tensors:
        raise bad(f"a repro's tensor {name!r} is not in the file")
    if (not isinstance(spec, dict) or not all(isinstance(spec.get(key), bool) for key in ("requires_grad", "leaf"))
            or not isinstance(spec.get("device"), str)):
        raise bad(f"the description of a repro's tensor {name!r}")
    tensor = restored(name)
    try:
        torch.device(spec["device"])
    except RuntimeError:
        raise bad(f"a repro's tensor on {spec.get('device')!r}, which is no device") from None
    stride = spec.get("stride")
    if stride is not None and (not isinstance(stride, list) or len(stride) != tensor.dim()
                               or not all(isinstance(step, int) and not isinstance(step, bool) and step >= 0
                                          for step in stride)):
        raise bad(f"a repro's tensor {name!r} with strides {stride!r}")
    return tensor


def _value(doc, tensors: list, bad):
    """An argument back from its data (see `_value_doc`)."""
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [_value(item, tensors, bad) for item in doc]
    if not isinstance(doc, dict) or len(doc) != 1:
        raise bad(f"a repro's argument {doc!r}")
    (kind, body), = doc.items()
    if kind == "tensor" and isinstance(body, int) and not isinstance(body, bool) and 0 <= body < len(tensors):
        return tensors[body]
    if kind == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if kind == "complex" and isinstance(body, list) and len(body) == 2:
        real, imag = (_value(part, tensors, bad) for part in body)
        if isinstance(real, (int, float)) and isinstance(imag, (int, float)):
            return complex(real, imag)
    if kind in BY_NAME and body in BY_NAME[kind]:
        return BY_NAME[kind][body]
    if kind == "device" and isinstance(body, str):
        try:
            return torch.device(body)
        except RuntimeError:
            pass
    if kind == "size" and isinstance(body, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in body):
        return torch.Size(body)
    if kind == "slice" and isinstance(body, list) and len(body) == 3:
        return slice(*(_value(part, tensors, bad) for part in body))
    if kind == "ellipsis" and body is True:
        return Ellipsis
    if kind == "tuple" and isinstance(body, list):
        return tuple(_value(item, tensors, bad) for item in body)
    if kind == "dict" and isinstance(body, dict):
        return {key: _value(item, tensors, bad) for key, item in body.items()}
    raise bad(f"a repro's argument {doc!r}")
