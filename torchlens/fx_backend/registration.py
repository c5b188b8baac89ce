"""`backend="torchlens"`: the function torch finds through the `torch_dynamo_backends` entry point.

Installed with pip, torch discovers the backend by name without torchlens being imported. In a
source checkout on `PYTHONPATH` there is no entry point, so importing torchlens registers it (only
then: registering a name twice is an error in dynamo).
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Iterable, Optional

import torch

__all__ = ["Backend", "install", "register_without_entry_point", "torchlens_backend"]

NAME = "torchlens"
_RUNTIME_ATTR = "_torchlens_runtime"

# The compiled path imports dynamo and inductor (seconds): this module imports them only when a
# backend is actually used, so that `import torchlens` stays cheap for eager use.


def prepare_tracing() -> None:
    """Before dynamo traces a frame for this backend: it traces the user's code as plain
    `torch.compile` does, and records the spellings the op names need (see `dynamo_seams`)."""
    from ..core.compiled_regions import install_for_dynamo
    from .dynamo_seams import record_user_spellings

    record_user_spellings()
    install_for_dynamo()


def torchlens_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options=None):
    """The dynamo backend: narrate the graph, then compile it with the inner compiler."""
    from . import dynamo_seams
    from .config import config_from_options
    from .graph import compile_graph

    call = dynamo_seams.current_call()
    ctx = call.context if call is not None else None
    runtime = getattr(ctx, _RUNTIME_ATTR, None)
    if runtime is None:
        runtime = runtime_for(call, config_from_options(options))
    return compile_graph(runtime, gm, example_inputs, mode)


def runtime_for(call, config):
    """Create the runtime of a compiled model the first time the backend sees it (during `call`,
    the wrapper call being compiled; None for a graph compiled outside one)."""
    from ..core.structure import module_of
    from . import dynamo_seams
    from .runtime import CompiledRuntime

    runtime = CompiledRuntime(config, module_of(call.fn if call is not None else None))
    if call is None:
        return runtime  # a graph compiled outside any wrapper: each of its calls is a pass
    if dynamo_seams.hook_calls(call.context, runtime.enter):
        setattr(call.context, _RUNTIME_ATTR, runtime)
        runtime.adopt(call)
    else:
        from ..torch_internals.seams import degraded

        degraded("compile wrapper", "the compile wrapper's context keeps no enter hooks")
    return runtime


class Backend:
    """The backend object `tl.compile` hands to `torch.compile`, bound to one runtime."""

    def __init__(self, runtime):
        self.runtime = runtime

    def __call__(self, gm, example_inputs, *, mode: Optional[str] = None, options=None):
        from .graph import compile_graph

        return compile_graph(self.runtime, gm, example_inputs, mode)  # options= is refused up front


def install(compiled, runtime) -> None:
    """Hook a runtime to what `torch.compile` returned, before its first call."""
    from . import dynamo_seams

    prepare_tracing()
    ctx = dynamo_seams.context_of_compiled(compiled)
    if ctx is None or not dynamo_seams.hook_calls(ctx, runtime.enter):
        from ..torch_internals.seams import degraded

        degraded("compile wrapper", "what torch.compile returned has no dynamo context with enter hooks")
        return  # graphs still narrate, each call of a graph as a forward of its own
    setattr(ctx, _RUNTIME_ATTR, runtime)


def register_without_entry_point() -> None:
    """Register the backend by hand when no installed distribution provides the entry point."""
    points: Iterable[importlib.metadata.EntryPoint]
    try:
        points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    except Exception:
        points = ()
    if any(point.name == NAME for point in points):
        return
    from torch._dynamo.backends import registry

    if NAME not in registry._BACKENDS:
        registry.register_backend(name=NAME)(torchlens_backend)
    prepare_tracing()


if "torch._dynamo" in sys.modules:  # imported by dynamo looking up the backend: before its first trace
    prepare_tracing()
