"""Which compiled forward is running on this thread.

A graph call finds the run it belongs to here; a compiled model called inside another's forward
(or during the eager re-run that locates a tracing failure) must not narrate into it.
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()


def active_run():
    """The compiled run in progress on this thread, or None."""
    return getattr(_local, "run", None)


def make_active(run) -> None:
    _local.run = run


def make_inactive(run) -> None:
    """`run` ends: no run is active any more, unless another has taken its place."""
    if getattr(_local, "run", None) is run:
        _local.run = None


@contextlib.contextmanager
def quiet_runs():
    """No run is active inside the block (its compiled calls narrate nothing into the outer run)."""
    saved, _local.run = active_run(), None
    try:
        yield
    finally:
        _local.run = saved
