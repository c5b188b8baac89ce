"""Locating the op that failed inside a compiled graph.

Inductor fuses ops into kernels and changes exception types (an embedding's `IndexError` becomes a
kernel's `RuntimeError: index out of bounds`), and its kernel names do not reliably say which op
failed. So when — and only when — a compiled graph raises, an untouched copy of the graph is run
again op by op under `torch.fx.Interpreter`; the node it is running when it raises is the attempted
op. A graph that never fails never pays for this beyond the copy made at compile time.

What a replay cannot promise is stated with its result: inputs the graph had already mutated in
place are replayed in their mutated state, and ops that draw random numbers draw different ones.
Whether ops drew is watched during the replay, per aten call, not guessed from the graph's op names:
an eval-mode dropout is a node named dropout that draws nothing.

A graph in live mode runs op by op as Python code, so the op it failed at is read from its own
frame in the traceback (`locate_live`); it is never replayed.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..events import TensorMeta
from ..measure.integer_values import device_faulted
from ..measure.memory import node_writes, tensors_of
from ..measure.writes import may_return_an_alias, target_name

__all__ = ["DrawWatch", "locate_failure", "locate_live", "mutates_inputs", "untouched_copy", "why_not_replay"]

_CALLS = ("call_function", "call_method", "call_module")
# Arguments that switch a seeded op's drawing off: `train=False` (dropout, rnn kernels),
# `training=False` (rrelu), a zero dropout probability (attention kernels, rnn kernels).
_OFF_WHEN_FALSE = ("train", "training")
_OFF_WHEN_ZERO = ("dropout", "dropout_p")


def untouched_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph that compilers cannot mutate (inductor rewrites the graph it is given)."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


class _Locator(fx.Interpreter):
    """Runs a graph node by node, remembering the node in flight and its real arguments."""

    def __init__(self, gm: fx.GraphModule, keep: Optional[Dict[str, str]] = None):
        super().__init__(gm, garbage_collect_values=True)
        self.current: Optional[fx.Node] = None
        self.current_inputs: Tuple = ()
        self.current_call: Tuple[tuple, dict] = ((), {})  # the node in flight's real arguments, for a repro
        self.keep = keep or {}
        self.values: Dict[str, object] = {}
        self.nodes = {node.name: node for node in gm.graph.nodes} if keep else {}
        self.copies_failed = False

    def run_node(self, n: fx.Node):
        self.current = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.current_call = (args, kwargs)
        self.current_inputs = tuple(tensors_of((args, kwargs)))
        result = super().run_node(n)
        holder = self.keep.get(n.name)
        if holder is not None:  # as it is right after the op (a write's tensor, after the write)
            try:
                self.values[n.name] = _copied(result if holder == n.name else self.env[self.nodes[holder]])
            except Exception:  # out of memory for the copies, say: never mistaken for the failing op
                self.keep, self.values = {}, {}
                self.copies_failed = True
        return result


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(item) for item in value)
    return value


class FailedNode:
    """Where a replay failed: the node, the metadata of its tensor inputs (and the inputs
    themselves, `tensors`), the replay's caveats, and the outputs of the nodes asked for that
    completed before it (copies, by node name)."""

    def __init__(self, node: Optional[fx.Node], inputs: Tuple[TensorMeta, ...], caveats: List[str], values=None,
                 call=None, tensors: tuple = ()):
        self.node = node
        self.inputs = inputs
        self.caveats = caveats
        self.values = values or {}
        self.call = call  # (function, args, kwargs, exception) of the failing node, when a torch-level call
        self.tensors = tensors


def locate_failure(gm: fx.GraphModule, args, keep: Optional[Dict[str, str]] = None) -> FailedNode:
    """Replay `gm` on `args`; return the node that raises (None if the replay does not fail),
    with, for each node named in `keep` that completed before it, a copy of the value of the node
    `keep` maps it to (itself, or the tensor an indexed write wrote) right after it ran."""
    locator = _Locator(gm, keep)
    watch = DrawWatch()
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=devices), watch:  # the user's generators are untouched
        try:
            locator.run(*args)
        except Exception as replayed:
            node = locator.current
            inputs = tuple(TensorMeta.of(t) for t in locator.current_inputs)
            caveats = replay_caveats(gm, watch.drew)
            if locator.copies_failed:
                caveats.append("the values of the ops before it could not be copied during the replay, and are "
                               "not kept")
            return FailedNode(node, inputs, caveats, locator.values, _node_call(node, *locator.current_call, replayed),
                              locator.current_inputs)
    unknown = "the replay ran without error, so the failing op is unknown"
    return FailedNode(None, (), replay_caveats(gm, watch.drew) + [unknown])


def _node_call(node: Optional[fx.Node], args, kwargs, raised: BaseException):
    """The node as a call a script can make again (a function, or a tensor method by name), with
    what it raised in the replay."""
    if node is None:
        return None
    if node.op == "call_function":
        return node.target, args, kwargs, raised
    method = node.target if node.op == "call_method" else None  # (a method's target is its name)
    if isinstance(method, str) and callable(getattr(torch.Tensor, method, None)):
        return getattr(torch.Tensor, method), args, kwargs, raised
    return None  # a submodule call: its code is the user's, not one torch call


class DrawWatch(TorchDispatchMode):
    """Sees each aten call of the replay, to tell whether any drew random numbers.

    Watching the calls rather than reading the graph's op names is what makes the answer right:
    `F.dropout(x, p, training=False)` is a graph node named dropout but dispatches nothing, while
    `torch.rand` or a training-mode dropout dispatches a seeded op. Only ops up to the failure run,
    so a draw after the op that failed (which the failed call never made either) is not counted.
    """

    supports_higher_order_operators = True  # a higher-order op passes through; its body is not watched

    def __init__(self):
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.drew and isinstance(func, torch._ops.OpOverload) and draws_random(func, args, kwargs):
            self.drew = True
        return func(*args, **kwargs)


def draws_random(func: "torch._ops.OpOverload", args, kwargs) -> bool:
    """Whether an aten call draws from a random generator.

    The rule is torch's own: the op is tagged `nondeterministic_seeded` (rand*, randn*, normal,
    bernoulli, multinomial, randperm, uniform_, dropout kernels, ...), unless an argument of the
    call switches the drawing off (`train=False`, `training=False`, a zero dropout probability) —
    an eval-mode rrelu or an attention kernel without dropout is tagged too but draws nothing.
    """
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for name, value in _gate_arguments(func._schema, args, kwargs):
        if name in _OFF_WHEN_FALSE and value is False:
            return False
        if name in _OFF_WHEN_ZERO and isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            return False
    return True


def _gate_arguments(schema, args, kwargs):
    """(name, value) of the call's arguments that can switch drawing off, defaults included."""
    position = 0
    for argument in schema.arguments:
        name = argument.name
        if name in _OFF_WHEN_FALSE + _OFF_WHEN_ZERO:
            if name in kwargs:
                yield name, kwargs[name]
            elif not argument.kwarg_only and position < len(args):
                yield name, args[position]
            elif argument.has_default_value():
                yield name, argument.default_value
        position += not argument.kwarg_only


def locate_live(gm: fx.GraphModule, exc: BaseException) -> Optional[FailedNode]:
    """The node a live (op-by-op) graph was running when it raised, with its real inputs; None
    when that cannot be read with certainty.

    A live graph is FX's generated Python code: each node's result is assigned, in node order, to
    a local named after the node (a dead value is rebound to None, not deleted). So in the graph's
    frame the node after the last one with a local had not returned, and its arguments are still
    bound. Nothing is run again: the ops of a live graph narrate as they complete, and a replay would
    repeat their effects.
    """
    frame = _frame_running(gm, exc)
    if frame is None:
        return None
    bound = frame.f_locals
    nodes = list(gm.graph.nodes)
    if not all(n.name in bound for n in nodes if n.op == "placeholder"):
        return None  # not the locals this reading relies on
    done = [i for i, n in enumerate(nodes) if n.op in _CALLS and n.name in bound]
    following = [n for n in nodes[(done[-1] + 1 if done else 0):] if n.op in _CALLS]
    if not following or not all(arg.name in bound for arg in following[0].all_input_nodes):
        return None
    node = following[0]
    values = fx.node.map_arg((node.args, node.kwargs), lambda arg: bound[arg.name])
    tensors = tuple(tensors_of(values))
    return FailedNode(node, tuple(TensorMeta.of(t) for t in tensors), [], tensors=tensors)


def _frame_running(gm: fx.GraphModule, exc: BaseException):
    """The frame of `gm`'s generated forward in the traceback of `exc` (None if it is not there)."""
    code = getattr(type(gm).forward, "__code__", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return tb.tb_frame
        tb = tb.tb_next
    return None


def why_not_replay(gm: fx.GraphModule, exc: BaseException) -> Optional[str]:
    """A reason not to replay this failure, or None when a replay is safe.

    A replay runs the graph again: not after the device faulted (it would fail anywhere) or ran out
    of memory (it would likely run out again), and not when the graph changes its own inputs in
    place (batch-norm statistics in training, a cache), which a replay would change a second time.
    """
    text = str(exc)
    if device_faulted(exc):
        return "the device reported the error and cannot run a replay"
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in text:
        return "the graph ran out of memory; a replay would likely run out again"
    if mutates_inputs(gm):
        return "the graph changes its inputs in place, which a replay would do a second time"
    return None


def mutates_inputs(gm: fx.GraphModule) -> bool:
    """Whether an op of the graph writes into one of its inputs, or into memory of one: through a
    chain of ops that may return their argument's memory (`view`, `getitem`, an in-place op)."""
    for node in gm.graph.nodes:
        written: List[fx.Node] = []
        fx.node.map_arg(node_writes(node), written.append)
        for target in written:
            while target.op != "placeholder" and target.args and isinstance(target.args[0], fx.Node):
                if not (may_return_an_alias(target_name(target)) or node_writes(target)):
                    break
                target = target.args[0]
            if target.op == "placeholder":
                return True
    return False


def replay_caveats(gm: fx.GraphModule, drew: bool) -> List[str]:
    """What may make a replay differ from the failed call: in-place ops, read from the graph, and
    random numbers, when the replay saw an op draw them (`drew`)."""
    caveats = []
    if any(node_writes(node) for node in gm.graph.nodes):
        caveats.append("the graph mutates tensors in place; the replay saw them after any mutation the failed "
                       "call made")
    if drew:
        caveats.append("the graph draws random numbers; the replay drew its own")
    return caveats
