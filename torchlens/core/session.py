"""One forward pass's event log: ops numbered, module nesting kept balanced, each event narrated live.

A substrate (eager hooks, or a compiled graph's plan) reports module enters and exits and failed
calls here directly, and the values it sees through the pass's `pipeline.Pipeline` (which
measures and judges them before they are appended). Every event enters the log through `append`
(`EventLog`'s, a backward run's too; a compiled graph's replayed run of events: `append_segment`);
the metadata-only capture's `add_op` is `append`'s body inlined, the hot path. At the end the
session produces a `Recording` (on failure, a `PartialTrace` attached to the user's exception).
"""

from __future__ import annotations

import traceback
from typing import Dict, List, NamedTuple, Optional

from ..events import ENTER, EXIT, INPUT, OP, OUTPUT, Attempt, Event, Scope
from ..measure.integer_values import call_stream, read_values
from ..narration.narrator import Narrator
from ..options import Settings
from ..repro.kept import KeptCall
from ..results import PartialTrace, Recording, Trace
from .sites import display_path, is_internal_file

__all__ = ["EventLog", "Session", "Settled", "attach", "attach_finding", "error_summary", "in_chain",
           "nonfinite_message"]


class Settled(NamedTuple):
    """What a pass's pipeline settled at its end for its recording (`Pipeline.settle`)."""

    findings: tuple
    verdict: Optional[str]
    kept_calls: dict


class FailedCall(NamedTuple):
    """A torch call that raised: the attempted op, should the exception end the forward."""

    op: str
    scope: Scope
    site: Optional[str]
    inputs: tuple  # metadata of its tensor inputs
    exc: BaseException
    notes: tuple
    call: Optional[KeptCall] = None  # the function and its arguments, when the capture saw them
    tensors: tuple = ()  # its tensor inputs, in `inputs` order: their integer values are read if the forward fails
    stream: object = None  # the accelerator stream it ran on, to read them on (`integer_values.call_stream`)
    values: Optional[tuple] = None  # those values, when already read (by an eager re-run of the forward)


class EventLog:
    """Events in order, each handed to the live narrator as it is added: `append` is the one way
    into a forward's log (`Session`) and a backward run's (`backward.run.BackwardRun`)."""

    def __init__(self, events: List[Event], narrator: Optional[Narrator], header: Optional[str]):
        self.events = events
        self.narrator = narrator
        self.header = header
        self.ordinal = 0  # the number of the last op (`#N`) or backward node (`~N`)
        self.incomplete: Optional[str] = None  # why some of the run went unrecorded, if it did
        if narrator is not None:
            narrator.begin_pass(header)

    def append(self, event: Event) -> Event:
        self.events.append(event)
        if self.narrator is not None:
            self.narrator.feed(event)
        return event

    def mark_incomplete(self, why: str) -> None:
        """Some of the run went unrecorded (`why`): the footer and the verdict say so. The first
        reason is kept."""
        if self.incomplete is None:
            self.incomplete = why


class Session(EventLog):
    """Collects one forward's events and narrates them live.

    `narrator` may be shared by several sessions (a `Recorder` narrates every pass to one sink).
    """

    def __init__(self, settings: Settings, root: Scope, narrator: Optional[Narrator] = None,
                 header: Optional[str] = None):
        super().__init__([], narrator, header)
        self.settings = settings
        self.root = root
        self.values: Optional[Dict[int, tuple]] = {} if settings.keep_values else None  # ordinal -> kept value
        self.scope = root
        self.failed_call: Optional[FailedCall] = None  # the last torch call that raised
        self._unwound: List[Scope] = []  # exits seen while an exception propagated, not yet recorded
        self.footer_extra: List[str] = []

    # -- what substrates report -----------------------------------------------------------------

    def append(self, event: Event) -> Event:
        """`EventLog.append`, after the exits of modules an exception caught inside the forward
        unwound through."""
        if self._unwound:
            self._recover()
        return super().append(event)

    def input_event(self, label: str, metas) -> Event:
        """The next input's event, numbered, at the root (not yet in the log)."""
        self.ordinal += 1
        return Event(INPUT, self.ordinal, "input", self.root, metas, None, None, label)

    def op_event(self, op: str, metas, site=None, stats=None) -> Event:
        """The next op's event, numbered and placed in the open module (not yet in the log)."""
        self.ordinal += 1
        self.failed_call = None
        return Event(OP, self.ordinal, op, self.scope, metas, site, stats, None)

    def output_event(self, label: str, metas) -> Event:
        """An output's event, at the root once the modules still open are left (not yet in the log)."""
        self.move_to(self.root)
        return Event(OUTPUT, self.ordinal, "output", self.root, metas, None, None, label)

    def add_op(self, op: str, metas) -> Event:
        """Record an op that needs no measuring, judging or keeping (the metadata-only capture).

        The hot path of every narrated forward: `op_event` and `append` inlined on purpose (the
        common case is two attribute checks, an append and the narrator).
        """
        self.ordinal += 1
        self.failed_call = None
        event = Event(OP, self.ordinal, op, self.scope, metas, None, None, None)
        if self._unwound:
            self._recover()
        self.events.append(event)
        if self.narrator is not None:
            self.narrator.feed(event)
        return event

    def enter(self, scope: Scope) -> None:
        self.append(Event(ENTER, self.ordinal, scope.type_name, scope))
        self.scope = scope

    def open_scope(self, paths) -> Optional[Scope]:
        """The innermost open module call with one of these paths (None for the root or a closed module)."""
        scope = self.scope
        while scope is not None and scope.parent is not None:
            if scope.path in paths:
                return scope
            scope = scope.parent
        return None

    def exit(self, scope: Scope, unwinding: bool = False) -> None:
        """Leave `scope`; exits of inner modules that were skipped are recorded first.

        While an exception propagates (`unwinding`) exits are held back: if the forward fails they
        are dropped, so a crash tail ends where the failure happened, inside its modules; if the
        exception is caught inside the forward and the run goes on, they are recorded then.
        """
        current = self.scope
        if unwinding:
            while current is not None and current is not scope and current.parent is not None:
                self._unwound.append(current)
                current = current.parent
            self._unwound.append(scope)
            assert scope.parent is not None  # (a module call: `open_scope` never gives the root)
            self.scope = scope.parent
            return
        if self._unwound:
            self._recover()
        while self.scope is not scope and self.scope.parent is not None:
            self._record_exit(self.scope)
        self._record_exit(scope)

    def _record_exit(self, scope: Scope) -> None:
        self.append(Event(EXIT, self.ordinal, scope.type_name, scope))
        assert scope.parent is not None  # (a module call, never the root)
        self.scope = scope.parent

    def _recover(self) -> None:
        """An exception was caught inside the forward: record the exits it unwound through."""
        unwound, self._unwound = self._unwound, []
        self.failed_call = None
        for scope in unwound:
            self.append(Event(EXIT, self.ordinal, scope.type_name, scope))

    def move_to(self, target: Scope) -> None:
        """Record the exits and enters that take the open module stack to `target`.

        The compiled substrate knows each op's module stack but not when modules were entered, so
        it derives module lines from transitions; eager capture reports enters and exits directly.
        """
        if target is self.scope:
            return
        wanted = target.chain()
        opened = self.scope.chain()
        common = 0
        while common < len(wanted) and common < len(opened) and wanted[common].key == opened[common].key:
            common += 1
        for scope in reversed(opened[common:]):
            self._record_exit(scope)
        if common:
            self.scope = opened[common - 1]
        for scope in wanted[common:]:
            self.enter(scope)
        self.scope = target

    def append_segment(self, events, ordinal: int, scope: Scope, narration_cache: dict) -> None:
        """Append a run of events recorded before in exactly this situation (same ordinal, same
        open module), leaving the session as recording them one by one would have."""
        if self._unwound:
            self._recover()
        self.events.extend(events)
        self.ordinal = ordinal
        self.scope = scope
        self.failed_call = None
        if self.narrator is not None:
            self.narrator.feed_block(events, narration_cache)

    def append_restated(self, events, stats_of, stats, ordinal: int, scope: Scope) -> None:
        """`append_segment` for a run whose ops' statistics differ from call to call: each op's
        event again with this call's statistics (`stats[stats_of[i]]` for event i; None in
        `stats_of` marks a module's enter or exit, appended as it is), narrated one by one (their
        lines show the statistics)."""
        if self._unwound:
            self._recover()
        fresh = [event if index is None else event.with_stats(stats[index]) for event, index in zip(events, stats_of)]
        self.events.extend(fresh)
        self.ordinal = ordinal
        self.scope = scope
        self.failed_call = None
        if self.narrator is not None:
            for event in fresh:
                self.narrator.feed(event)

    def replace_events(self, events, attempt: Attempt) -> None:
        """Take another capture's record of this same forward, up to its attempted op, as this
        pass's own (a compiled forward dynamo failed to trace, located by running it eagerly)."""
        self.events[:] = events
        self.ordinal, self.scope = attempt.ordinal - 1, attempt.scope

    def op_failed(self, op: str, metas, site, exc: BaseException, scope: Optional[Scope] = None,
                  notes=(), call: Optional[KeptCall] = None, tensors=(), values: Optional[tuple] = None) -> None:
        """A torch call raised: remember it as the attempted op in case the forward fails.
        `tensors` are its tensor inputs (described by `metas`), held while the exception unwinds
        and read only if the forward fails (`integer_values`); `values`, what was already read."""
        tensors = tuple(tensors)
        self.failed_call = FailedCall(op, scope or self.scope, site, metas, exc, tuple(notes), call, tensors,
                                      call_stream(tensors), values)

    # -- ending the pass ------------------------------------------------------------------------

    def finish(self, output, settled: Settled) -> Recording:
        """The recording of the forward that returned `output` (its modules left: `move_to` the root),
        with what its pipeline `settled` (the footer's words included)."""
        if self.narrator is not None:
            self.narrator.end_pass(self.footer_extra)
        cls = Trace if self.values is not None else Recording
        return self._recording(cls, output, settled, footer_extra=list(self.footer_extra))

    def fail(self, exc: BaseException, attempt: Optional[Attempt], settled: Settled) -> PartialTrace:
        """The partial trace for `exc` (`attempt`: the op it ended, `attempt_for`), the tail narrated,
        both attached to the exception."""
        error = error_summary(exc)
        partial = self._recording(PartialTrace, None, settled, footer_extra=[], attempt=attempt, error=error)
        if self.narrator is not None:
            self.narrator.fail(self.events, attempt, error)
        attach(exc, partial)
        return partial

    def _recording(self, cls, output, settled: Settled, **more):
        made = cls(events=self.events, output=output, settings=self.settings, header=self.header, values=self.values,
                   findings=settled.findings, verdict=settled.verdict, **more)
        made.kept_calls = settled.kept_calls
        return made

    def attempt_for(self, exc: BaseException, unread=None) -> Attempt:
        """The attempted op of a forward that `exc` ends. `unread(tensor)`: why a tensor's memory
        must not be read (the pipeline's rule), for the values of the call's integer inputs."""
        failed = self.failed_call
        if failed is not None and in_chain(failed.exc, exc):
            # the forward ends here: what the call read is copied, so that the partial trace holds
            # neither the forward's activations nor its graph (`torchlens.repro.kept`)
            call = failed.call.copy() if failed.call is not None else None
            values = failed.values
            if values is None and failed.tensors:
                values = read_values(failed.tensors, exc, unread, failed.stream)
            if values is not None and len(values) != len(failed.inputs or ()):
                values = None  # (described otherwise than read: shown without them)
            return Attempt(failed.op, self.ordinal + 1, failed.scope, failed.site, failed.inputs, failed.notes, call,
                           values)
        scope = self._unwound[0] if self._unwound else self.scope
        return Attempt(None, self.ordinal + 1, scope, user_site_of(exc), ())


def attach_finding(finding, live: bool) -> None:
    """Put a finding on its op; `live`: its `!!` line follows the op's line (when printed)."""
    finding.live = live
    if finding.event is not None and finding.event.finding is None:
        finding.event.finding = finding


def in_chain(target: BaseException, exc: BaseException) -> bool:
    """Whether `target` is `exc` or one of the exceptions it was raised from or during."""
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if current is target:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def error_summary(exc: BaseException) -> str:
    try:
        message = str(exc).strip().splitlines()
    except Exception:  # an exception whose message itself fails
        message = ["<message could not be rendered>"]
    first = message[0] if message else ""
    if len(first) > 240:
        first = first[:237] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def user_site_of(exc: BaseException) -> Optional[str]:
    """The innermost frame outside torch and torchlens where `exc` was raised, as a site string.

    Dynamo's errors carry the user's stack separately (`real_stack`): their traceback is dynamo's.
    """
    frames = [(f.filename, f.lineno) for f in getattr(exc, "real_stack", None) or ()]
    frames += [(frame.f_code.co_filename, lineno) for frame, lineno in traceback.walk_tb(exc.__traceback__)]
    site = None
    for filename, lineno in frames:
        if not is_internal_file(filename):
            site = f"{display_path(filename)}:{lineno}"
    return site


def attach(exc: BaseException, partial: PartialTrace) -> None:
    """Give the exception `exc.partial_trace` and a PEP 678 note with the short form of the tail."""
    try:
        exc.partial_trace = partial  # type: ignore[attr-defined]  # an attribute of our own on the user's exception
    except Exception:  # an exception type that refuses attributes: the note still helps
        pass
    try:
        add_note = getattr(exc, "add_note", None)  # (Python 3.11 on: on 3.10 an exception takes no notes)
        if add_note is not None:
            add_note(partial.short_note())
    except Exception:
        pass


def nonfinite_message(finding) -> str:
    event = finding.event
    site = f" ({event.site})" if event is not None and event.site else ""
    return (f"on_nonfinite='raise': {finding.text}{site}. The partial trace is attached as exc.partial_trace; "
            f"on_nonfinite='track' records the run without stopping.")
