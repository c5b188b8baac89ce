"""Each run of autograd's engine through watched graphs: its lines, statistics and verdict, how it
ends (autograd's final callback, or a failure seen later), and the hooks' entry points."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..core.guard import contain, internal_error, is_stop
from ..core.session import EventLog, attach, attach_finding, error_summary, nonfinite_message
from ..core.values import ValueKeeper
from ..errors import NonFiniteError
from ..events import GRAD, NODE, BackwardAttempt, BackwardEvent, TensorMeta
from ..findings import Finding
from ..measure.memory import version
from ..measure.meter import Meter
from ..measure.tracking import held, stats_known
from ..narration.grammar import measurement_notes
from ..narration.narrator import Narrator
from ..narration.ranks import world_size
from ..narration.sinks import ListSink
from ..results import Backward, PartialTrace, Recording
from .graph import BackwardWatch, GradientRoots, NodeRecord
from .verdicts import UNREAD, GradTracker

__all__ = ["BackwardNarration", "BackwardStopped", "end_unseen_runs_everywhere"]

_graph_task_id = torch._C._current_graph_task_id
_Tensor = torch.Tensor


def _queue_callback(fn) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class _Running(NamedTuple):
    """The node running now, as its pre-hook saw it (holding its gradients would keep them)."""

    record: NodeRecord
    inputs: tuple  # metadata of the gradients it received
    versions: Tuple[Optional[int], ...]  # theirs, to tell after it ran that they are unchanged (on the CPU)


class BackwardRun(EventLog):
    """One execution of autograd's engine through watched graphs, narrated as one section: its log
    holds the `Backward`'s events."""

    def __init__(self, narration: "BackwardNarration", watch: BackwardWatch, task: int):
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

    def _narrator(self, narration: "BackwardNarration", settings):
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


class BackwardNarration:
    """The backwards of one entry point's passes (`Recorder`, a compiled model): their runs, the
    narrator they write to, and the watches whose hooks are still on a graph."""

    MAX_WATCHES = 8  # graphs kept hooked while no backward has run through them (gradient accumulation)

    def __init__(self, settings, narrator: Optional[Narrator], forward_open: Callable[[], bool] = bool,
                 once: bool = False):
        self.settings = settings
        self.narrator = narrator  # shared with the forwards (a `Recorder`'s); else each run opens its own
        self.thread = threading.get_ident()  # the thread whose forwards the shared narrator narrates
        self.forward_open = forward_open  # whether a forward is being narrated on the shared narrator now
        self.live_run: Optional[BackwardRun] = None  # the run writing to the shared narrator now
        self._pending: list = []  # lines of runs held back until the forward being narrated ends
        # `once`: the graph of one forward (`tl.record`, `tl.trace`), released when its backward ends
        self.once = once
        self.raising = settings.on_nonfinite == "raise"
        # The runs not ended yet, by autograd's graph task: a backward may run inside another (a
        # reentrant checkpoint's), or on another thread while this one runs a forward.
        self.runs: Dict[int, BackwardRun] = {}
        self.watches: List[BackwardWatch] = []
        self.released = 0  # graphs released before any backward ran through them (past MAX_WATCHES)
        self._lock = threading.RLock()  # nodes on different devices run on different threads

    def busy(self, thread: int) -> bool:
        """Whether a run on `thread` must hold its lines back from the shared narrator."""
        return thread != self.thread or self.live_run is not None or self.forward_open()

    def deliver(self, lines) -> None:
        """A held-back run's lines: written now, or, while a forward is being narrated, after it."""
        with self._lock:
            if self.forward_open():
                self._pending.append(lines)
            else:
                narrator = self.narrator
                assert narrator is not None  # (a run holds its lines back only from a shared narrator)
                narrator.write_lines(lines)

    def flush_pending(self) -> None:
        """A forward's narration ended: write the backwards held back while it ran."""
        with self._lock:
            pending, self._pending = self._pending, []
            narrator = self.narrator
            if narrator is None:  # (none shared: no run held its lines back)
                return
            for lines in pending:
                narrator.write_lines(lines)

    # -- the forward side -------------------------------------------------------------------------

    def watch(self, recording: Recording, roots: GradientRoots, outputs, names: dict, root, parameters=(),
              forward_values=None) -> None:
        """Hook the graph a forward just built; graphs whose backward already ran are released
        (and, past `MAX_WATCHES`, the oldest ones). `parameters`: (name, weak reference) of the
        model's, looked at after a backward under a process group (`GradTracker.written_after`);
        `forward_values`: what the forward's ops read or produced that was not finite (tracking)."""
        with self._lock:
            self._release()
            watch = BackwardWatch(self, recording, roots, outputs, names, root, forward_values)
            watch.parameters = parameters
            self.watches.append(watch)
            _OPEN.add(self)

    def _release(self) -> None:
        running = {run.watch for run in self.runs.values()}
        kept = []
        for watch in self.watches:
            if watch in running or watch.runs == 0:
                kept.append(watch)
            else:
                watch.detach()
        while len(kept) >= self.MAX_WATCHES:  # room for the graph being added
            oldest = kept.pop(0)
            oldest.detach()
            self.released += 1
        self.watches = kept

    def end_unseen_runs(self) -> None:
        """A new pass begins outside any backward: the runs this thread began and did not end
        failed unseen (their final callback never came)."""
        with self._lock:
            if _graph_task_id() != -1:
                return
            thread = threading.get_ident()
            for run in list(self.runs.values()):
                if run.thread == thread:
                    self._end_failed(run, None)

    def _ended(self) -> None:
        """After a run ended: a one-forward narration lets go of its graph."""
        if self.once:
            for watch in self.watches:
                watch.detach()
            self.watches = []
            _OPEN.discard(self)

    def close(self, exc: Optional[BaseException] = None) -> None:
        """The entry point is done (the `Recorder` block ends): a backward still open failed (with
        `exc`, the exception leaving the block, when there is one); every hook is removed."""
        with self._lock:
            try:
                for run in list(self.runs.values()):
                    self._end_failed(run, exc)
            finally:
                for watch in self.watches:
                    watch.detach()
                self.watches = []
                if self.narrator is not None:
                    self.flush_pending()

    # -- hooks (autograd's engine calls them, possibly on a device's thread) -----------------------

    def node_starting(self, watch: BackwardWatch, record: NodeRecord, grad_outputs) -> None:
        self._in_run(watch, record, BackwardRun.starting, record, grad_outputs)

    def node_done(self, watch: BackwardWatch, record: NodeRecord, grad_inputs, grad_outputs) -> None:
        self._in_run(watch, record, BackwardRun.node_done, watch, record, grad_inputs, grad_outputs)

    def output_grad(self, watch: BackwardWatch, label: str, node, grad) -> None:
        self._in_run(watch, None, BackwardRun.output_grad, watch, label, node, grad)

    def _in_run(self, watch: BackwardWatch, record: Optional[NodeRecord], step, *args) -> None:
        """Hand a hook's report to the run it belongs to (`step` of that run, with `args`), begun
        now if need be; a failure goes to `_hook_failed`."""
        try:
            with self._lock:
                run = self._run_for(watch, record)
                if run is not None:
                    step(run, *args)
        except Exception as exc:
            self._hook_failed(exc)

    def _hook_failed(self, exc: Exception) -> None:
        """A hook raised. A deliberate stop (a kept-values budget) ends the run with its partial
        trace and stops the backward; a failure of torchlens is reported and the run marked
        incomplete, the backward untouched."""
        with self._lock:
            run = self.runs.get(_graph_task_id())
            if is_stop(exc) and run is not None:
                self._end_failed(run, exc)
        contain(exc, "narrating a backward node", run.mark_incomplete if run is not None else None,
                "nodes after an internal error were not all narrated")

    def _run_for(self, watch: BackwardWatch, record: Optional[NodeRecord] = None) -> Optional[BackwardRun]:
        """The run the engine's current execution belongs to, begun now if need be. A leaf's node
        (`AccumulateGrad`, which outlives graphs and is shared by them) never begins a run: fired
        alone, it is a backward through a graph no narrated forward built (None)."""
        task = _graph_task_id()
        run = self.runs.get(task)
        if run is None:
            if record is not None and record.label is not None:
                return None
            run = self.runs[task] = BackwardRun(self, watch, task)
            _queue_callback(functools.partial(self._finished, run))
        return run

    def _finished(self, run: BackwardRun) -> None:
        """Autograd's final callback for the run's graph task: it finished. Never raises (it runs
        inside the user's backward)."""
        try:
            if run.waits_for_final_callbacks():  # ends after the callbacks queued since (DDP's, a hook's)
                _queue_callback(functools.partial(self._finished, run))
                return
            with self._lock:
                if self.runs.get(run.task) is not run:
                    return
                del self.runs[run.task]
                if self.released:  # said by the next backward to end, the one that would reach them
                    graphs = "the graph of 1 earlier pass was" if self.released == 1 else \
                        f"the graphs of {self.released} earlier passes were"
                    run.mark_incomplete(f"{graphs} released before a backward reached them (more than "
                                        f"{self.MAX_WATCHES} waited)")
                    self.released = 0
                run.finish()
                self._ended()
        except Exception as exc:
            internal_error("ending the backward's narration", exc)

    def _end_failed(self, run: BackwardRun, exc: Optional[BaseException]) -> None:
        self.runs.pop(run.task, None)
        known = exc is not None
        failure = exc if exc is not None else BackwardStopped()
        try:
            partial = run.fail(failure, noticed_late=not known)
            if known and getattr(failure, "partial_trace", None) is None:
                attach(failure, partial)
        except Exception as inner:
            internal_error("ending a failed backward", inner)
        self._ended()

    def stop(self, run: BackwardRun, finding: Finding) -> None:
        """`on_nonfinite="raise"`: stop the backward at this finding, with the partial trace."""
        error = NonFiniteError(nonfinite_message(finding))
        self._end_failed(run, error)
        raise error


# Narrations with graphs still hooked: a backward of theirs that failed unseen is ended (its sink
# closed, its partial trace kept) when this thread next begins a forward.
_OPEN: "weakref.WeakSet[BackwardNarration]" = weakref.WeakSet()


def end_unseen_runs_everywhere() -> None:
    """A forward begins: end the runs of this thread that failed unseen, whatever narrated them."""
    if not _OPEN:  # the common case, every forward: nothing is watched
        return
    for narration in list(_OPEN):
        if narration.runs:
            narration.end_unseen_runs()


def _versions(tensors) -> tuple:
    return tuple(map(version, tensors))


class BackwardStopped(BaseException):
    """Stands for an exception a backward raised that torchlens did not see (it was caught inside
    the `Recorder` block, or the backward was run after it): the error its partial trace reports."""

    def __str__(self) -> str:
        return "the backward stopped without finishing (an exception raised inside it was not seen by torchlens)"
