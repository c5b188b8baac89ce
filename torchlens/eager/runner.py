"""One eager forward under capture, from inputs to `Recording` (or to the partial trace of a failure)."""

from __future__ import annotations

import os
from typing import Optional

from torch import nn

from ..backward import BackwardNarration
from ..core.forward_pass import ForwardPass
from ..core.scopes import ScopeTable
from ..core.structure import check_selection, named_arguments
from ..narration.grammar import opaque_calls_note
from ..narration.narrator import Narrator
from ..options import Settings
from ..results import Recording
from .model_capture import EagerCapture

__all__ = ["EagerPass", "run_eager"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class EagerPass(ForwardPass):
    """A `ForwardPass` seen by module hooks and the capture mode: `begin(args, kwargs)`, then
    `finish(output)` or `fail(exc)`; `close()` always runs afterwards (it is idempotent) and leaves
    no hook, mode or open sink behind.
    """

    def __init__(self, model: nn.Module, settings: Settings, narrator: Optional[Narrator] = None, header=None,
                 backward=None):
        self.model = model
        self.scopes = ScopeTable.for_model(model)
        check_selection(settings, self.scopes.paths)
        super().__init__(settings, self.scopes.root_scope, model, header, narrator, backward)
        try:
            self.capture = EagerCapture(self.pipeline, self.scopes, self.nested)
        except BaseException:
            super().close()  # the sink it opened
            raise

    # `begin` and `finish` take what this substrate has and hand the base its named inputs and its
    # notes: a pass is driven through its own class, never as a plain ForwardPass
    def begin(self, args: tuple, kwargs: dict) -> None:  # type: ignore[override]
        super().begin(lambda: named_arguments(self.model, args, kwargs))
        self.capture.start()

    def finish(self, output) -> Recording:  # type: ignore[override]
        self.capture.stop()
        capture = self.capture
        return super().finish(output, lambda: opaque_calls_note(capture.scripted, capture.graph_calls))

    def fail(self, exc: BaseException):
        self.capture.stop()
        partial = super().fail(exc)
        strip_own_frames(exc)
        return partial

    def close(self) -> None:
        self.capture.release()
        super().close()


def run_eager(model: nn.Module, args: tuple, kwargs: dict, settings: Settings) -> Recording:
    """Run `model(*args, **kwargs)` once under capture and return its recording. With
    `settings.backward`, the backward run later through its graph is narrated to a sink of its own
    (the forward's sink is closed when this returns), and added to the recording."""
    backward = BackwardNarration(settings, None, once=True) if settings.backward else None
    run = EagerPass(model, settings, backward=backward)
    try:
        run.begin(args, kwargs)
        output = model(*args, **kwargs)
    except BaseException as exc:
        try:
            run.fail(exc)
        finally:
            run.close()
        raise
    try:
        return run.finish(output)
    finally:
        run.close()


def strip_own_frames(exc: BaseException) -> None:
    """Unlink torchlens's frames from the traceback, so the user sees their code and torch's.

    The first entry is kept: it is the frame currently handling the exception, and Python will
    keep adding the frames it propagates through above it.
    """
    tb = exc.__traceback__
    if tb is None:
        return
    keep = tb
    node = tb.tb_next
    while node is not None:
        if node.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            node = node.tb_next
            keep.tb_next = node
        else:
            keep = node
            node = node.tb_next
