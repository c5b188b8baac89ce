"""`Recorder`: narrate every forward of a model inside a `with` block.

The decorator idiom of line tracers (`with snoop():`) maps onto this: each call of the model while
the block is open is one pass, recorded and narrated with a pass number.
"""

from __future__ import annotations

import collections
import sys
import threading
import types
from typing import Deque, List, Literal, Optional, Tuple

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..backward import BackwardNarration, running_backward
from ..core.guard import contain, internal_error
from ..core.sites import still_running
from ..core.structure import check_model, check_selection
from ..errors import OptionValueError, RecorderStateError
from ..events import Event
from ..narration.grammar import render_dropped_events_note
from ..narration.narrator import Narrator, render_lines
from ..options import NarrationOptions, Settings, check_keyword, make_settings
from ..results import Recording, Transcript
from .capture import unwinding
from .runner import EagerPass

__all__ = ["PassCutShort", "Recorder"]


class Recorder:
    """Context manager: every forward of `model` called inside is one recorded, narrated pass.

    ::

        with tl.recording.Recorder(model, narrate="run.log") as rec:
            model(x)
            model(y)
        rec.recordings[1].narrate(last=10)

    `recordings` holds one `Recording` per pass (a `PartialTrace` for a pass that failed), each with
    its forward's output: over a long loop pass `keep=N` to keep only the last N (the pass numbers
    go on counting; `keep=0` keeps none). `tail=N` also keeps the last N events across passes, and
    `narrate_tail()` shows what ran last, pass boundaries included: with `keep=` set, memory stays
    bounded over any number of passes.

    `backward=True` also narrates each backward through the graph a pass built (a training step's
    `loss.backward()`), after the pass's footer, in `recording.backward` (see `torchlens.backward`).
    """

    def __init__(self, model: nn.Module, *, narrate=None, value_stats: str = "off", on_nonfinite=None,
                 keep: Optional[int] = None, tail: Optional[int] = None, backward: bool = False,
                 dtensor_stats: str = "local"):
        check_model(model, "Recorder")
        keep = check_keyword("Recorder", "keep", keep)
        tail = check_keyword("Recorder", "tail", tail)
        self.model = model
        self.settings: Settings = make_settings(narrate, value_stats, on_nonfinite, backward=backward,
                                                dtensor_stats=dtensor_stats)
        check_selection(self.settings, [name for name, _ in model.named_modules()])
        self.recordings: Deque[Recording] = collections.deque(maxlen=keep)
        self._tail: Optional[Deque[Event]] = None if tail is None else collections.deque(maxlen=tail)
        # the passes the tail holds events of, oldest first: (pass number, index in the pass of its
        # first event put in the tail, events put in); one entry per pass, not one per event
        self._tail_passes: Deque[Tuple[int, int, int]] = collections.deque()
        self.passes = 0
        self._narrator: Optional[Narrator] = None
        self._handles: List[RemovableHandle] = []
        self._run: Optional[EagerPass] = None
        self._backward: Optional[BackwardNarration] = None
        self._narrating = False  # a pass's lines are being written (from its header to its footer)
        self._call_frame: Optional[types.FrameType] = None
        self._thread: Optional[int] = None

    def __repr__(self) -> str:
        state = "active" if self._handles else "inactive"
        kept = len(self.recordings)
        passes = f"{self.passes} pass{'es' if self.passes != 1 else ''}"
        return f"<Recorder of {type(self.model).__name__} ({state}): {passes}, {kept} kept>"

    def __enter__(self) -> "Recorder":
        if self._handles:
            raise RecorderStateError("this Recorder is already active: leave its `with` block before entering it again")
        if self.settings.narration is not None:
            self._narrator = Narrator(self.settings.narration)
        if self.settings.backward:
            self._backward = BackwardNarration(self.settings, self._narrator, lambda: self._narrating)
        self._thread = threading.get_ident()
        self._handles = [
            self.model.register_forward_pre_hook(self._begin, with_kwargs=True),
            self.model.register_forward_hook(self._end, with_kwargs=True, always_call=True),
        ]
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._run is not None:  # a pass cut short by something forward hooks do not see
            self._end_cut_short(exc)
        if self._backward is not None:  # a backward still open failed with `exc`; every hook goes
            backward, self._backward = self._backward, None
            backward.close(exc)
        if self._narrator is not None:
            self._narrator.close()
            self._narrator = None
        return False

    def _end_cut_short(self, exc: Optional[BaseException] = None) -> None:
        """End a pass whose forward stopped without its forward hook running.

        `Module.__call__` runs `always_call` hooks for an `Exception` only: a `KeyboardInterrupt`
        or `SystemExit` leaves the pass open. Seen when the block exits with it, or, if it was
        caught inside the block, when the next pass begins: kept then as a `PartialTrace`.
        """
        run, self._run = self._run, None
        assert run is not None  # (called with a pass open)
        self._call_frame = None
        try:
            self._keep(run.fail(exc if exc is not None else PassCutShort()))
        except Exception as inner:
            internal_error("ending an interrupted pass", inner)
        finally:
            run.close()
            self._pass_written()

    def _keep(self, recording) -> None:
        if recording is None:
            return
        self.recordings.append(recording)
        if self._tail is not None:
            events = recording.events[-(self._tail.maxlen or 0):]  # (its maxlen is `tail`, always set)
            if not events:
                return
            self._tail.extend(events)
            passes = self._tail_passes
            passes.append((self.passes, len(recording.events) - len(events), len(events)))
            held = sum(count for _, _, count in passes)
            while held - passes[0][2] >= len(self._tail):  # a pass wholly pushed out of the buffer
                held -= passes.popleft()[2]

    @property
    def tail(self) -> List[Event]:
        """The last `tail=N` events recorded, oldest first, across passes ([] without `tail=`)."""
        return list(self._tail) if self._tail is not None else []

    def _tail_by_pass(self, tail: Deque[Event]):
        """(pass number, index in its pass of the first event kept, the events kept) per pass the
        `tail` buffer holds, oldest first."""
        events = list(tail)
        held = sum(count for _, _, count in self._tail_passes)
        start = 0
        for i, (number, first, count) in enumerate(self._tail_passes):
            dropped = held - len(events) if i == 0 else 0  # only the oldest pass loses events
            yield number, first + dropped, events[start:start + count - dropped]
            start += count - dropped

    def narrate_tail(self) -> Transcript:
        """The events `tail` holds, narrated pass by pass under each pass's header.

        A pass the buffer holds only the end of starts with a note of how many of its events
        were dropped; its lines are indented by module depth as they were live.
        """
        if self._tail is None:
            raise OptionValueError("Recorder.narrate_tail() needs a tail buffer: Recorder(model, ..., tail=N)")
        options = (self.settings.narration or NarrationOptions()).replace(on_error_only=False)
        lines: List[str] = []
        for number, dropped, events in self._tail_by_pass(self._tail):
            rendered = render_lines(events, options.replace(prefix=""), f"pass {number}")
            if dropped:  # the first kept event's index in its pass
                rendered.insert(1, render_dropped_events_note(dropped, number))
            lines += rendered
        return Transcript("".join(options.prefix + line + "\n" for line in lines))

    def _begin(self, module, args, kwargs):
        if threading.get_ident() != self._thread:
            return None
        if self._backward is not None and running_backward():
            return None  # a forward run inside a backward (a checkpoint's recompute) is no pass of its own
        if self._run is not None:
            if still_running(self._call_frame):
                return None  # a nested call of the model inside its own forward is part of the pass
            self._end_cut_short()
        self._call_frame = sys._getframe(1)  # the model's `_call_impl`, running this pass
        try:
            if self._backward is not None:
                self._backward.end_unseen_runs()
            self.passes += 1
            self._narrating = True
            self._run = EagerPass(self.model, self.settings, self._narrator, header=f"pass {self.passes}",
                                  backward=self._backward)
            self._run.begin(args, kwargs)
        except Exception as exc:
            if self._run is not None:
                self._run.close()
            self._run = None
            self._pass_written()
            contain(exc, "starting a pass")
        return None

    def _end(self, module, args, kwargs, output):
        run = self._run
        if run is None or threading.get_ident() != self._thread:
            return None
        self._run = None
        self._call_frame = None  # the frame holds the forward's locals, its output among them
        try:
            failure = sys.exc_info()[1] if unwinding() else None  # (unwinding: an exception is being handled)
            self._keep(run.fail(failure) if failure is not None else run.finish(output))
        except Exception as exc:
            internal_error("ending a pass", exc)
        finally:
            run.close()
            self._pass_written()
        return None

    def _pass_written(self) -> None:
        """A pass's lines are all written: the backwards of other threads held back meanwhile follow."""
        self._narrating = False
        if self._backward is not None and self._narrator is not None:
            self._backward.flush_pending()


class PassCutShort(BaseException):
    """Stands for what stopped a pass out of torchlens's sight (a `KeyboardInterrupt` caught inside
    the `Recorder` block): the error its `PartialTrace` reports. Never raised."""

    def __str__(self) -> str:
        return "the forward stopped without returning or raising an Exception (e.g. a KeyboardInterrupt)"
