"""Backward narration: the gradient half of a training step, each node tied to its forward op.

A forward narrated with `backward=True` notes the autograd node each op's output got
(`GradientRoots`). When the forward ends, `BackwardWatch` walks the graph from those nodes: each
node made while the forward ran is tied to the op that made it — autograd numbers nodes as it makes
them (`_sequence_nr`), so the nodes an op made are the new ones its output's node reaches — and
each leaf's `AccumulateGrad` to the leaf's name (`blocks.0.fc.weight`). A pre-hook and a hook go on
each node, and a hook on each output tensor for the gradient that reaches it from outside (the
loss). Nothing is hooked for a forward that built no graph (`no_grad`, `inference_mode`).

The hooks report to the entry point's `BackwardNarration` (one per `Recorder` or compiled model).
One *run* is one execution of autograd's engine (`loss.backward()`, `torch.autograd.grad`): its
nodes are numbered `~1, ~2, ...` in the order they ran, narrated under `-- backward of pass N`,
measured and judged like forward ops, and closed by the engine's final callback with a footer.
A run whose final callback never comes failed: the next run, the next pass or the end of the
`Recorder` block ends it with the partial trace, the attempted node being the one whose pre-hook
ran without its hook.

Nothing changes a gradient: the hooks return None, read metadata, and measure with the meter
(detached reductions) exactly as forward ops are measured.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Dict, List, Optional

import torch

from .errors import NonFiniteError
from .events import GRAD, NODE, BackwardAttempt, BackwardEvent, StatsGroup, TensorMeta
from .grammar import op_ref
from . import meter as meter_module
from .meter import Meter
from .narrator import Narrator
from .results import Backward, PartialTrace, Recording
from .session import attach, error_summary, internal_error, nonfinite_message
from .tracking import NAN, NEGINF, POSINF, Finding, _bits, held, kind_names, settled, unmeasured_reason

_sequence_nr = torch._C._autograd._get_sequence_nr
_graph_task_id = torch._C._current_graph_task_id
_Tensor = torch.Tensor
_BackwardCFunction = torch.autograd.function.BackwardCFunction


def _queue_callback(fn) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class GradientRoots:
    """What one forward's ops fed autograd: (event, node of an output) in order, the sequence
    number autograd was at when the forward began, and the forward's inputs that are leaves."""

    __slots__ = ("start", "items", "inputs")

    def __init__(self):
        self.start = _sequence_nr()
        self.items: list = []
        self.inputs: Dict[int, tuple] = {}  # id(tensor) -> (weak reference, label)

    def note(self, event, out, forward: Optional[str] = None) -> None:
        """`event` produced `out` (a tensor or a sequence of them): remember their nodes.
        `forward` names what made them when it is more than the op (a compiled graph call)."""
        if isinstance(out, _Tensor):
            node = out.grad_fn
            if node is not None:
                self.items.append((event, node, forward))
            return
        for tensor in out:
            if isinstance(tensor, _Tensor) and tensor.grad_fn is not None:
                self.items.append((event, tensor.grad_fn, forward))

    def note_input(self, label: str, tensor) -> None:
        if isinstance(tensor, _Tensor) and tensor.requires_grad:
            self.inputs[id(tensor)] = (weakref.ref(tensor), f"the input {label}")

    def leaf_label(self, tensor, names: dict) -> str:
        name = names.get(id(tensor))
        if name is not None:
            return name
        known = self.inputs.get(id(tensor))
        if known is not None and known[0]() is tensor:
            return known[1]
        return "a leaf tensor no narrated op produced"


class NodeRecord:
    """A hooked node: its name and what it stands for in the forward. The record is itself the
    node's pre-hook and hook (called with one argument before the node runs, two after), and a
    leaf's post-accumulate hook: one object per node, which a training step makes by the thousand.

    It holds no autograd node (that would keep the graph, and the activations it saved, alive for
    as long as the pass is watched): `edges` are the records of the nodes it sends its gradients to,
    by slot, and `key` tells nodes apart in a run (a leaf's is its tensor's: graphs of two passes
    share a parameter's accumulator).
    """

    __slots__ = ("watch", "key", "name", "scope", "site", "forward", "label", "edges")

    def __init__(self, name, scope, site, forward, label=None, key=None):
        self.watch = None  # the `BackwardWatch` it reports through
        self.key = id(self) if key is None else key
        self.name = name
        self.scope = scope
        self.site = site
        self.forward = forward  # `#5 linear @fc2`: the forward op the node differentiates
        self.label = label  # for AccumulateGrad: the leaf's name
        self.edges = ()  # per gradient slot: the record of the node it is sent to (None: unwatched)

    def __call__(self, *grads) -> None:
        watch = self.watch
        if len(grads) == 2:  # after the node ran: (what it produced, what it received)
            watch.narration.node_done(watch, self, grads[0], grads[1])
        elif self.label is not None:  # a leaf's gradient was accumulated: the leaf
            watch.narration.node_done(watch, self, (), (grads[0].grad,))
        else:  # the node is about to run: what it received
            watch.narration.node_starting(watch, self, grads[0])


class BackwardWatch:
    """The hooks on one forward's graph, and the recording its backwards are added to."""

    def __init__(self, narration: "BackwardNarration", recording: Recording, roots: GradientRoots, outputs,
                 names: dict, root):
        self.narration = narration
        # The recording is held weakly: its output holds the graph (and what it saved for the
        # backward), which the user may drop (`Recorder(keep=0)`, an evaluation never backwarded).
        # What a backward needs of it is held here instead.
        self._recording = weakref.ref(recording)
        self.backwards = recording.backward  # where each run's `Backward` is added
        self.header = recording.header
        self._forward = (recording.events, recording.settings, recording.footer_extra, recording.findings)
        self.root = root  # the model's scope: where gradients reaching its outputs are shown
        self.runs = 0  # backwards through this graph so far
        self.handles: list = []
        try:
            records, held = self._hook_nodes(roots, names)
            self._hook_outputs(outputs, records)
            del held
        except BaseException:
            self.detach()
            raise

    @property
    def pass_name(self) -> str:
        return self.header or "the forward"

    def recording(self) -> Recording:
        """The pass's recording, or, if nothing holds it any more, one like it without the output."""
        recording = self._recording()
        if recording is None:
            events, settings, footer_extra, findings = self._forward
            recording = Recording(events, None, settings, self.header, footer_extra, findings=findings)
            recording.backward = self.backwards
        return recording

    def _hook_nodes(self, roots: GradientRoots, names: dict):
        """Record and hook every node of this forward: (id(node) -> record, the nodes, which must be
        held for as long as those ids are read)."""
        records, start, handles = {}, roots.start, self.handles
        # Every node reached is held until the walk ends: autograd makes a node's Python object on
        # demand and may make a new one (at a freed one's address) once nothing holds the last
        held = []
        walked = []  # (record, the nodes it sends to), to resolve the edges once all are recorded
        for event, first, forward in roots.items:
            stack = [first]
            while stack:
                node = stack.pop()
                if node is None or id(node) in records:
                    continue
                held.append(node)
                record = self._record(node, event, forward, start, roots, names)
                if record is None:
                    records[id(node)] = None  # made before this forward: not walked again
                    continue
                records[id(node)] = record
                record.watch = self
                if record.label is not None:
                    # A leaf: hooked on the tensor, after accumulation. A hook on its node would be
                    # handed the incoming gradient, and autograd, seeing it referenced, would copy it
                    # into `.grad` instead of taking it (a parameter-sized copy per step).
                    handles.append(node.variable.register_post_accumulate_grad_hook(record))
                    continue
                handles.append(node.register_prehook(record))
                handles.append(node.register_hook(record))
                next_nodes = tuple(next_node for next_node, _ in node.next_functions)
                walked.append((record, next_nodes))
                stack.extend(next_nodes)
        for record, next_nodes in walked:
            record.edges = tuple(records.get(id(n)) if n is not None else None for n in next_nodes)
        return records, held

    @staticmethod
    def _record(node, event, forward, start: int, roots: GradientRoots, names: dict) -> Optional[NodeRecord]:
        """What `node`, reached from `event`'s output, stands for; None for a node made before
        the forward began (another model's, or preprocessing's)."""
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            leaf = node.variable
            return NodeRecord(kind, event.scope, None, None, roots.leaf_label(leaf, names), key=("leaf", id(leaf)))
        if node._sequence_nr() < start:
            return None
        if forward is None:
            forward = op_ref(event.ordinal, event.op, event.scope.path)
            if isinstance(node, _BackwardCFunction):  # a custom autograd.Function: its apply is no torch op
                forward = f"{node._forward_cls.__name__}.apply (an autograd.Function), read by {forward}"
        return NodeRecord(node.name(), event.scope, event.site, forward)

    def _hook_outputs(self, outputs, records: dict) -> None:
        arrived = self.narration.output_grad
        for label, tensor in outputs:
            if isinstance(tensor, _Tensor) and tensor.requires_grad:
                node = records.get(id(tensor.grad_fn)) if tensor.grad_fn is not None else None
                self.handles.append(tensor.register_hook(functools.partial(arrived, self, label, node)))

    def detach(self) -> None:
        """Remove every hook (nodes outlive the pass while the user holds the graph). Idempotent."""
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


class GradTracker:
    """Where the first non-finite gradient was born: the first node that produced one while what it
    received was finite.

    What a node received is the sum of what the nodes that ran before it sent it, so the tracker
    follows the graph: a node that produced a non-finite gradient marks the node it sends it to.
    A produced kind the node did not receive is a birth. On the CPU a claimed birth is checked
    against what the node actually received (a sum of finite gradients can overflow).
    """

    def __init__(self):
        self.received: Dict[object, int] = {}  # record key -> non-finite kinds sent to its node
        self.findings: List[Finding] = []
        self.unmeasured: Dict[str, int] = {}
        self.measured = 0
        self.leaves: List[str] = []  # leaves whose accumulated gradient was non-finite
        self._queue: list = []

    def judge(self, event, record: Optional[NodeRecord], positions, direct: Optional[int]) -> List[Finding]:
        """Take `event` in (and any before it still waiting for statistics); the findings made now.
        `positions`: which of the node's gradient slots the measured tensors came from; `direct`:
        the kinds the node received, when measured at once (None otherwise)."""
        self._queue.append((event, record, positions, direct))
        made = []
        while self._queue and settled(self._queue[0][0]):
            made.extend(self._judge_one(*self._queue.pop(0)))
        return made

    def judge_rest(self) -> List[Finding]:
        queue, self._queue = self._queue, []
        made = []
        for item in queue:
            made.extend(self._judge_one(*item))
        return made

    def _judge_one(self, event, record, positions, direct) -> List[Finding]:
        kinds = held(event)
        if kinds is None:
            reason = unmeasured_reason(event)
            self.unmeasured[reason] = self.unmeasured.get(reason, 0) + 1
            return []
        self.measured += 1
        if event.kind is GRAD:
            return self._arrived(event, record, kinds)
        if not kinds:
            return []
        received = self.received.get(record.key, 0)
        if record.label is not None:  # AccumulateGrad: what it shows is what it received
            self.leaves.append(record.label)
            new = kinds & ~received
            if not new:
                return []
            return self._note(Finding(f"{kind_names(new)} gradient first seen at ~{event.ordinal} AccumulateGrad "
                                      f"{record.label} ({_counts(event, new)}): the sum of the finite gradients it "
                                      f"received overflowed", event))
        self._send(record, event, positions)
        new = kinds & ~received
        if not new:
            return []
        overflowed = new & direct if direct is not None else 0
        if overflowed:  # what it received held it, though no node sent it: their sum overflowed
            return self._note(Finding(f"{kind_names(overflowed)} gradient first seen entering ~{event.ordinal} "
                                      f"{event.op}, the backward of {record.forward}: the sum of the finite "
                                      f"gradients it received overflowed", event))
        return self._note(Finding(f"{kind_names(new)} gradient born at ~{event.ordinal} {event.op}, the backward of "
                                  f"{record.forward} ({_counts(event, new)})", event, birth=True))

    def _arrived(self, event, node: Optional[NodeRecord], kinds) -> List[Finding]:
        """The gradient of a forward output (`node`: the record of the node it feeds): non-finite
        from outside unless the forward's own nodes already sent it a non-finite value."""
        if not kinds:
            return []
        inside = self.received.get(node.key, 0) if node is not None else 0
        if node is not None:
            self.received[node.key] = inside | kinds
        new = kinds & ~inside
        if not new:
            return []
        return self._note(Finding(f"{kind_names(new)} in the gradient reaching the output {event.label} "
                                  f"({_counts(event, new)}): it came from outside the narrated forward, "
                                  f"such as the loss", event, birth=True))

    def _send(self, record: NodeRecord, event, positions) -> None:
        """Mark the nodes this one sent a non-finite gradient to (by gradient slot)."""
        parts = event.stats.parts if isinstance(event.stats, StatsGroup) else (event.stats,)
        edges = record.edges
        for part, position in zip(parts, positions):
            sent = _bits(part.nan, part.posinf, part.neginf) if part.nan is not None else 0
            target = edges[position] if sent and position < len(edges) else None
            if target is not None:
                self.received[target.key] = self.received.get(target.key, 0) | sent

    def _note(self, finding: Finding) -> List[Finding]:
        self.findings.append(finding)
        return [finding]

    def summary(self, incomplete: Optional[str]) -> str:
        missing = sum(self.unmeasured.values())
        why = ", ".join(f"{count} {reason}" for reason, count in sorted(self.unmeasured.items()))
        gap = f"; {missing} not measured ({why})" if missing else ""
        if incomplete:
            gap += f"; {incomplete}, so nothing is claimed of the rest"
        leaves = ""
        if self.leaves:
            shown = ", ".join(self.leaves[:3]) + (f" and {len(self.leaves) - 3} more" if len(self.leaves) > 3 else "")
            leaves = f"; non-finite gradients reached {len(self.leaves)} lea{'f' if len(self.leaves) == 1 else 'ves'} ({shown})"
        if self.findings:
            more = len(self.findings) - 1
            extra = f" (+{more} more finding{'s' if more != 1 else ''})" if more else ""
            return f"first non-finite gradient: {self.findings[0].text}{extra}{leaves}{gap}"
        if missing or incomplete:
            return f"no non-finite gradients in the {self.measured} measured{gap}"
        return "no non-finite gradients" + leaves


def _counts(event, kinds: int) -> str:
    parts = event.stats.parts if isinstance(event.stats, StatsGroup) else (event.stats,)
    shown = []
    for bit, field, label in ((NAN, "nan", "nan"), (POSINF, "posinf", "+inf"), (NEGINF, "neginf", "-inf")):
        if kinds & bit:
            shown.append(f"{label}={sum(getattr(part, field) or 0 for part in parts)}")
    return " ".join(shown)


def _received_kinds(grads) -> int:
    """The non-finite kinds in the gradients a node received (measured at once, on the CPU)."""
    kinds = 0
    for grad in grads:
        if isinstance(grad, _Tensor) and (grad.dtype.is_floating_point or grad.dtype.is_complex):
            g = grad.detach()
            if g.is_complex():
                g = torch.view_as_real(g)
            if not bool(torch.isfinite(g).all()):
                kinds |= _bits(bool(torch.isnan(g).any()), bool(torch.isposinf(g).any()), bool(torch.isneginf(g).any()))
    return kinds


class BackwardRun:
    """One execution of autograd's engine through watched graphs, narrated as one section."""

    def __init__(self, narration: "BackwardNarration", watch: BackwardWatch, task: int):
        watch.runs += 1
        number = "" if watch.runs == 1 else f" {watch.runs}"
        settings = narration.settings
        self.narration = narration
        self.watch = watch
        self.task = task
        self.record = Backward(f"backward{number} of {watch.pass_name}", settings)
        watch.backwards.append(self.record)
        self.ordinal = 0
        meter = Meter(settings.value_stats, settings.on_nonfinite is not None)
        self.meter = meter if meter.active else None
        self.tracker = GradTracker() if settings.on_nonfinite is not None else None
        self.in_flight: Optional[tuple] = None  # (record, grads received) of the node running now
        self.seen: set = set()  # keys of the nodes narrated (graphs of two passes share leaves' nodes)
        self.incomplete: Optional[str] = None
        self.narrator = narration.narrator
        self._owned = None  # a narrator (and sink) of this run's own, when no entry point shares one
        if self.narrator is None and settings.narration is not None:
            self.narrator = self._owned = Narrator(settings.narration)
        if self.narrator is not None:
            self.narrator.begin_pass(self.record.header)

    def add(self, event, record: Optional[NodeRecord], measured, positions, received) -> None:
        """Measure, record, narrate and judge one node (or received gradient)."""
        narration = self.narration
        narrator = self.narrator
        tracker = self.tracker
        if self.meter is not None and measured:
            at_hand = measured[0].device.type in meter_module.READ_NOW  # no device to wait for
            live = (narration.raising or (narrator is not None and narrator.prints(event))
                    or (tracker is not None and at_hand))
            event.stats = self.meter.measure_output(measured[0] if len(measured) == 1 else measured, live)
        self.record.events.append(event)
        findings = ()
        if tracker is not None:
            direct = None
            if received is not None and event.stats is not None and settled(event) and held(event):
                direct = _received_kinds(received)
            findings = tracker.judge(event, record, positions, direct)
            for finding in findings:
                finding.live = finding.event is event
                event.finding = event.finding or finding
        if narrator is not None:
            narrator.feed(event)
        if findings and narration.raising:
            narration.stop(self, findings[0])

    def finish(self) -> None:
        """The engine finished: read what is still on the device, judge, print the footer."""
        record = self.record
        extra = record.footer_extra
        try:
            if self.meter is not None:
                self.meter.flush()
            settings = self.narration.settings
            if settings.value_stats != "off":
                extra.append(f"value_stats={settings.value_stats}")
            if self.tracker is not None:
                for finding in self.tracker.judge_rest():
                    if finding.event is not None and finding.event.finding is None:
                        finding.event.finding = finding
                record.findings = tuple(self.tracker.findings)
                extra.append(self.tracker.summary(self.incomplete))
        except Exception as exc:
            internal_error("ending the backward's narration", exc)
        record.finished = True
        if self.narrator is not None:
            self.narrator.end_pass(extra, backward=True)
        self.close()

    def close(self) -> None:
        """Release the sink this run opened (not a shared one). Idempotent."""
        owned, self._owned = self._owned, None
        if owned is not None:
            owned.close()

    def fail(self, exc: BaseException, noticed_late: bool) -> PartialTrace:
        """The backward raised `exc` (or stopped unseen): the partial trace, the tail printed."""
        record = self.record
        if self.tracker is not None:
            try:
                if self.meter is not None:
                    self.meter.flush()
                self.tracker.judge_rest()
                record.findings = tuple(self.tracker.findings)
            except Exception as inner:
                internal_error("judging the failed backward's gradients", inner)
        record.error = error_summary(exc)
        record.attempt = self._attempt(noticed_late)
        partial = PartialTrace.of_backward(self.watch.recording(), record)
        if self.narrator is not None:
            self.narrator.fail(record.events, record.attempt, record.error, "backward")
        self.close()
        return partial

    def _attempt(self, noticed_late: bool) -> Optional[BackwardAttempt]:
        if self.in_flight is None:
            return None
        record, inputs = self.in_flight
        notes = ("seen after the backward had already stopped: the node whose hook never ran",) if noticed_late else ()
        return BackwardAttempt(record.name, self.ordinal + 1, record.scope, record.site, inputs, record.forward, notes)


class BackwardNarration:
    """The backwards of one entry point's passes (`Recorder`, a compiled model): their runs, the
    narrator they write to, and the watches whose hooks are still on a graph."""

    MAX_WATCHES = 8  # graphs kept hooked while no backward has run through them (gradient accumulation)

    def __init__(self, settings, narrator: Optional[Narrator]):
        self.settings = settings
        self.narrator = narrator  # shared with the forwards (a `Recorder`'s); else each run opens its own
        self.raising = settings.on_nonfinite == "raise"
        self.run: Optional[BackwardRun] = None
        self.watches: List[BackwardWatch] = []
        self._lock = threading.RLock()  # nodes on different devices run on different threads

    # -- the forward side -------------------------------------------------------------------------

    def watch(self, recording: Recording, roots: GradientRoots, outputs, names: dict, root) -> None:
        """Hook the graph a forward just built; graphs whose backward already ran are released
        (and, past `MAX_WATCHES`, the oldest ones)."""
        with self._lock:
            self._release(keep_pending=True)
            self.watches.append(BackwardWatch(self, recording, roots, outputs, names, root))

    def _release(self, keep_pending: bool) -> None:
        kept = []
        for watch in self.watches:
            if keep_pending and watch.runs == 0 and (self.run is None or self.run.watch is not watch):
                kept.append(watch)
            elif self.run is not None and self.run.watch is watch:
                kept.append(watch)
            else:
                watch.detach()
        while len(kept) > self.MAX_WATCHES:
            kept.pop(0).detach()
        self.watches = kept

    def settle(self) -> None:
        """A new pass begins: a backward still open and no longer running failed unseen."""
        with self._lock:
            if self.run is not None and self.run.task != _graph_task_id():
                self._end_failed(None)

    def close(self, exc: Optional[BaseException] = None) -> None:
        """The entry point is done (the `Recorder` block ends): a backward still open failed (with
        `exc`, the exception leaving the block, when there is one); every hook is removed."""
        with self._lock:
            try:
                if self.run is not None:
                    self._end_failed(exc)
            finally:
                for watch in self.watches:
                    watch.detach()
                self.watches = []

    # -- hooks (autograd's engine calls them, possibly on a device's thread) -----------------------

    def node_starting(self, watch: BackwardWatch, record: NodeRecord, grad_outputs) -> None:
        try:
            with self._lock:
                run = self._run_for(watch, record)
                if run is not None:  # what it received, as metadata: holding the gradients would keep them
                    run.in_flight = (record, tuple(TensorMeta.of(g) for g in grad_outputs if isinstance(g, _Tensor)))
        except Exception as exc:
            internal_error("narrating a backward node", exc)

    def node_done(self, watch: BackwardWatch, record: NodeRecord, grad_inputs, grad_outputs) -> None:
        try:
            with self._lock:
                run = self._run_for(watch, record)
                if run is None or record.key in run.seen:
                    return
                run.seen.add(record.key)
                run.in_flight = None
                grads = grad_outputs if record.label is not None else grad_inputs
                positions = [i for i, g in enumerate(grads) if isinstance(g, _Tensor)]
                measured = tuple(grads[i] for i in positions)
                run.ordinal += 1
                forward = record.forward
                if forward is not None and watch is not run.watch:
                    forward += f" of {watch.pass_name}"
                event = BackwardEvent(NODE, run.ordinal, record.name, record.scope,
                                      tuple(TensorMeta.of(t) for t in measured), record.site, None, record.label,
                                      forward)
                run.add(event, record, measured, positions, None if record.label is not None else grad_outputs)
        except Exception as exc:
            if getattr(exc, "torchlens_stop", False):
                raise
            internal_error("narrating a backward node", exc)

    def output_grad(self, watch: BackwardWatch, label: str, node, grad) -> None:
        try:
            with self._lock:
                run = self._run_for(watch)
                if not isinstance(grad, _Tensor):
                    return
                event = BackwardEvent(GRAD, run.ordinal, "grad", watch.root, (TensorMeta.of(grad),), None, None, label)
                run.add(event, node, (grad,), (0,), None)
        except Exception as exc:
            if getattr(exc, "torchlens_stop", False):
                raise
            internal_error("narrating a gradient reaching the forward's output", exc)

    def _run_for(self, watch: BackwardWatch, record: Optional[NodeRecord] = None) -> Optional[BackwardRun]:
        """The run the engine's current execution belongs to, begun now if need be. A leaf's node
        (`AccumulateGrad`, which outlives graphs and is shared by them) never begins a run: fired
        alone, it is a backward through a graph no narrated forward built (None)."""
        task = _graph_task_id()
        run = self.run
        if run is not None and run.task != task:
            self._end_failed(None)  # its final callback never came: it raised
            run = None
        if run is None:
            if record is not None and record.label is not None:
                return None
            run = self.run = BackwardRun(self, watch, task)
            _queue_callback(functools.partial(self._finished, run))
        return run

    def _finished(self, run: BackwardRun) -> None:
        with self._lock:
            if self.run is not run:
                return
            self.run = None
            run.finish()

    def _end_failed(self, exc: Optional[BaseException]) -> None:
        run, self.run = self.run, None
        known = exc is not None
        if not known:
            exc = BackwardStopped()
        try:
            partial = run.fail(exc, noticed_late=not known)
            if known and getattr(exc, "partial_trace", None) is None:
                attach(exc, partial)
        except Exception as inner:
            internal_error("ending a failed backward", inner)

    def stop(self, run: BackwardRun, finding: Finding) -> None:
        """`on_nonfinite="raise"`: stop the backward at this finding, with the partial trace."""
        self.run = None
        error = NonFiniteError(nonfinite_message(finding))
        partial = run.fail(error, noticed_late=False)
        attach(error, partial)
        raise error


class BackwardStopped(BaseException):
    """Stands for an exception a backward raised that torchlens did not see (it was caught inside
    the `Recorder` block, or the backward was run after it): the error its partial trace reports."""

    def __str__(self) -> str:
        return "the backward stopped without finishing (an exception raised inside it was not seen by torchlens)"
