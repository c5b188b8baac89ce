"""One run of autograd's engine through watched graphs: its lines, statistics and verdict, and
how it ends (finished, failed, or stopped unseen)."""

from __future__ import annotations

import threading
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from ..core.guard import internal_error
from ..core.session import EventLog, attach_finding, error_summary
from ..core.values import ValueKeeper
from ..events import GRAD, NODE, BackwardAttempt, BackwardEvent, TensorMeta
from ..findings import Finding
from ..measure.memory import version
from ..measure.meter import Meter
from ..measure.tracking import held, stats_known
from ..narration.grammar import measurement_notes
from ..narration.narrator import Narrator
from ..narration.ranks import world_size
from ..narration.sinks import ListSink
from ..results import Backward, PartialTrace
from .graph import BackwardWatch, NodeRecord
from .verdicts import UNREAD, GradTracker

__all__ = ["BackwardRun"]

_Tensor = torch.Tensor


class _Running(NamedTuple):
    """The node running now, as its pre-hook saw it (holding its gradients would keep them)."""

    record: NodeRecord
    inputs: tuple  # metadata of the gradients it received
    versions: Tuple[Optional[int], ...]  # theirs, to tell after it ran that they are unchanged (on the CPU)


class BackwardRun(EventLog):
    """One execution of autograd's engine through watched graphs, narrated as one section: its log
    holds the `Backward`'s events. Its `narration` is the `BackwardNarration` that opened it (the
    settings, the shared narrator, and `stop` under `raise`)."""

    def __init__(self, narration, watch: BackwardWatch, task: int):
        watch.runs += 1
        number = "" if watch.runs == 1 else f" {watch.runs}"
        settings = narration.settings
        self.narration = narration
        self.watch = watch
        self.task = task
        self.result = Backward(f"backward{number} of {watch.pass_name}", settings)
        watch.add_backward(self.result)
        self.meter = Meter.of(settings, judging=True)
        # `tl.trace(..., backward=True)`: each node's gradients kept, within a budget of their own
        self.keeper = (ValueKeeper(self.result.values, settings.keep_on_cpu, settings.max_bytes)
                       if self.result.values is not None else None)
        self.tracker = GradTracker() if settings.on_nonfinite is not None else None
        if self.tracker is not None and watch.parameters:  # (given under a process group only)
            self.tracker.note_gradients_before(watch.parameters)
        self.thread = threading.get_ident()
        self.in_flight: Optional[_Running] = None
        self._received: Dict[object, object] = {}  # record key -> statistics of what it received, still on the device
        self.seen: set = set()  # keys of the nodes narrated (graphs of two passes share leaves' nodes)
        self._waited = False  # (see `waits_for_final_callbacks`)
        narrator, self._owned, self._held_back = self._narrator(narration, settings)
        super().__init__(self.result.events, narrator, self.result.header)

    def _narrator(self, narration, settings):
        """(the narrator it writes to, the one it opened itself, whether its lines go to the shared
        one as one block at its end). A shared narrator busy with a forward or with another run, or owned
        by another thread, gets this run's lines in one block when it ends, not interleaved."""
        shared = narration.narrator
        if shared is None:
            if settings.narration is None:
                return None, None, False
            own = Narrator(settings.narration)  # a sink of its own, opened again for each backward
            return own, own, False
        if narration.busy(self.thread):
            buffer = Narrator(settings.narration.replace(prefix=""), ListSink())
            return buffer, buffer, True
        narration.live_run = self
        return shared, None, False

    def starting(self, record: NodeRecord, grads) -> None:
        """A node is about to run with `grads`: remember it (as metadata and versions: holding the
        gradients would keep them), and where values are read once per backward, measure what it
        received."""
        tensors = tuple(g for g in grads if isinstance(g, _Tensor))
        versions: Tuple[Optional[int], ...] = ()
        meter = self.meter
        if self.tracker is not None and meter is not None and tensors:  # (tracking measures: it has a meter)
            if meter.on_host(tensors):
                versions = _versions(tensors)  # to tell, after, that they are unchanged
            else:  # read at once under `raise`, which must decide at this node; else with the rest
                self._received[record.key] = meter.observe(tensors)
        self.in_flight = _Running(record, TensorMeta.all_of(tensors), versions)

    def node_done(self, watch: BackwardWatch, record: NodeRecord, grad_inputs, grad_outputs) -> None:
        """A node of `watch`'s graph ran: narrated once (graphs of two passes share a leaf's node),
        with the gradients it produced (a leaf's accumulator: those it received)."""
        if record.key in self.seen:
            return
        self.seen.add(record.key)
        running, self.in_flight = self.in_flight, None
        versions = running.versions if running is not None and running.record is record else None
        grads = grad_outputs if record.label is not None else grad_inputs
        positions = [i for i, g in enumerate(grads) if isinstance(g, _Tensor)]
        measured = tuple(grads[i] for i in positions)
        self.ordinal += 1
        forward = record.forward
        if forward is not None and watch is not self.watch:
            forward += f" of {watch.pass_name}"
        event = BackwardEvent(NODE, self.ordinal, record.name, record.scope, TensorMeta.all_of(measured), record.site,
                              None, record.label, forward)
        self.add(event, record, measured, positions, None if record.label is not None else grad_outputs, versions)

    def output_grad(self, watch: BackwardWatch, label: str, node: Optional[NodeRecord], grad) -> None:
        """The gradient `grad` reached the forward output `label` (which feeds `node`'s node)."""
        if not isinstance(grad, _Tensor):
            return
        if watch is not self.watch:
            label += f" of {watch.pass_name}"
        event = BackwardEvent(GRAD, self.ordinal, "grad", watch.root, TensorMeta.single(grad), None, None, label)
        self.add(event, node, (grad,), (0,), None)

    def add(self, event, record: Optional[NodeRecord], measured, positions, received, versions=()) -> None:
        """Measure, judge, log (narrating it) and keep one node (or received gradient), as the
        forward's pipeline does an op; `versions` are those of the gradients it received, when it
        was about to run."""
        if self.meter is not None and measured:
            event.stats = self.meter.observe(measured[0] if len(measured) == 1 else measured,
                                             self.narrator is not None and self.narrator.prints(event))
        findings = self._judge(event, record, positions, received, versions) if self.tracker is not None else ()
        self.append(event)
        if self.keeper is not None and measured and event.kind is NODE:
            self.keeper(event, measured)
        if findings and self.narration.raising:
            self.narration.stop(self, findings[0])

    def _judge(self, event, record: Optional[NodeRecord], positions, received, versions) -> Sequence[Finding]:
        """The tracker's findings made now, each on its event (those about this one: a `!!` line
        after its line)."""
        tracker, meter = self.tracker, self.meter
        assert tracker is not None and meter is not None  # (tracking measures: it has a meter)
        direct = self._received.pop(record.key, None) if event.kind is NODE and record is not None else None
        if direct is None and received is not None and event.stats is not None and stats_known(event):
            # at hand: measured only when it produced one, and only if the node left it as it was
            # received (a backward may reuse its incoming gradient's memory); the meter shares
            # the statistics of a gradient measured as an earlier node's output. A DTensor
            # measured whole is a collective: then every rank measures it, whatever it holds.
            nonfinite = held(event)
            if nonfinite or meter.measures_collectively(received):
                tensors = tuple(g for g in received if isinstance(g, _Tensor))
                measured = meter.observe(tensors, True) if versions == _versions(tensors) else UNREAD
                direct = measured if nonfinite else None
        findings = tracker.judge(event, record, positions, direct)
        if event.kind is NODE and record is not None and record.leaf is not None:
            tracker.accumulated(event, record)
        for finding in findings:
            attach_finding(finding, finding.event is event)
        return findings

    def finish(self) -> None:
        """The engine finished: read what is still on the device, judge, print the footer."""
        result = self.result
        extra = result.footer_extra
        try:
            self.settle()
            verdict = result.verdict = self.tracker.summary(self.incomplete) if self.tracker is not None else None
            extra.extend(measurement_notes(self.narration.settings.value_stats, verdict, self.incomplete))
        except Exception as exc:
            internal_error("ending the backward's narration", exc)
        result.finished = True
        if self.narrator is not None:
            self.narrator.end_pass(extra, backward=True)
        self.close()

    def settle(self) -> None:
        """Read the statistics still on the device, and judge what waited for them."""
        if self.meter is not None:
            self.meter.flush()
        if self.tracker is not None:
            after = (self.tracker.written_after(self.watch.parameters, distributed=world_size() > 1)
                     if self._waited else [])
            for finding in self.tracker.judge_rest() + after:
                attach_finding(finding, False)
            self.result.findings = tuple(self.tracker.findings)

    def waits_for_final_callbacks(self) -> bool:
        """Whether the run's end waits for the engine's other final callbacks, once: DDP reduces
        gradients in one queued after this run's (under a process group), a hook may queue one
        that writes `.grad`, and the verdict must see the gradients they left
        (`GradTracker.written_after`)."""
        if self.tracker is None or self._waited:
            return False
        self._waited = True
        return True

    def close(self) -> None:
        """Release the sink this run opened (not a shared one), or hand its lines to the shared
        narrator it held them back from. Idempotent."""
        owned, self._owned = self._owned, None
        if self.narration.live_run is self:
            self.narration.live_run = None
        if owned is None:
            return
        if self._held_back:
            self.narration.deliver(owned.sink.lines)
        owned.close()

    def fail(self, exc: BaseException, noticed_late: bool) -> PartialTrace:
        """The backward raised `exc` (or stopped unseen): the partial trace, the tail printed."""
        result = self.result
        try:
            self.settle()
        except Exception as inner:
            internal_error("judging the failed backward's gradients", inner)
        result.error = error_summary(exc)
        result.attempt = self._attempt(noticed_late)
        partial = PartialTrace.of_backward(self.watch.recording(result), result)
        if self.narrator is not None:
            self.narrator.fail(result.events, result.attempt, result.error, "backward")
        self.close()
        return partial

    def _attempt(self, noticed_late: bool) -> Optional[BackwardAttempt]:
        if self.in_flight is None:
            return None
        record = self.in_flight.record
        notes = ("seen after the backward had already stopped: the node whose hook never ran",) if noticed_late else ()
        return BackwardAttempt(record.name, self.ordinal + 1, record.scope, record.site, self.in_flight.inputs,
                               record.forward, notes)


def _versions(tensors) -> tuple:
    return tuple(map(version, tensors))
