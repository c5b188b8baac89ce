"""Naming the op a compiled forward failed at, for the partial trace.

Two kinds of failure reach a compiled run:

- a compiled graph raises while it runs: the graph is replayed op by op (`replay.py`) to find the
  node in flight, and the ops of the graph that completed before it are recorded;
- dynamo raises while it traces (a shape error found on fake tensors, typically after a new input
  size forces a recompile): no graph ran, so the forward is run eagerly under capture instead,
  which fails at the same op.

Both only ever add to the session; neither may raise.
"""

from __future__ import annotations

import torch

from ..eager.runner import run_eager
from ..events import Scope, TensorMeta
from ..options import make_settings
from ..session import internal_error
from ..sites import site_from_stack_trace
from .plan import node_op_name
from .replay import locate_failure, why_not_replay

_NOT_LOCATED = "<compiled graph>"


def graph_failed(run, graph, args, scope: Scope, exc: BaseException) -> None:
    """Record what a failed graph call did before failing, and the op it failed at."""
    try:
        completed, op, op_scope, site, inputs, notes = _locate(run, graph, args, scope, exc)
        if completed and not graph.live:
            plan = graph.plan
            concrete = plan.resolver.resolve(args) if plan.resolver is not None else None
            run.add_plan_ops(plan, scope, concrete, 0, completed)
        run.session.move_to(op_scope)  # the enter lines of the op's modules, as eager would show
        run.session.op_failed(op, inputs, site, exc, op_scope, notes)
    except Exception as inner:
        internal_error("locating the failure in a compiled graph", inner)


def _locate(run, graph, args, scope: Scope, exc: BaseException):
    """(plan ops completed before the failure, op name, scope, site, input metas, notes)."""
    arg_metas = tuple(TensorMeta.of(a) for a in args if isinstance(a, torch.Tensor))
    reason = why_not_replay(graph.replay_copy, exc)
    if reason is not None:
        return _not_located(run, graph, scope, arg_metas, [f"not replayed: {reason}"])
    located = locate_failure(graph.replay_copy, args)
    notes = ["located by replaying the compiled graph op by op"] + [f"replay caveat: {c}" for c in located.caveats]
    if located.node is None:
        return _not_located(run, graph, scope, arg_metas, notes)
    node, plan = located.node, graph.plan
    order = {n.name: i for i, n in enumerate(graph.replay_copy.graph.nodes)}
    position = order.get(node.name, 0)
    completed = sum(1 for op in plan.ops if order.get(op.node, -1) < position)
    table = run.runtime.scopes
    plan_op = plan.by_node.get(node.name)
    if plan_op is not None:
        return completed, plan_op.op, plan.op_scopes(table, scope)[plan_op.index], plan_op.site, located.inputs, notes
    modules = table.relative_stack(node.meta.get("nn_module_stack"), plan.compiled_in.path)
    site = site_from_stack_trace(node.meta.get("stack_trace"))
    return completed, node_op_name(node, graph.replay_copy), table.resolve(scope, modules), site, located.inputs, notes


def _not_located(run, graph, scope, arg_metas, notes):
    """The graph call itself as the attempted call; in live mode, the op after the last narrated."""
    if graph.live:
        nxt = run.live_progress(graph) + 1
        if nxt < len(graph.plan.ops):
            op = graph.plan.ops[nxt]
            scopes = graph.plan.op_scopes(run.runtime.scopes, scope)
            return None, op.op, scopes[op.index], op.site, (), notes + ["the op after the last narrated one"]
    return None, _NOT_LOCATED, scope, None, arg_metas, notes


def locate_by_running_eagerly(run, exc: BaseException) -> None:
    """Dynamo raised while tracing: run the forward eagerly under capture to find the op.

    The forward runs a second time (without gradients): its cost, and its effect on state a forward
    changes even in eval mode (a KV cache) are the price of the answer. Not done for a model in
    training mode, whose batch-norm statistics a second forward would update again; the tail then
    names the user's line only.
    """
    from .runtime import module_of, quiet_runs  # the runtime imports this module

    fn, args, kwargs = run.call
    model = module_of(fn)
    if model is None or any(m.training for m in model.modules()):
        return
    try:
        with quiet_runs(), torch.no_grad():  # compiled calls nested in the re-run are not this run's
            run_eager(model, args, kwargs, make_settings(None))
    except Exception as eager_exc:
        _adopt_eager_failure(run, exc, getattr(eager_exc, "partial_trace", None))


def _adopt_eager_failure(run, exc: BaseException, partial) -> None:
    attempt = getattr(partial, "attempt", None)
    if attempt is None or attempt.op is None:
        return
    session = run.session
    session.events[:] = partial.events
    session.ordinal, session.scope = attempt.ordinal - 1, attempt.scope
    note = "dynamo raised while tracing; located by running the forward eagerly"
    session.op_failed(attempt.op, attempt.inputs, attempt.site, exc, attempt.scope, (note,))
