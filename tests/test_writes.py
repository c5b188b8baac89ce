"""Which arguments a call writes into (`torchlens.measure.writes`, listed in `torchlens.measure.memory`): one rule
read from torch's operator schemas, Python's in-place operators and the call's flags, asked by the
eager capture, tracking, the compiled plan, the statistics pass, the failure replay and the
collectives alike, for a call and for a graph node."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchlens.measure import writes


@pytest.mark.parametrize("name", ["add_", "relu_", "copy_", "index_put_", "masked_fill_", "uniform_", "zero_",
                                  "_foreach_add_", "requires_grad_", "iadd", "__iadd__", "imatmul", "ior", "setitem",
                                  "__setitem__"])
def test_calls_that_write_an_argument(name):
    x = torch.zeros(2)
    assert writes.call_writes(name, (x, 1.0)) == (x,)


@pytest.mark.parametrize("name", ["add", "relu", "contiguous", "to", "view", "sort", "append", "invert", "__invert__",
                                  "index", "__index__", "linear", "masked_fill", "batch_norm", "clone"])
def test_calls_that_do_not(name):
    """Out-of-place ops, calls that return their argument unchanged (`contiguous`, `to`), list
    methods whose schemas write the list (`sort`, `append`), and operators that merely begin with
    an i (`invert`, `index`)."""
    assert writes.call_writes(name, (torch.zeros(2), 1.0)) == ()


def test_the_call_flags_count():
    x, y = torch.zeros(2), torch.zeros(2)
    assert writes.call_writes("relu", (x,), {"inplace": True}) == (x,)
    assert writes.call_writes("add", (x, x), {"out": y}) == (y,)  # the `out=`, not the input
    assert writes.call_writes("relu", (x,), {"inplace": False}) == ()
    assert writes.call_writes("add", (x, x), {"out": None}) == ()


def test_flags_passed_positionally_are_named_by_the_functions_signature():
    """A graph records `F.relu(x, True)` as written; torch hands a function mode `inplace=True`:
    given the function, both are the same write."""
    x, mean, var = torch.zeros(2), torch.zeros(2), torch.ones(2)
    assert writes.call_writes("relu", (x, True), None, F.relu) == (x,)
    assert writes.call_writes("relu", (x,), {"inplace": True}, F.relu) == (x,)
    assert writes.call_writes("relu", (x, False), None, F.relu) == ()
    training = (x.view(1, 2), mean, var, None, None, True)
    assert writes.call_writes("batch_norm", training, None, F.batch_norm) == (mean, var)
    assert writes.call_writes("batch_norm", training[:5] + (False,), None, F.batch_norm) == ()


def test_an_operator_names_the_arguments_its_schema_writes():
    x, y = torch.zeros(2), torch.zeros(2)
    assert writes.call_writes("add_.Tensor", (x, y), None, torch.ops.aten.add_.Tensor) == (x,)
    assert writes.call_writes("copy_", (x, y)) == (x,)
    pair = [x, y]
    assert writes.call_writes("_foreach_add_", (pair, 1.0)) == (pair,)


def test_a_graph_nodes_writes_are_read_from_its_target():
    seen = []

    def backend(gm, example_inputs):
        seen.append([(writes.target_name(node), bool(writes.node_writes(node))) for node in gm.graph.nodes
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
