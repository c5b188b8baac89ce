"""What a compiled model (or function) keeps across its calls: its options, module names and
forward count, and the pass each call opens. Dynamo's wrapper calls the runtime's `enter` hook
before each call of the compiled callable and the returned cleanup after it (the boundary
`dynamo_seams.CompiledCall` describes). A pass begins only through `CompiledRuntime.start`: from
the enter hook, from the first compile of a string-backend model (`adopt`), or for a graph called
outside any wrapper."""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

from torch import nn

from ..backward import BackwardNarration
from ..core.guard import contain, is_stop
from ..core.scopes import ScopeTable
from ..core.structure import check_selection
from ..results import Recording
from . import dynamo_seams
from .active import active_pass
from .compiled_pass import CompiledPass
from .config import CompileConfig

__all__ = ["CompiledRuntime"]


class CompiledRuntime:
    """Options, module names and forward count shared by every forward of one compiled model.

    `last_recording` is the most recent forward's `Recording` (only the last is kept: its output
    and any kept values stay alive as long as it does, and no longer than the model).
    """

    def __init__(self, config: CompileConfig, root: Optional[nn.Module] = None):
        self.config = config
        self.scopes = ScopeTable(root)
        if root is not None:
            check_selection(config.settings, self.scopes.paths)
            _forget_recording_with(root, self)
        self.passes = 0
        self.last_recording: Optional[Recording] = None
        self.last_graph_calls = 0
        self.stop_pending: Optional[_PendingStop] = None  # see `pending_stop`
        # `backward=True`: the backwards through the graphs of this model's forwards (see `backward`)
        self.backward = BackwardNarration(config.settings, None) if config.settings.backward else None

    # -- the forward boundary -------------------------------------------------------------------

    def enter(self) -> Callable[[], None]:
        """Dynamo's enter hook: begin a pass for this call; return the cleanup that ends it."""
        try:
            current = active_pass()
            if current is not None and not current.call_running():
                current.abandon()  # its call ended without its cleanup (a first call, or dynamo raised)
                current = None
            call = dynamo_seams.current_call()
            if call is None or current is not None:
                return _nothing  # a compiled callable called inside a forward already being narrated
            forward = self.start(call, push_mode=True)
            return forward.cleanup if forward is not None else _nothing
        except Exception as exc:  # (a stop: on_nonfinite="raise" found a NaN in the inputs)
            contain(exc, "starting a compiled forward")
            return _nothing

    def adopt(self, call: dynamo_seams.CompiledCall) -> None:
        """First compile of a model compiled with the string backend: narrate the call in progress.

        Its enter hooks ran before this backend existed, so the pass begins here, the capture mode
        joins the frame being compiled, and the pass ends when the call does.
        """
        if active_pass() is not None:
            return
        try:
            forward = self.start(call, push_mode=False)  # dynamo is tracing: the mode joins its saved stack
        except Exception as exc:  # a stop (on_nonfinite="raise": a NaN in the inputs), its partial trace attached
            self.stop_pending = _PendingStop(exc, call)  # raised inside the compile, dynamo would wrap it
            dynamo_seams.when_call_ends(call, self.pending_stop)  # a call that ran no graph drops it
            return
        if forward is None:
            return
        forward.mode_pushed = dynamo_seams.adopt_mode_for_this_compile(forward.mode)
        if not dynamo_seams.when_call_ends(call, forward.cleanup):
            forward.call = call._replace(frame=None)  # ended when the next call begins

    def pending_stop(self) -> Optional[BaseException]:
        """The stop the first call's pass raised while dynamo compiled it, to be raised by the
        first graph that call runs: out of the compile, it reaches the user as it is, not wrapped in
        `BackendCompilerFailed`. None when there is none, or its call has ended."""
        if self.stop_pending is None:
            return None
        pending, self.stop_pending = self.stop_pending, None
        return pending.stop if pending.call.running() else None

    def start(self, call: Optional[dynamo_seams.CompiledCall], push_mode: bool) -> Optional["CompiledPass"]:
        """The one way a compiled pass begins: for a wrapper `call` in progress, or (None) for a
        graph called outside any (then the graph call is the whole pass). None if it cannot."""
        forward = None
        try:
            if self.backward is not None:
                self.backward.end_unseen_runs()
            self.passes += 1
            forward = CompiledPass(self, header=f"pass {self.passes}", call=call)
            forward.begin(push_mode)
            return forward
        except Exception as exc:
            if forward is not None:
                if is_stop(exc):
                    forward.end(False, exc=exc)  # the partial trace of the inputs, attached to the stop
                else:
                    forward.close()
            contain(exc, "starting a compiled forward")
            return None

    def renew_backward(self) -> None:
        """The backwards of forwards from now on are narrated with the current options (a runtime
        reused by `tl.trace(compiled=...)`; graphs watched before keep theirs)."""
        settings = self.config.settings
        self.backward = BackwardNarration(settings, None) if settings.backward else None

    def __reduce__(self):
        """A copied or saved compiled model carries no narration state: its copy's runtime is
        None (the runtime holds the sink, weak references and dynamo's hooks, none of which copy)."""
        return (_no_runtime, ())

    def keep_latest(self, recording: Optional[Recording], graph_calls: int) -> None:
        self.last_recording = recording
        self.last_graph_calls = graph_calls


class _PendingStop(NamedTuple):
    """A stop a pass raised while dynamo compiled the call it belongs to."""

    stop: BaseException
    call: dynamo_seams.CompiledCall


def _nothing() -> None:
    return None


def _no_runtime() -> None:
    return None


def _forget_recording_with(root: nn.Module, runtime: CompiledRuntime) -> None:
    """Drop the runtime's last recording (its output tensors) when the model is collected.

    Dynamo keeps every backend it was given, and the compiled graphs, until `torch._dynamo.reset()`,
    so a runtime outlives its model; the recording of the model's last forward must not.
    """
    finalizer = weakref.finalize(root, _forget_recording, weakref.ref(runtime))
    finalizer.atexit = False


def _forget_recording(runtime_ref) -> None:
    runtime = runtime_ref()
    if runtime is not None:
        runtime.last_recording = None
