"""Which calls write into their arguments (`torchlens.writes`): one rule read from torch's operator
schemas and Python's in-place operators, asked by the eager capture, tracking, the compiled plan,
the statistics pass and the failure replay alike."""

from __future__ import annotations

import pytest
import torch

from torchlens import writes


@pytest.mark.parametrize("name", ["add_", "relu_", "copy_", "index_put_", "masked_fill_", "uniform_", "zero_",
                                  "_foreach_add_", "requires_grad_", "iadd", "__iadd__", "imatmul", "ior", "setitem",
                                  "__setitem__"])
def test_calls_that_write_an_argument(name):
    assert writes.writes_an_argument(name)


@pytest.mark.parametrize("name", ["add", "relu", "contiguous", "to", "view", "sort", "append", "invert", "__invert__",
                                  "index", "__index__", "linear", "masked_fill", "batch_norm", "clone"])
def test_calls_that_do_not(name):
    """Out-of-place ops, calls that return their argument unchanged (`contiguous`, `to`), list
    methods whose schemas write the list (`sort`, `append`), and operators that merely begin with
    an i (`invert`, `index`)."""
    assert not writes.writes_an_argument(name)


def test_the_call_flags_count():
    x = torch.zeros(2)
    assert writes.call_writes("relu", (x,), {"inplace": True})
    assert writes.call_writes("add", (x, x), {"out": x})
    assert not writes.call_writes("relu", (x,), {"inplace": False})
    assert not writes.call_writes("add", (x, x), {"out": None})


def test_a_graph_nodes_writes_are_read_from_its_target():
    seen = []

    def backend(gm, example_inputs):
        seen.append([(writes.target_name(node), writes.node_writes(node)) for node in gm.graph.nodes
                     if node.op in ("call_function", "call_method")])
        return gm

    def f(x, mask):
        y = x.clone()
        y[mask] = 0.0
        y += 1
        return torch.relu_(y) * (~mask), torch.ops.aten.add_.Tensor(y, x)

    torch._dynamo.reset()
    torch.compile(f, backend=backend)(torch.randn(4), torch.tensor([True, False, True, False]))
    [found] = seen
    written = sorted(name for name, w in found if w)
    assert written == ["add_.Tensor", "iadd", "relu_", "setitem"], found  # (an operator by its own schema)


def test_nothing_returning_writers_name_the_tensor_they_wrote():
    x = torch.zeros(3)
    assert writes.written_tensor("__setitem__", (x, 0, 1.0), {}) is x
    pair = [torch.zeros(2), torch.zeros(2)]
    assert writes.written_tensor("_foreach_add_", (pair, 1.0), {}) == tuple(pair)
    assert writes.written_tensor("add_", (x, 1.0), {}) is None  # it returns what it wrote
