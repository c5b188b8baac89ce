"""Odd but valid models: each is narrated correctly eagerly, and compiled (one check per kind, with
`compiler="eager"`), and returns exactly what the plain forward returns.

Kinds: no parameters; tensors in dicts, tuples and dataclasses, as inputs and as outputs; keyword-only
inputs; outputs that are not tensors; a module called twice per forward; a module whose `.forward`
is called directly; a custom `torch.autograd.Function`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import OP_LINE, check_nesting, op_lines
from torch import nn

import torchlens as tl


def ops_of(text: str):
    return [OP_LINE.match(line).group("op") for line in op_lines(text)]


def labels_of(text: str, kind: str):
    """The names on the `input` or `output` lines, in order."""
    return [line.split()[-1] for line in text.splitlines() if line.split()[1:2] == [kind]]


def body(text: str):
    """The transcript without its `--` header and footer lines (which say eager or compiled)."""
    return [line for line in text.splitlines() if not line.startswith("--")]


def assert_same(actual, expected) -> None:
    """Equal structure, equal tensors (bit for bit), equal everything else."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected)
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            assert_same(getattr(actual, field.name), getattr(expected, field.name))
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
    else:
        assert actual == expected


def narrate_compiled(model, *args, **kwargs):
    """Run `model` once through `tl.compile` (eager compiler underneath); the output and transcript."""
    lines = []
    output = tl.compile(model, narrate=lines.append, compiler="eager")(*args, **kwargs)
    text = "\n".join(lines) + "\n"
    check_nesting(text)
    return output, text


def check_eager_and_compiled(model, *args, **kwargs):
    """Narrate `model` eagerly and compiled: both transcripts nest correctly and agree line for line,
    and both outputs are the plain forward's. Returns the eager recording."""
    expected = model(*args, **kwargs)
    recording = tl.record(model, *args, **kwargs)
    eager = recording.narrate()
    check_nesting(eager)
    assert_same(recording.output, expected)
    output, compiled = narrate_compiled(model, *args, **kwargs)
    assert_same(output, expected)
    assert body(compiled) == body(eager)
    return recording


class Parameterless(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2 + x.mean()


def test_a_model_without_parameters():
    x = torch.randn(2, 3)
    recording = check_eager_and_compiled(Parameterless(), x)
    text = recording.narrate()
    assert ops_of(text) == ["input", "tanh", "mul", "mean", "add"]
    assert labels_of(text, "input") == ["x"] and labels_of(text, "output") == ["out"]
    assert not any(line.lstrip().startswith((">", "<")) for line in text.splitlines()), "no module lines"
    trace = tl.trace(Parameterless(), x)
    assert torch.equal(trace.value(trace.ops[1].ordinal), torch.tanh(x))


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


class Containers(nn.Module):
    """Takes a dict, a tuple and a dataclass; returns a dict holding a tuple holding a list, and a dataclass."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, features, pair, batch):
        y = self.proj(features["x"]) + pair[0] * pair[1] + batch.first - batch.second
        return {"y": y, "parts": (y.sum(), [y.mean()])}, Pair(y, -y)


def test_tensors_in_dicts_tuples_and_dataclasses_as_inputs_and_outputs():
    a, b, c, d, e = (torch.randn(1, 2) for _ in range(5))
    args = ({"x": a}, (b, c), Pair(d, e))
    recording = check_eager_and_compiled(Containers(), *args)
    text = recording.narrate()
    assert labels_of(text, "input") == ["features['x']", "pair[0]", "pair[1]", "batch.first", "batch.second"]
    assert labels_of(text, "output") == ["out[0]['y']", "out[0]['parts'][0]", "out[0]['parts'][1][0]",
                                         "out[1].first", "out[1].second"]
    assert ops_of(text)[5:] == ["linear", "mul", "add", "add", "sub", "sum", "mean", "neg"]
    trace = tl.trace(Containers(), *args)
    kept_inputs = [trace.value(event.ordinal) for event in trace.ops[:5]]
    assert all(torch.equal(kept, given) for kept, given in zip(kept_inputs, (a, b, c, d, e)))


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x, *, scale, bias=None):
        y = self.proj(x) * scale
        return y if bias is None else y + bias


def test_keyword_only_inputs_are_named_after_their_parameters():
    x, scale, bias = torch.randn(1, 2), torch.tensor(3.0), torch.randn(2)
    recording = check_eager_and_compiled(KeywordOnly(), x, scale=scale, bias=bias)
    text = recording.narrate()
    assert labels_of(text, "input") == ["x", "scale", "bias"]
    assert ops_of(text) == ["input", "input", "input", "linear", "mul", "add"]
    without_bias = tl.record(KeywordOnly(), x, scale=scale).narrate()
    assert labels_of(without_bias, "input") == ["x", "scale"] and ops_of(without_bias)[-1] == "mul"


class Returns(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x + 1)


NON_TENSOR_OUTPUTS = {
    "none": lambda y: None,
    "int": lambda y: 3,
    "str": lambda y: "done",
    "mixed": lambda y: (None, 3, "done", y, {"none": None, "twice": y * 2}),
}


@pytest.mark.parametrize("kind", NON_TENSOR_OUTPUTS)
def test_outputs_that_are_not_tensors_are_returned_unchanged(kind):
    x = torch.randn(1, 2)
    model = Returns(NON_TENSOR_OUTPUTS[kind])
    recording = tl.record(model, x)
    assert_same(recording.output, model(x))
    text = recording.narrate()
    check_nesting(text)
    tensor_outputs = ["out[3]", "out[4]['twice']"] if kind == "mixed" else []
    assert labels_of(text, "output") == tensor_outputs
    assert ops_of(text) == ["input", "add"] + (["mul"] if kind == "mixed" else [])
    assert text.splitlines()[-1].startswith("-- end:")


def test_outputs_that_are_not_tensors_compiled():
    check_eager_and_compiled(Returns(NON_TENSOR_OUTPUTS["mixed"]), torch.randn(1, 2))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x):
        return self.proj(torch.relu(self.proj(x)))


def test_a_module_called_twice_gets_two_enter_exit_pairs():
    model, x = Twice(), torch.randn(1, 2)
    recording = check_eager_and_compiled(model, x)
    lines = recording.narrate().splitlines()
    assert [line for line in lines if line.lstrip().startswith((">", "<"))] == ["> proj (Linear)", "< proj"] * 2
    assert ops_of(recording.narrate()) == ["input", "linear", "relu", "linear"]
    trace = tl.trace(model, x)
    first, second = (e.ordinal for e in trace.ops if e.op == "linear")
    assert torch.equal(trace.value(first), model.proj(x))
    assert torch.equal(trace.value(second), model.proj(torch.relu(model.proj(x))))


class Rotate(nn.Module):
    """A function wrapped as a module and kept in a global, as transformers' kernel hub wraps
    `apply_rotary_pos_emb`: not part of any model, called by every layer."""

    def forward(self, x):
        return torch.cat((-x[..., 1:], x[..., :1]), dim=-1)


ROTATE = Rotate()


class UsesTheGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x):
        return ROTATE(self.proj(x)) * 2


def test_a_module_kept_in_a_global_and_called_by_every_layer_closes_each_call():
    """Each layer's call of the shared module is named under that layer (`layers.1.<Rotate>`) and
    closes there: the ops after it belong to the layer, eager and compiled."""
    model, x = nn.Sequential(UsesTheGlobal(), UsesTheGlobal()), torch.randn(1, 2)
    recording = check_eager_and_compiled(model, x)
    lines = recording.narrate().splitlines()
    assert [line.strip() for line in lines if line.lstrip().startswith(("> 1", "< 1"))] == [
        "> 1 (UsesTheGlobal)", "> 1.proj (Linear)", "< 1.proj", "> 1.<Rotate> (Rotate)", "< 1.<Rotate>", "< 1"]
    assert [(e.op, e.scope.path) for e in recording.ops][-2:] == [("cat", "1.<Rotate>"), ("mul", "1")]


class CallsForwardDirectly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.helper = nn.Linear(2, 2)

    def forward(self, x):
        return self.helper.forward(self.fc(x))  # `.forward`, not `self.helper(...)`


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.caller = CallsForwardDirectly()

    def forward(self, x):
        return self.caller(x).relu()


def test_a_direct_forward_call_is_narrated_inside_the_module_that_was_called():
    """`module.forward(x)` bypasses `nn.Module.__call__`: no hook fires, and torch itself does not
    count it as a module call (no hooks, no entry in `torch.compile`'s module stack). torchlens
    narrates what was called: there is no `> caller.helper` line, and the ops that ran in
    `helper.forward` are attributed to the enclosing module that *was* called (`caller`), where
    they ran. Nothing is lost: every op is still there, eagerly and compiled alike."""
    recording = check_eager_and_compiled(Outer(), torch.randn(1, 2))
    text = recording.narrate()
    assert [line.strip() for line in text.splitlines() if line.lstrip().startswith((">", "<"))] == [
        "> caller (CallsForwardDirectly)", "> caller.fc (Linear)", "< caller.fc", "< caller"]
    linears = [line for line in op_lines(text) if OP_LINE.match(line).group("op") == "linear"]
    assert len(linears) == 2
    assert linears[0].rstrip().endswith("@caller.fc") and linears[1].rstrip().endswith("@caller")


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class UsesFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x):
        return Square.apply(self.proj(x)).sum()


def gradients(model, x, run):
    """Run `run(model, x)` and backpropagate from its output; the gradients of x and the parameters."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_()
    output = run(model, x)
    output.backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def test_a_custom_autograd_function_is_narrated_and_backward_still_works():
    """Eagerly, the ops inside the Function's forward are narrated (`mul`); compiled, dynamo captures
    the Function as one node, narrated as one op. Backward through it is unchanged either way."""
    torch.manual_seed(0)
    model, x = UsesFunction(), torch.randn(3, 2)
    plain = gradients(model, x, lambda m, v: m(v))
    recording = tl.trace(model, x.clone().requires_grad_())
    text = recording.narrate()
    check_nesting(text)
    assert ops_of(text) == ["input", "linear", "mul", "sum"]
    for captured in (gradients(model, x, lambda m, v: tl.record(m, v).output),
                     gradients(model, x, lambda m, v: tl.trace(m, v).output)):
        assert all(torch.equal(a, b) for a, b in zip(captured, plain))
    lines = []
    compiled = tl.compile(model, narrate=lines.append, compiler="eager")
    assert all(torch.equal(a, b) for a, b in zip(gradients(model, x, lambda m, v: compiled(v)), plain))
    compiled_ops = ops_of("\n".join(lines))
    check_nesting("\n".join(lines))
    assert compiled_ops[:2] == ["input", "linear"] and compiled_ops[-1] == "sum" and len(compiled_ops) == 4
