"""Statistics inside compiled graphs: reductions added as graph nodes, returned as one extra output.

For each op that gets statistics, the same vector functions the eager substrate uses
(`torchlens.stats`) are traced into the graph right after the op's node; all vectors are
concatenated into one extra graph output. Inductor fuses the reductions into the kernels that
produce the tensors, and the vector is read to the host once per graph call.

In a graph a sample is not cheaper than the full reduction (it is fused into the producing kernel
either way), so `value_stats="sampled"` measures every element there and says so with `=`.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import fx
from torch.fx.proxy import GraphAppendingTracer

from ..events import StatsGroup
from ..recipes import Recipe, not_applicable, recipe
from ..stats import as_float, value_kind, vector_dtype
from ..tracking import UNINITIALIZED
from .plan import GraphPlan
from .replay import is_in_place, target_name


class Slot(NamedTuple):
    """What the graph's statistics output holds for one plan op: a recipe per tensor output, or
    (`same_as`) the index of an earlier op whose statistics it shares (the same elements)."""

    recipes: Tuple[Recipe, ...] = ()
    same_as: Optional[int] = None


# Per plan op: None (no statistics), else its `Slot`.
Slots = List[Optional[Slot]]


def module_outputs(plan: GraphPlan) -> List[int]:
    """Indices of the ops that end a module call: the last op before the graph leaves a module."""
    chosen = []
    for op, following in zip(plan.ops, plan.ops[1:] + [None]):
        leaving = following is None or following.modules[: len(op.modules)] != op.modules
        if op.modules and leaving:
            chosen.append(op.index)
    return chosen


def add_stats_output(gm: fx.GraphModule, plan: GraphPlan, rung: str, tracking: bool, only=None) -> Slots:
    """Trace statistics nodes into `gm` and append their concatenation to the graph's outputs."""
    graph = gm.graph
    tracer = GraphAppendingTracer(graph)
    nodes = {node.name: node for node in graph.nodes}
    chosen = set(range(len(plan.ops)) if only is None else only)
    slots: Slots = [None] * len(plan.ops)
    vectors, devices = [], []
    measured = {}  # node -> index of its op, for ops measured with one vector of their own
    for op in plan.ops:
        if op.index not in chosen:
            continue
        node, holder = nodes[op.node], nodes[op.value]  # the op, and the node holding its output
        value = holder.meta["example_value"]
        source = _same_elements_as(node, measured)
        if source is not None:
            slots[op.index] = Slot(same_as=source)
            measured[node] = source  # a chain of views shares one measurement
            continue
        if op.op.startswith(UNINITIALIZED):  # `empty` and friends: nothing written to measure yet
            slots[op.index] = Slot((not_applicable("uninitialized", rung),) * len(op.metas))
            continue
        with graph.inserting_before(node.next):
            proxy = fx.Proxy(holder, tracer)
            outputs = [(proxy, value)] if isinstance(value, torch.Tensor) else [
                (proxy[i], t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
            recipes = []
            for output, fake in outputs:
                recipe_, vector = _vector_for(output, fake, rung, tracking)
                recipes.append(recipe_)
                if vector is not None:
                    vectors.append(vector.reshape(-1))
                    devices.append(fake.device)
        slots[op.index] = Slot(tuple(recipes))
        if holder is node and isinstance(value, torch.Tensor) and recipes[0].measures and not recipes[0].padded:
            measured[node] = op.index
    output_node = next(node for node in reversed(graph.nodes) if node.op == "output")
    with graph.inserting_before(output_node):
        if vectors:
            # One vector, on the device most of them are on (a few stray ones, such as a CPU
            # `arange` in a CUDA model, are moved): one read per graph call.
            home = max(set(devices), key=devices.count)
            stacked = torch.cat([v if d == home else v.to(home) for v, d in zip(vectors, devices)])
        else:
            stacked = fx.Proxy(graph.call_function(torch.zeros, (0,)), tracer)
    results = output_node.args[0]
    output_node.args = ((*results, stacked.node) if isinstance(results, (tuple, list)) else (results, stacked.node),)
    gm.recompile()
    return slots


# Ops whose output holds the same elements as their first argument, in another arrangement.
_REARRANGING_METHODS = {"view", "reshape", "transpose", "permute", "t", "contiguous", "flatten", "unsqueeze",
                        "squeeze", "clone", "detach", "view_as", "reshape_as"}
_REARRANGING_FUNCTIONS = {torch.reshape, torch.transpose, torch.permute, torch.t, torch.flatten, torch.unsqueeze,
                          torch.squeeze, torch.clone, torch.detach}


def _same_elements_as(node: fx.Node, measured) -> Optional[int]:
    """The op index whose statistics `node`'s output shares, or None.

    A view, reshape, transpose, `contiguous` or eval-mode dropout of a tensor measured just before
    holds the same elements, so the same statistics: they are read once, not reduced again (about
    half of a transformer's ops). Only when nothing in between may have changed the tensor in place.
    """
    if not node.args or not isinstance(node.args[0], fx.Node) or node.args[0] not in measured:
        return None
    if not (_rearranges(node) or _is_eval_dropout(node)):
        return None
    source = node.args[0]
    value, before = node.meta.get("example_value"), source.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or not isinstance(before, torch.Tensor) or value.dtype != before.dtype:
        return None
    numel, numel_before = value.numel(), before.numel()
    if not isinstance(numel, int) or numel != numel_before:
        return None
    between = source.next
    while between is not node:
        if _may_mutate(between):
            return None
        between = between.next
    return measured[source]


def _rearranges(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _REARRANGING_METHODS
    return node.op == "call_function" and node.target in _REARRANGING_FUNCTIONS


def _is_eval_dropout(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.nn.functional.dropout:
        return False
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return training is False


def _may_mutate(node: fx.Node) -> bool:
    """Whether a node may write into an existing tensor: an in-place op (`replay.is_in_place`),
    `inplace=True`, or an opaque module call."""
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    if node.kwargs.get("inplace") is True or node.op == "call_module":
        return True
    return is_in_place(target_name(node))


def _vector_for(output, fake: torch.Tensor, rung: str, tracking: bool):
    """(recipe, vector proxy or None) for one tensor output (see `torchlens.recipes`)."""
    if fake.layout != torch.strided:
        return not_applicable(str(fake.layout).replace("torch.", ""), rung), None
    kind = value_kind(fake.dtype)
    if kind is None:
        return not_applicable(str(fake.dtype).replace("torch.", ""), rung), None
    numel = fake.numel()
    if isinstance(numel, int) and numel == 0:
        return not_applicable("empty", rung), None
    chosen = recipe(kind, rung, tracking, numel_known=isinstance(numel, int), in_graph=True)
    if not chosen.measures:
        return chosen, None
    dtype = vector_dtype(fake.device)
    values = output if kind == "bool" else output.to(dtype) if kind == "int" else as_float(output, fake.dtype)
    return chosen, chosen.build(values, dtype, numel, fake.dim())


def read_stats(slots: Slots, values: Sequence[float], tracking: bool, numels) -> List:
    """Turn one graph call's statistics (read to the host) into a `Stats`, a `StatsGroup` or
    None per plan op; `numels[i]` are the element counts of op i's outputs in this call."""
    position = 0
    result = []
    for slot, counts in zip(slots, numels):
        if slot is None:
            result.append(None)
            continue
        if slot.same_as is not None:
            result.append(result[slot.same_as])  # the same elements, read once
            continue
        parts = []
        for recipe_, numel in zip(slot.recipes, counts):
            stats = recipe_.stats(numel)
            if recipe_.measures:
                recipe_.read(stats, values[position:position + recipe_.size], tracking)
                position += recipe_.size
            parts.append(stats)
        result.append(parts[0] if len(parts) == 1 else StatsGroup(parts))
    return result
