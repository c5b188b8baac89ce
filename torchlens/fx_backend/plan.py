"""The narration plan: what a compiled graph will narrate, read from FX node metadata at compile time.

Dynamo records, for every node, the value it produced on fake tensors (`example_value`), the module
stack it ran under (`nn_module_stack`), and the user's traceback (`stack_trace`). That is enough to
know, before the graph ever runs, every op line it will produce: its op name, module, shapes (or
symbolic shapes), dtype, device and site. At run time only the ordinals (which depend on what ran
before the graph) and, with dynamic shapes, the concrete sizes are filled in.

Nodes whose value is not a tensor (`size()`, `item`, SymInt arithmetic, `_assert_scalar`) are not
ops; `getitem` on a tuple-valued node only unpacks a multi-output op that eager narration shows as
one line, so it is not an op either.
"""

from __future__ import annotations

import functools
import operator
from typing import Dict, List, Optional, Set, Tuple, cast

import torch
from torch import fx

from ..core.collectives import graph_label, is_wait
from ..core.naming import USER_SPELLING, node_name
from ..core.scopes import ScopeTable
from ..core.sites import site_from_stack_trace
from ..events import Scope, TensorMeta
from ..measure.memory import memory_span, node_writes, storage_key, tensors_of
from ..measure.provenance import carried_kinds, origin_chain
from ..torch_internals.node_meta import example_value, module_stack, stack_trace
from .module_stack import relative_stack
from .shapes import ShapeResolver, maybe_resolver, symbolic_shape

__all__ = ["GraphPlan", "build_plan", "node_op_name", "numel_of"]


class PlanOp:
    """One op line of a graph: everything static about it."""

    __slots__ = ("index", "node", "op", "modules", "metas", "site", "exprs", "value", "reads", "label", "lands")

    def __init__(self, index, node, op, modules, metas, site, exprs, value=None, reads=((), 0), label=None,
                 lands=None):
        self.index = index      # position among the graph's ops (0-based)
        self.node = node        # the FX node's name
        self.op = op
        self.modules = modules  # module stack relative to the compiled frame's module
        self.metas = metas      # tuple of TensorMeta; symbolic sizes shown as text (`s0`)
        self.site = site
        self.exprs = exprs      # with dynamic shapes: the output shapes as sympy expressions
        self.value = value or node  # the node holding the op's output: for `y[i] = v`, `y`
        # What the op read, for non-finite tracking: (("op", index) | ("arg", placeholder position)
        # | None for what cannot be told, ...), and the non-finite kinds its scalar arguments carry.
        self.reads = reads
        self.label = label  # a functional collective's group (`group of 2, async`), else None
        # a `wait_tensor`: the index of the collective whose values arrive with it, else None
        self.lands = lands

    def __repr__(self) -> str:
        return f"PlanOp({self.index} {self.op})"


class Segment:
    """The events one call of a graph produced, starting at a given ordinal and module. With
    tracking, a call whose ops were all judged finite: the ids of those ops' events (`judged`),
    and the events of the ops whose outputs the graph returns, by op index (`outputs`). With
    statistics alone, per event the index of the op whose statistics it carries, None for a
    module's enter or exit (`restated`: a later call's events are these with its own statistics)."""

    __slots__ = ("events", "ordinal", "scope", "narration", "judged", "outputs", "restated")

    def __init__(self, events, ordinal, scope, judged=(), outputs=None, restated=()):
        self.events = events
        self.ordinal = ordinal      # the session's ordinal after these events
        self.scope = scope          # the open module after these events
        self.narration = {}         # narrator state before -> (lines, state after)
        self.judged = judged
        self.outputs = outputs
        self.restated = restated


class GraphPlan:
    """The ops of one graph, plus how to resolve their modules and concrete sizes per call.

    `fixed_scope` is the module whose frame was compiled when that is the root (always the same
    module); otherwise it is None and the module is read from the caller at each call, since
    dynamo may reuse the graph for another instance of the same module class.
    """

    MAX_SEGMENTS = 32

    def __init__(self, ops: List[PlanOp], resolver: Optional[ShapeResolver], compiled_in: Scope, outputs=(),
                 written_inputs=()):
        self.ops = ops
        self.outputs = tuple(outputs)  # per graph output: the index of the op that produced it, or None
        # positions of the graph inputs the graph writes into: read after the call, what they hold
        # is not what its ops read (`provenance.Provenance.met_after_writing`)
        self.written_inputs = frozenset(written_inputs)
        self.resolver = resolver
        self.compiled_in = compiled_in  # the module whose frame was compiled (at compile time)
        self.fixed_scope = compiled_in if compiled_in.parent is None else None
        self.by_node = {op.node: op for op in ops}
        dynamic = [op.index for op in ops if op.exprs is not None]
        self.dynamic_position = {index: position for position, index in enumerate(dynamic)}
        self.segments: Dict[tuple, Segment] = {}
        # whether a functional collective (or its wait) is among the ops: its values land elsewhere
        self.exchanges = any(op.label is not None or op.lands is not None for op in ops)
        self._scopes: Dict[Scope, List[Scope]] = {}

    @functools.cached_property
    def static_numels(self) -> List[Tuple[Optional[int], ...]]:
        """The element counts of each op's outputs, for a graph of static sizes (every call's)."""
        return [tuple(numel_of(meta.shape) for meta in op.metas) for op in self.ops]

    def op_scopes(self, table: ScopeTable, frame_scope: Scope) -> List[Scope]:
        """The scope of each op when the graph runs in `frame_scope` (memoised)."""
        scopes = self._scopes.get(frame_scope)
        if scopes is None:
            scopes = self._scopes[frame_scope] = [table.resolve(frame_scope, op.modules) for op in self.ops]
        return scopes

    def remember(self, key, events, ordinal, scope, judged=(), outputs=None, restated=()) -> None:
        if len(self.segments) >= self.MAX_SEGMENTS:
            self.segments.clear()
        self.segments[key] = Segment(events, ordinal, scope, judged, outputs, restated)


def numel_of(shape) -> Optional[int]:
    """Element count of a concrete shape (None when a size is only known symbolically)."""
    count = 1
    for size in shape:
        if not isinstance(size, int):
            return None
        count *= size
    return count


def node_op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    """The op name a node is narrated under (the eager substrate's vocabulary)."""
    spelled = node.meta.get(USER_SPELLING)
    if spelled is not None:
        return spelled
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__.lower()  # (a module's target is its path)
    return node_name(node.target, node.args, node.op)


def _is_unpacking(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source = node.args[0]
    return isinstance(source, fx.Node) and isinstance(example_value(source), (tuple, list))


def _shape_exprs(tensor) -> Tuple:
    """A fake tensor's sizes as ints, or sympy expressions where they are symbolic."""
    shape = []
    for size in tensor.shape:
        if isinstance(size, torch.SymInt):
            expr = size.node.expr
            shape.append(int(expr) if expr.is_number else expr)
        else:
            shape.append(int(size))
    return tuple(shape)


def _written_node(node: fx.Node) -> Optional[fx.Node]:
    """The tensor node an op that returns nothing wrote into (`y[i] = v`), else None."""
    if example_value(node) is not None:
        return None
    return next((written for written in node_writes(node) if isinstance(written, fx.Node)), None)


def build_plan(gm: fx.GraphModule, scopes: ScopeTable, frame_scope: Scope) -> GraphPlan:
    """The op lines a graph narrates, in node order; `frame_scope`: the compiled frame's module."""
    ops: List[PlanOp] = []
    sources = _Sources(gm)
    collectives: Dict[fx.Node, int] = {}  # a functional collective's node -> its op's index
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        written = _written_node(node)
        holder = written if written is not None else node
        tensors = tensors_of(example_value(holder))
        if not tensors or _is_unpacking(node):
            continue
        shapes = tuple(_shape_exprs(t) for t in tensors)
        dynamic = any(not isinstance(size, int) for shape in shapes for size in shape)
        metas = tuple(TensorMeta(symbolic_shape(shape), t.dtype, t.device) for shape, t in zip(shapes, tensors))
        ops.append(
            PlanOp(
                index=len(ops),
                node=node.name,
                op=node_op_name(node, gm),
                modules=relative_stack(scopes, module_stack(node), frame_scope.path),
                metas=metas,
                site=site_from_stack_trace(stack_trace(node)),
                exprs=shapes if dynamic else None,
                value=holder.name,
                reads=sources.reads(node),
                label=graph_label(node.target, node.args, node.kwargs),
                lands=_waited_collective(node, collectives),
            )
        )
        if ops[-1].label is not None and len(tensors) == 1:
            collectives[node] = len(ops) - 1
        sources.produced(node, len(ops) - 1, written)
    resolver = maybe_resolver([op.exprs for op in ops if op.exprs is not None], gm)
    return GraphPlan(ops, resolver, frame_scope, sources.outputs(gm), sources.written_inputs)


def _waited_collective(node: fx.Node, collectives: Dict[fx.Node, int]) -> Optional[int]:
    """The index of the collective a `wait_tensor` node waits for (its values arrive with the wait)."""
    if node.op != "call_function" or not is_wait(node.target) or not node.args:
        return None
    source = node.args[0]
    return collectives.get(source) if isinstance(source, fx.Node) else None


class _Sources:
    """Where each tensor a node reads comes from, at compile time: the plan op that produced it
    (or last wrote into its memory: views share a storage), or the graph input it is."""

    def __init__(self, gm: fx.GraphModule):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._args = {n: position for position, n in enumerate(placeholders)}
        self._input_memory: Dict[object, List[int]] = {}  # storage key -> positions of the graph inputs that hold it
        for node, position in self._args.items():
            memory = _storage(node)
            if memory is not None:
                self._input_memory.setdefault(memory[0], []).append(position)
        self._producer: Dict[fx.Node, int] = {}
        self._writers: Dict[object, List[Tuple[int, object]]] = {}  # storage key -> (op index, span written)
        self.written_inputs: Set[int] = set()  # positions of the graph inputs the graph writes into

    def produced(self, node: fx.Node, index: int, written: Optional[fx.Node]) -> None:
        """Op `index` produced `node`'s value and wrote the arguments `memory.node_writes` names (or
        `written`, the tensor an op that returns nothing wrote)."""
        self._producer[node] = index
        targets: List[fx.Node] = [written] if written is not None else []
        fx.node.map_arg(node_writes(node), lambda target: None if target is written else targets.append(target))
        for target in targets:
            memory = _storage(target)
            if memory is not None:
                self._writers.setdefault(memory[0], []).append((index, memory[1]))
                self.written_inputs.update(self._input_memory.get(memory[0], ()))

    def origin(self, node: fx.Node) -> tuple:
        """What `node`'s value comes from: its producer, then the writes into its memory since,
        from the last write that covered all of it on (`provenance.origin_chain`, as eager tracking)."""
        if _is_unpacking(node):
            node = cast(fx.Node, node.args[0])  # (what `_is_unpacking` found a Node)
        if node in self._producer:
            first = ("op", self._producer[node])
        elif node in self._args:
            first = ("arg", self._args[node])
        else:
            first = None
        after = first[1] if first is not None and first[0] == "op" else -1
        memory = _storage(node)
        if memory is None:
            return (first,)
        writes = [(("op", index), index, span) for index, span in self._writers.get(memory[0], ())]
        return origin_chain(first, writes, after, memory[1])

    def reads(self, node: fx.Node) -> tuple:
        refs: list = []
        for value in (*node.args, *node.kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, fx.Node) and isinstance(example_value(item), torch.Tensor):
                    refs.extend(self.origin(item))
                elif isinstance(item, fx.Node) and _is_unpacking(item):
                    refs.extend(self.origin(item))
        return tuple(refs), carried_kinds(node.args, node.kwargs)

    def outputs(self, gm: fx.GraphModule) -> List[Optional[int]]:
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        results = output.args[0]
        results = results if isinstance(results, (tuple, list)) else (results,)
        found = []
        for result in results:
            ops = [o[1] for o in self.origin(result) if o is not None and o[0] == "op"] if isinstance(
                result, fx.Node) else []
            found.append(ops[-1] if ops else None)  # the last write holds what the output holds
        return found


def _storage(node: fx.Node):
    """(storage key, element span or None) of a node's fake value: views share the storage."""
    value = example_value(node)
    key = storage_key(value) if isinstance(value, torch.Tensor) else None
    return None if key is None else (key, memory_span(value))
