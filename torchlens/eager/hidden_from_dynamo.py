"""Dynamo traces user code as if no capture were running.

A capture's `TorchFunctionMode` sits on the torch function mode stack for the whole narrated
forward, because code that runs eagerly inside a compiled region (between graphs, in frames dynamo
skips) must be captured. But dynamo starts every trace from that stack: left alone, it would trace
the mode's `__torch_function__` around every op, and the graph would record what the mode called
(`torch.floor_divide` for `x // 2`, `torch.rsub` for `1 - x`) instead of what the user wrote
(`operator.floordiv`, `operator.sub`). Dynamo's errors and graph-break messages would also point
into torchlens.

So the capture modes are taken out of the stack dynamo traces with (its symbolic stack), and kept
in the stack its guards expect (the mode is there at run time, so the compiled frame is reused).
If the traced code changes the stack itself (enters or leaves a mode), dynamo writes back the stack
it traced; the capture modes are put back at their places in it. Graphs are then the ones plain
`torch.compile` makes.

Installed once, the first time a capture starts after dynamo was imported (a compiled region cannot
run before that); it does nothing to stacks without capture modes. If torch's internals moved, it
installs nothing and dynamo traces the modes as before (correct graphs, torch-level op names).
"""

from __future__ import annotations

import sys
import threading

import torch

_lock = threading.Lock()
_installed = False


def _is_capture(mode) -> bool:
    return getattr(mode, "torchlens_capture", False)


def hide_capture_modes() -> None:
    """Install the filter if dynamo is loaded and it is not installed yet (cheap after the first)."""
    global _installed
    if _installed or "torch._dynamo.variables.torch_function" not in sys.modules:
        return
    with _lock:
        if _installed:
            return
        _installed = True
        try:
            _install(sys.modules["torch._dynamo.variables.torch_function"], sys.modules["torch._dynamo.utils"])
        except Exception:  # another torch's internals: traced with the modes, as before
            pass


def _install(torch_function, utils) -> None:
    state = torch_function.SymbolicTorchFunctionState
    original_init = state.__init__
    original_set = utils.set_torch_function_mode_stack

    def init_without_captures(self, py_stack, *args, **kwargs):
        original_init(self, py_stack, *args, **kwargs)
        modes = list(py_stack)
        if any(_is_capture(mode) for mode in modes) and len(modes) == len(self.mode_stack):
            kept = [var for var, mode in zip(list(self.mode_stack), modes) if not _is_capture(mode)]
            self.mode_stack.clear()
            self.mode_stack.extend(kept)

    def set_keeping_captures(stack):
        original_set(with_captures_kept(stack))

    state.__init__ = init_without_captures
    utils.set_torch_function_mode_stack = set_keeping_captures


def with_captures_kept(stack: list) -> list:
    """`stack` (written back by traced code) with the capture modes now active put back, each above
    the same number of other modes as it is now."""
    current = torch.overrides._get_current_function_mode_stack()
    if not any(_is_capture(mode) for mode in current) or any(_is_capture(mode) for mode in stack):
        return stack
    result = list(stack)
    others_below = 0
    inserted = 0
    for mode in current:
        if _is_capture(mode):
            result.insert(min(others_below + inserted, len(result)), mode)
            inserted += 1
        else:
            others_below += 1
    return result
