"""Options of the compiled path: `torch.compile(..., backend="torchlens", options={...})` and `tl.compile`.

Keys mirror `tl.record`'s keywords (`narrate`, `value_stats`, `on_nonfinite`) and add what only a
compiled run has: `live` (narrate each op as it completes, running the graph op by op), `compiler`
(what compiles the graph: "inductor" by default, "eager", another registered backend's name, or a
backend callable), `stats_on` ("ops", or "module_outputs" to measure only the last op of each
module call) and `backward` (narrate the backward through each forward's graphs).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, cast

import torch

from ..errors import OptionTypeError, suggest
from ..options import COMPILE, Settings, check_keyword, keywords_of, make_settings, misplaced

__all__ = ["OPTION_KEYS", "CompileConfig", "config_from_options", "inner_compile", "make_config"]

OPTION_KEYS = keywords_of(COMPILE)


class CompileConfig(NamedTuple):
    """Validated options of one compiled model."""

    settings: Settings
    live: bool
    compiler: Any
    stats_on: str


def make_config(narrate=None, value_stats="off", on_nonfinite=None, live=False, compiler="inductor",
                stats_on="ops", keep_values=False, keep_on_cpu=False, max_bytes=None, backward=False) -> CompileConfig:
    live = check_keyword("compiled options", "live", live)
    stats_on = check_keyword("compiled option", "stats_on", stats_on)
    compiler = check_keyword("compiled options", "compiler", compiler)
    settings = make_settings(narrate, value_stats, on_nonfinite, keep_values=keep_values,
                             keep_on_cpu=keep_on_cpu, max_bytes=max_bytes, backward=backward)
    return CompileConfig(settings, live, compiler, stats_on)


def config_from_options(options: Optional[Mapping[str, Any]]) -> CompileConfig:
    """Validate `options=` of the string backend."""
    if options is None:
        return make_config()
    if not isinstance(options, Mapping):
        raise OptionTypeError(f"backend 'torchlens' takes options as a dict with keys {', '.join(OPTION_KEYS)}; "
                              f"got {type(options).__name__}")
    for key, value in options.items():
        fix = misplaced(COMPILE, str(key), value) if key not in OPTION_KEYS else None
        if fix is not None:
            raise OptionTypeError(f"backend 'torchlens' got the option {key!r}: {fix}")
        if key not in OPTION_KEYS:
            raise OptionTypeError(
                f"backend 'torchlens' got an unknown option {key!r}{suggest(str(key), OPTION_KEYS)}; "
                f"accepted: {', '.join(OPTION_KEYS)}"
            )
    return make_config(**options)


def inner_compile(compiler, gm: torch.fx.GraphModule, example_inputs, mode: Optional[str] = None) -> Callable:
    """Compile `gm` with the compiler underneath (inductor unless told otherwise)."""
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = torch._inductor.list_mode_options(mode) if mode else None
        # (its stubs name every kind of result; without an AOT option asked for, a callable)
        return cast(Callable, compile_fx(gm, example_inputs, config_patches=patches))
    if compiler == "eager":
        return gm.forward
    if isinstance(compiler, str):
        compiler = torch._dynamo.lookup_backend(compiler)
    return compiler(gm, example_inputs)
