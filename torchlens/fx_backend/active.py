"""Which compiled pass is running on this thread.

A graph call finds the pass it belongs to here; a compiled model called inside another's forward
(or during the eager re-run that locates a tracing failure) must not narrate into it.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["active_pass", "make_active", "make_inactive", "no_active_pass"]

_local = threading.local()


def active_pass():
    """The `CompiledPass` in progress on this thread, or None."""
    return getattr(_local, "compiled_pass", None)


def make_active(compiled_pass) -> None:
    _local.compiled_pass = compiled_pass


def make_inactive(compiled_pass) -> None:
    """`compiled_pass` ends: no pass is active any more, unless another has taken its place."""
    if getattr(_local, "compiled_pass", None) is compiled_pass:
        _local.compiled_pass = None


@contextlib.contextmanager
def no_active_pass():
    """No pass is active inside the block (its compiled calls narrate nothing into the outer pass)."""
    saved, _local.compiled_pass = active_pass(), None
    try:
        yield
    finally:
        _local.compiled_pass = saved
