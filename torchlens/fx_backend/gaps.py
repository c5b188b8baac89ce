"""Narrating what dynamo runs eagerly between compiled graphs.

A `print`, a `.item()` branch, or a frame dynamo skips after a graph break inside a loop all run as
plain Python; the backend never sees them. The eager substrate's `CaptureMode` is active for the
whole compiled forward to catch those ops, and is paused while a compiled graph runs (whose ops the
plan narrates). Module hooks cannot be used here — registering them changes what dynamo compiles —
so a gap op's module is read from the Python stack: the innermost frame whose `self` is a module of
the model.
"""

from __future__ import annotations

import sys

from ..eager.capture import input_metas, output_metas
from ..naming import op_name
from ..session import Session, internal_error
from ..sites import find_user_site
from ..scopes import ScopeTable


class GapCapture:
    """The capture `CaptureMode` reports to during a compiled forward."""

    def __init__(self, session: Session, scopes: ScopeTable, sites: bool, keeper=None):
        self.session = session
        self.scopes = scopes
        self.sites = sites
        self.keeper = keeper  # keeps op values for `tl.trace(..., compiled=True)`
        self.paused = False
        self.ops = 0  # ops recorded between graphs, for the footer

    def op_done(self, func, out) -> None:
        metas = output_metas(out)
        if metas is None:
            return
        try:
            frame = sys._getframe(2)
            session = self.session
            session.move_to(self.scopes.scope_of_stack(frame))
            event = session.add_op(op_name(func), metas, find_user_site(frame) if self.sites else None, value=out)
            if self.keeper is not None:
                self.keeper(event, out)
            self.ops += 1
        except Exception as exc:
            if getattr(exc, "torchlens_stop", False):
                raise  # a deliberate stop (on_nonfinite="raise", a trace budget)
            self.paused = True
            internal_error("recording an op between compiled graphs", exc)

    def op_raised(self, func, args, kwargs, exc) -> None:
        try:
            frame = sys._getframe(2)
            session = self.session
            session.move_to(self.scopes.scope_of_stack(frame))
            session.op_failed(op_name(func), input_metas(args, kwargs), find_user_site(frame), exc)
        except Exception as inner:
            internal_error("describing the failed op", inner)
