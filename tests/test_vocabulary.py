"""One vocabulary in both substrates: a compiled transcript names each op as the eager one does.

Dynamo writes `x // 2` as `operator.floordiv`, `1 - x` as `operator.sub(1, x)`, `x.T` as
`getattr(x, "T")`, `x.new_tensor(d)` as `torch.tensor(d, ...)`; eager narration is handed
`Tensor.__floordiv__`, `Tensor.__rsub__`, the getter of `T`, `Tensor.new_tensor`. The cases below
are derived from torch's tables where they can be (every Python operator `Tensor` implements, in
its plain, reflected and in-place forms) and cover a broad set of tensor methods and functions.
"""

import operator
import sys

import pytest
import torch
from torch import nn

import torchlens as tl


def op_names(recording):
    return [event.op for event in recording.events if event.kind == tl.EventKind.OP]


class Calls(nn.Module):
    """Runs each case on the input, in order, and returns every result."""

    def __init__(self, cases):
        super().__init__()
        self.cases = list(cases)

    def forward(self, x):
        return [case(x) for case in self.cases]


def _eager_and_compiled(cases, x, **options):
    model = Calls(cases)
    eager = op_names(tl.record(model, x))
    torch._dynamo.reset()
    compiled = op_names(tl.trace(model, x, compiled={"compiler": "eager", **options}))
    return eager, compiled


def _operator_cases():
    """Every binary operator of the `operator` module that `Tensor` implements as a dunder, as
    plain `x op y`, reflected `2 op x` and in-place `x op= y`, on a dtype where torch accepts it."""
    cases = []
    for name in operator.__all__:
        core = name.rstrip("_")
        if name.startswith("i") or core in ("getitem", "setitem", "delitem", "contains", "concat", "index"):
            continue
        if not hasattr(torch.Tensor, f"__{core}__"):
            continue
        function = getattr(operator, name)
        inplace = getattr(operator, f"i{core}", None)
        for dtype in (torch.float32, torch.int64, torch.bool):
            sample = torch.ones(4, 4, dtype=dtype)
            try:
                function(sample, sample)
            except Exception:
                continue
            forms = [(f"x {name} y", lambda x, f=function, d=dtype: f(x.to(d), x.to(d)))]
            scalar = True if dtype == torch.bool else 2
            if _works(function, scalar, sample):
                forms.append((f"2 {name} x", lambda x, f=function, d=dtype, s=scalar: f(s, x.to(d))))
            if inplace is not None and hasattr(torch.Tensor, f"__i{core}__"):
                forms.append((f"x {name}= y", lambda x, f=inplace, d=dtype: f(x.to(d).clone(), x.to(d))))
            cases.extend(forms)
            break
    return cases


def _works(function, *args) -> bool:
    try:
        function(*args)
        return True
    except Exception:
        return False


def test_the_operator_table_covers_the_operators_users_write():
    written = {label.split()[1] for label, _ in _operator_cases()}
    assert {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor",
            "lshift", "rshift", "lt", "eq", "ne"} <= written


@pytest.mark.parametrize("unary", [False, True], ids=["binary", "unary"])
def test_every_python_operator_on_a_tensor_has_one_name_eager_and_compiled(unary):
    x = torch.rand(4, 4) + 1
    if unary:
        cases = [operator.neg, operator.pos, operator.abs, lambda x: operator.invert(x > 1.5)]
    else:
        cases = [case for _, case in _operator_cases()]
    eager, compiled = _eager_and_compiled(cases, x)
    assert compiled == eager
    if not unary:
        assert "floordiv" in eager and "rsub" not in compiled and "floor_divide" not in compiled


METHODS = [
    lambda x: x.T * 2, lambda x: x.mT + 1, lambda x: x.real + 1, lambda x: x.data + 1,
    lambda x: x + x.new_tensor([1.0] * 6), lambda x: x.new_zeros(3), lambda x: x.view(24),
    lambda x: x.reshape(2, 12), lambda x: x.view(x.size(0), -1), lambda x: x.float() + 1,
    lambda x: x.to(torch.float64), lambda x: x.type_as(x.double()), lambda x: x.t().contiguous(),
    lambda x: x.chunk(2)[0] + 1, lambda x: x.split(2)[1] * 2, lambda x: x.unbind(0)[0],
    lambda x: x.softmax(-1), lambda x: nn.functional.softmax(x, -1), lambda x: x.detach(),
    lambda x: x.masked_fill(x > 0, 0.0), lambda x: torch.where(x > 0, x, 0.0),
    lambda x: x.max(dim=-1).values, lambda x: torch.topk(x, 2).indices, lambda x: torch.cat([x, x]),
    lambda x: torch.stack([x, x]), lambda x: torch.einsum("ij,kj->ik", x, x), lambda x: x + torch.arange(6),
    lambda x: torch.zeros_like(x), lambda x: x + torch.full((6,), 2.0), lambda x: x + torch.tensor(2.0),
    lambda x: x.mean(), lambda x: x.sum(dim=1, keepdim=True), lambda x: x[:, :1].expand(4, 6),
    lambda x: x.permute(1, 0), lambda x: x.transpose(0, 1), lambda x: x.unsqueeze(0), lambda x: x.flatten(),
    lambda x: x.repeat(2, 1), lambda x: x.clamp(min=0), lambda x: (x.abs() + 1).rsqrt(), lambda x: x.long(),
    lambda x: x[0], lambda x: x[:, 1:3], lambda x: x[len(x) - 1], lambda x: x.view(-1, x.dim()),
    lambda x: nn.functional.linear(x, x), lambda x: nn.functional.gelu(x), lambda x: torch.tril(x),
    lambda x: torch.ones(6, 6).triu(1) @ x.T, lambda x: x.sum(-1).argmax(), lambda x: 1 / (x + 10),
]


def test_tensor_methods_attributes_and_functions_have_one_name_eager_and_compiled():
    eager, compiled = _eager_and_compiled(METHODS, torch.randn(4, 6))
    assert compiled == eager
    assert {"T", "mT", "real", "data", "new_tensor"} <= set(eager)


def test_returning_a_view_of_an_input_is_one_op_compiled_as_eagerly():
    """Dynamo re-derives an output that is a view of an input (`return x.T`) after the graph:
    its own work, not an op run between graphs."""

    class Transpose(nn.Module):
        def forward(self, x):
            return x.T

    x = torch.randn(4, 6)
    torch._dynamo.reset()
    trace = tl.trace(Transpose(), x, compiled={"compiler": "eager"}, narrate=True)
    assert op_names(trace) == ["T"]
    assert "between graphs" not in trace.narrate()


def test_compiled_graphs_are_plain_torch_compile_graphs():
    """The graph dynamo hands the compiler under torchlens is the one plain torch.compile makes."""
    graphs = {}

    def keeping(name):
        def compiler(gm, example_inputs):
            graphs.setdefault(name, []).append(gm.code)
            return gm
        return compiler

    def forward(x):
        return (x // 2 + (1 - x)).T @ x + 3 % (x.abs() + 1)

    class Model(nn.Module):
        def forward(self, x):
            return forward(x)

    x = torch.randn(4, 4)
    torch._dynamo.reset()
    torch.compile(Model(), backend=keeping("plain"))(x)
    torch._dynamo.reset()
    tl.compile(Model(), compiler=keeping("torchlens"))(x)
    torch._dynamo.reset()
    tl.record(nn.Sequential(torch.compile(Model(), backend=keeping("inside"))), x)  # inside an eager capture
    assert graphs["torchlens"] == graphs["plain"] == graphs["inside"]
    assert "floordiv" in graphs["plain"][0] and "floor_divide" not in graphs["plain"][0]


def test_dynamo_errors_read_as_under_plain_torch_compile():
    class BadView(nn.Module):
        def forward(self, x):
            return x.view(5, 7)

    messages = []
    for make in (lambda m: torch.compile(m, backend="eager"), lambda m: tl.compile(m, compiler="eager")):
        torch._dynamo.reset()
        with pytest.raises(Exception) as caught:
            make(BadView())(torch.randn(3))
        messages.append((type(caught.value), str(caught.value)))
    assert messages[0] == messages[1]
    assert "torchlens" not in messages[1][1]


def test_a_torch_whose_tracer_is_shaped_otherwise_still_compiles(monkeypatch):
    """The hooks into dynamo's tracer fit one torch's internals; on another they must step aside,
    never raise (torch 2.14 renamed the attribute hook `record_user_spellings` wraps, and raising
    there failed every compile through the backend)."""
    from torch._dynamo import output_graph
    from torch._dynamo.variables import tensor as tensor_variables

    from torchlens.core import compiled_regions
    from torchlens.fx_backend import dynamo_seams

    class Reshaped:  # a tracer class with none of the methods the hooks wrap
        pass

    monkeypatch.setattr(tensor_variables, "TensorVariable", Reshaped)
    monkeypatch.setattr(dynamo_seams, "_spellings_recorded", False)
    dynamo_seams.record_user_spellings()  # installs nothing, raises nothing
    assert Reshaped.__dict__.get("call_method") is None and Reshaped.__dict__.get("var_getattr") is None

    installed = output_graph.OutputGraph.call_user_compiler
    monkeypatch.setattr(compiled_regions, "_installed", False)
    monkeypatch.setitem(sys.modules, "torch._dynamo.variables.torch_function", Reshaped)
    compiled_regions.install_for_dynamo()  # the mode filter does not fit: left out, nothing raised
    assert output_graph.OutputGraph.call_user_compiler is installed  # the graph rule is not stacked twice
    monkeypatch.undo()

    class Doubles(nn.Module):
        def forward(self, x):
            return x // 2

    torch._dynamo.reset()
    trace = tl.trace(Doubles(), torch.randn(3), compiled={"compiler": "eager"})
    assert op_names(trace) == ["floordiv"]


def test_matrix_product_assignment_is_named_as_eager_names_it():
    """`x @= y`: Tensor has no `__imatmul__`, so Python runs `x = x @ y`; both name it `matmul`."""
    def product(x):
        y = x.clone()
        y @= x
        return y

    eager, compiled = _eager_and_compiled([product], torch.randn(3, 3))
    assert compiled == eager == ["clone", "matmul"]
