"""The first backward of each of two traces, node by node: their gradients compared.

Kept backwards (`tl.trace(..., backward=True)`) are aligned as forwards are (`align`), their
leaves' accumulators by the leaf's name, and compared as forward ops are (`diff`).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..events import Event
from .align import align_on, full_key, name_key
from .diff import Tolerance, compare_pairs
from .report import CompareReport

__all__ = ["compare_gradients"]


def compare_gradients(trace_a, trace_b, rtol: Optional[float], atol: Optional[float],
                      floor: Tuple[float, float]) -> Optional[CompareReport]:
    """The first backward of each trace, node by node, when both kept their gradients.

    Nodes are aligned in the order they ran on the module of their forward op and the node's name;
    leaves' accumulators are paired by the leaf's name, wherever they ran (a compiled graph's
    backward is one node, and accumulates its parameters in an order of its own). Rows follow
    trace_b's backward; the first divergence is the one nearest the loss, where the two backwards
    first part. Gradients are held to the tolerance the forwards ended with: the rounding a lower
    precision brought into the forward travels into every gradient (`floor`).
    """
    backward_a, backward_b = _kept_backward(trace_a), _kept_backward(trace_b)
    if backward_a is None or backward_b is None:
        return None
    tolerance = Tolerance(rtol, atol, floor)
    nodes_a = [e for e in backward_a.nodes if not e.label]
    nodes_b = [e for e in backward_b.nodes if not e.label]
    leaves_a, leaves_b = _leaves(backward_a), _leaves(backward_b)
    pairs = align_on(nodes_a, nodes_b, (full_key, name_key))
    pairs += [(leaves_a.get(key), leaves_b.get(key)) for key in {**leaves_a, **leaves_b}]
    rows = compare_pairs(sorted(pairs, key=_backward_position), backward_a.values, backward_b.values, tolerance,
                         lambda event: f"{event.op} {event.label}" if event.label else event.op)
    return CompareReport(rows, tag="~")


def _backward_position(pair) -> tuple:
    """Where a pair sits in trace_b's backward (a node only in a sits at its own position in a)."""
    a, b = pair
    return (b.ordinal, 0) if b is not None else (a.ordinal, 1)


def _leaves(backward) -> dict:
    """(label, occurrence) -> the accumulator's event: leaves of the same name (unnamed tensors)
    pair in the order they ran, none dropped."""
    leaves: Dict[Tuple[str, int], Event] = {}
    seen: Dict[str, int] = {}
    for event in backward.nodes:
        if event.label:
            seen[event.label] = seen.get(event.label, 0) + 1
            leaves[(event.label, seen[event.label])] = event
    return leaves


def _kept_backward(trace):
    backwards = getattr(trace, "backward", None) or ()
    return next((b for b in backwards if b.values is not None), None)
