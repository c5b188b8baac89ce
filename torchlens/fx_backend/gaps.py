"""Narrating what dynamo runs eagerly between compiled graphs.

A `print`, a `.item()` branch, or a frame dynamo skips after a graph break inside a loop all run as
plain Python; the backend never sees them. The eager substrate's `CaptureMode` is active for the
whole compiled forward to catch those ops, and is suspended while a compiled graph runs (whose ops the
plan narrates). Module hooks cannot be used here — registering them changes what dynamo compiles —
so a gap op's module is read from the Python stack: the innermost frame whose `self` is a module of
the model.
"""

from __future__ import annotations

from ..core.pipeline import Pipeline
from ..core.scopes import ScopeTable
from ..eager.capture import OpReporter

__all__ = ["GapCapture"]


class GapCapture(OpReporter):
    """The capture `CaptureMode` reports to during a compiled forward."""

    def __init__(self, pipeline: Pipeline, scopes: ScopeTable, nested: bool):
        super().__init__(pipeline)
        self.scopes = scopes
        self.nested = nested  # inside an eager capture's forward

    follows_stack = True

    def locate(self, frame) -> None:
        self.session.move_to(self.scopes.scope_of_stack(frame))
