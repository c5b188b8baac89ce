"""`tl.compile` and `tl.trace(..., compiled=True)`: torch.compile with a torchlens backend bound to a
runtime for the model, hooked to the compiled callable before its first call."""

from __future__ import annotations

import inspect
import weakref
from typing import Dict, Optional

import torch
from torch import nn

from ..core.structure import check_selection, module_of
from ..errors import ModelTypeError, OptionTypeError, OptionValueError, describe_choices, suggest, warn_safely
from ..options import COMPILE, check_bool, misplaced
from ..results import Trace
from .config import OPTION_KEYS, CompileConfig
from .handle import CompiledNarration
from .registration import Backend, install
from .runtime import CompiledRuntime

__all__ = ["compile_model", "trace_compiled"]


def _torch_compile_keywords() -> tuple:
    """The keywords this torch's `torch.compile` takes, less those torchlens sets itself."""
    try:
        parameters = inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):
        return ("fullgraph", "dynamic", "mode", "disable")
    return tuple(name for name, p in parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("backend", "options"))


TORCH_COMPILE_KEYWORDS = _torch_compile_keywords()


def check_torch_compile_kwargs(kwargs: dict, entry: str) -> None:
    """Keywords meant for torch.compile: a typo or a wrong value is a typed error that lists what is
    accepted, raised here rather than by torch (an AssertionError) or at the first call (wrapped
    by dynamo)."""
    for key, value in kwargs.items():
        if key == "backend":
            raise OptionTypeError(f"{entry} chooses the backend itself; name the compiler underneath with compiler=")
        if key == "options":
            raise OptionTypeError(f"{entry} takes torchlens options as keywords ({', '.join(OPTION_KEYS)}), "
                                  f"not options=")
        if key not in TORCH_COMPILE_KEYWORDS:
            fix = misplaced(COMPILE, str(key), value)
            if fix is not None:
                raise OptionTypeError(f"{entry} got {key}={value!r}: {fix}")
            accepted = OPTION_KEYS + TORCH_COMPILE_KEYWORDS
            raise OptionTypeError(f"{entry} got an unknown keyword {key!r}{suggest(str(key), accepted)}; accepted: "
                                  f"{', '.join(OPTION_KEYS)} (torchlens) and {', '.join(TORCH_COMPILE_KEYWORDS)} "
                                  "(torch.compile)")
        _check_torch_compile_value(entry, key, value)


def _check_torch_compile_value(entry: str, key: str, value) -> None:
    """torch.compile takes any truthy `fullgraph=` and checks `mode=` only when inductor compiles:
    a misspelt mode would surface at the first call, wrapped by dynamo, or never (compiler="eager")."""
    if key in ("fullgraph", "disable"):
        check_bool(entry, key, value)
    if key == "disable" and value:  # torch.compile would hand the model back untouched: nothing narrates
        raise OptionValueError(f"{entry}: disable=True turns torch.compile off, and the torchlens backend with "
                               f"it, so nothing would be narrated; narrate the model eagerly with tl.record, "
                               f"tl.trace or tl.recording.Recorder instead")
    if key == "dynamic" and value is not None and not isinstance(value, bool):
        raise OptionTypeError(f"{entry}: dynamic= takes True, False or None (decide per input), got {value!r}")
    if key == "mode" and value is not None:
        from torch._inductor import list_mode_options

        modes = list(list_mode_options())
        if not isinstance(value, str):
            raise OptionTypeError(f"{entry}: mode= takes None or one of {describe_choices(modes)}, got {value!r}")
        if value not in modes:
            raise OptionValueError(f"{entry}: mode={value!r}{suggest(value, modes)}: accepted are None or "
                                   f"{describe_choices(modes)}")


def compile_model(model, config: CompileConfig, torch_compile_kwargs: dict, backend: Optional[Backend] = None):
    """`torch.compile(model, backend=<torchlens for this model>, **torch_compile_kwargs)`, hooked."""
    if not callable(model):
        raise ModelTypeError(f"tl.compile takes an nn.Module or a function, got {type(model).__name__}")
    check_torch_compile_kwargs(torch_compile_kwargs, "tl.compile")
    if backend is None:
        backend = Backend(CompiledRuntime(config, model if isinstance(model, nn.Module) else module_of(model)))
    compiled = torch.compile(model, backend=backend, **torch_compile_kwargs)
    install(compiled, backend.runtime)
    # On the wrapper torch.compile returned, not on the user's module (which `nn.Module` attribute
    # setting would reach through it): the model itself stays as copyable and saveable as before.
    object.__setattr__(compiled, "torchlens", CompiledNarration(backend.runtime))
    return compiled


# One backend per (model, what shapes the compiled graphs): dynamo keeps compiled graphs per backend,
# so tracing the same model again reuses them instead of recompiling (and, after a few, giving up).
_trace_backends: "weakref.WeakKeyDictionary[nn.Module, Dict[tuple, Backend]]" = weakref.WeakKeyDictionary()


def trace_compiled(model: nn.Module, args, kwargs, config: CompileConfig, torch_compile_kwargs: dict) -> Trace:
    """Run `model` once compiled, keeping each op's value; return the trace."""
    check_torch_compile_kwargs(torch_compile_kwargs, "tl.trace(compiled=...)")
    settings = config.settings
    key = (settings.value_stats, settings.on_nonfinite, settings.keep_on_cpu, settings.max_bytes, config.live,
           config.compiler, config.stats_on, settings.backward, tuple(sorted(torch_compile_kwargs.items())))
    backends = _trace_backends.setdefault(model, {})
    backend = backends.get(key)
    if backend is None:
        backend = backends[key] = Backend(CompiledRuntime(config, model))
    backend.runtime.scopes.refresh()  # a reused runtime read the model's names at its first trace
    check_selection(settings, backend.runtime.scopes.paths)
    backend.runtime.config = config  # this call's narration; the graphs are instrumented alike
    backend.runtime.renew_backward()  # its backward narrated with this call's options
    compiled = compile_model(model, config, torch_compile_kwargs, backend)
    compiled(*args, **kwargs)
    runtime = backend.runtime
    trace, runtime.last_recording = runtime.last_recording, None  # the trace is the caller's now
    if runtime.last_graph_calls == 0:
        warn_safely("tl.trace(compiled=True): dynamo compiled no graph for this call, so the values are "
                    "eager ones; torch._dynamo.explain(model)(...) says why")
    return trace
