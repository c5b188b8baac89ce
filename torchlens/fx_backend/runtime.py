"""Compiled forwards as narrated passes: one `CompiledRun` per call of a compiled model.

A `CompiledRuntime` belongs to one compiled model (or function): its options, module names and
forward count. Dynamo's wrapper calls the runtime's `enter` hook before each call of the compiled
callable and the returned cleanup after it, so every call is one run: input events, then each
compiled graph's plan and the eager code between graphs in the order they execute, all numbered
by one ordinal sequence, then the outputs and the footer (or, on failure, the partial trace).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from typing import Callable, Optional

import torch
from torch import nn

from ..eager.capture import CaptureMode, remove_mode
from ..eager.runner import run_eager
from ..eager.values import ValueKeeper
from ..eager.structure import named_arguments, named_outputs
from ..events import Scope, TensorMeta
from ..grammar import plural
from ..narrator import Narrator
from ..options import make_settings
from ..records import Recording
from ..session import Session, internal_error
from ..stats import Meter
from . import dynamo_seams
from .config import CompileConfig
from .gaps import GapCapture
from ..scopes import ScopeTable
from .plan import GraphPlan
from .replay import locate_in_graph
from .stats_pass import read_stats

_local = threading.local()


def active_run() -> Optional["CompiledRun"]:
    return getattr(_local, "run", None)


class CompiledRuntime:
    """Options, module names and history shared by every forward of one compiled model.

    `last_recording` is the most recent forward's `Recording`; `recordings` keeps the last few.
    """

    def __init__(self, config: CompileConfig, root: Optional[nn.Module] = None, keep: int = 8):
        self.config = config
        self.root = root
        self.scopes = ScopeTable(root)
        self.passes = 0
        self.recordings = collections.deque(maxlen=keep)

    @property
    def last_recording(self) -> Optional[Recording]:
        return self.recordings[-1] if self.recordings else None

    # -- forward boundaries ---------------------------------------------------------------------

    def enter(self) -> Callable[[], None]:
        """Dynamo's enter hook: begin a run for this call; return the cleanup that ends it."""
        frame = dynamo_seams.find_call_frame()
        current = active_run()
        if current is not None and current.abandon_on_next_begin:
            current.finish(None)  # a first call whose end could not be hooked: close it now
            current.close()
            current = None
        if frame is None or current is not None:
            return _nothing  # a compiled callable called inside a forward already being narrated
        fn, args, kwargs = dynamo_seams.call_of_frame(frame)
        run = self.begin(fn, args, kwargs, push_mode=True)
        return run.cleanup if run is not None else _nothing

    def begin(self, fn, args, kwargs, push_mode: bool) -> Optional["CompiledRun"]:
        try:
            self.passes += 1
            run = CompiledRun(self, header=f"pass {self.passes}")
            run.begin(fn, args, kwargs, push_mode)
            return run
        except Exception as exc:
            internal_error("starting a compiled forward", exc)
            return None

    def adopt_current_call(self, frame) -> None:
        """First compile of a model compiled with the string backend: narrate the call in progress.

        Its enter hooks ran before this backend existed, so the run begins here, the capture mode
        joins the frame being compiled, and the run ends when the call does.
        """
        if active_run() is not None:
            return
        fn, args, kwargs = dynamo_seams.call_of_frame(frame)
        run = self.begin(fn, args, kwargs, push_mode=False)  # dynamo is tracing: the stack is its own
        if run is None:
            return
        run.mode_adopted = run._mode_pushed = dynamo_seams.adopt_mode_for_this_compile(run.mode)
        if not dynamo_seams.end_call_with(frame, run.cleanup):
            run.abandon_on_next_begin = True

    def record(self, recording: Recording) -> None:
        self.recordings.append(recording)


def _nothing() -> None:
    return None


class CompiledRun:
    """One compiled forward: its session, narrator and the capture of code between graphs."""

    def __init__(self, runtime: CompiledRuntime, header: Optional[str]):
        self.runtime = runtime
        settings = runtime.config.settings
        self.narrator = Narrator(settings.narration) if settings.narration is not None else None
        self.session = Session(settings, runtime.scopes.root_scope, self.narrator, header)
        meter = Meter(settings.value_stats, settings.on_nonfinite is not None)
        if meter.active:
            self.session.meter = meter  # ops between graphs, and every op in live mode
        self.keeper = (ValueKeeper(self.session.values, settings.keep_on_cpu, settings.max_bytes)
                       if settings.keep_values else None)
        self.gaps = GapCapture(self.session, runtime.scopes, settings.sites, self.keeper)
        self.mode = CaptureMode(self.gaps)
        self.mode_adopted = False
        self.abandon_on_next_begin = False
        self.graph_calls = 0
        self._mode_pushed = False
        self._done = False

    def begin(self, fn, args, kwargs, push_mode: bool) -> None:
        self.call = (fn, args, kwargs)
        for label, tensor in named_arguments(fn, args, kwargs):
            event = self.session.add_input(label, (TensorMeta.of(tensor),), value=tensor)
            if self.keeper is not None:
                self.keeper(event, tensor)
        if push_mode:
            self.mode.__enter__()
            self._mode_pushed = True
        _local.run = self

    # -- graphs ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def graph_running(self):
        """While a compiled graph runs, the gap capture steps aside.

        The mode is taken off the stack when it is on top (the compiled code's own torch calls,
        such as inductor's extern kernels, then cost nothing extra); otherwise it is paused.
        """
        mode = self.mode
        lifted = self._mode_pushed and torch._C._len_torch_function_stack() > 0 and \
            torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1) is mode
        if lifted:
            torch._C._pop_torch_function_stack()
        else:
            self.gaps.paused = True
        try:
            yield
        finally:
            if lifted:
                torch._C._push_on_torch_function_stack(mode)
            else:
                self.gaps.paused = False

    def frame_scope(self, plan: GraphPlan, caller) -> Scope:
        """The module the graph runs in for this call."""
        return plan.frame_scope or self.runtime.scopes.scope_of_stack(caller)

    def add_plan(self, plan: GraphPlan, args, frame_scope: Scope, stats_vector=None, slots=None, kept=None) -> None:
        """Record (and narrate) the ops a graph call performed, in order.

        A graph called again in the same situation — same ordinal, same open module, same frame,
        same sizes — produces the same events, so they are built once and replayed (a forward's
        second call costs a dictionary lookup and one sink write per graph). Statistics and kept
        values differ from call to call, so a graph that returns them is recorded afresh each time.
        """
        session = self.session
        concrete = plan.resolver.resolve(args) if plan.resolver is not None else None
        if stats_vector is not None or kept is not None:
            stats = None
            if stats_vector is not None:
                metas = self.op_metas(plan, concrete, 0, len(plan.ops))
                numels = [tuple(_numel(meta.shape) for meta in op_metas) for op_metas in metas]
                settings = session.settings
                values = session.meter.read_along(stats_vector)  # with what was measured since the last graph
                stats = read_stats(slots, values, settings.value_stats, settings.on_nonfinite is not None, numels)
            self.add_plan_ops(plan, frame_scope, concrete, 0, len(plan.ops), stats=stats, kept=kept)
            return
        key = (session.ordinal, session.scope, frame_scope, None if concrete is None else tuple(concrete))
        segment = plan.segments.get(key)
        if segment is not None:
            session.replay(segment.events, segment.ordinal, segment.scope, segment.narration)
            return
        start = len(session.events)
        self.add_plan_ops(plan, frame_scope, concrete, 0, len(plan.ops))
        plan.remember(key, session.events[start:], session.ordinal, session.scope)

    def op_metas(self, plan: GraphPlan, concrete, start: int, stop: int):
        """The output metadata of plan ops [start, stop) in this call: concrete sizes where they
        are dynamic, unless `symbolic_shapes` asks for the symbols."""
        narration = self.session.settings.narration
        symbolic = narration is not None and narration.symbolic_shapes
        result = []
        for op in plan.ops[start:stop]:
            metas = op.metas
            if concrete is not None and op.exprs is not None and not symbolic:
                shapes = concrete[plan.dynamic_position[op.index]]
                metas = tuple(TensorMeta(shape, m.dtype, m.device) for shape, m in zip(shapes, metas))
            result.append(metas)
        return result

    def add_plan_ops(self, plan: GraphPlan, frame_scope: Scope, concrete, start: int, stop: int,
                     stats=None, values=None, kept=None) -> None:
        """Record plan ops [start, stop): with `stats` read from the graph, or with `values` (the
        ops' outputs, in live mode) for the eager meter to measure and the keeper to keep; `kept`
        are the outputs a graph returned for `tl.trace(..., compiled=True)`."""
        session = self.session
        scopes = plan.op_scopes(self.runtime.scopes, frame_scope)
        for offset, (op, metas) in enumerate(zip(plan.ops[start:stop], self.op_metas(plan, concrete, start, stop))):
            scope = scopes[op.index]
            if scope is not session.scope:
                session.move_to(scope)
            value = None if values is None else values[offset]
            event = session.add_op(op.op, metas, op.site, stats=None if stats is None else stats[op.index], value=value)
            if self.keeper is not None:
                output = kept[op.index] if kept is not None else value
                if output is not None:
                    self.keeper(event, output)

    # -- ending ---------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Dynamo's cleanup for the call: finish or fail the run. Never raises."""
        exc = sys.exc_info()[1]
        try:
            if exc is not None:
                self.fail(exc)
            else:
                self.finish(dynamo_seams.result_of_call())
        except Exception as inner:
            internal_error("ending a compiled forward", inner)
        finally:
            self.close()

    def finish(self, output) -> Recording:
        self.pop_mode()
        for label, tensor in named_outputs(output):
            self.session.add_output(label, (TensorMeta.of(tensor),))
        self.session.footer_extra.append(self.footer_note())
        recording = self.session.finish(output)
        self.runtime.record(recording)
        return recording

    def graph_failed(self, graph, args, frame_scope: Scope, exc: BaseException) -> None:
        """A compiled graph raised: find the op by replaying the graph, record what ran before it."""
        try:
            failure = locate_in_graph(graph, args, frame_scope, self, exc)
            if failure is None:
                return
            completed, op, scope, site, inputs, notes = failure
            if completed is not None and not graph.live:
                plan = graph.plan
                concrete = plan.resolver.resolve(args) if plan.resolver is not None else None
                self.add_plan_ops(plan, frame_scope, concrete, 0, completed)
            self.session.move_to(scope)  # the enter lines of the op's modules, as eager would show
            self.session.op_failed(op, inputs, site, exc, scope, notes)
        except Exception as inner:
            internal_error("locating the failure in a compiled graph", inner)

    def locate_by_running_eagerly(self, exc: BaseException) -> None:
        """Dynamo raised while tracing (a shape error found on fake tensors, often after a
        recompile with new sizes): no graph ran, so there is nothing to replay. Running the forward
        eagerly under capture fails at the same op, with its modules and inputs.

        Not done for a model in training mode, where running the forward again would update state
        such as batch-norm statistics a second time; the tail then names the user's line only.
        """
        fn, args, kwargs = self.call
        model = module_of(fn)
        if model is None or any(m.training for m in model.modules()):
            return
        try:
            run_eager(model, args, kwargs, make_settings(None))
        except Exception as eager_exc:
            partial = getattr(eager_exc, "partial_trace", None)
            attempt = getattr(partial, "attempt", None)
            if attempt is None or attempt.op is None:
                return
            session = self.session
            session.events[:] = partial.events
            session.ordinal, session.scope = attempt.ordinal - 1, attempt.scope
            note = "dynamo raised while tracing; located by running the forward eagerly"
            session.op_failed(attempt.op, attempt.inputs, attempt.site, exc, attempt.scope, (note,))

    def footer_note(self) -> str:
        """How the forward ran: compiled graph calls, and ops dynamo ran eagerly between them."""
        note = plural(self.graph_calls, "compiled graph call")
        if self.gaps.ops:
            note += f", {plural(self.gaps.ops, 'op')} run eagerly between graphs"
        return note

    def fail(self, exc: BaseException):
        self.pop_mode()
        if isinstance(exc, torch._dynamo.exc.TorchRuntimeError):
            self.locate_by_running_eagerly(exc)
        partial = self.session.fail(exc)
        self.runtime.record(partial)
        return partial

    def pop_mode(self) -> None:
        if self._mode_pushed:
            self._mode_pushed = False
            remove_mode(self.mode)

    def close(self) -> None:
        self.pop_mode()
        if getattr(_local, "run", None) is self:
            _local.run = None
        if self.narrator is not None and not self._done:
            self._done = True
            self.narrator.close()


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size if isinstance(size, int) else 0
    return count


def module_of(fn) -> Optional[nn.Module]:
    """The module a compiled callable belongs to (`OptimizedModule` wraps `module.__call__`)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return getattr(owner, "_orig_mod", owner)
    return fn if isinstance(fn, nn.Module) else None

