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

from ..events import TensorMeta

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
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):  # the user's generators are untouched
        try:
            locator.run(*args)
        except Exception:
            node = locator.current
            inputs = tuple(TensorMeta.of(t) for t in locator.current_inputs)
            return Located(node, inputs, caveats)
    return Located(None, (), caveats + ["the replay ran without error, so the failing op is unknown"])


def why_not_replay(gm: fx.GraphModule, exc: BaseException) -> Optional[str]:
    """A reason not to replay this failure, or None when a replay is safe.

    A replay runs the graph again: not after the device faulted (it would fail anywhere) or ran out
    of memory (it would likely run out again), and not when the graph changes its own inputs in
    place (batch-norm statistics in training, a cache), which a replay would change a second time.
    """
    text = str(exc)
    if "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text:
        return "the device reported the error and cannot run a replay"
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in text:
        return "the graph ran out of memory; a replay would likely run out again"
    if mutates_inputs(gm):
        return "the graph changes its inputs in place, which a replay would do a second time"
    return None


def mutates_inputs(gm: fx.GraphModule) -> bool:
    """Whether an in-place op of the graph writes into one of its inputs (or a view of one)."""
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and is_in_place(target_name(node)) and node.args:
            target = node.args[0]
            while isinstance(target, fx.Node) and target.op != "placeholder" and target.args:
                name = target_name(target)
                if not (_is_view(name) or is_in_place(name)):  # an in-place op returns its first argument
                    break
                target = target.args[0]
            if isinstance(target, fx.Node) and target.op == "placeholder":
                return True
    return False


_VIEWS = ("view", "reshape", "transpose", "permute", "expand", "squeeze", "unsqueeze", "getitem", "narrow",
          "select", "as_strided", "t", "flatten", "unflatten", "detach", "contiguous")


def _is_view(name: str) -> bool:
    return name in _VIEWS


_IN_PLACE_OPERATORS = {"i" + name for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                                                 "xor", "lshift", "rshift", "matmul")}


def is_in_place(name: str) -> bool:
    """Whether a graph node's target (by `target_name`) writes into its first argument: `relu_`,
    `setitem`, `operator.iadd` (how dynamo records `x += y`), `__iadd__`."""
    return ((name.endswith("_") and not name.endswith("__")) or name == "setitem" or name.startswith("__i")
            or name in _IN_PLACE_OPERATORS)


def replay_caveats(gm: fx.GraphModule) -> List[str]:
    """What may make a replay differ from the failed call, read from the graph."""
    caveats = []
    names = [target_name(node) for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    if any(is_in_place(name) for name in names):
        caveats.append("the graph mutates tensors in place; the replay saw them after any mutation the failed call made")
    if any(name.startswith(_RANDOM_OPS) for name in names):
        caveats.append("the graph draws random numbers; the replay drew its own")
    return caveats


def target_name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))
