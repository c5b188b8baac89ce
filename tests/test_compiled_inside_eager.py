"""One rule for what an eager capture shows of compiled code running inside its forward.

Each compiled graph call is one op, `compiled`, with the graph's outputs (statistics and tracking
apply to them), in the module that made the call, named as the user's module (`block (Block)`,
not `(OptimizedModule)`); code dynamo runs eagerly between graphs is narrated as usual; the footer
says how many graph calls were narrated so and how to see their ops. It holds whichever backend
compiled the graph: plain inductor, the `torchlens` string backend, or `tl.compile`.
"""

import io

import pytest
import torch
from torch import nn

import torchlens as tl

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2


class Parent(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = block

    def forward(self, x):
        return self.block(self.pre(x)) + 1


def ops(recording):
    return [(event.op, event.scope.path) for event in recording.events if event.kind is tl.EventKind.OP]


COMPILERS = {
    "inductor": lambda block: torch.compile(block),
    "string backend": lambda block: torch.compile(block, backend="torchlens", options={"compiler": "eager"}),
    "tl.compile": lambda block: tl.compile(block, compiler="eager"),
}


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.inference_mode], ids=["grad", "inference_mode"])
@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_a_compiled_submodule_is_one_compiled_op_in_its_module(compiler, mode):
    torch.manual_seed(0)
    model, x = Parent(Block()), torch.randn(2, 8)
    expected = model(x)
    model.block = COMPILERS[compiler](model.block)
    torch._dynamo.reset()
    try:
        with mode():
            recording = tl.record(model, x, narrate=io.StringIO())
            again = tl.record(model, x)  # the same compiled graph, called again
    finally:
        torch._dynamo.reset()
    text = recording.narrate()
    assert ops(recording) == [("linear", "pre"), ("compiled", "block"), ("add", "")]
    assert ops(again) == ops(recording)
    assert "> block (Block)" in text and "OptimizedModule" not in text and "_orig_mod" not in text
    assert "addmm" not in text  # inductor's kernels are not the user's ops
    assert "1 compiled graph call narrated as one op each (`compiled`)" in text
    assert torch.allclose(recording.output, expected, atol=1e-6)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_a_compiled_model_as_the_root_is_its_graph_calls(mode):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.arange(8).reshape(1, 8) % 50
    with mode():
        expected = model(input_ids=ids).logits
    torch._dynamo.reset()
    try:
        with mode():
            recording = tl.record(torch.compile(model, backend="eager"), input_ids=ids, value_stats="exact")
    finally:
        torch._dynamo.reset()
    assert {op for op, _ in ops(recording)} == {"compiled"}
    assert recording.events[0].label == "input_ids"
    assert recording.events[-2].stats is not None  # statistics apply to a graph call's outputs
    assert torch.equal(recording.output.logits, expected)


def test_code_between_graphs_is_narrated_as_usual():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x)
            torch._dynamo.graph_break()
            return self.b(y.sin())

    model = Parent.__new__(Parent)
    nn.Module.__init__(model)
    model.pre, model.block = nn.Linear(4, 4), torch.compile(Breaks(), backend="eager")
    torch._dynamo.reset()
    try:
        recording = tl.record(model, torch.randn(2, 4))
    finally:
        torch._dynamo.reset()
    names = [op for op, _ in ops(recording)]
    assert names == ["linear", "compiled", "compiled", "add"]
    assert all(path == "block" for op, path in ops(recording) if op == "compiled")


def test_a_nan_made_inside_a_graph_is_found_at_its_graph_call():
    class MakesNaN(nn.Module):
        def forward(self, x):
            return torch.log(x - 10)

    model = Parent(torch.compile(MakesNaN(), backend="eager"))
    torch._dynamo.reset()
    try:
        recording = tl.record(model, torch.randn(2, 8), on_nonfinite="track")
        with pytest.raises(tl.errors.NonFiniteError):
            tl.record(model, torch.randn(2, 8), on_nonfinite="raise")
    finally:
        torch._dynamo.reset()
    first = recording.first_nonfinite
    assert (first.op, first.scope.path) == ("compiled", "block")


def test_a_graph_that_fails_is_the_attempted_op_and_the_error_is_the_users():
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(4, 8)

        def forward(self, x):
            return self.table(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lookup = torch.compile(Lookup(), backend="eager")

        def forward(self, ids):
            return self.lookup(ids + 1)

    model, ids = Model(), torch.tensor([1, 2, 3])
    torch._dynamo.reset()
    try:
        with pytest.raises(IndexError) as plain:
            model(ids)
        with pytest.raises(IndexError) as narrated:
            tl.record(model, ids)
    finally:
        torch._dynamo.reset()
    assert str(narrated.value) == str(plain.value)
    attempt = narrated.value.partial_trace.attempt
    assert (attempt.op, attempt.scope.path) == ("compiled", "lookup")
    assert ops(narrated.value.partial_trace) == [("add", "")]


def test_a_tl_compile_submodule_narrates_its_ops_in_its_own_transcript():
    inner_lines = []
    model, x = Parent(Block()), torch.randn(2, 8)
    model.block = tl.compile(model.block, narrate=inner_lines.append, compiler="eager")
    torch._dynamo.reset()
    try:
        outer = tl.record(model, x)
    finally:
        torch._dynamo.reset()
    assert ops(outer) == [("linear", "pre"), ("compiled", "block"), ("add", "")]
    inner = "\n".join(inner_lines)
    assert " linear " in inner and " relu " in inner and " mul " in inner


def test_a_compiled_function_called_in_a_forward_is_one_compiled_op():
    @torch.compile(backend="eager")
    def gate(x):
        return torch.sigmoid(x) * x

    class UsesGate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return gate(self.fc(x)).sum(-1)

    model, x = UsesGate(), torch.randn(2, 8)
    torch._dynamo.reset()
    try:
        recording = tl.record(model, x)
    finally:
        torch._dynamo.reset()
    assert ops(recording) == [("linear", "fc"), ("compiled", ""), ("sum", "")]
    assert torch.equal(recording.output, model(x))


@pytest.mark.parametrize("builtin", ["Linear", "Sequential"])
def test_a_compiled_torch_nn_module_is_narrated_in_its_own_module(builtin):
    """torch.compile runs torch.nn modules through a wrapper function whose hooks dynamo traces:
    the call is still the module's, named by its class."""
    inner = nn.Linear(8, 8) if builtin == "Linear" else nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    model = nn.Sequential(nn.Linear(8, 8), torch.compile(inner, backend="eager"))
    torch._dynamo.reset()
    try:
        recording = tl.record(model, torch.randn(2, 8), narrate=io.StringIO())
    finally:
        torch._dynamo.reset()
    assert ops(recording) == [("linear", "0"), ("compiled", "1")]
    assert f"> 1 ({builtin})" in recording.narrate()


def test_a_graph_first_compiled_for_tl_compile_is_one_op_under_tl_record():
    """Which capture a graph call reports to is decided per call, not when it was traced."""
    block = Block()
    compiled = tl.compile(block, compiler="eager")
    model = Parent(block)
    torch._dynamo.reset()
    try:
        compiled(torch.randn(2, 8))  # traced under the compiled run's own capture
        model.block = compiled
        recording = tl.record(model, torch.randn(2, 8))
    finally:
        torch._dynamo.reset()
    assert ops(recording) == [("linear", "pre"), ("compiled", "block"), ("add", "")]


def test_floats_dynamo_wraps_for_a_graph_are_not_ops_of_the_eager_transcript():
    class Tempered(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, temperature):
            return self.fc(x) / temperature

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(Tempered(), backend="eager")

        def forward(self, x, temperature):
            return self.inner(x, temperature) + 1

    model, x = Outer(), torch.randn(2, 8)
    torch._dynamo.reset()
    try:
        seen = [ops(tl.record(model, x, temperature)) for temperature in (0.7, 0.9, 1.3)]
    finally:
        torch._dynamo.reset()
    assert seen == [[("compiled", "inner"), ("add", "")]] * 3  # the recompile's float wrapping is dynamo's


def test_a_graph_that_only_writes_its_inputs_shows_what_it_wrote():
    class Accumulate(nn.Module):
        def forward(self, total, x):
            total.add_(x.sum())

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.acc = torch.compile(Accumulate(), backend="eager")
            self.fc = nn.Linear(4, 4)
            self.register_buffer("total", torch.zeros(()))

        def forward(self, x):
            self.acc(self.total, x)
            return self.fc(x)

    model = Model()
    torch._dynamo.reset()
    try:
        recording = tl.record(model, torch.ones(2, 4))
    finally:
        torch._dynamo.reset()
    assert ops(recording) == [("compiled", "acc"), ("linear", "fc")]
    graph_call = next(e for e in recording.events if e.kind is tl.EventKind.OP and e.op == "compiled")
    assert [tuple(meta.shape) for meta in graph_call.outputs] == [()]  # the buffer it wrote


@pytest.mark.slow
def test_a_model_compiled_lazily_inside_its_forward_is_one_op(tmp_path):
    """Dynamo loaded for the first time during a narrated forward: the rules are installed as it
    loads, before its first trace (a fresh process, where dynamo is not loaded yet)."""
    script = tmp_path / "lazy.py"
    script.write_text(
        "import sys, warnings, torch, torchlens as tl\n"
        "from torch import nn\n"
        "warnings.filterwarnings('ignore')\n"
        "assert 'torch._dynamo.output_graph' not in sys.modules\n"
        "class Block(nn.Module):\n"
        "    def forward(self, x): return (x // 2) * 3 + torch.relu(x)\n"
        "class Lazy(nn.Module):\n"
        "    def __init__(self): super().__init__(); self.b = Block(); self.c = None\n"
        "    def forward(self, x):\n"
        "        if self.c is None: self.c = torch.compile(self.b, backend='eager')\n"
        "        return self.c(x) + 1\n"
        "model = Lazy()\n"
        "for _ in range(2):\n"
        "    print([(e.op, e.scope.path) for e in tl.record(model, torch.randn(4)).events if e.kind.value == 'op'])\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["[('compiled', 'b'), ('add', '')]"] * 2


class ViewOnly(nn.Module):
    def forward(self, x):
        return x[:, 1:].t()  # the graph's only ops return a view of its input


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.no_grad, torch.inference_mode],
                         ids=["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_a_graph_whose_only_ops_return_a_view_of_its_input_is_one_op(compiler, mode):
    torch._dynamo.reset()
    with mode():
        x = torch.randn(2, 3)
        recording = tl.record(COMPILERS[compiler](ViewOnly()), x)
    assert [event.op for event in recording.ops] == ["input", "compiled"]
    assert tuple(recording.ops[-1].outputs[0].shape) == (2, 2) and torch.equal(recording.output, x[:, 1:].t())
    own = tl.compile(ViewOnly(), compiler="eager")
    with mode():
        own(x)
    assert [event.op for event in own.torchlens.last_recording.ops] == ["input", "getitem", "t"]
