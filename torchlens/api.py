"""The capture entry points: `tl.record` and `tl.trace`."""

from __future__ import annotations

import difflib
import inspect
from typing import cast

from torch import nn

from .core.structure import check_model, forward_signature
from .core.values import DEFAULT_MAX_BYTES
from .eager.capture import outside_dynamo
from .eager.runner import run_eager
from .errors import OptionTypeError, OptionValueError, suggest
from .options import COMPILE, RECORD, TRACE, check_keyword, keywords_of, make_settings, misplaced
from .results import Recording, Trace

__all__ = ["compile", "load", "record", "trace"]

_RECORD_KEYWORDS = keywords_of(RECORD)
_TRACE_KEYWORDS = keywords_of(TRACE)
_COMPILED_ONLY = tuple(name for name in keywords_of(COMPILE) if name not in _TRACE_KEYWORDS)


@outside_dynamo
def record(model: nn.Module, *args, narrate=None, value_stats: str = "off", on_nonfinite=None, backward: bool = False,
           dtensor_stats: str = "local", **kwargs) -> Recording:
    """Run `model(*args, **kwargs)` once and record every op; narrate it live if asked.

    `narrate=` takes True (stderr), a path, a text stream, a callable taking one line, a Logger, a
    selector such as `tl.in_module("encoder.layer.3")`, or `tl.options.NarrationOptions(...)`.
    `value_stats=` is "off", "reuse", "sampled" or "exact"; `on_nonfinite=` None, "track" or
    "raise". `backward=True` also narrates the backward you run later through the graph this
    forward built (`recording.backward`, docs/backward.md). `dtensor_stats="global"` measures a
    DTensor's whole value, at one collective per measured DTensor, instead of this rank's shard
    (docs/distributed.md). Other keyword arguments go to the model's forward.

    If the forward raises, the exception propagates unchanged, with `exc.partial_trace` attached.
    """
    check_model(model, "tl.record")
    _check_forward_kwargs(model, kwargs, _RECORD_KEYWORDS, "tl.record")
    settings = make_settings(narrate, value_stats, on_nonfinite, backward=backward, dtensor_stats=dtensor_stats)
    return run_eager(model, args, kwargs, settings)


@outside_dynamo
def trace(model: nn.Module, *args, narrate=None, value_stats: str = "off", on_nonfinite=None,
          keep_on_cpu: bool = False, max_bytes=DEFAULT_MAX_BYTES, compiled=False, backward: bool = False,
          dtensor_stats: str = "local", **kwargs) -> Trace:
    """Like `record`, and also keep a detached copy of every op's output (`trace.values`).

    `keep_on_cpu=True` copies values to host memory; `max_bytes` (default 2 GiB, None for no
    limit) bounds what is kept: exceeding it stops the forward with `TraceBudgetError`.

    `compiled=True` runs the model once through `torch.compile` with the torchlens backend
    (inductor underneath) and keeps each compiled op's value, returned by the graph itself, so
    `tl.debug.compare(tl.trace(model, x), tl.trace(model, x, compiled=True))` finds where compiled
    numerics leave eager's. `compiled=` may also be a dict of `tl.compile` keywords, such as
    `{"compiler": "aot_eager", "dynamic": True}`.

    `backward=True` also keeps the gradients of the backward you run later through this forward's
    graph, node by node, so `compare` aligns them too (each backward within its own `max_bytes`).
    """
    check_model(model, "tl.trace")
    _check_forward_kwargs(model, kwargs, _TRACE_KEYWORDS + ("compiled",), "tl.trace")
    check_keyword("tl.trace", "keep_on_cpu", keep_on_cpu)
    check_keyword("tl.trace", "max_bytes", max_bytes)
    check_keyword("tl.trace", "dtensor_stats", dtensor_stats)
    if compiled is not False and dtensor_stats != "local":
        raise OptionValueError("tl.trace(compiled=..., dtensor_stats='global'): a compiled graph measures the local "
                               "shards it computes on; trace eagerly for a DTensor's whole value")
    if compiled is not False:
        from .fx_backend.config import OPTION_KEYS, make_config
        from .fx_backend.entry import trace_compiled

        options = _compiled_options(compiled)
        ours = {key: options.pop(key) for key in _COMPILED_ONLY if key in options}
        for key in set(options) & set(OPTION_KEYS + _TRACE_KEYWORDS):
            raise OptionTypeError(f"tl.trace(compiled=...): {key!r} is a keyword of tl.trace itself; pass it there")
        config = make_config(narrate, value_stats, on_nonfinite, keep_values=True, keep_on_cpu=keep_on_cpu,
                             max_bytes=max_bytes, backward=backward, **ours)
        return trace_compiled(model, args, kwargs, config, options)
    settings = make_settings(narrate, value_stats, on_nonfinite, keep_values=True, keep_on_cpu=keep_on_cpu,
                             max_bytes=max_bytes, backward=backward, dtensor_stats=dtensor_stats)
    return cast(Trace, run_eager(model, args, kwargs, settings))  # (a run that keeps values records a Trace)


def _compiled_options(compiled) -> dict:
    if compiled is True:
        return {}
    if isinstance(compiled, dict):
        return dict(compiled)
    raise OptionTypeError(f"tl.trace(compiled=...) takes True, False or a dict of tl.compile keywords; "
                          f"got {compiled!r}")


def compile(model, *, narrate=None, value_stats: str = "off", on_nonfinite=None, live: bool = False,
            compiler="inductor", stats_on: str = "ops", backward: bool = False, **torch_compile_kwargs):
    """`torch.compile(model, backend="torchlens")` with the options as keywords and absolute module names.

    `live=True` writes each op's line as it completes (the graph runs op by op); `compiler=` is what
    compiles the graph underneath ("inductor", "eager", another backend's name, or a callable);
    `stats_on="module_outputs"` limits value statistics to the last op of each module call;
    `backward=True` also narrates each backward through a forward's graphs (docs/compiled.md).
    Other keywords (`dynamic=`, `fullgraph=`, `mode=`) go to `torch.compile`. The returned object
    is what `torch.compile` returns; `compiled.torchlens.last_recording` is the latest forward's
    recording.
    """
    from .fx_backend.config import make_config
    from .fx_backend.entry import compile_model

    config = make_config(narrate, value_stats, on_nonfinite, live=live, compiler=compiler, stats_on=stats_on,
                         backward=backward)
    return compile_model(model, config, torch_compile_kwargs)


def _check_forward_kwargs(model: nn.Module, kwargs: dict, keywords, entry: str) -> None:
    """A keyword the forward cannot take is most likely a misspelt option: say so, with both lists.

    A forward taking `**kwargs` (nearly every transformers model) would swallow `value_stat=` or
    `narate=` without a word, so there a keyword the forward does not name and that is a near miss
    of a torchlens option is refused too, as is a torchlens option in the wrong place (`sites=`
    belongs inside `narrate=`, `keep_on_cpu=` to `tl.trace`), with the fix; a forward that really
    wants such a keyword gets it by
    calling the model inside `tl.recording.Recorder(model, ...)`.
    """
    if not kwargs:
        return
    try:
        parameters = forward_signature(model).parameters
    except (TypeError, ValueError):
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for name, value in kwargs.items():
        if name in parameters:
            continue
        if name in _COMPILED_ONLY:
            raise OptionTypeError(f"{entry} got {name!r}, an option of compiled runs only: pass it to "
                                  f"tl.compile(model, {name}=...) or torch.compile(..., backend='torchlens')")
        fix = misplaced(entry, name, value)
        if fix is not None:
            swallowed = f"; {type(model).__name__}.forward takes **kwargs and would have dropped it silently" \
                if takes_any else ""
            raise OptionTypeError(f"{entry} got {name}={value!r}: {fix}{swallowed}. If it really is for the forward, "
                                  f"call the model yourself inside `with tl.recording.Recorder(model, ...):`, which "
                                  f"passes every argument through.")
        if not takes_any:
            raise OptionTypeError(
                f"{entry} got {name!r}, which is neither a torchlens option{suggest(name, keywords)} "
                f"({', '.join(keywords)}) nor a parameter of {type(model).__name__}.forward "
                f"({', '.join(parameters) or 'none'})"
            )
        close = difflib.get_close_matches(name, list(keywords), n=1, cutoff=0.8)
        if close:
            raise OptionTypeError(
                f"{entry} got {name!r}: did you mean the torchlens option {close[0]!r}? "
                f"{type(model).__name__}.forward takes **kwargs, so it would have received {name!r} "
                f"silently. If it really is for the forward, call the model yourself inside "
                f"`with tl.recording.Recorder(model, ...):`, which passes every argument through."
            )


def load(path) -> Recording:
    """The recording, trace or partial trace `recording.save(path)` wrote, as it was saved.

    Reads data only (JSON and a safetensors file): nothing in the file is imported, unpickled or
    run, and a file that is not a saved trace raises `tl.errors.TraceFileError`. Kept values and
    output tensors load on the CPU; the events keep the devices they ran on.
    """
    from .archive import decode, files
    from .errors import OptionTypeError, TraceFileError

    try:
        loaded = decode.recording(*files.read(path))
        loaded.narrate()  # every line renders: a file that loads also narrates
        for run in loaded.backward:
            run.narrate()
    except (TraceFileError, OptionTypeError, OSError, MemoryError):
        raise  # not a trace; a path of the wrong type; a file that cannot be read
    except Exception as exc:  # what the checks above let through: damaged data is still damaged data
        raise TraceFileError(f"not a trace torchlens saved, or a damaged one: {type(exc).__name__}: {exc}") from None
    return loaded
