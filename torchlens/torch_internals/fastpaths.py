"""Fast paths that look for torch-function overrides run exactly as they would without capture.

`nn.MultiheadAttention`, `nn.TransformerEncoderLayer` and `nn.TransformerEncoder` take a fused
"fast path" (`torch._native_multi_head_attention`, `torch._transformer_encoder_layer_fwd`, nested
tensors for padding masks) only when `torch.overrides.has_torch_function(...)` says no override is
active. The capture's `TorchFunctionMode` is one, so under capture they would run their slow path,
whose results differ (padded positions by whole units). Narration must never change results.

So, while a capture runs, `torch.overrides.has_torch_function` answers the modules whose forward
consults it as if the capture's modes were not there (any other override still counts). The fast
path then runs, and the capture narrates its fused call as one op: its insides are a single kernel.
Which forwards consult it is read from torch (the names their code uses), not listed by hand.
Only those callers are answered differently; everyone else gets torch's own answer. Both the
eager capture and a compiled forward (for the code dynamo runs eagerly between graphs) hold it.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import FrozenSet

import torch
from torch import nn

from .mode_stack import only_capture_modes_lifted
from .seams import degraded

__all__ = ["keep_fast_paths", "release_fast_paths"]

_original = torch.overrides.has_torch_function
_is_compiling = torch.compiler.is_compiling
_lock = threading.Lock()
_installed = 0  # captures running, in any thread, that need the answer kept
# code objects of the torch module forwards that consult has_torch_function (read at the first capture)
_forwards: FrozenSet[types.CodeType] = frozenset()


def _consulting_forwards() -> FrozenSet[types.CodeType]:
    """The `forward` code of every torch.nn module class that calls `has_torch_function`."""
    codes = set()
    pending = [nn.Module]
    seen = set()
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
        forward = cls.__dict__.get("forward")
        code = getattr(forward, "__code__", None)
        if code is not None and cls.__module__.startswith("torch.nn") and "has_torch_function" in code.co_names:
            codes.add(code)
    return frozenset(codes)


def _has_torch_function(args) -> bool:
    """torch's answer, except to a fast-path check of a module forward under capture.

    While dynamo traces (a compiled region inside a narrated forward) it is torch's answer too,
    so compiled graphs are the ones plain `torch.compile` makes."""
    answer = _original(args)
    if not answer or _is_compiling() or sys._getframe(1).f_code not in _forwards:
        return answer
    return _without_capture(args)


def _without_capture(args) -> bool:
    """What `has_torch_function(args)` would say with the capture modes off the stack."""
    with only_capture_modes_lifted() as lifted:
        # not lifted: a tensor subclass, or somebody else's mode: the slow path, as without us
        return _original(args) if lifted else True


def _same_to_dynamo() -> None:
    """Keep dynamo's handling of `has_torch_function` whichever function it met first.

    Dynamo builds its table of special torch functions once, reading `torch.overrides` as it is
    then; built while ours is installed, it would not know torch's own afterwards (and break
    graphs at every fast-path check). Both are given the same entry, so dynamo traces the check
    as plain `torch.compile` does, with or without a capture running."""
    variables = sys.modules.get("torch._dynamo.variables.torch")
    if variables is None:
        return
    try:
        handlers = variables.TorchInGraphFunctionVariable._get_handlers()
        known = handlers.get(_original) or handlers.get(_has_torch_function)
        if known is not None:
            handlers.setdefault(_original, known)
            handlers.setdefault(_has_torch_function, known)
    except Exception as exc:  # another torch: nothing to keep in step, and we say so
        degraded("fast-path handlers", exc)


def keep_fast_paths() -> None:
    """A capture starts: answer fast-path checks as if it were not there (until `release`)."""
    global _installed, _forwards
    with _lock:
        if not _forwards:
            _forwards = _consulting_forwards()
        _installed += 1
        if _installed == 1:
            _same_to_dynamo()
            torch.overrides.has_torch_function = _has_torch_function


def release_fast_paths() -> None:
    """A capture ends; the last one gives torch its own function back."""
    global _installed
    with _lock:
        _installed = max(_installed - 1, 0)
        if _installed == 0 and torch.overrides.has_torch_function is _has_torch_function:
            torch.overrides.has_torch_function = _original
            _same_to_dynamo()
