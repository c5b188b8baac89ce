"""One rule for "do these two tensors address the same elements?" (`torchlens.measure.memory`): the eager
meter and the compiled statistics pass share a view's statistics in exactly the same cases, so a
view measured in one substrate is not reduced again in the other, and a copy is measured in both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchlens.fx_backend import stats_pass
from torchlens.measure import memory

# (name, what the op does to a [2, 3, 24] tensor, whether it addresses the same elements)
OPS = [
    ("view", lambda y: y.view(6, 24), True),
    ("transpose", lambda y: y.transpose(0, 1), True),
    ("permute", lambda y: y.permute(2, 0, 1), True),
    ("contiguous of a contiguous tensor", lambda y: y.contiguous(), True),
    ("reshape", lambda y: y.reshape(2, 72), True),
    ("unsqueeze", lambda y: y.unsqueeze(0), True),
    ("flatten", lambda y: y.flatten(), True),
    ("eval-mode dropout", lambda y: nn.functional.dropout(y, 0.1, training=False), True),
    ("a split part", lambda y: y.split(8, dim=-1)[1], False),
    ("a narrowed slice", lambda y: y[:, :, :8], False),
    ("clone", lambda y: y.clone(), False),
    ("contiguous of a transpose", lambda y: y.transpose(1, 2).contiguous(), False),
    ("another dtype", lambda y: y.double(), False),
    ("an expand", lambda y: y[:, :1].expand(2, 3, 24), False),
    ("an in-place op", lambda y: y.relu_(), False),  # the same memory, other values
    ("relu(inplace=True)", lambda y: nn.functional.relu(y, inplace=True), False),
]


def _eager(op):
    y = torch.randn(2, 3, 24)
    theirs = memory.elements_identity(y)  # as it was measured, before the op
    mine = memory.elements_identity(op(y))
    return mine is not None and theirs is not None and mine[1] == theirs[1]


class _Graph(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x * 2)


def _compiled(op):
    """Whether the statistics pass shares the last node's output with its argument's, measured just before."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(_Graph(op).eval(), backend=backend)(torch.randn(2, 3, 24))
    [gm] = seen
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    node = nodes[-1]
    return stats_pass._same_elements_as(node, {node.args[0]: 0}) == 0


@pytest.mark.parametrize("name, op, same", OPS, ids=[o[0] for o in OPS])
def test_eager_and_compiled_share_statistics_in_the_same_cases(name, op, same):
    assert _eager(op) is same
    assert _compiled(op) is same


def test_a_write_in_between_stops_the_sharing_in_both():
    y = torch.randn(2, 3, 24)
    before = memory.elements_identity(y)[1]
    view = y.view(6, 24)
    y.add_(1)
    assert memory.elements_identity(view)[1] != before

    def op(y):
        y.add_(1)
        return y.view(6, 24)

    assert _compiled(op) is False
