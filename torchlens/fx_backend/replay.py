"""Locating the op that failed inside a compiled graph.

Inductor fuses ops into kernels and changes exception types (an embedding's `IndexError` becomes a
kernel's `RuntimeError: index out of bounds`), and its kernel names do not reliably say which op
failed. So when — and only when — a compiled graph raises, an untouched copy of the graph is run
again op by op under `torch.fx.Interpreter`; the node it is running when it raises is the attempted
op. A graph that never fails never pays for this beyond the copy made at compile time.

What a replay cannot promise is stated with its result: inputs the graph had already mutated in
place are replayed in their mutated state, and ops that draw random numbers draw different ones.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import fx

from ..events import Scope, TensorMeta
from ..sites import site_from_stack_trace
from .plan import node_op_name

_RANDOM_OPS = ("rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal", "dropout", "uniform")


def untouched_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph that compilers cannot mutate (inductor rewrites the graph it is given)."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


class _Locator(fx.Interpreter):
    """Runs a graph node by node, remembering the node in flight and its real arguments."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.current: Optional[fx.Node] = None
        self.current_inputs: Tuple = ()

    def run_node(self, n: fx.Node):
        self.current = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.current_inputs = tuple(a for a in _flatten((args, kwargs)) if isinstance(a, torch.Tensor))
        return super().run_node(n)


def _flatten(value) -> List:
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _flatten(part)]
    if isinstance(value, dict):
        return [item for part in value.values() for item in _flatten(part)]
    return [value]


class Located:
    """Where a replay failed: the node, the metadata of its tensor inputs, and the replay's caveats."""

    def __init__(self, node: Optional[fx.Node], inputs: Tuple[TensorMeta, ...], caveats: List[str]):
        self.node = node
        self.inputs = inputs
        self.caveats = caveats


def locate_failure(gm: fx.GraphModule, args) -> Located:
    """Replay `gm` on `args`; return the node that raises (None if the replay does not fail)."""
    caveats = replay_caveats(gm)
    locator = _Locator(gm)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            locator.run(*args)
        except Exception:
            node = locator.current
            inputs = tuple(TensorMeta.of(t) for t in locator.current_inputs)
            return Located(node, inputs, caveats)
    return Located(None, (), caveats + ["the replay ran without error, so the failing op is unknown"])


def replay_caveats(gm: fx.GraphModule) -> List[str]:
    """What may make a replay differ from the failed call, read from the graph."""
    caveats = []
    names = [_target_name(node) for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    if any(name.endswith("_") and not name.endswith("__") or name in ("setitem", "copy_") for name in names):
        caveats.append("the graph mutates tensors in place; the replay saw them after any mutation the failed call made")
    if any(name.startswith(_RANDOM_OPS) for name in names):
        caveats.append("the graph draws random numbers; the replay drew its own")
    return caveats


def _target_name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


_NOT_LOCATED = "<compiled graph>"


def locate_in_graph(graph, args, frame_scope: Scope, run, exc: BaseException):
    """The attempted op of a failed graph call, for the session.

    Returns (ops of the plan that completed before it, op name, scope, site, input metas, notes).
    """
    arg_metas = tuple(TensorMeta.of(a) for a in args if isinstance(a, torch.Tensor))
    if _device_fault(exc):
        note = "the device reported the error: a replay cannot run on a faulted device, so the op inside the graph is not located"
        return None, _NOT_LOCATED, frame_scope, None, arg_metas, [note]
    located = locate_failure(graph.replay_copy, args)  # the caller keeps the gap capture out of this
    notes = ["located by replaying the compiled graph op by op"] + [f"replay caveat: {c}" for c in located.caveats]
    if located.node is None:
        return None, _NOT_LOCATED, frame_scope, None, arg_metas, notes
    node, plan = located.node, graph.plan
    order = {n.name: i for i, n in enumerate(graph.replay_copy.graph.nodes)}
    position = order.get(node.name, 0)
    completed = sum(1 for op in plan.ops if order.get(op.node, -1) < position)
    table = run.runtime.scopes
    plan_op = plan.by_node.get(node.name)
    if plan_op is not None:
        return completed, plan_op.op, plan.op_scopes(table, frame_scope)[plan_op.index], plan_op.site, located.inputs, notes
    modules = table.relative_stack(node.meta.get("nn_module_stack"), plan.compiled_in.path)
    scope = table.resolve(frame_scope, modules)
    site = site_from_stack_trace(node.meta.get("stack_trace"))
    return completed, node_op_name(node, graph.replay_copy), scope, site, located.inputs, notes


def _device_fault(exc: BaseException) -> bool:
    text = str(exc)
    return "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text
