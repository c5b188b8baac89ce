"""One call of a compiled model, narrated as a pass: its inputs, each compiled graph's plan and
the eager code between graphs in the order they run (all numbered by one ordinal sequence), then
its outputs and footer, or on failure its partial trace. `CompiledRuntime.start` begins one;
`CompiledPass.end` is the only way it ends."""

from __future__ import annotations

import contextlib
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ..core.compiled_regions import install_for_dynamo
from ..core.forward_pass import ForwardPass
from ..core.guard import internal_error
from ..core.structure import named_arguments
from ..eager.capture import CaptureMode
from ..events import Event, Scope, TensorMeta
from ..measure.provenance import LazyReads
from ..measure.recipes import all_finite
from ..measure.tracking import Tracker
from ..narration.grammar import RECOUNTED_FINITE_NOTE, UNFINISHED_NOTE, compiled_run_note
from ..results import Recording
from ..torch_internals.fastpaths import keep_fast_paths, release_fast_paths
from ..torch_internals.mode_stack import lifted_if_on_top, remove_mode
from . import dynamo_seams
from .active import make_active, make_inactive
from .failures import locate_while_tracing, place_python_failure
from .gaps import GapCapture
from .plan import GraphPlan, numel_of
from .stats_pass import measure_returned, read_screened, read_stats, screens_finite

__all__ = ["CompiledPass"]


class CompiledPass(ForwardPass):
    """A `ForwardPass` made of compiled graph calls and the code dynamo runs between them; its
    `runtime` is the `CompiledRuntime` of the model called (options, scopes, backward narration)."""

    def __init__(self, runtime, header: Optional[str],
                 call: Optional[dynamo_seams.CompiledCall] = None):
        scopes = runtime.scopes
        super().__init__(runtime.config.settings, scopes.root_scope, scopes.root, header,
                         backward=runtime.backward)
        self.runtime = runtime
        self.call = call or _NO_CALL  # the wrapper call this pass narrates
        self.mode_pushed = False
        self.graph_calls = 0
        self._live: Dict[object, _LiveCall] = {}  # live mode: per graph, its call in progress
        self._fast_paths_kept = False
        try:
            self.gaps = GapCapture(self.pipeline, scopes, self.nested)
            self.mode = CaptureMode(self.gaps)
            keep_fast_paths()  # code run eagerly between graphs takes module fast paths as without us
            self._fast_paths_kept = True
            install_for_dynamo()  # dynamo traces the user's code, not the gap capture's mode
        except BaseException:
            self.close()  # the fast paths it kept, the sink it opened
            raise

    # (begun from the compiled call it narrates, whose arguments it hands the base as named inputs:
    # a pass is driven through its own class, never as a plain ForwardPass)
    def begin(self, push_mode: bool) -> None:  # type: ignore[override]
        call = self.call
        super().begin(lambda: named_arguments(call.fn, call.args, call.kwargs))
        if push_mode:
            self.mode.__enter__()
            self.mode_pushed = True
        make_active(self)

    def call_running(self) -> bool:
        """Whether the call this pass narrates is still on the stack."""
        return self.call.running()

    # -- graphs ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def graph_running(self):
        """While a compiled graph runs, the gap capture steps aside.

        The mode is taken off the stack when it is on top (the compiled code's own torch calls,
        such as inductor's extern kernels, then cost nothing extra); otherwise it is suspended.
        A gap capture a failure turned off stays off (`OpReporter.off`).
        """
        with lifted_if_on_top(self.mode if self.mode_pushed else None) as lifted:
            if lifted:
                yield
                return
            with self.gaps.stepping_aside():
                yield

    def scope_of_call(self, plan: GraphPlan, caller) -> Scope:
        """The module the graph runs in for this call (read from the caller unless it is fixed)."""
        return plan.fixed_scope or self.runtime.scopes.scope_of_stack(caller)

    def add_plan(self, plan: GraphPlan, args, scope: Scope, stats_vector=None, layout=None, kept=None,
                 out=None) -> None:
        """Record (and narrate) the ops a graph call performed, in order.

        A graph called again in the same situation — same ordinal, same open module, same frame,
        same sizes — produces the same events, so they are built once and replayed (a forward's
        second call costs a dictionary lookup and one sink write per graph). Statistics and kept
        values differ from call to call, so a graph that returns them is recorded afresh each time
        (`_add_measured`).
        """
        session = self.session
        concrete = plan.resolver.resolve(args) if plan.resolver is not None else None
        key = (session.ordinal, session.scope, scope, None if concrete is None else tuple(concrete))
        if stats_vector is not None or kept is not None:
            self._add_measured(plan, key, args, scope, concrete, stats_vector, layout, kept, out)
            return
        segment = plan.segments.get(key)
        if segment is not None:
            session.append_segment(segment.events, segment.ordinal, segment.scope, segment.narration)
            return
        start = len(session.events)
        self.add_plan_ops(plan, scope, concrete, 0, len(plan.ops))
        plan.remember(key, session.events[start:], session.ordinal, session.scope)

    def _add_measured(self, plan: GraphPlan, key: tuple, args, scope: Scope, concrete, stats_vector, layout, kept,
                      out) -> None:
        """Record a call whose statistics or kept values the graph returned.

        With tracking alone, a call in the same situation as one whose every op was judged finite
        is that call again when its outputs are all finite: one read to the host tells it (a sum of
        the returned outputs' sums, `recipes.all_finite`, or the screened graph's screens), and the
        events recorded then are replayed as narration's are.
        Each op's statistics say only "finite", its verdict is the same, and what it read is never
        asked for. A call not shown finite is measured and judged op by op.
        With statistics alone, a call in the same situation as an earlier one records that call's
        events again with its own statistics (`_restates`).
        """
        session = self.session
        tracker = self._replaying(plan, layout) if kept is None else None
        if tracker is not None:
            key = (*key, "finite")
            segment = plan.segments.get(key)  # (no segment: no read, the call is measured as it is)
            if segment is not None and self._finite(stats_vector, layout) and tracker.finite_again(segment.judged):
                session.append_segment(segment.events, segment.ordinal, segment.scope, segment.narration)
                self.graph_outputs(plan, segment.outputs, out)
                return
            mark, start = tracker.mark(), len(session.events)
        stats = self._read_stats(plan, concrete, stats_vector, layout, args) if stats_vector is not None else None
        restating = stats is not None and kept is None and self._restates(plan)
        if restating:
            key = (*key, "measured")
            segment = plan.segments.get(key)
            if segment is not None:
                session.append_restated(segment.events, segment.restated, stats, segment.ordinal, segment.scope)
                return
            start = len(session.events)
        events: Dict[int, Event] = {}
        self.add_plan_ops(plan, scope, concrete, 0, len(plan.ops), stats=stats, kept=kept, args=args, events=events)
        self.graph_outputs(plan, events, out)
        if restating:
            recorded, index_of = session.events[start:], {id(event): index for index, event in events.items()}
            plan.remember(key, recorded, session.ordinal, session.scope,
                          restated=tuple(index_of.get(id(event)) for event in recorded))
        elif tracker is not None and tracker.finite_since(mark, list(events.values())):
            outputs = {index: events[index] for index in plan.outputs if index in events}
            plan.remember(key, session.events[start:], session.ordinal, session.scope,
                          tuple(map(id, events.values())), outputs)

    def _restates(self, plan: GraphPlan) -> bool:
        """Whether a measured call of this graph may be recorded as an earlier call in the same
        situation with its own statistics (`Session.append_restated`): statistics alone, with
        nothing else a call records per op (no tracking, whose verdicts and provenance are the
        call's own; no values kept; no backward to narrate; no collective, whose values land at its wait)."""
        pipeline = self.pipeline
        return pipeline.tracker is None and pipeline.keeper is None and pipeline.roots is None and not plan.exchanges

    @staticmethod
    def _finite(returned, layout) -> bool:
        """Whether a tracked call's returned outputs, or its screens, show every output finite."""
        return all_finite(returned) if layout.after_call else screens_finite(returned, layout.checked)

    def _replaying(self, plan: GraphPlan, layout) -> Optional[Tracker]:
        """The tracker, when a call of this graph may replay an earlier call's events (see
        `_add_measured`): tracking without statistics (the meter screens), the outputs measured
        after the call, and nothing a call records beyond its ops' verdicts (no collective, no
        graph input written, no backward to narrate, no values kept)."""
        pipeline = self.pipeline
        meter, tracker = pipeline.meter, pipeline.tracker
        if (tracker is None or meter is None or not meter.screens or not (layout.after_call or layout.recount)
                or plan.exchanges or plan.written_inputs or pipeline.roots is not None or pipeline.keeper is not None):
            return None
        return tracker

    def _read_stats(self, plan: GraphPlan, concrete, vector, layout, args):
        """The graph's statistics: its returned outputs measured now, or its fused vector read to the
        host once, with what was measured since the last graph. A screened call not shown finite
        is counted again by the graph that returns its outputs (`recount`)."""
        numels = plan.static_numels if concrete is None else [
            tuple(numel_of(meta.shape) for meta in metas)
            for metas in self.op_metas(plan, concrete, 0, len(plan.ops), concrete_only=True)]
        meter = self.pipeline.meter
        assert meter is not None  # (a graph returns what statistics need only when they are measured)
        if layout.after_call:
            return measure_returned(layout.slots, vector, meter, numels)
        if layout.recount is None:
            values = meter.read_along(vector)
            return read_stats(layout.slots, values, self.session.settings.on_nonfinite is not None, numels)
        if screens_finite(vector, layout.checked):
            return read_screened(layout.slots, numels)
        recount = layout.recount
        returned = recount.outputs(args)
        if returned is None:
            return read_screened(layout.slots, numels, f"not shown finite; {recount.failure}")
        stats = measure_returned(recount.layout.slots, returned, meter, numels)
        notes = self.session.footer_extra
        if not any(part is not None and part.nonfinite for part in stats) and RECOUNTED_FINITE_NOTE not in notes:
            notes.append(RECOUNTED_FINITE_NOTE)  # (a value the second run, rounding otherwise, did not make)
        return stats

    def op_metas(self, plan: GraphPlan, concrete, start: int, stop: int, concrete_only: bool = False):
        """The output metadata of plan ops [start, stop) in this call: concrete sizes where they
        are dynamic, unless `symbolic_shapes` asks for the symbols."""
        narration = self.session.settings.narration
        symbolic = not concrete_only and narration is not None and narration.symbolic_shapes
        result = []
        for op in plan.ops[start:stop]:
            metas = op.metas
            if concrete is not None and op.exprs is not None and not symbolic:
                shapes = concrete[plan.dynamic_position[op.index]]
                metas = tuple(TensorMeta(shape, m.dtype, m.device) for shape, m in zip(shapes, metas))
            result.append(metas)
        return result

    def add_plan_ops(self, plan: GraphPlan, scope: Scope, concrete, start: int, stop: int,
                     stats=None, values=None, kept=None, args=(), events=None) -> None:
        """Record plan ops [start, stop): with `stats` read from the graph, or with `values` (the
        ops' outputs, in live mode) for the eager meter to measure and the keeper to keep; `kept`
        are the outputs a graph returned for `tl.trace(..., compiled=True)`. With tracking, `args`
        are the graph call's inputs and `events` the call's events so far, by op index."""
        session, pipeline = self.session, self.pipeline
        tracker = pipeline.tracker
        scopes = plan.op_scopes(self.runtime.scopes, scope)
        for offset, (op, metas) in enumerate(zip(plan.ops[start:stop], self.op_metas(plan, concrete, start, stop))):
            if scopes[op.index] is not session.scope:
                session.move_to(scopes[op.index])
            reads = None if tracker is None or events is None else PlanReads(tracker, op.reads, args, events,
                                                                             plan.written_inputs)
            # (live: each op's value is its own, measured and noted as an eager op's would be)
            lands = None if events is None or op.lands is None else events.get(op.lands)
            event = pipeline.op(op.op, metas, op.site, value=None if values is None else values[offset],
                                stats=None if stats is None else stats[op.index], reads=reads,
                                kept=None if kept is None else kept[op.index], group=op.label, lands=lands)
            if events is not None:
                events[op.index] = event

    # -- live mode ------------------------------------------------------------------------------

    def start_live(self, graph, args, scope: Scope) -> None:
        plan = graph.plan
        concrete = plan.resolver.resolve(args) if plan.resolver is not None else None
        self._live[graph] = _LiveCall(concrete, scope, args, {})

    def emit_live(self, graph, index: int, value) -> None:
        """Record op `index` of `graph`, which just completed (live mode)."""
        call = self._live[graph]
        self.add_plan_ops(graph.plan, call.scope, call.concrete, index, index + 1, values=[value], args=call.args,
                          events=call.events)

    def live_narrated(self, graph) -> int:
        """How many of `graph`'s ops this call has narrated so far (live mode)."""
        events = self._live[graph].events if graph in self._live else {}
        return max(events) + 1 if events else 0

    def end_live(self, graph, out) -> None:
        """A live graph call returned `out`."""
        if graph in self._live:
            self.graph_outputs(graph.plan, self._live.pop(graph).events, out)

    def graph_fed_autograd(self, first: int, out) -> None:
        """With `backward=True`: a fused graph call recorded its ops from `session.events[first]` on
        and returned `out`; the autograd nodes of its outputs (one per call under inductor) stand
        for the whole call."""
        if self.roots is None or out is None:
            return
        ops = [event for event in self.session.events[first:] if event.is_op]
        if not ops:
            return
        path = ops[-1].scope.path
        forward = f"the compiled graph of #{ops[0].ordinal}..#{ops[-1].ordinal}" + (f" @{path}" if path else "")
        self.roots.note(ops[-1], out if isinstance(out, (tuple, list)) else (out,), forward, tuple(ops))

    def graph_outputs(self, plan: GraphPlan, events: dict, out) -> None:
        """With tracking: the graph's outputs were produced by these ops (code after the graph,
        or the next graph, reads them)."""
        if self.pipeline.tracker is None or out is None:
            return
        for index, value in zip(plan.outputs, out if isinstance(out, (tuple, list)) else (out,)):
            if index is not None and index in events and isinstance(value, torch.Tensor):
                self.pipeline.produced(events[index], value)

    # -- ending -----------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Dynamo's cleanup for the call: end the pass as the call ended. Never raises."""
        try:
            succeeded, result, exc = dynamo_seams.call_outcome()
        except Exception as inner:
            internal_error("reading how a compiled call ended", inner)
            succeeded, result, exc = False, None, RuntimeError("torchlens could not read how the compiled call ended")
        self.end(succeeded, result, exc)

    def abandon(self) -> None:
        """End a pass whose call ended without its cleanup: what it recorded is kept as is."""
        self.end(True, None, notes=(UNFINISHED_NOTE,))

    def end(self, succeeded: bool, result=None, exc: Optional[BaseException] = None, notes=()) -> None:
        """The one way a compiled pass ends: finished with the call's `result`, or failed with
        `exc`; the recording becomes the runtime's latest. Never raises."""
        try:
            with self.own_work():
                self.pop_mode()
                recording: Optional[Recording]
                if succeeded:
                    recording = self.finish(
                        result, lambda: (*notes, compiled_run_note(self.graph_calls, self.gaps.ops)))
                else:
                    assert exc is not None  # (a failed call ends with its exception: `call_outcome`)
                    if dynamo_seams.raised_while_tracing(exc):
                        locate_while_tracing(self, exc)
                    else:
                        place_python_failure(self, exc)
                    recording = self.fail(exc)
                self.runtime.keep_latest(recording, self.graph_calls)
        except Exception as inner:
            internal_error("ending a compiled forward", inner)
        finally:
            self.close()

    def pop_mode(self) -> None:
        if self.mode_pushed:
            self.mode_pushed = False
            remove_mode(self.mode)

    def close(self) -> None:
        self.pop_mode()
        # The call is over: its wrapper's frame links the caller's whole stack (a pass kept after
        # its call, by a recording or a backward, must not keep every caller's locals alive) and
        # holds the cleanup bound to this pass (a reference cycle): let go, the pass is freed as it ends.
        self.call = _NO_CALL
        if self._fast_paths_kept:
            self._fast_paths_kept = False
            release_fast_paths()
        make_inactive(self)
        self._live.clear()
        super().close()


_NO_CALL = dynamo_seams.CompiledCall(None, None, (), {})


class _LiveCall(NamedTuple):
    """A live graph call in progress: its concrete sizes, the module it runs in, its arguments,
    and its events so far by op index."""

    concrete: Optional[Tuple]
    scope: Scope
    args: tuple
    events: Dict[int, Event]


class PlanReads(LazyReads):
    """A plan op's reads in this call (`_reads`), worked out only if its verdict needs them, as an
    eager op's are (`LazyReads`: the pipeline drops them once the op is judged finite). An op that
    reads a graph input the graph writes into works them out at once: the input's provenance must
    be noted before anything later changes it."""

    __slots__ = ("_static", "_events", "_written")

    def __init__(self, tracker, static, args, events, written_inputs):
        super().__init__(tracker, args, None)
        self._static, self._events, self._written = static, events, written_inputs
        if written_inputs and any(ref is not None and ref[0] != "op" and ref[1] in written_inputs
                                  for ref in static[0]):
            self.resolve()

    def resolve(self) -> tuple:
        if self._value is None:
            self._value = _reads(self._tracker, self._static, self._args, self._events, self._written)
            self._tracker = self._args = self._static = self._events = None  # keep no tensor alive by it
        return self._value


def _reads(tracker, static, args, events, written_inputs=frozenset()) -> tuple:
    """A plan op's reads in this call: the events of the ops it read, or what the graph inputs it
    read came from (an op before the graph, a forward input, a parameter). A graph input the graph
    writes into, first met now (after the call), is a source whose values are not what was read."""
    refs, carried = static
    resolved = []
    for ref in refs:
        if ref is None:
            continue
        if ref[0] == "op":
            event = events.get(ref[1])
            if event is not None:
                resolved.append(event)
        elif ref[1] < len(args) and isinstance(args[ref[1]], torch.Tensor):
            tensor, written = args[ref[1]], ref[1] in written_inputs
            known = tracker.provenance.sources_of((tensor,)) if written else None
            resolved.extend(tracker.origin_of(tensor))
            if written:
                tracker.provenance.met_after_writing((tensor,), known)
    return tuple(resolved), carried

