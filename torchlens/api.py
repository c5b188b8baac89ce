"""The capture entry points: `tl.record` and `tl.trace`."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .errors import ModelTypeError, OptionTypeError, suggest
from .options import make_settings
from .records import Recording, Trace
from .eager.runner import run_eager
from .eager.structure import check_model, forward_signature
from .eager.values import DEFAULT_MAX_BYTES

_RECORD_KEYWORDS = ("narrate", "value_stats", "on_nonfinite")
_TRACE_KEYWORDS = _RECORD_KEYWORDS + ("keep_on_cpu", "max_bytes")


def record(model: nn.Module, *args, narrate=None, value_stats: str = "off", on_nonfinite=None, **kwargs) -> Recording:
    """Run `model(*args, **kwargs)` once and record every op; narrate it live if asked.

    `narrate=` takes True (stderr), a path, a text stream, a callable taking one line, a Logger, a
    selector such as `tl.in_module("encoder.layer.3")`, or `tl.options.NarrationOptions(...)`.
    `value_stats=` is "off", "reuse", "sampled" or "exact"; `on_nonfinite=` None, "track" or
    "raise". Other keyword arguments go to the model's forward.

    If the forward raises, the exception propagates unchanged, with `exc.partial_trace` attached.
    """
    check_model(model, "tl.record")
    _check_forward_kwargs(model, kwargs, _RECORD_KEYWORDS, "tl.record")
    settings = make_settings(narrate, value_stats, on_nonfinite)
    return run_eager(model, args, kwargs, settings)


def trace(model: nn.Module, *args, narrate=None, value_stats: str = "off", on_nonfinite=None,
          keep_on_cpu: bool = False, max_bytes=DEFAULT_MAX_BYTES, compiled=False, **kwargs) -> Trace:
    """Like `record`, and also keep a detached copy of every op's output (`trace.values`).

    `keep_on_cpu=True` copies values to host memory; `max_bytes` (default 2 GiB, None for no
    limit) bounds what is kept: exceeding it stops the forward with `TraceBudgetError`.

    `compiled=True` runs the model once through `torch.compile` with the torchlens backend
    (inductor underneath) and keeps each compiled op's value, returned by the graph itself, so
    `tl.debug.compare(tl.trace(model, x), tl.trace(model, x, compiled=True))` finds where compiled
    numerics leave eager's. `compiled=` may also be a dict of `tl.compile` keywords, such as
    `{"compiler": "aot_eager", "dynamic": True}`.
    """
    check_model(model, "tl.trace")
    _check_forward_kwargs(model, kwargs, _TRACE_KEYWORDS + ("compiled",), "tl.trace")
    if not isinstance(keep_on_cpu, bool):
        raise OptionTypeError(f"tl.trace(keep_on_cpu=...) takes True or False, got {keep_on_cpu!r}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise OptionTypeError(f"tl.trace(max_bytes=...) takes a byte count >= 0 or None (no limit), got {max_bytes!r}")
    if compiled is not False:
        from .fx_backend.config import make_config

        options = _compiled_options(compiled)
        ours = {key: options.pop(key) for key in ("live", "compiler", "stats_on") if key in options}
        config = make_config(narrate, value_stats, on_nonfinite, keep_values=True, keep_on_cpu=keep_on_cpu,
                             max_bytes=max_bytes, **ours)
        compiled_model = _compile_with(model, config, options)
        compiled_model(*args, **kwargs)
        return compiled_model.torchlens.last_recording
    settings = make_settings(narrate, value_stats, on_nonfinite, keep_values=True, keep_on_cpu=keep_on_cpu,
                             max_bytes=max_bytes)
    return run_eager(model, args, kwargs, settings)


def _compiled_options(compiled) -> dict:
    if compiled is True:
        return {}
    if isinstance(compiled, dict):
        return dict(compiled)
    raise OptionTypeError(f"tl.trace(compiled=...) takes True, False or a dict of tl.compile keywords; got {compiled!r}")


def compile(model, *, narrate=None, value_stats: str = "off", on_nonfinite=None, live: bool = False,
            compiler="inductor", stats_on: str = "ops", **torch_compile_kwargs):
    """`torch.compile(model, backend="torchlens")` with the options as keywords and absolute module names.

    `live=True` writes each op's line as it completes (the graph runs op by op); `compiler=` is what
    compiles the graph underneath ("inductor", "eager", another backend's name, or a callable);
    `stats_on="module_outputs"` limits value statistics to the last op of each module call.
    Other keywords (`dynamic=`, `fullgraph=`, `mode=`) go to `torch.compile`. The returned object
    is what `torch.compile` returns; `compiled.torchlens.last_recording` is the latest forward's
    recording.
    """
    from .fx_backend.config import make_config

    config = make_config(narrate, value_stats, on_nonfinite, live=live, compiler=compiler, stats_on=stats_on)
    return _compile_with(model, config, torch_compile_kwargs)


def _compile_with(model, config, torch_compile_kwargs: dict):
    """`torch.compile` with a torchlens backend bound to a runtime for `model`, hooked before its
    first call."""
    from .fx_backend.registration import Backend, install
    from .fx_backend.runtime import CompiledRuntime, module_of

    if "backend" in torch_compile_kwargs:
        raise OptionTypeError("tl.compile chooses the backend itself; name the compiler underneath with compiler=")
    if not callable(model):
        raise ModelTypeError(f"tl.compile takes an nn.Module or a function, got {type(model).__name__}")
    runtime = CompiledRuntime(config, model if isinstance(model, nn.Module) else module_of(model))
    compiled = torch.compile(model, backend=Backend(runtime), **torch_compile_kwargs)
    install(compiled, runtime)
    compiled.torchlens = runtime
    return compiled


def _check_forward_kwargs(model: nn.Module, kwargs: dict, keywords, entry: str) -> None:
    """A keyword the forward cannot take is most likely a misspelt option: say so, with both lists."""
    if not kwargs:
        return
    try:
        parameters = forward_signature(model).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for name in kwargs:
        if name not in parameters:
            raise OptionTypeError(
                f"{entry} got {name!r}, which is neither a torchlens option{suggest(name, keywords)} "
                f"({', '.join(keywords)}) nor a parameter of {type(model).__name__}.forward "
                f"({', '.join(parameters) or 'none'})"
            )
