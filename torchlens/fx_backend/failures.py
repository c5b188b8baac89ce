"""Naming the op a compiled forward failed at, for the partial trace.

Two kinds of failure reach a compiled run:

- a compiled graph raises while it runs: the graph is replayed op by op (`replay.py`) to find the
  node in flight, and the ops of the graph that completed before it are recorded; a live graph
  already ran op by op, so its node in flight is read from its frame instead, with no replay;
- dynamo raises while it traces (a shape error found on fake tensors, typically after a new input
  size forces a recompile): no graph ran, so the forward is run eagerly under capture instead,
  which fails at the same op; after a graph break, where the code before the break has run, the
  op is read from dynamo's trace instead and nothing runs twice.

Every note says how the op was located, or why it was not; a failure that was not located is never
reported as one with no torch call in flight. Both only ever add to the session; neither may raise.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..core.guard import internal_error
from ..core.naming import USER_SPELLING, node_name
from ..core.session import error_summary, in_chain
from ..core.sites import site_from_stack_trace
from ..core.structure import module_of
from ..eager.runner import run_eager
from ..events import INPUT, Scope, TensorMeta
from ..options import make_settings
from ..repro.kept import KeptCall
from ..torch_internals.node_meta import example_value, module_stack, stack_trace
from . import dynamo_seams
from .active import no_active_pass
from .module_stack import relative_stack
from .plan import node_op_name
from .replay import locate_failure, locate_live, why_not_replay

__all__ = ["graph_failed", "locate_while_tracing", "place_python_failure"]

_NOT_LOCATED = "<compiled graph>"  # the attempted call when the op inside a graph call is not known
_TRACING = "<dynamo tracing>"  # the attempted call when the op dynamo failed to trace is not known
REPLAYED = "located by replaying the compiled graph op by op"
LIVE = "located live: the graph runs op by op, and this op had started but not returned"
LIVE_NEXT = "located live: the op after the last one narrated (its inputs could not be read)"
LIVE_TYPES = ("live mode ran this graph op by op, eagerly: the exception is the eager op's, and may differ "
              "in type from what the same fault raises in an inductor-compiled graph")
LIVE_UNREAD = "not located: the op-by-op graph's frame could not be read from the traceback"
LIVE_OWN = "not located: the error came from torchlens's own narration call between ops, not from a model op"
RESUMED = ("located from dynamo's trace, after a graph break: the forward was not run again (its code before "
           "the break had run), so the ops of this frame before it are not narrated and its inputs are shapes only")
RESUMED_NOT_READ = ("dynamo raised after a graph break, so the forward's code before the break had already run, "
                    "and it is not run again to locate the op; dynamo's trace could not be read")
REPLAY_VALUES = ("the values of the ops before it (statistics, kept values) are the replay's, computed again "
                 "from the graph's inputs")


class FailedOp(NamedTuple):
    """Where a graph call failed: how many of its plan ops completed before, and the op in flight."""

    completed: Optional[int]
    op: str
    scope: Scope
    site: Optional[str]
    inputs: Optional[tuple]
    notes: Sequence[str]
    values: Optional[list] = None  # the completed ops' outputs, from the replay, when they are wanted
    call: Optional[tuple] = None  # the replayed node's (function, args, kwargs, exception), for a repro
    tensors: tuple = ()  # the op's tensor inputs, as `inputs` describes them (the replay's, or the live frame's)


def graph_failed(run, graph, args, scope: Scope, exc: BaseException) -> None:
    """Record what a failed graph call did before failing, and the op it failed at."""
    try:
        where = _locate(run, graph, args, scope, exc)
        if where.completed and not graph.live:
            plan = graph.plan
            concrete = plan.resolver.resolve(args) if plan.resolver is not None else None
            run.add_plan_ops(plan, scope, concrete, 0, where.completed, values=where.values, args=args, events={})
        run.session.move_to(where.scope)  # the enter lines of the op's modules, as eager would show
        call = None
        if where.call is not None:
            func, call_args, call_kwargs, replayed = where.call
            notes = ["the inputs are the replay's: the graph ran again, eagerly, up to this op"]
            if type(replayed) is not type(exc):
                notes.append(f"the compiled graph raised {error_summary(exc)}; replayed eagerly, the op raises "
                             f"{error_summary(replayed)}, which is what this script expects")
            call = KeptCall(func, call_args, call_kwargs, notes, error=error_summary(replayed))
        run.session.op_failed(where.op, where.inputs, where.site, exc, where.scope, where.notes, call, where.tensors)
    except Exception as inner:
        internal_error("locating the failure in a compiled graph", inner)


def _wants_values(run) -> bool:
    """Whether the ops completed before a failure need their values: statistics, tracking or a
    trace's kept values (a `tl.trace` that fails compares up to the failure)."""
    meter = run.pipeline.meter
    return run.keeper is not None or (meter is not None and meter.active)


def _locate(run, graph, args, scope: Scope, exc: BaseException) -> FailedOp:
    arg_metas = tuple(TensorMeta.of(a) for a in args if isinstance(a, torch.Tensor))
    if graph.live:
        return _locate_live(run, graph, scope, arg_metas, exc)
    reason = why_not_replay(graph.replay_copy, exc)
    if reason is not None:
        return _graph_call(scope, arg_metas, [f"not replayed: {reason}"])
    keep = {op.node: op.value for op in graph.plan.ops} if _wants_values(run) else None
    located = locate_failure(graph.replay_copy, args, keep)
    notes = [REPLAYED] + [f"replay caveat: {c}" for c in located.caveats]
    if located.node is None:
        return _graph_call(scope, arg_metas, notes)
    where = _at_node(run, graph, scope, located.node, located.inputs, notes)._replace(call=located.call,
                                                                                      tensors=located.tensors)
    if keep is None or not where.completed or not located.values:
        return where
    values = [located.values.get(op.node) for op in graph.plan.ops[:where.completed]]
    return where._replace(values=values, notes=list(where.notes) + [REPLAY_VALUES])


def _locate_live(run, graph, scope: Scope, arg_metas, exc: BaseException):
    """A live graph is never replayed: it ran op by op, so its frame says which op was in flight.

    Replaying would run its ops a second time (with the effects that stop a fused graph's replay)
    to learn what the live run already knows. If the frame cannot be read, the graph call is named.
    """
    located = locate_live(graph.live_module, exc) if graph.live_module is not None else None
    if located is None or located.node is None:  # (a located failure has its node)
        return _after_last_narrated(run, graph, scope, arg_metas)
    if located.node.name not in {node.name for node in graph.replay_copy.graph.nodes}:
        return _graph_call(scope, arg_metas, [LIVE_OWN])  # a narration call torchlens inserted raised
    return _at_node(run, graph, scope, located.node, located.inputs, [LIVE_TYPES, LIVE])._replace(
        tensors=located.tensors)


def _after_last_narrated(run, graph, scope: Scope, arg_metas):
    """The frame could not be read (FX re-raises errors from generated code without it): the op
    in flight is the plan op after the last one this call narrated."""
    following = run.live_narrated(graph)
    if following >= len(graph.plan.ops):
        return _graph_call(scope, arg_metas, [LIVE_UNREAD])
    op = graph.plan.ops[following]
    op_scope = graph.plan.op_scopes(run.runtime.scopes, scope)[op.index]
    return FailedOp(following, op.op, op_scope, op.site, None, [LIVE_TYPES, LIVE_NEXT])


def _at_node(run, graph, scope: Scope, node, inputs, notes):
    """The located node as the attempted op, with the count of plan ops that completed before it."""
    plan = graph.plan
    order = {n.name: i for i, n in enumerate(graph.replay_copy.graph.nodes)}
    position = order.get(node.name, 0)
    completed = sum(1 for op in plan.ops if order.get(op.node, -1) < position)
    table = run.runtime.scopes
    plan_op = plan.by_node.get(node.name)
    if plan_op is not None:
        return FailedOp(completed, plan_op.op, plan.op_scopes(table, scope)[plan_op.index], plan_op.site, inputs, notes)
    modules = relative_stack(table, module_stack(node), plan.compiled_in.path)
    site = site_from_stack_trace(stack_trace(node))
    return FailedOp(completed, node_op_name(node, graph.replay_copy), table.resolve(scope, modules), site, inputs,
                    notes)


def _graph_call(scope, arg_metas, notes) -> FailedOp:
    """The graph call itself as the attempted call, when the op inside it is not known."""
    return FailedOp(None, _NOT_LOCATED, scope, None, arg_metas, notes)


def locate_while_tracing(run, exc: BaseException) -> None:
    """Dynamo raised while tracing: find the op it was tracing.

    Traced after a graph break (a resume function), the code before the break has already run:
    the op is read from the node dynamo was running on fake tensors, and nothing runs again.
    Otherwise no code of the forward has run yet, and the forward is run eagerly under capture
    (`_locate_by_running_eagerly`), which also narrates the ops before the failure.
    """
    if dynamo_seams.traced_frame_resumed(exc):
        node = dynamo_seams.traced_node(exc)
        if node is not None and _at_traced_node(run, exc, node):
            return
        _not_located_while_tracing(run, exc, RESUMED_NOT_READ)
        return
    _locate_by_running_eagerly(run, exc)


def _at_traced_node(run, exc: BaseException, node) -> bool:
    """The node dynamo failed to trace as the attempted op: its name, its inputs' shapes (from the
    fake values), its module and the user's line. Whether it could be read."""
    try:
        table = run.runtime.scopes
        frame_scope = table.scope_of_traceback(exc.__traceback__)
        modules = relative_stack(table, module_stack(node), frame_scope.path)
        scope = table.resolve(frame_scope, modules)
        inputs = tuple(TensorMeta.of(value) for value in (example_value(arg) for arg in node.all_input_nodes)
                       if isinstance(value, torch.Tensor))
        name = node.meta.get(USER_SPELLING) or node_name(node.target, node.args, node.op)
        site = site_from_stack_trace(stack_trace(node))
    except Exception as inner:
        internal_error("reading the op dynamo failed to trace", inner)
        return False
    run.session.move_to(scope)
    run.session.op_failed(name, inputs, site, exc, scope, (RESUMED,))
    return True


def _locate_by_running_eagerly(run, exc: BaseException) -> None:
    """The forward, run eagerly under capture, fails at the op dynamo could not trace.

    The forward runs a second time (without gradients): its cost, and its effect on state a forward
    changes even in eval mode (a KV cache) are the price of the answer. Not done for a model in
    training mode, whose batch-norm statistics or dropout generator a second forward would change.
    Whatever stops the op being found, the tail says so: dynamo raised in a torch call it traced,
    so "no torch call was in flight" would be false.
    """
    fn, args, kwargs = run.call.fn, run.call.args, run.call.kwargs
    model = module_of(fn)
    reason = _why_not_rerun(model)
    if reason is None:
        assert model is not None  # (`_why_not_rerun` gives a reason for anything but a module)
        try:
            with no_active_pass(), torch.no_grad():  # compiled calls nested in the re-run are not this run's
                run_eager(model, args, kwargs, make_settings(None))
            reason = "run again eagerly, the forward did not fail"
        except Exception as eager_exc:
            partial = getattr(eager_exc, "partial_trace", None)
            if _adopt_eager_failure(run, exc, partial):
                return
            reason = ("run again eagerly, the forward failed without a partial trace" if partial is None
                      else "run again eagerly, the forward failed outside any torch call")
    _not_located_while_tracing(run, exc, reason)


def place_python_failure(run, exc: BaseException) -> None:
    """A failure no torch call raised (the forward's own Python code): open the module whose code
    raised it, as eager's module hooks would have closed the ones that had returned. A compiled
    frame has no such hooks, so without this the last op's module would be named."""
    failed = run.session.failed_call
    if failed is not None and in_chain(failed.exc, exc):
        return  # a torch call raised it: its module stands
    gaps = getattr(run, "gaps", None)
    if gaps is not None and exc.__traceback__ is not None:
        run.session.move_to(gaps.scopes.scope_of_traceback(exc.__traceback__))


def _why_not_rerun(model) -> Optional[str]:
    """Why the forward must not be run again eagerly to locate the op (None: it may)."""
    if model is None:
        return "only a compiled module's forward is run again eagerly, and this callable is not a module"
    if any(m.training for m in model.modules()):
        return "the model has modules in training mode, and re-running it eagerly could change them"
    return None


def _not_located_while_tracing(run, exc: BaseException, reason: str) -> None:
    """The tail for a tracing failure not located: dynamo's trace of the forward as the attempted
    call, with the forward's inputs and the user's line dynamo raised at, and why it was not located."""
    session = run.session
    unlocated = session.attempt_for(exc)  # where the error surfaced: the open module and the user's line
    if unlocated.op is not None:
        return  # a call was recorded as failing with this very exception: that answer stands
    inputs = tuple(meta for event in session.events if event.kind is INPUT for meta in event.outputs)
    note = f"dynamo raised while tracing; not located: {reason}"
    session.op_failed(_TRACING, inputs, unlocated.site, exc, unlocated.scope, (note,))


def _adopt_eager_failure(run, exc: BaseException, partial) -> bool:
    """Take the eager re-run's partial trace as this run's, if it names a torch call."""
    attempt = getattr(partial, "attempt", None)
    if attempt is None or attempt.op is None:
        return False
    session = run.session
    session.replace_events(partial.events, attempt)
    note = "dynamo raised while tracing; located by running the forward eagerly"
    session.op_failed(attempt.op, attempt.inputs, attempt.site, exc, attempt.scope, (note,), values=attempt.values)
    return True
