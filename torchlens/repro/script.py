"""Writing a kept call as a standalone repro: `repro.py` and its inputs, with plain torch only.

The script names the op as torch spells it (`torch.nn.functional.linear`, `torch.Tensor.masked_fill`:
looked up again and checked to be the very function the forward called), writes the arguments as
Python literals with each tensor loaded from `inputs.pt` (read with `weights_only=True`), and
puts each tensor back on its device, dtype, strides and `requires_grad`. Run, it replays the op
and says whether it reproduced what the forward saw: the same exception, or non-finite values of
the same kinds in the output. It exits 0 when it did, 1 when it did not.
"""

from __future__ import annotations

import importlib
import math
import pathlib
import textwrap
from typing import List, Optional

import torch
from torch.nn import functional as F

from ..errors import ReproError
from .kept import KeptCall, NamedFunction

__all__ = ["expected_counts", "spell", "strides", "write"]

# Where a torch-level function can be named from, most specific spelling first.
_NAMESPACES = (("torch.Tensor", torch.Tensor), ("torch.nn.functional", F), ("torch.special", torch.special),
               ("torch.linalg", torch.linalg), ("torch.fft", torch.fft), ("torch", torch))


def spell(func) -> str:
    """The dotted name that gives back `func` itself, or `ReproError`."""
    if isinstance(func, NamedFunction):  # (loaded from a saved trace: named when it was saved)
        return func.name
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a tensor attribute such as .T, read through its descriptor
        owner = getattr(func, "__self__", None)
        attribute = getattr(owner, "__name__", None)
        if attribute and getattr(torch.Tensor, attribute, None) is owner:
            return f"torch.Tensor.{attribute}.__get__"
    elif name:
        for prefix, namespace in _NAMESPACES:
            if getattr(namespace, name, None) is func:
                return f"{prefix}.{name}"
        attribute = next((a for a in dir(torch.Tensor) if getattr(torch.Tensor, a, None) is func), None)
        if attribute is not None:  # a Python-level wrapper a tensor method is spelled by (`x ** 2`: __pow__)
            return f"torch.Tensor.{attribute}"
        module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
        if module in _PUBLIC_MODULES:
            module = _PUBLIC_MODULES[module]
        if module and qualname and _resolves(module, qualname, func):
            return f"{module}.{qualname}"
    raise ReproError(f"{func!r} cannot be named as a function a script could import, so it cannot be replayed alone")


_PUBLIC_MODULES = {"_operator": "operator", "_functools": "functools"}  # (compiled graphs index with operator.getitem)


def _import_line(name: str) -> str:
    """What the script imports to call `name` (torch itself is always imported)."""
    parts = name.split(".")
    if parts[0] == "torch":
        return ""
    for end in range(len(parts) - 1, 0, -1):  # the longest importable prefix (`operator` of `operator.getitem`)
        candidate = ".".join(parts[:end])
        try:
            importlib.import_module(candidate)
            return f"import {candidate}\n"
        except ImportError:
            continue
    return f"import {parts[0]}\n"


def _resolves(module: str, qualname: str, func) -> bool:
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is func


class _Literals:
    """Arguments as Python source; tensors become `T["t0"]` and are collected to be saved."""

    def __init__(self):
        self.tensors: List[torch.Tensor] = []

    def of(self, value) -> str:
        if isinstance(value, torch.Tensor):
            self.tensors.append(value)
            return f'T["t{len(self.tensors) - 1}"]'
        if value is None or isinstance(value, (bool, int, str)):
            return repr(value)
        if isinstance(value, float):
            return repr(value) if math.isfinite(value) else f'float("{value}")'
        if isinstance(value, complex):
            return f"complex({self.of(value.real)}, {self.of(value.imag)})"
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return str(value)
        if isinstance(value, torch.device):
            return f"device_for({str(value)!r})"
        if isinstance(value, torch.Size):
            return f"torch.Size({list(value)!r})"
        if isinstance(value, slice):
            return f"slice({self.of(value.start)}, {self.of(value.stop)}, {self.of(value.step)})"
        if value is Ellipsis:
            return "..."
        if isinstance(value, list):
            return "[" + ", ".join(map(self.of, value)) + "]"
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return "(" + "".join(self.of(item) + ", " for item in value) + ")"
        if isinstance(value, dict) and all(isinstance(key, str) for key in value):
            return "{" + ", ".join(f"{key!r}: {self.of(item)}" for key, item in value.items()) + "}"
        raise ReproError(f"an argument of type {type(value).__qualname__} cannot be written into a script")


def _spec(tensor: torch.Tensor, origin, place=None) -> dict:
    """How the script puts `tensor` back: as the op saw it (`place`: its device and strides when
    `tensor` is not where the op read it, as a saved trace's are not)."""
    requires_grad, leaf = origin
    if place is None:
        place = (str(tensor.device), strides(tensor))
    return {"device": place[0], "requires_grad": bool(requires_grad), "leaf": bool(leaf), "stride": place[1]}


def strides(tensor: torch.Tensor):
    """The strides the script gives a tensor (None: contiguous, as it is loaded)."""
    strided = tensor.layout is torch.strided and not tensor.is_contiguous() and 0 not in tensor.stride()
    return list(tensor.stride()) if strided else None


def _saved(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_nested or tensor.layout is not torch.strided:
        kind = "nested" if tensor.is_nested else str(tensor.layout).replace("torch.", "")
        raise ReproError(f"the op was given a {kind} tensor, which a replay script cannot load back")
    saved = tensor.detach().to("cpu").contiguous().clone()
    return saved if type(saved) is torch.Tensor else saved.as_subclass(torch.Tensor)  # weights-only loads plain ones


def write(directory, call: KeptCall, title: str, expected: dict, notes=()) -> pathlib.Path:
    """Write `repro.py` and `inputs.pt` into `directory` (made if needed); returns the script's path.

    `expected` is {"error": "RuntimeError: ..."} or {"nonfinite": {"nan": n, "+inf": n, "-inf": n}}."""
    name = spell(call.func)
    literals = _Literals()
    args_source = literals.of(tuple(call.args))
    kwargs_source = literals.of(call.kwargs)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    saved = {f"t{i}": _saved(tensor) for i, tensor in enumerate(literals.tensors)}
    torch.save(saved, directory / "inputs.pt")
    origins = {id(t): origin for t, origin in zip(call.tensors(), call.origins)}
    places = {id(t): place for t, place in zip(call.tensors(), call.places or ())}
    specs = {f"t{i}": _spec(tensor, origins.get(id(tensor), (tensor.requires_grad, tensor.is_leaf)),
                            places.get(id(tensor))) for i, tensor in enumerate(literals.tensors)}
    context = call.context or {"grad": True, "autocast": None}
    script = directory / "repro.py"
    script.write_text(_SCRIPT.format(
        title=_docstring_safe(title), expected=_docstring_safe(_expected_text(expected)),
        notes=_docstring_safe(_notes(tuple(call.notes) + tuple(notes))),
        torch_version=torch.__version__, specs=repr(specs), function=name, imports=_import_line(name),
        grad=repr(bool(context.get("grad", True))), autocast=repr(context.get("autocast")),
        args=args_source, kwargs=kwargs_source, expected_repr=repr(expected)))
    return script


def _docstring_safe(text: str) -> str:
    """Text from the run (a site's path, an error message) that cannot end the script's docstring."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _expected_text(expected: dict) -> str:
    if "error" in expected:
        return expected["error"]
    counts = expected["nonfinite"]
    return "non-finite values in the output: " + " ".join(f"{k}={v}" for k, v in counts.items() if v)


def _notes(notes) -> str:
    if not notes:
        return ""
    return "\nNotes:\n" + "".join(textwrap.fill(note, 96, initial_indent="- ", subsequent_indent="  ") + "\n"
                                  for note in notes)


def expected_counts(stats) -> Optional[dict]:
    parts = getattr(stats, "parts", (stats,))
    counts = {"nan": 0, "+inf": 0, "-inf": 0}
    for part in parts:
        counts["nan"] += part.nan or 0
        counts["+inf"] += part.posinf or 0
        counts["-inf"] += part.neginf or 0
    return counts


_SCRIPT = '''"""{title}

Replays that one op with plain torch, on the inputs it was given (inputs.pt, beside this file).
What the forward saw: {expected}
Recorded with torch {torch_version}. Run: python repro.py  (exit status 0: reproduced)
{notes}"""

import contextlib
import pathlib
import sys

import torch
{imports}
HERE = pathlib.Path(__file__).resolve().parent
EXPECTED = {expected_repr}
SPECS = {specs}
GRAD_ENABLED = {grad}  # the grad mode the op ran under
AUTOCAST = {autocast}  # (device type, dtype) when it ran under torch.autocast


def device_for(name):
    """The op's device where this machine has it; the CPU otherwise (and the script says so)."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    try:
        torch.empty(0, device=device)
        return device
    except Exception:
        print(f"note: {{name}} is not available here: replaying on the CPU")
        return torch.device("cpu")


def load_inputs():
    tensors = {{}}
    for key, value in torch.load(HERE / "inputs.pt", weights_only=True).items():
        spec = SPECS[key]
        value = value.to(device_for(spec["device"]))
        if spec["stride"] is not None:  # the layout it had (a transposed view, say)
            value = torch.empty_strided(value.shape, spec["stride"], dtype=value.dtype,
                                        device=value.device).copy_(value)
        if spec["requires_grad"]:
            with torch.enable_grad():  # an activation is made inside a graph, as in the forward
                value = value.requires_grad_(True) if spec["leaf"] else value.requires_grad_(True).clone()
        tensors[key] = value
    return tensors


def summary(exc):
    """`Type: first line of the message`, as torchlens wrote the forward's."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > 240:
        first = first[:237] + "..."
    return f"{{type(exc).__name__}}: {{first}}" if first else type(exc).__name__


def replay_context():
    stack = contextlib.ExitStack()
    stack.enter_context(torch.set_grad_enabled(GRAD_ENABLED))
    if AUTOCAST is not None:
        stack.enter_context(torch.autocast(AUTOCAST[0], dtype=getattr(torch, AUTOCAST[1])))
    return stack


def nonfinite_counts(value):
    counts = {{"nan": 0, "+inf": 0, "-inf": 0}}
    tensors = [value] if isinstance(value, torch.Tensor) else list(value) if isinstance(value, (tuple, list)) else []
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.detach()
            if tensor.is_complex():  # measured by magnitude, as torchlens measures complex values
                tensor = tensor.abs()
            counts["nan"] += int(torch.isnan(tensor).sum())
            counts["+inf"] += int(torch.isposinf(tensor).sum())
            counts["-inf"] += int(torch.isneginf(tensor).sum())
    return counts


def shown(counts):
    return " ".join(f"{{k}}={{v}}" for k, v in counts.items() if v) or "finite"


def held(tensor):
    """What an input holds: its non-finite counts, or an integer one's smallest and largest value
    (an index past a table's end, labels that are all the ignored index)."""
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        return shown(nonfinite_counts(tensor))
    if tensor.numel() == 0:
        return "empty"
    values = tensor.detach().cpu()
    unsigned64 = values.dtype == getattr(torch, "uint64", None)  # (reduced as int64, its top bit flipped)
    values = values.view(torch.int64) ^ -2**63 if unsigned64 else values.to(torch.int64)
    low, high = values.min().item() + unsigned64 * 2**63, values.max().item() + unsigned64 * 2**63
    return f"min={{low}} max={{high}}"


T = load_inputs()


def main():
    described = (f"{{k}} {{list(v.shape)}} {{v.dtype}} {{held(v)}}" for k, v in T.items())
    print("inputs:", ", ".join(described))
    try:
        with replay_context():
            out = {function}(*{args}, **{kwargs})
    except Exception as exc:
        got = summary(exc)
        print("raised:", got)
        if got == EXPECTED.get("error"):
            print("reproduced: the same exception as in the forward")
            return 0
        print("did not reproduce: the forward saw", EXPECTED.get("error") or EXPECTED["nonfinite"])
        return 1
    counts = nonfinite_counts(out)
    print("output:", shown(counts))
    if "nonfinite" in EXPECTED and all(counts[k] > 0 for k, v in EXPECTED["nonfinite"].items() if v):
        print("reproduced: the same kinds of non-finite values as in the forward")
        return 0
    print("did not reproduce: the forward saw", EXPECTED.get("error") or EXPECTED["nonfinite"])
    return 1


if __name__ == "__main__":
    sys.exit(main())
'''
