"""One forward pass being recorded: the seam between a substrate and everything downstream.

A substrate (eager hooks, or a compiled graph's plan) reports what happens — inputs, ops, module
enters and exits, outputs, a failure — and the session numbers the ops, keeps module nesting
balanced, stores the events, hands each one to the live narrator, and at the end produces a
`Recording` (or, on failure, a `PartialTrace` attached to the user's exception).
"""

from __future__ import annotations

import traceback
from typing import List, NamedTuple, Optional


from .errors import NonFiniteError
from .guard import internal_error
from .events import ENTER, EXIT, INPUT, OP, OUTPUT, Attempt, Event, Scope, Stats
from .narrator import Narrator
from .options import Settings
from .results import PartialTrace, Recording, Trace
from .sites import display_path, is_internal_file
from .meter import Meter, reads_now
from .tracking import UNINITIALIZED, Tracker
from .repro.kept import InputKeeper, KeptCall

__all__ = ["Session", "attach", "attach_finding", "error_summary", "in_chain", "nonfinite_message"]


class FailedCall(NamedTuple):
    """A torch call that raised: the attempted op, should the exception end the forward."""

    op: str
    scope: Scope
    site: Optional[str]
    inputs: tuple  # metadata of its tensor inputs
    exc: BaseException
    notes: tuple
    call: Optional[KeptCall] = None  # the function and its arguments, when the capture saw them


class Session:
    """Collects one forward's events and narrates them live.

    `narrator` may be shared by several sessions (a `Recorder` narrates every pass to one sink).
    """

    def __init__(self, settings: Settings, root: Scope, narrator: Optional[Narrator] = None,
                 header: Optional[str] = None, tensor_names=dict):
        self.settings = settings
        self.root = root
        self.narrator = narrator
        self.header = header
        self.events: List[Event] = []
        self.values = {} if settings.keep_values else None
        self.ordinal = 0
        self.scope = root
        self.failed_call: Optional[FailedCall] = None  # the last torch call that raised
        self._unwound: List[Scope] = []  # exits seen while an exception propagated, not yet recorded
        self.footer_extra: List[str] = []
        self.meter: Optional[Meter] = None  # set by a substrate that measures values itself (eager)
        self.raise_on_nonfinite = settings.on_nonfinite == "raise"
        # `tensor_names()`: id -> name of the model's parameters and buffers, read when a finding needs it
        self.tracker = Tracker(tensor_names) if settings.on_nonfinite is not None else None
        # With tracking: the inputs of the first op to introduce each kind of non-finite value, for `.repro()`
        self.kept_inputs = InputKeeper() if self.tracker is not None else None
        self._outputs = []  # (label, tensor) of the forward's outputs, for the tracker
        self.incomplete: Optional[str] = None  # why some of the forward went unrecorded, if it did
        # Tracking while narrating: CPU statistics are read as each op completes (there is no
        # device to wait for), so a finding's `!!` line follows its op whatever the selection.
        self._judge_live = self.tracker is not None and narrator is not None
        if narrator is not None:
            narrator.begin_pass(header)

    # -- what substrates report -----------------------------------------------------------------

    def append(self, event: Event) -> Event:
        """Add an event to the pass's log (after the exits of modules an exception caught inside the
        forward unwound through), and hand it to the live narrator."""
        if self._unwound:
            self._recover()
        return self._append(event)

    def _append(self, event: Event) -> Event:
        self.events.append(event)
        if self.narrator is not None:
            self.narrator.feed(event)
        return event

    def add_input(self, label: str, metas, site=None, value=None) -> Event:
        self.ordinal += 1
        event = self._measured(Event(INPUT, self.ordinal, "input", self.root, metas, site, None, label), value)
        if self.tracker is not None and value is not None:
            self.tracker.produced(event, value)
        return event

    def add_op(self, op: str, metas, site=None, stats=None, value=None, reads=None) -> Event:
        """Record an op, with its `stats`, or with its output `value` for the meter to measure;
        `reads` is what it read, when non-finite values are tracked (see `torchlens.tracking`).

        The hot path of every capture: kept flat on purpose (the common case, no meter and no
        unwound modules, is three attribute checks, an append and the narrator).
        """
        self.ordinal += 1
        self.failed_call = None
        event = Event(OP, self.ordinal, op, self.scope, metas, site, stats, None)
        if reads is not None:
            event.reads = reads
        if self.meter is not None or self._unwound:
            return self._measured(event, value)
        self.events.append(event)
        if self.narrator is not None:
            self.narrator.feed(event)
        return event

    def _measured(self, event: Event, value) -> Event:
        if self.meter is not None and value is not None:
            event.stats = self._measure(event, value)
        findings = self._judge(event) if self.tracker is not None else ()
        self.append(event)
        if self.raise_on_nonfinite and findings:  # the NaN at this op; its message names the cause
            raise NonFiniteError(nonfinite_message(next((f for f in findings if f.event is event), findings[0])))
        return event

    def _measure(self, event: Event, value):
        """The statistics of an op's output, read now or at the end of the pass by `meter.reads_now`
        (the rule the backward uses too; tracking judges live here only while it narrates)."""
        if event.op.startswith(UNINITIALIZED):  # `empty` and friends: no values to measure yet
            return Stats("na", 0, self.meter.rung != "off", note="uninitialized")
        live = reads_now(self.raise_on_nonfinite, self.narrator is not None and self.narrator.prints(event),
                         self._judge_live, value)
        return self.meter.measure_output(value, live)  # never raises: "n/a" when it cannot

    def _judge(self, event: Event) -> list:
        """The tracker's findings made now; those about this very op get their `!!` line after it."""
        findings = self.tracker.judge(event)
        for finding in findings:
            attach_finding(finding, finding.live and finding.event is event)
        return findings

    def add_output(self, label: str, metas, value=None) -> Event:
        if self.tracker is not None and value is not None:
            self._outputs.append((label, value))
        self.move_to(self.root)
        return self.append(Event(OUTPUT, self.ordinal, "output", self.root, metas, None, None, label))

    def enter(self, scope: Scope) -> None:
        self.append(Event(ENTER, self.ordinal, scope.type_name, scope))
        self.scope = scope

    def open_scope(self, path: Optional[str]) -> Optional[Scope]:
        """The innermost open module call with this path (None for the root or a closed module)."""
        scope = self.scope
        while scope is not None and scope.parent is not None:
            if scope.path == path:
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
            self.scope = scope.parent
            return
        if self._unwound:
            self._recover()
        while self.scope is not scope and self.scope.parent is not None:
            self._record_exit(self.scope)
        self._record_exit(scope)

    def _record_exit(self, scope: Scope) -> None:
        self._append(Event(EXIT, self.ordinal, scope.type_name, scope))
        self.scope = scope.parent

    def _recover(self) -> None:
        """An exception was caught inside the forward: record the exits it unwound through."""
        unwound, self._unwound = self._unwound, []
        self.failed_call = None
        for scope in unwound:
            self._append(Event(EXIT, self.ordinal, scope.type_name, scope))

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

    def replace_events(self, events, attempt: Attempt) -> None:
        """Take another capture's record of this same forward, up to its attempted op, as this
        pass's own (a compiled forward dynamo failed to trace, located by running it eagerly)."""
        self.events[:] = events
        self.ordinal, self.scope = attempt.ordinal - 1, attempt.scope

    def mark_incomplete(self, why: str) -> None:
        """Some of the forward went unrecorded (`why`): the footer and the verdict say so. The
        first reason is kept."""
        if self.incomplete is None:
            self.incomplete = why

    def op_failed(self, op: str, metas, site, exc: BaseException, scope: Optional[Scope] = None,
                  notes=(), call: Optional[KeptCall] = None) -> None:
        """A torch call raised: remember it as the attempted op in case the forward fails."""
        self.failed_call = FailedCall(op, scope or self.scope, site, metas, exc, tuple(notes), call)

    # -- ending the pass ------------------------------------------------------------------------

    def finish(self, output) -> Recording:
        self.move_to(self.root)
        self._settle_stats()
        if self.narrator is not None:
            self.narrator.end_pass(self.footer_extra)
        cls = Trace if self.values is not None else Recording
        made = cls(
            events=self.events,
            output=output,
            settings=self.settings,
            header=self.header,
            footer_extra=list(self.footer_extra),
            values=self.values,
            findings=self.findings,
        )
        made.kept_calls = self._kept_calls()
        return made

    def _kept_calls(self) -> dict:
        return self.kept_inputs.calls if self.kept_inputs is not None else {}

    def fail(self, exc: BaseException) -> PartialTrace:
        """Build the partial trace for `exc`, narrate the tail, and attach both to the exception.

        Never raises: a problem here is reported as a warning and the user's exception goes on.
        """
        try:
            self._settle_stats()
            attempt = None if isinstance(exc, NonFiniteError) else self.attempt_for(exc)
            error = error_summary(exc)
            partial = PartialTrace(
                events=self.events,
                output=None,
                settings=self.settings,
                header=self.header,
                footer_extra=[],
                values=self.values,
                findings=self.findings,
                attempt=attempt,
                error=error,
            )
            partial.kept_calls = self._kept_calls()
            if self.narrator is not None:
                self.narrator.fail(self.events, attempt, error)
            attach(exc, partial)
            return partial
        except Exception as inner:
            internal_error("building the partial trace", inner)
            return None

    def _settle_stats(self) -> None:
        """Read what statistics are still on the device, and summarise tracking in the footer."""
        try:
            if self.meter is not None:
                self.meter.flush()
        except Exception as exc:
            internal_error("reading value statistics", exc)
        settings = self.settings
        if settings.value_stats != "off":
            self.footer_extra.append(f"value_stats={settings.value_stats}")
        tracker = self.tracker
        if tracker is None and self.incomplete:  # (tracking's verdict says it in its own words)
            self.footer_extra.append(f"not everything after {self.incomplete} was recorded")
        if tracker is not None:
            try:
                for finding in tracker.judge_rest():
                    # with no live narration, nothing was printed it must match: the note shows
                    attach_finding(finding, finding.live and self.narrator is None)
                for label, value in self._outputs:
                    tracker.output_reached(label, value)
                self.footer_extra.append(tracker.summary(self.incomplete))
                for event in self.events:  # provenance served its purpose: keep no pass alive by it
                    event.reads = None
            except Exception as exc:
                internal_error("judging non-finite values", exc)
                self.footer_extra.append("non-finite tracking failed: no verdict")

    @property
    def findings(self) -> tuple:
        """What non-finite tracking found (`torchlens.findings.Finding`), in order."""
        return tuple(self.tracker.findings) if self.tracker is not None else ()

    def attempt_for(self, exc: BaseException) -> Attempt:
        failed = self.failed_call
        if failed is not None and in_chain(failed.exc, exc):
            # the forward ends here: what the call read is copied, so that the partial trace holds
            # neither the forward's activations nor its graph (`torchlens.repro.kept`)
            call = failed.call.copy() if failed.call is not None else None
            return Attempt(failed.op, self.ordinal + 1, failed.scope, failed.site, failed.inputs, failed.notes, call)
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
    while exc is not None and id(exc) not in seen:
        if exc is target:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
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
        exc.partial_trace = partial
    except Exception:  # an exception type that refuses attributes: the note still helps
        pass
    try:
        exc.add_note(partial.short_note())
    except Exception:
        pass


def nonfinite_message(finding) -> str:
    event = finding.event
    site = f" ({event.site})" if event is not None and event.site else ""
    return (f"on_nonfinite='raise': {finding.text}{site}. The partial trace is attached as exc.partial_trace; "
            f"on_nonfinite='track' records the run without stopping.")
