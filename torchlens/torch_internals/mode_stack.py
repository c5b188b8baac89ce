"""Every operation on torch's function mode stack that torchlens makes, in one place.

The captures of both substrates are `TorchFunctionMode`s marked `torchlens_capture`. They sit on
the thread's mode stack for a whole forward, and step off it in a few well-defined situations: a
capture ends (its mode is removed wherever it is, keeping modes pushed above it), a compiled graph
runs (the gap capture's mode is lifted while it is on top), a module's fast-path check asks
whether any override is active (answered with the capture modes off), and dynamo writes back the
stack it traced (the capture modes are put back where they were).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["capture_modes", "is_capture", "lifted_if_on_top", "only_capture_modes_lifted", "own_work", "remove_mode",
           "under_a_capture", "with_captures_kept"]

_current = torch.overrides._get_current_function_mode_stack
_pop = torch._C._pop_torch_function_stack
_push = torch._C._push_on_torch_function_stack
_disabled = torch._C.DisableTorchFunction  # torch calls made inside reach no mode, no subclass


def own_work(nested: bool):
    """Context for a capture's own torch calls (statistics, kept copies, inputs, the footer): made
    invisible to other captures in the thread when there are any (`nested`), a no-op otherwise.
    Disabling torch function dispatch costs half a microsecond; it is paid only when needed."""
    return _disabled() if nested else contextlib.nullcontext()


def is_capture(mode) -> bool:
    """Whether `mode` is a torchlens capture's mode."""
    return getattr(mode, "torchlens_capture", False)


def capture_modes():
    """The capture modes on this thread's stack, bottom first."""
    return [mode for mode in _current() if is_capture(mode)]


def under_a_capture() -> bool:
    """Whether a capture's mode is on this thread's stack (a capture starting now nests)."""
    return any(is_capture(mode) for mode in _current())


def remove_mode(mode) -> None:
    """Pop `mode` from the stack, keeping any modes above it in place (a no-op if absent)."""
    if not any(other is mode for other in _current()):
        return
    above = []
    while True:
        top = _pop()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        _push(other)


@contextlib.contextmanager
def lifted_if_on_top(mode):
    """Take `mode` off the stack for the block if it is on top; yields whether it was."""
    depth = torch._C._len_torch_function_stack()
    on_top = depth > 0 and torch._C._get_function_stack_at(depth - 1) is mode
    if on_top:
        _pop()
    try:
        yield on_top
    finally:
        if on_top:
            _push(mode)


@contextlib.contextmanager
def only_capture_modes_lifted():
    """With every mode on the stack a capture's (or torchlens's float64 reference mode, which
    keeps fast paths too), take them all off for the block (yields True); otherwise change
    nothing (yields False): somebody else's override stays in force."""
    stack = _current()
    if not stack or not all(is_capture(mode) or getattr(mode, "torchlens_keeps_fast_paths", False) for mode in stack):
        yield False
        return
    popped = [_pop() for _ in stack]
    try:
        yield True
    finally:
        for mode in reversed(popped):
            _push(mode)


def with_captures_kept(stack: list) -> list:
    """`stack` (written back by code dynamo traced) with the capture modes now active put back,
    each above the same number of other modes as it is now."""
    current = _current()
    if not any(is_capture(mode) for mode in current) or any(is_capture(mode) for mode in stack):
        return stack
    result = list(stack)
    others_below = 0
    inserted = 0
    for mode in current:
        if is_capture(mode):
            result.insert(min(others_below + inserted, len(result)), mode)
            inserted += 1
        else:
            others_below += 1
    return result
