"""Keeping op values in compiled graphs (`tl.trace(..., compiled=True)`): each op's output becomes an
extra graph output.

Returning a value forces inductor to materialise it, which can change what it fuses and so move a
result by an ulp; that is the price of seeing compiled numerics op by op, and `tl.debug.compare`
tolerances are far wider than that.
"""

from __future__ import annotations

import operator
from typing import List

import torch
from torch import fx

from .plan import GraphPlan


def add_value_outputs(gm: fx.GraphModule, plan: GraphPlan) -> List[int]:
    """Append every plan op's tensor outputs to the graph's outputs; return how many per op."""
    graph = gm.graph
    nodes = {node.name: node for node in graph.nodes}
    output_node = next(node for node in reversed(graph.nodes) if node.op == "output")
    kept, counts = [], []
    with graph.inserting_before(output_node):
        for op in plan.ops:
            node = nodes[op.node]
            value = node.meta["example_value"]
            if isinstance(value, torch.Tensor):
                outputs = [node]
            else:
                outputs = [graph.call_function(operator.getitem, (node, i))
                           for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
            kept.extend(outputs)
            counts.append(len(outputs))
    results = output_node.args[0]
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    output_node.args = (results + tuple(kept),)
    gm.recompile()
    return counts


def split_values(flat, counts: List[int]) -> List[tuple]:
    """The kept outputs of one graph call, grouped per plan op."""
    grouped, start = [], 0
    for count in counts:
        grouped.append(tuple(flat[start:start + count]))
        start += count
    return grouped
