"""One eager forward under capture, from inputs to `Recording` (or to the partial trace of a failure)."""

from __future__ import annotations

import os
from typing import Optional

from torch import nn

from ..events import TensorMeta
from ..grammar import opaque_calls_note
from ..narrator import Narrator
from ..results import Recording
from ..options import Settings
from ..session import Session, internal_error
from ..stats import Meter
from .capture import EagerCapture
from ..scopes import ScopeTable
from ..structure import check_selection, named_inputs, named_outputs, tensor_names
from ..values import ValueKeeper

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class EagerRun:
    """Session + capture for one forward: `begin(args, kwargs)`, then `end(output)` or `abort(exc)`.

    `close()` always runs afterwards (it is idempotent) and leaves no hook or mode behind.
    """

    def __init__(self, model: nn.Module, settings: Settings, narrator: Optional[Narrator], header=None,
                 observers=()):
        self.model = model
        self.scopes = ScopeTable.for_model(model)
        check_selection(settings, self.scopes.paths)
        self.session = Session(settings, self.scopes.root_scope, narrator, header,
                               tensor_names=lambda: tensor_names(model))
        meter = Meter(settings.value_stats, settings.on_nonfinite is not None)
        if meter.active:
            self.session.meter = meter
        observers = list(observers)
        if settings.keep_values:
            observers.append(ValueKeeper(self.session.values, settings.keep_on_cpu, settings.max_bytes))
        self.observers = observers
        self.capture = EagerCapture(self.session, self.scopes, observers)

    def begin(self, args: tuple, kwargs: dict) -> None:
        with self.capture.own_work():
            self._record_inputs(args, kwargs)
        self.capture.start()

    def _record_inputs(self, args: tuple, kwargs: dict) -> None:
        try:
            for label, tensor in named_inputs(self.model, args, kwargs):
                event = self.session.add_input(label, (TensorMeta.of(tensor),), value=tensor)
                for observe in self.observers:
                    observe(event, tensor)
        except Exception as exc:
            if getattr(exc, "torchlens_stop", False):
                raise  # a trace budget exceeded by the inputs alone
            internal_error("recording the forward's inputs", exc)

    def end(self, output) -> Recording:
        """The recording of the forward that returned `output`. A failure of torchlens here must not
        turn the user's successful forward into an error: it is reported and a bare recording kept."""
        self.capture.stop()
        with self.capture.own_work():
            try:
                for label, tensor in named_outputs(output):
                    self.session.add_output(label, (TensorMeta.of(tensor),), tensor)
                self.session.footer_extra.extend(opaque_calls_note(self.capture.scripted, self.capture.graph_calls))
                return self.session.finish(output)
            except Exception as exc:
                internal_error("finishing the recording", exc)
                return Recording(self.session.events, output, self.session.settings)

    def abort(self, exc: BaseException):
        self.capture.stop()
        with self.capture.own_work():
            partial = self.session.fail(exc)
        strip_own_frames(exc)
        return partial

    def close(self) -> None:
        self.capture.stop()


def run_eager(model: nn.Module, args: tuple, kwargs: dict, settings: Settings, header=None) -> Recording:
    """Run `model(*args, **kwargs)` once under capture and return its recording."""
    narrator = Narrator(settings.narration) if settings.narration is not None else None
    try:
        run = EagerRun(model, settings, narrator, header)
        try:
            run.begin(args, kwargs)
            output = model(*args, **kwargs)
        except BaseException as exc:
            run.abort(exc)
            raise
        finally:
            run.close()
        return run.end(output)
    finally:
        if narrator is not None:
            narrator.close()


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
