"""The global module hooks every eager capture shares: registered once, dispatched per thread.

A capture learns where modules begin and end from torch's global forward hooks. Dynamo guards a
compiled frame on the *keys* of those hook dictionaries (its trace of `Module._call_impl` reads
them). Hooks registered and removed by each capture gave every capture new keys, so a compiled
submodule under `tl.record` recompiled at each forward until dynamo's recompile limit, and captures
in several threads changed the dictionaries while another thread traced (dynamo raised
`InternalTorchDynamoError: KeyError`). So:

- one pre hook and one post hook are registered when the first capture starts, and dispatch to
  the captures active in the calling thread (in the order they started, as separate
  registrations ran); with none in this thread they return after one thread-local read;
- once dynamo is loaded they stay registered for the life of the process (a later registration
  would give compiled frames new keys to guard on); until then they are removed when the last
  capture in the process ends, so a process that never compiles keeps torch's hook-free fast path.

Traced by dynamo they return at once (`is_compiling()`), so compiled graphs are unchanged. Torch
warns on every call of a `torch.compile`d module while any global hook is registered ("hooks fire
an extra time"); captures handle that call themselves, so the warning counts only other hooks
(`_has_any_global_hook`, a seam: `torch_seams`, "global hook check").
"""

from __future__ import annotations

import sys
import threading
from typing import List

import torch

from ..torch_seams import degraded

__all__ = ["HOOKS", "add_capture", "remove_capture", "routed", "shared_keys"]

_is_compiling = torch.compiler.is_compiling
_threads = threading.local()  # .hooked: the captures active in this thread, outermost first
_lock = threading.Lock()
_handles: List = []
_users = 0  # captures active in the process
_MODULE = torch.nn.modules.module
_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _pre_hook(module, args):
    if _is_compiling():
        return None
    captures = getattr(_threads, "hooked", None)
    if captures:
        for capture in tuple(captures):
            capture._pre_hook(module, args)
    return None


def _post_hook(module, args, output):
    if _is_compiling():
        return None
    captures = getattr(_threads, "hooked", None)
    if captures:
        unwound = sys._getframe(1).f_code is _CALL_IMPL  # the forward raised (see `capture.unwinding`)
        for capture in tuple(captures):
            capture._post_hook(module, args, output, unwound)
    return None


HOOKS = (_pre_hook, _post_hook)


def add_capture(capture) -> None:
    """Route this thread's module calls to `capture` (after the captures already active here)."""
    global _users
    with _lock:
        if not _handles:
            _handles.extend((_MODULE.register_module_forward_pre_hook(_pre_hook),
                             _MODULE.register_module_forward_hook(_post_hook, always_call=True)))
            _count_only_other_hooks()
        _users += 1
    captures = getattr(_threads, "hooked", None)
    if captures is None:
        captures = _threads.hooked = []
    captures.append(capture)


def remove_capture(capture) -> None:
    """Stop routing to `capture`. Safe to call for a capture that was never added."""
    global _users
    captures = getattr(_threads, "hooked", None)
    if not captures or capture not in captures:
        return
    captures.remove(capture)
    with _lock:
        _users -= 1
        if _users == 0 and "torch._dynamo" not in sys.modules:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def routed() -> tuple:
    """(captures routed to in this thread, captures active in the process): what a capture that
    ended without `remove_capture` would leave behind."""
    return len(getattr(_threads, "hooked", None) or ()), _users


def shared_keys() -> set:
    """The keys the shared hooks have in torch's global hook dictionaries (none when removed)."""
    return {handle.id for handle in _handles}


_checks_installed = False


def _count_only_other_hooks() -> None:
    """Make torch's "are there global hooks?" check, read only to warn about compiled modules,
    leave ours out."""
    global _checks_installed
    if _checks_installed:
        return
    _checks_installed = True
    original = getattr(_MODULE, "_has_any_global_hook", None)
    dicts = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
             "_global_forward_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")
    if original is None or not all(isinstance(getattr(_MODULE, name, None), dict) for name in dicts):
        degraded("global hook check", "torch.nn.modules.module._has_any_global_hook or its dictionaries moved")
        return

    def has_any_global_hook() -> bool:
        ours = shared_keys()  # (a hook's key is its handle's id in every dictionary)
        return any(key not in ours for name in dicts for key in getattr(_MODULE, name))

    _MODULE._has_any_global_hook = has_any_global_hook
