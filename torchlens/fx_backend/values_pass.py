"""Keeping op values in compiled graphs (`tl.trace(..., compiled=True)`): each op's output becomes an
extra graph output.

Each value is copied right after its op (so later in-place ops of the graph do not change it) and
returned; this forces inductor to materialise it, which can change what it fuses and so move a
result by an ulp — the price of seeing compiled numerics op by op, far inside `tl.debug.compare`'s
tolerances.
"""

from __future__ import annotations

import operator
from typing import List

import torch
from torch import fx

from ..torch_internals.node_meta import example_value
from .plan import GraphPlan

__all__ = ["add_value_outputs", "append_outputs", "split_values"]


def add_value_outputs(gm: fx.GraphModule, plan: GraphPlan) -> List[int]:
    """Append every plan op's tensor outputs to the graph's outputs; return how many per op."""
    graph = gm.graph
    nodes = {node.name: node for node in graph.nodes}
    kept, counts = [], []
    for op in plan.ops:
        node, holder = nodes[op.node], nodes[op.value]  # the op, and the node holding its output
        value = example_value(holder)
        # A copy taken right after the op: a later in-place op of the graph (`x += y`) must not
        # change what is kept, as the eager trace's copies are taken at op time too.
        with graph.inserting_before(node.next):
            if isinstance(value, torch.Tensor):
                outputs = [graph.call_function(torch.clone, (holder,))]
            else:
                outputs = [graph.call_function(torch.clone, (graph.call_function(operator.getitem, (holder, i)),))
                           for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
        kept.extend(outputs)
        counts.append(len(outputs))
    append_outputs(gm, kept)
    return counts


def append_outputs(gm: fx.GraphModule, extra) -> None:
    """Add the nodes `extra` after the graph's own outputs (which become a tuple if they were not)."""
    output_node = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    results = output_node.args[0]
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    output_node.args = (results + tuple(extra),)
    gm.recompile()


def split_values(flat, counts: List[int]) -> List[tuple]:
    """The kept outputs of one graph call, grouped per plan op."""
    grouped, start = [], 0
    for count in counts:
        grouped.append(tuple(flat[start:start + count]))
        start += count
    return grouped
