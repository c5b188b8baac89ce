"""Crash workflows: partial traces, the attempted-op marker, live tails, hard deaths."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch
from helpers import op_lines
from models import Tiny, tiny_gpt, tokens
from torch import nn

import torchlens as tl

NarrationOptions = tl.options.NarrationOptions
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(3)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.norm(x)))  # a [2,3] input cannot go through a 4->4 linear


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.inner = Inner()

    def forward(self, x):
        return self.inner(self.pre(x))


def _fail(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


def test_a_shape_mismatch_keeps_the_exception_and_names_the_attempted_linear():
    model, x = Outer(), torch.randn(2, 3)
    plain = _fail(lambda: model(x))
    exc = _fail(lambda: tl.record(model, x))
    assert type(exc) is type(plain) and str(exc) == str(plain)
    tail = exc.partial_trace.narrate(last=20).splitlines()
    assert tail[0] == f"!! forward failed: RuntimeError: {str(plain).splitlines()[0]}"
    assert tail[-1].startswith("!! attempted #5 linear @inner.fc  ")
    assert "inputs: [2,3] f32 cpu, [4,4] f32 cpu, [4] f32 cpu  (not proven culprit)" in tail[-1]
    assert "test_crashes.py:" in tail[-1]  # the site: Inner.forward's line
    body = [" ".join(line.split()[:2]) for line in tail[1:-1]]
    assert body == [
        "#1 input", "> pre", "#2 linear", "< pre", "> inner", "> inner.norm",
        "#3 layer_norm", "< inner.norm", "#4 tanh", "> inner.fc",
    ]


def test_the_tail_keeps_the_enter_lines_of_open_modules_when_the_window_cuts():
    exc = _fail(lambda: tl.record(Outer(), torch.randn(2, 3)))
    tail = exc.partial_trace.narrate(last=2).splitlines()
    assert tail == [
        tail[0],
        "> inner (Inner)",
        "-- ... 8 earlier lines",
        "  #4    tanh          [2,3] f32 cpu  @inner",
        "  > inner.fc (Linear)",
        tail[-1],
    ]


def test_partial_trace_is_attached_with_narration_off_and_for_trace_and_recorder():
    x = torch.randn(2, 3)
    for run in (lambda m: tl.record(m, x), lambda m: tl.trace(m, x)):
        exc = _fail(lambda run=run: run(Outer()))
        assert isinstance(exc.partial_trace, tl.PartialTrace)
        assert exc.partial_trace.attempt.op == "linear" and exc.partial_trace.attempt.module == "inner.fc"
    model = Outer()
    with tl.recording.Recorder(model) as recorder:
        exc = _fail(lambda: model(x))
    assert exc.partial_trace is recorder.recordings[0]
    assert exc.partial_trace.values is None
    traced = _fail(lambda: tl.trace(Outer(), x)).partial_trace
    assert set(traced.values) == {1, 2, 3, 4}, "a failed trace keeps the values of the ops that ran"


def test_the_note_shows_the_attempted_op_under_the_traceback():
    exc = _fail(lambda: tl.record(Outer(), torch.randn(2, 3)))
    printed = "".join(traceback.format_exception(exc))
    assert "torchlens: attempted #5 linear @inner.fc" in printed
    assert "exc.partial_trace.narrate(last=20)" in printed


def test_live_narration_prints_the_tail_on_failure_and_partial_narrate_reproduces_it():
    sink = io.StringIO()
    exc = _fail(lambda: tl.record(Outer(), torch.randn(2, 3), narrate=NarrationOptions(sink=sink, tail_on_error=3)))
    lines = sink.getvalue().splitlines()
    assert lines[:10] == exc.partial_trace.narrate(last=None).splitlines()[:10]
    assert exc.partial_trace.narrate() == sink.getvalue()
    failed_at = lines.index(next(line for line in lines if line.startswith("!! forward failed")))
    # every line was printed above it: the block repeats none, and ends the transcript
    assert lines[failed_at + 1:] == exc.partial_trace.narrate(last=3).splitlines()[-1:]
    assert len(lines[failed_at + 1:]) == 1 and lines[-1].startswith("!! attempted #5 linear @inner.fc")
    # asked for after the fact, the tail view still shows the last lines with their context
    assert len(exc.partial_trace.narrate(last=3).splitlines()) == 1 + 2 + 1 + 3 + 1


def test_on_error_only_prints_nothing_on_success_and_the_tail_on_failure():
    sink = io.StringIO()
    tl.record(Tiny(), torch.randn(1, 2), narrate=NarrationOptions(sink=sink, on_error_only=True))
    assert sink.getvalue() == ""
    _fail(lambda: tl.record(Outer(), torch.randn(2, 3), narrate=NarrationOptions(sink=sink, on_error_only=True,
                                                                                 tail_on_error=4)))
    text = sink.getvalue().splitlines()
    assert text[0].startswith("!! forward failed") and text[-1].startswith("!! attempted #5 linear")
    assert len(text) == 1 + 2 + 1 + 4 + 1  # header, 2 open modules, elision note, 4 lines, marker


def test_an_error_from_python_code_says_no_torch_call_was_in_flight():
    class Checks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            y = self.fc(x)
            if y.shape[0] != 3:
                raise ValueError("expected a batch of 3")
            return y

    exc = _fail(lambda: tl.record(Checks(), torch.randn(2, 2)))
    assert isinstance(exc, ValueError) and str(exc) == "expected a batch of 3"
    last = exc.partial_trace.narrate(last=3).splitlines()[-1]
    assert last.startswith("!! attempted: no torch call was in flight; the error came from Python code after #2")
    assert "test_crashes.py:" in last


def test_an_exception_caught_inside_the_forward_does_not_end_the_recording():
    class Recovers(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.fallback = nn.Linear(3, 3)

        def forward(self, x):
            try:
                return self.inner(x)
            except RuntimeError:
                return self.fallback(x)

    sink = io.StringIO()
    rec = tl.record(Recovers(), torch.randn(2, 3), narrate=sink)
    text = sink.getvalue()
    assert "< inner.fc" in text and "< inner" in text, "the modules the error unwound through are closed"
    assert text.index("< inner") < text.index("> fallback (Linear)")
    assert not isinstance(rec, tl.PartialTrace)


def test_cuda_inputs_add_the_asynchronous_error_caveat():
    from torchlens.events import Attempt, Scope, TensorMeta
    from torchlens.narration import grammar

    on_gpu = TensorMeta((2, 3), torch.float32, torch.device("cuda", 0))
    lines = grammar.render_attempt(Attempt("linear", 4, Scope("fc", "Linear", Scope("", "M", None)), None, (on_gpu,)),
                                   normalize=False)
    assert lines[0].endswith("(not proven culprit)")
    assert "asynchronous" in lines[1] and "CUDA_LAUNCH_BLOCKING=1" in lines[1]


# -- compiled ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_embedding_index_out_of_range_names_the_embedding():
    model = tiny_gpt()
    compiled = torch.compile(model, backend="torchlens")
    bad = tokens(2, 8)
    with torch.no_grad():
        compiled(bad)
        bad[1, 5] = 1000  # past the 64-token vocabulary
        exc = _fail(lambda: compiled(bad))
    tail = exc.partial_trace.narrate(last=4).splitlines()
    assert tail[-2] == "-- located by replaying the compiled graph op by op"
    assert tail[-1].startswith("!! attempted #3 embedding @tok  ")
    assert "inputs: [2,8] i64 cpu (min=0 max=1000), [64,32] f32 cpu  (not proven culprit)" in tail[-1]
    assert tail[-3] == "> tok (Embedding)"


def test_a_shape_error_found_while_dynamo_traces_gets_the_same_context():
    model = Outer().eval()
    compiled = tl.compile(model, compiler="eager", dynamic=True)
    exc = _fail(lambda: compiled(torch.randn(2, 3)))
    assert isinstance(exc, torch._dynamo.exc.TorchRuntimeError)
    tail = exc.partial_trace.narrate(last=3).splitlines()
    assert tail[-2] == "-- dynamo raised while tracing; located by running the forward eagerly"
    assert tail[-1].startswith("!! attempted #5 linear @inner.fc")


def test_an_index_error_dynamo_passes_on_while_tracing_is_located_not_called_python_code():
    class Gather(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, i):
            return self.fc(x)[i]  # a Python int index: dynamo checks it on fake tensors, and raises IndexError

    compiled = tl.compile(Gather().eval(), compiler="eager")
    exc = _fail(lambda: compiled(torch.randn(3, 4), 7))
    assert type(exc) is IndexError  # the user's exception type, as plain torch.compile raises it
    tail = exc.partial_trace.narrate(last=2).splitlines()
    assert tail[-2] == "-- dynamo raised while tracing; located by running the forward eagerly"
    assert tail[-1].startswith("!! attempted #3 getitem  ")
    training = tl.compile(Gather(), compiler="eager")  # training mode: not run again, and it says so
    tail = _fail(lambda: training(torch.randn(3, 4), 7)).partial_trace.narrate(last=2).splitlines()
    assert "not located: the model has modules in training mode" in tail[-2]
    assert "no torch call was in flight" not in tail[-1]


class BreaksThenFails(nn.Module):
    """A graph break (a print) between two blocks; `inner` fails on a [*,3] input. Each forward
    counts itself, as code with side effects (a step counter, an RNG draw, I/O) does."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.inner = Inner()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.pre(x)
        print("between the blocks")  # a graph break: the rest is a resume function
        return self.inner(h)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_tracing_error_after_a_graph_break_is_located_without_running_the_code_before_it_again(training, capsys):
    model = BreaksThenFails().train(training)
    compiled = tl.compile(model, compiler="eager")
    exc = _fail(lambda: compiled(torch.randn(2, 3)))
    assert isinstance(exc, torch._dynamo.exc.TorchRuntimeError)
    assert model.calls == 1 and capsys.readouterr().out.count("between the blocks") == 1, \
        "the code before the graph break ran twice"
    partial = exc.partial_trace
    assert [(e.op, e.scope.path) for e in partial.ops] == [("input", ""), ("linear", "pre")]
    tail = partial.narrate(last=2).splitlines()
    assert tail[-2].startswith("-- located from dynamo's trace, after a graph break: the forward was not run again")
    assert tail[-1].startswith("!! attempted #3 linear @inner.fc") and "inputs: [2,3] f32 cpu, [4,4] f32 cpu" in tail[-1]
    assert tail[-1].endswith("(not proven culprit)") and "test_crashes.py:" in tail[-1]
    assert [line for line in partial.narrate().splitlines() if line.strip().startswith(">")] == \
        ["> pre (Linear)", "> inner (Inner)", "  > inner.fc (Linear)"]


class RaisesAfter(nn.Module):
    """Raises in its own Python code after its submodule returned, or inside the submodule."""

    def __init__(self, inside: bool):
        super().__init__()
        self.inside = inside
        self.fc = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x):
        h = self.fc(x)
        if h.shape[0] == 3 and not self.inside:
            raise ValueError("three rows")
        return self.block(h)


def _raise_in_block(module, args, output):
    raise ValueError("from inside block")


@pytest.mark.parametrize("inside", [False, True])
def test_a_python_error_in_a_compiled_forward_is_placed_in_the_module_eager_names(inside):
    model = RaisesAfter(inside).eval()
    if inside:
        model.block[0].register_forward_hook(_raise_in_block)
    eager = _fail(lambda: tl.record(model, torch.randn(3, 4))).partial_trace.narrate(last=3)
    compiled = tl.compile(model, compiler="eager")
    tail = _fail(lambda: compiled(torch.randn(3, 4))).partial_trace.narrate(last=3)
    assert tail.splitlines()[-1] == eager.splitlines()[-1]
    assert ("in @block.0" in tail) is inside and "in @fc" not in tail


class CountsFromNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.names = ["a", "b"]

    def forward(self, x):
        return self.fc(x) * sum(int(name) for name in self.names)  # a ValueError inside a generator


class Identity(nn.Module):
    def forward(self, x):
        return x


class PlacesErrors(nn.Module):
    def __init__(self, wrong_call: bool):
        super().__init__()
        self.wrong_call = wrong_call
        self.s = CountsFromNames()
        self.b = Identity()

    def forward(self, x):
        return self.b(self.s.fc(x), 3) if self.wrong_call else self.s(x) + 1  # (b takes one argument)


@pytest.mark.parametrize("wrong_call", [False, True])
def test_errors_in_a_generator_or_a_module_call_are_placed_where_eager_places_them(wrong_call):
    model = PlacesErrors(wrong_call).eval()
    eager = _fail(lambda: tl.record(model, torch.randn(3, 4))).partial_trace.narrate(last=1)
    compiled = tl.compile(model, compiler="eager")
    tail = _fail(lambda: compiled(torch.randn(3, 4))).partial_trace.narrate(last=1)
    assert tail == eager and ("in @b" if wrong_call else "in @s ") in tail


def test_dynamo_own_errors_do_not_run_the_forward_again():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.fc(x)
            torch._dynamo.graph_break()
            return h

    def failing_backend(gm, inputs):
        raise RuntimeError("backend failed")

    for options in ({"compiler": "eager", "fullgraph": True}, {"compiler": failing_backend}):
        model = Counting().eval()
        _fail(lambda model=model, options=options: tl.compile(model, **options)(torch.randn(3, 4)))
        assert model.calls == 0  # a graph break under fullgraph, a failed backend: no op to locate


def test_replay_caveats_are_stated_on_the_tail():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, idx):
            return self.embed(self.drop(torch.ones(2, 4)).long().clamp(max=7) + idx)

    compiled = tl.compile(Noisy().train(), compiler="eager")
    exc = _fail(lambda: compiled(torch.full((2, 4), 100)))
    tail = exc.partial_trace.narrate(last=3)
    assert "replay caveat: the graph draws random numbers; the replay drew its own" in tail
    assert tail.splitlines()[-1].startswith("!! attempted") and "embedding @embed" in tail.splitlines()[-1]


# -- hard deaths ---------------------------------------------------------------------------------

_KILLED_EAGER = """
    import os, signal, sys, torch
    from torch import nn
    import torchlens as tl

    class Dies(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            x = torch.relu(self.a(x))
            os.kill(os.getpid(), signal.SIGKILL)
            return self.b(x)

    tl.record(Dies(), torch.randn(1, 2), narrate=sys.argv[1])
"""

_KILLED_COMPILED = """
    import os, signal, sys, torch
    from torch import nn
    import torchlens as tl

    @torch.library.custom_op("torchlens_test::die", mutates_args=())
    def die(x: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        return x.clone()

    @die.register_fake
    def _(x):
        return torch.empty_like(x)

    class Dies(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(die(torch.relu(self.a(x))))

    tl.compile(Dies(), narrate=sys.argv[1], live=True)(torch.randn(1, 2))
"""


@pytest.mark.parametrize("script", [_KILLED_EAGER, _KILLED_COMPILED], ids=["eager", "compiled-live"])
def test_sigkill_mid_forward_leaves_every_narrated_line_on_disk(script, tmp_path):
    path = tmp_path / "run.log"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr[-2000:]
    ops = [line.split()[1] for line in op_lines(path.read_text())]
    assert ops == ["input", "linear", "relu"], path.read_text()


def test_a_graph_that_changes_its_inputs_in_place_is_not_replayed():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, idx):
            self.calls.add_(1)  # state a replay would change a second time
            return self.embed(idx)

    model = Counts()
    compiled = tl.compile(model, compiler="eager")
    compiled(torch.tensor([1, 2]))
    exc = _fail(lambda: compiled(torch.tensor([1, 99])))
    assert model.calls.item() == 2, "the failing call counted once, and was not replayed"
    tail = exc.partial_trace.narrate(last=3)
    assert "not replayed: the graph changes its inputs in place" in tail
    assert "!! attempted" in tail.splitlines()[-1]


def test_a_graph_that_adds_into_its_input_is_not_replayed():
    """`x += y` reaches the graph as `operator.iadd`: replaying it would add twice."""
    import operator

    from torch import fx

    from torchlens.fx_backend.replay import mutates_inputs

    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    added = graph.call_function(operator.iadd, (x, y))
    graph.call_method("relu_", (added,))  # in place on the in-place result: still the input
    graph.output(graph.call_function(operator.mul, (added, 2)))
    assert mutates_inputs(fx.GraphModule(torch.nn.Module(), graph))


def test_a_partial_trace_narrates_with_the_keywords_a_recording_takes():
    """`narrate(engine_ops=...)` is a `Recording.narrate` keyword: a failed run's partial trace
    took all of them but that one, and raised TypeError."""
    exc = _fail(lambda: tl.record(Outer(), torch.randn(2, 3)))
    assert exc.partial_trace.narrate(last=5, engine_ops=True) == exc.partial_trace.narrate(last=5)
