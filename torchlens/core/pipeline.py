"""The per-value work of one forward pass, written once for every substrate.

Eager capture, the compiled plans and the code between compiled graphs each see values in their
own way; what happens to a value once seen is the same for all of them and lives here:

    measure                     `Meter.observe`, the backward's entry too: read now (tracking
                                narrated live, `raise`, a line that prints) or with the rest at
                                the end of the pass; never raises ("n/a" when it cannot)
    judge                       `Tracker.judge`, with what the op read (`reads`)
    log and narrate             `Session.append`: the event log and the live narrator
    keep                        `tl.trace`'s `ValueKeeper`, and the inputs of the first op to
                                introduce a kind of non-finite value (`repro.kept.InputKeeper`)
    note autograd's nodes       `backward.GradientRoots`, with `backward=True`
    register what it produced   `Tracker.produced`: the origin of what later ops read

A substrate tells `input`, `op` and `output`; `settle` ends the pass's measuring and judging. The
metadata-only capture (no statistics, tracking, kept values or roots) skips all of this: it goes
straight to `Session.add_op`, the hot path of every narrated forward.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from ..errors import NonFiniteError
from ..events import Event, Stats
from ..measure.memory import call_writes, may_return_an_alias, tensors_of
from ..measure.meter import Meter
from ..measure.provenance import LazyReads, passed_in
from ..measure.tracking import UNINITIALIZED, ForwardValues, Tracker, can_hold_nonfinite
from ..measure.unwritten import IN_FLIGHT, UNINITIALIZED_NOTE, SeenMemory, UnwrittenMemory, returns_an_argument
from ..narration.grammar import measurement_notes
from ..repro.kept import InputKeeper
from .collectives import Collective, in_memory_of, memory_refs, reads_memory, shares_memory, wait_for
from .engines import distributed
from .guard import internal_error
from .session import Session, Settled, attach_finding, nonfinite_message

__all__ = ["Call", "Pipeline"]

# what a call wrote into its arguments, as `Tracker.produced` takes it: (args, kwargs), or ((), None)
_Written = Tuple[tuple, Optional[dict]]


class Call(NamedTuple):
    """The torch call an eager op was, for what the pipeline derives from it: what the op read
    (tracking), whether it wrote into its arguments (`memory.call_writes`, unless the caller knows:
    `wrote`), and the inputs a one-op repro replays."""

    func: object
    args: tuple
    kwargs: Optional[dict] = None
    wrote: Optional[bool] = None

    def written_into(self, name: str) -> _Written:
        """(args, kwargs) for `Tracker.produced` when the call (the op `name`) wrote into its
        arguments, else ((), None) (an output that is one of its arguments is then not a write:
        `contiguous` and `to` return their argument unchanged)."""
        writes = call_writes(name, self.args, self.kwargs, self.func) if self.wrote is None else self.wrote
        return (self.args, self.kwargs) if writes else ((), None)


class Pipeline:
    """Measures, judges, logs, keeps and registers each value one forward's substrate reports.

    `keeper` is `tl.trace`'s (None otherwise); `roots` collects the autograd nodes the ops feed
    (`backward=True` with a graph being built; None otherwise).
    """

    def __init__(self, session: Session, meter: Optional[Meter], tensor_names, keeper=None, roots=None, held=tuple):
        settings = session.settings
        self.session = session
        self.meter = meter  # (`Meter.of`: None when nothing is measured)
        # `tensor_names()`: id -> name of the model's parameters and buffers, read when a finding needs it
        self.tracker = Tracker(tensor_names) if settings.on_nonfinite is not None else None
        # With tracking: the inputs of the first op to introduce each kind of non-finite value, for `.repro()`
        self.kept_inputs = InputKeeper() if self.tracker is not None else None
        # Memory that holds no values yet (`empty`'s, an engine's that the pass never saw written),
        # never measured; and, where an engine may run, the memory the pass saw hold values: its
        # ops' outputs, its inputs and `held()`, the tensors the model holds (see `torchlens.measure.unwritten`)
        self.unwritten = UnwrittenMemory() if self.meter is not None else None
        # (only an engine's ops view memory the pass never saw written: kept under a process group)
        self.seen = SeenMemory(held) if self.meter is not None and distributed() else None
        self.keeper = keeper
        self.roots = roots
        self.raising = settings.on_nonfinite == "raise"
        self._outputs: List[tuple] = []  # (label, tensor) of the forward's outputs, for the tracker
        # (event, collective, written) of asynchronous collectives whose values no op has read yet
        self._in_flight: List[Tuple[Event, Collective, _Written]] = []
        # with tracking and a backward to narrate: the forward's non-finite values by op, for its verdicts
        self.forward_values: Optional[ForwardValues] = None
        # metadata only, where nothing lands them: the memory of every asynchronous collective's
        # output, never read after a failure (`unread`)
        self._unwaited: list = []

    @property
    def lean(self) -> bool:
        """Whether nothing here has work to do: ops may go straight to `Session.add_op`."""
        return self.meter is None and self.tracker is None and self.keeper is None and self.roots is None

    # -- what substrates report -----------------------------------------------------------------

    def input(self, label: str, metas, value) -> Event:
        if self.seen is not None:
            self.seen.saw(value)
        event = self._observe(self.session.input_event(label, metas), value)
        if self.tracker is not None:
            self.tracker.produced(event, value)
        self._keep(event, value)
        if self.roots is not None:
            self.roots.note_input(label, value)
        return event

    def op(self, name: str, metas, site=None, value=None, stats=None, reads=None, call: Optional[Call] = None,
           kept=None, collective: Optional[Collective] = None, engine: Optional[str] = None,
           group: Optional[Collective] = None, lands: Optional[Event] = None) -> Event:
        """Record an op: with its `stats` (read from a compiled graph), or with its output `value`
        for the meter to measure. What it read is `reads` (a compiled plan op's `PlanReads`) or is
        derived from its `call`, either way worked out only if a verdict asks for it (`LazyReads`); a `call`
        also registers what the op produced and wrote. `kept` is the value `tl.trace` keeps when
        it is not `value` (the outputs a compiled graph returned). A `collective` (`collectives`)
        is recorded by `_collective`; `engine` names the distributed engine that ran the op (`engines`).
        A compiled graph's functional collective comes with its `group` (its `Collective`, no tensors), and
        the graph's `wait_tensor` for it with the collective's event, which it `lands`."""
        event = self.session.op_event(name, metas, site, stats)
        event.engine = engine
        if group is not None:
            event.label = group.label
            if self.tracker is not None:
                self.tracker.collective(event, group.group)
        if lands is not None:
            self._land_in_graph(lands, event, value)
        if self._in_flight and call is not None:
            self._land_what_it_reads(event, name, call, value)
        if collective is not None:
            return self._collective(event, metas, value, call, collective)
        tracker = self.tracker
        written = call.written_into(name) if call is not None else None
        if self.unwritten is not None and value is not None:
            self._follow_memory(name, value, call, written, engine)
        lazy = reads  # (a compiled plan op's `PlanReads`, or None)
        if tracker is not None and call is not None and written is not None:
            # (integer and bool outputs hold no NaN or infinity: what they read is never asked for)
            if can_hold_nonfinite(metas):
                reads = lazy = LazyReads(tracker, call.args, call.kwargs or {})
                if written[0] or written[1]:
                    lazy.resolve_written(value)  # (wrote into its argument: see `LazyReads.resolve_written`)
        if reads is not None:
            event.reads = reads
        try:
            self._observe(event, value)
        except NonFiniteError:  # `on_nonfinite="raise"` stops at this op: keep what it read first
            if lazy is not None:
                self._keep_inputs(event, call, value)
            raise
        if lazy is not None and tracker is not None:  # (there is a lazy reading only with a tracker)
            nonfinite = event.stats is not None and event.stats.nonfinite
            if nonfinite:
                self._keep_inputs(event, call, value)
            if nonfinite or group is not None or tracker.waiting(event) or (self.roots is not None and
                                                                            not tracker.clean):
                lazy.resolve()  # (now, before its outputs are registered; a compiled collective's
                # as it was sent: judged again when it lands; with a backward to come, a finite op's too)
            else:
                event.reads = None  # judged finite: what it read is never asked for
        if written is not None and tracker is not None:
            tracker.produced(event, value, *written)
        self._keep(event, value if kept is None else kept)
        if self.roots is not None and value is not None:
            self.roots.note(event, value)
        return event

    def _keep_inputs(self, event: Event, call: Optional[Call], value) -> None:
        """Tracking keeps the inputs of an op whose output is not finite, for `.repro()`."""
        if self.kept_inputs is not None and call is not None:
            self.kept_inputs.consider(event, call.func, value, call.args, call.kwargs)

    def _collective(self, event: Event, metas, value, call: Optional[Call], collective: Collective) -> Event:
        """A collective's op: its line says its group. What it sends is read now; what it brings
        is measured now if it has arrived, else when the first op reads it (`_land`)."""
        assert call is not None  # (a collective is an eager torch call, reported with its call)
        event.label = collective.label
        written = call.written_into(event.op)
        tracker, unwritten = self.tracker, self.unwritten
        if unwritten is not None:
            self._follow_memory(event.op, value, call, None if collective.in_flight else written, event.engine)
            if collective.in_flight:
                unwritten.in_flight(collective.tensors)
        if tracker is not None:
            tracker.collective(event, collective.group)
            if can_hold_nonfinite(metas):
                event.reads = lazy = LazyReads(tracker, call.args, call.kwargs or {})
                if written[0] or written[1]:
                    lazy.resolve_written(value)
                lazy.resolve()  # what it sent, as it was sent
        if self.meter is not None and collective.writes:  # (c10d writes leave version counters as they were)
            self.meter.forget(collective.tensors)
        if collective.in_flight:
            if self.meter is not None:
                event.stats = Stats("na", 0, self.meter.rung != "off", note=IN_FLIGHT)
            self._observe(event, None)
            if self.meter is not None or tracker is not None or self.keeper is not None:
                # (its values are wanted when they arrive; a narration of metadata only wants none,
                # and waits for nothing torch would not have waited for)
                self._in_flight.append((event, collective, written))
            else:
                self._unwaited.extend(memory_refs(collective.tensors))
        else:
            self._observe(event, value)
            if tracker is not None:
                tracker.produced(event, value, *written)
            self._keep(event, value)
        if tracker is not None and collective.in_flight and not written[0]:
            tracker.produced(event, value)  # a functional collective's output: a tensor it made
        if self.roots is not None:
            self.roots.note(event, value)
        return event

    def _land_what_it_reads(self, event: Event, name: str, call: Call, value) -> None:
        """The asynchronous collectives whose output this op (which returned `value`) read have
        arrived (it was waited on, or torch would not read it): measured and judged now, before
        this op is."""
        for entry in list(self._in_flight):
            read = reads_memory(name, call.func, call.args, call.kwargs or {}, entry[1].tensors, value)
            if read is not None:
                self._in_flight.remove(entry)
                self._land(entry, event, overwritten=read == "written")

    def _land(self, entry: Tuple[Event, Collective, _Written], reader: Event, overwritten: bool) -> None:
        collective_event, collective, written = entry
        value = collective.value
        if not overwritten:
            wait_for(collective)
        if self.meter is not None:
            self.meter.forget(collective.tensors)
            collective_event.stats = (Stats("na", 0, self.meter.rung != "off",
                                            note=f"overwritten by #{reader.ordinal} before it was read")
                                      if overwritten else self.meter.observe(value, True))
        if self.unwritten is not None:
            self.unwritten.landed(collective.tensors)
        if self.tracker is not None:
            for finding in self.tracker.landed(collective_event, value, *written, position=reader.ordinal - 0.5):
                attach_finding(finding, False)
        if not overwritten:
            self._keep(collective_event, value)

    def _land_in_graph(self, collective_event: Event, wait: Event, value) -> None:
        """A compiled graph's functional collective got its values at `wait` (its `wait_tensor`,
        which returns them as they are): they are the collective's, judged now as `_land` judges
        an eager one's, before the wait is."""
        stats = wait.stats
        if stats is None and value is not None and self.meter is not None:  # (live: measured here)
            stats = self.meter.observe(value, True)
        if stats is None:
            return
        collective_event.stats = stats
        if self.tracker is not None:
            for finding in self.tracker.landed(collective_event, None, (), {}, position=wait.ordinal - 0.5):
                attach_finding(finding, False)

    def output(self, label: str, metas, value=None) -> Event:
        if self.tracker is not None and value is not None:
            self._outputs.append((label, value))
        event = self.session.output_event(label, metas)
        if value is not None:
            event.stats = self._held_by(value)
        return self.session.append(event)

    def _held_by(self, value) -> Optional[Stats]:
        """What an output holds, for the page and tools (the `=>` line shows no statistics): the
        statistics of the op that produced it, found without another read (tracking's provenance,
        or the meter's record of the same elements); None where neither knows it."""
        if self.tracker is not None:
            origin = self.tracker.origin_of(value)
            producer = origin[0] if len(origin) == 1 else None
            if isinstance(producer, Event) and len(producer.outputs) == 1 and isinstance(producer.stats, Stats):
                return producer.stats
            return None
        return self.meter.known(value) if self.meter is not None else None

    def produced(self, event: Event, value) -> None:
        """`value` is `event`'s (a compiled graph's output, read by code after the graph)."""
        if self.tracker is not None:
            self.tracker.produced(event, value)

    def returned(self, value) -> None:
        """Code the pass does not see op by op (a compiled graph) returned `value`: memory torch wrote."""
        if self.seen is not None:
            for tensor in tensors_of(value):
                self.seen.saw(tensor)

    # -- the steps ----------------------------------------------------------------------------------

    def _observe(self, event: Event, value) -> Event:
        """Measure, judge and log one event; under `on_nonfinite="raise"`, stop at its NaN."""
        if self.meter is not None and value is not None:
            event.stats = self._measure(self.meter, event, value)
        findings = self._judge(self.tracker, event) if self.tracker is not None else ()
        self.session.append(event)
        if self.raising and findings:  # the NaN at this op; its message names the cause
            raise NonFiniteError(nonfinite_message(next((f for f in findings if f.event is event), findings[0])))
        return event

    def _follow_memory(self, name: str, value, call: Optional[Call], written, engine: Optional[str] = None) -> None:
        """Remember what an uninitialized op allocated, which outputs of a distributed `engine`'s
        own ops view memory the pass never saw written, and what ops wrote into either. (An engine
        gives memory its bytes back outside any op, as FSDP2 does its unsharded parameters; the
        model's own code viewing a tensor the pass did not see made, a table kept in a global,
        views values the program wrote before: those are measured.)"""
        unwritten = self.unwritten
        assert unwritten is not None  # (memory is followed only where the meter runs)
        if name.startswith(UNINITIALIZED):
            unwritten.allocated(value)
            return
        if call is None:  # (a compiled graph's op: its values are the graph's)
            return
        args, kwargs = call.args, call.kwargs or {}
        wrote = written is not None and (written[0] or written[1])
        seen = self.seen
        if seen is not None:  # (an engine may run: there is a process group)
            if wrote or may_return_an_alias(name) or returns_an_argument(value, args, kwargs):
                unseen = seen.unseen_views(value, args, kwargs)
                if unseen and engine is None:  # the model's own view: of values its program wrote
                    seen.saw(unseen)
                else:
                    for tensor in unseen:
                        unwritten.unseen(tensor)
            else:  # fresh memory the op wrote
                seen.saw(value)
        if unwritten and wrote:
            unwritten.wrote(tensor for tensor in tensors_of(value) if passed_in(tensor, args, kwargs))

    def _measure(self, meter: Meter, event: Event, value) -> Stats:
        """The statistics of an op's output, through `Meter.observe` (the backward's entry too).
        Memory no op has written yet (`empty`'s, and views of it) is never read: torch has not
        read it."""
        note = UNINITIALIZED_NOTE if event.op.startswith(UNINITIALIZED) else (
            self.unwritten.unwritten(value) if self.unwritten else None)
        if note is not None:
            return Stats("na", 0, meter.rung != "off", note=note)
        narrator = self.session.narrator
        return meter.observe(value, narrator is not None and narrator.prints(event))

    def _judge(self, tracker: Tracker, event: Event) -> list:
        """The tracker's findings made now; those about this very op get their `!!` line after it."""
        findings = tracker.judge(event)
        for finding in findings:
            attach_finding(finding, finding.live and finding.event is event)
        return findings

    def _keep(self, event: Event, value) -> None:
        if self.keeper is not None and value is not None:
            self.keeper(event, value)

    def unread(self, tensor) -> Optional[str]:
        """Why the memory of `tensor` must not be read now, after a failure (None: it may be): it
        holds no values yet (`torchlens.measure.unwritten`), or an asynchronous collective may still be
        writing it (one no op has read since; under metadata narration, whose ops do not tell
        what they read, any)."""
        note = self.unwritten.unwritten(tensor) if self.unwritten else None
        in_flight = (note == IN_FLIGHT or any(shares_memory(tensor, c.tensors) for _, c, _ in self._in_flight)
                     or (self._unwaited and in_memory_of(tensor, self._unwaited)))
        if in_flight:  # (its waiting is not seen: perhaps it was waited on, perhaps not)
            return "an asynchronous collective's output, perhaps still in flight"
        return note

    # -- ending the pass ------------------------------------------------------------------------

    def settle(self) -> Settled:
        """Read what statistics are still on the device, judge what waited for them, and say in the
        session's footer what was measured and found: what the pass's recording takes. Never raises."""
        session = self.session
        try:
            if self.meter is not None:
                self.meter.flush()
        except Exception as exc:
            internal_error("reading value statistics", exc)
        if self.tracker is not None:
            for _ in self._in_flight:
                self.tracker.never_landed()
        self._in_flight = []
        verdict = self._verdict(self.tracker) if self.tracker is not None else None
        session.footer_extra.extend(measurement_notes(session.settings.value_stats, verdict, session.incomplete))
        return Settled(tuple(self.tracker.findings) if self.tracker is not None else (), verdict,
                       self.kept_inputs.calls if self.kept_inputs is not None else {})

    def _verdict(self, tracker: Tracker) -> str:
        session = self.session
        try:
            for finding in tracker.judge_rest():
                # with no live narration, nothing was printed it must match: the note shows
                attach_finding(finding, finding.live and session.narrator is None)
            for label, value in self._outputs:
                tracker.output_reached(label, value)
            verdict = tracker.summary(session.incomplete)
            if self.roots is not None:  # what the backward's verdicts need of it, before it is dropped
                self.forward_values = tracker.forward_values(session.events)
            for event in session.events:  # provenance served its purpose: keep no pass alive by it
                event.reads = None
            return verdict
        except Exception as exc:
            internal_error("judging non-finite values", exc)
            return "non-finite tracking failed: no verdict"
