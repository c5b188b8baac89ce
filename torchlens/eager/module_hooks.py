"""The global module hooks every eager capture shares: registered while captures run, under keys
that never change, dispatched per thread.

A capture learns where modules begin and end from torch's global forward hooks. Two facts of
torch shape how they are held:

- while any global forward hook is registered, `Module._call_impl` takes its slow path for every
  module call of every model in the process: a plain forward of a 12-block `Linear+GELU` model
  costs 1.34-1.40x. So the hooks are registered only while a capture runs anywhere in the
  process, and removed when the last one ends (returned, raised or interrupted);
- dynamo guards a compiled frame that calls modules on those hook dictionaries: whether they are
  empty, and their *keys*. Hooks registered under new keys at each capture made a compiled
  submodule under `tl.record` recompile at every forward, until dynamo's recompile limit. So the
  hooks are registered once, and afterwards put back under the same keys: a compiled frame sees
  one of two states (no hooks, or ours), and dynamo keeps a compiled entry for each.

The hooks dispatch to the captures active in the calling thread (in the order they started); with
none in this thread they return after one thread-local read. They are added and removed under
dynamo's compile lock when dynamo is loaded: a thread tracing a frame reads the dictionaries
(captures in several threads changing them mid-trace made dynamo raise `KeyError`). Traced by
dynamo they return at once (`is_compiling()`), so compiled graphs are unchanged.

Torch warns on every call of a `torch.compile`d module while any global hook is registered ("hooks
fire an extra time"); captures handle that call themselves, so while ours are registered the
warning's check counts only other hooks (`_has_any_global_hook`, a seam: `torch_seams`, "global
hook check"), and torch's own check is put back with them.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import List

import torch

from ..torch_internals.seams import degraded

__all__ = ["HOOKS", "add_capture", "remove_capture", "routed", "shared_keys"]

_is_compiling = torch.compiler.is_compiling
_threads = threading.local()  # .hooked: the captures active in this thread, outermost first
_lock = threading.Lock()
_handles: List = []  # (pre, post): made by the first registration, kept for their keys
_registered = False
_users = 0  # captures active in the process
_MODULE = torch.nn.modules.module
_CALL_IMPL = torch.nn.Module._call_impl.__code__
_HOOK_CHECK = getattr(_MODULE, "_has_any_global_hook", None)  # torch's own
_DICTS = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
          "_global_forward_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")


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
    """Route this thread's module calls to `capture` (after the captures already active here);
    the first capture in the process registers the hooks."""
    global _users
    with _tracing_held(), _lock:
        if _users == 0:
            _register()
        _users += 1
    captures = getattr(_threads, "hooked", None)
    if captures is None:
        captures = _threads.hooked = []
    captures.append(capture)


def remove_capture(capture) -> None:
    """Stop routing to `capture`; the last capture in the process removes the hooks. Safe to call
    for a capture that was never added."""
    global _users
    captures = getattr(_threads, "hooked", None)
    if not captures or capture not in captures:
        return
    captures.remove(capture)
    with _tracing_held(), _lock:
        _users -= 1
        if _users == 0:
            _unregister()


def _register() -> None:
    """Register the two hooks: through torch the first time, then under the keys that gave."""
    global _registered
    try:
        if _handles:
            _put_back(*_handles)
    except Exception as exc:  # another torch's dictionaries: new keys each time, and we say so
        degraded("shared hook keys", exc)
        _handles.clear()
    if not _handles:
        _handles.extend((_MODULE.register_module_forward_pre_hook(_pre_hook),
                         _MODULE.register_module_forward_hook(_post_hook, always_call=True)))
    _registered = True
    _count_only_other_hooks()


def _put_back(pre, post) -> None:
    """What torch's registration did, under the keys it gave (a seam: "shared hook keys")."""
    _MODULE._global_forward_pre_hooks[pre.id] = _pre_hook
    _MODULE._global_forward_hooks[post.id] = _post_hook
    _MODULE._global_forward_hooks_always_called[post.id] = True


def _unregister() -> None:
    global _registered
    for handle in _handles:
        handle.remove()  # (removes the key from every dictionary it was put in)
    _registered = False
    if _HOOK_CHECK is not None and _MODULE._has_any_global_hook is _has_any_global_hook:
        _MODULE._has_any_global_hook = _HOOK_CHECK


def _tracing_held():
    """Dynamo's compile lock, when dynamo is loaded: no frame is traced while the dictionaries
    change (a re-entrant lock: a capture started by code dynamo is compiling takes it again)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def routed() -> tuple:
    """(captures routed to in this thread, captures active in the process): what a capture that
    ended without `remove_capture` would leave behind."""
    return len(getattr(_threads, "hooked", None) or ()), _users


def shared_keys() -> set:
    """The keys the shared hooks have in torch's global hook dictionaries while registered."""
    return {handle.id for handle in _handles} if _registered else set()


def _has_any_global_hook() -> bool:
    """torch's "are there global hooks?" check, read only to warn about compiled modules, with
    ours left out (a hook's key is its handle's id in every dictionary)."""
    ours = shared_keys()
    return any(key not in ours for name in _DICTS for key in getattr(_MODULE, name))


def _count_only_other_hooks() -> None:
    if _HOOK_CHECK is None or not all(isinstance(getattr(_MODULE, name, None), dict) for name in _DICTS):
        degraded("global hook check", "torch.nn.modules.module._has_any_global_hook or its dictionaries moved")
        return
    _MODULE._has_any_global_hook = _has_any_global_hook
