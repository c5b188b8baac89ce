"""The compiled path under stress: recompiles, several compiled models at once, `torch._dynamo.reset()`,
narration switched off, graph breaks, and what is left behind once a compiled model is gone.

Each scenario checks what a user sees (one pass per forward, ops numbered from 1, the transcript an
eager run of the same input gives, outputs equal to the plain model's) and that nothing of torchlens
stays behind (`conftest.py` checks hooks, modes and active runs after every test). Graphs are
compiled with the "eager" inner compiler except where inductor itself is the point.
"""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from helpers import OP_LINE, op_lines, ordinals
from models import Breaking, LoopBreak, Tiny, conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl

NarrationOptions = tl.options.NarrationOptions
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_OPS = 61  # the input and the ops of `tiny_gpt()`'s forward, at any batch and length


class Passes(list):
    """A callable sink that keeps every line, split into passes on demand."""

    def __call__(self, line):
        self.append(line)

    def passes(self):
        """The text of each pass; the sink must hold nothing outside a pass."""
        assert not self or self[0].startswith("-- pass "), self[:3]
        texts = []
        for line in self:
            if line.startswith("-- pass "):
                texts.append("")
            texts[-1] += line + "\n"
        return texts

    def headers(self):
        return [line for line in self if line.startswith("-- pass ")]


def body(text):
    """A transcript without its `--` notes (headers and footers differ between substrates)."""
    return [line for line in text.splitlines() if not line.startswith("--")]


def eager_body(model, *args):
    return body(tl.record(model, *args, narrate=NarrationOptions(sink=io.StringIO())).narrate())


def unique_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def assert_one_narrated_pass(text, model, *args):
    """`text` narrates one forward of `model(*args)`: ordinals from 1, eager's transcript."""
    assert ordinals(text) == list(range(1, len(op_lines(text)) + 1))
    assert body(text) == eager_body(model, *args)


class GraphBreakMLP(nn.Module):
    """Two layers with an explicit graph break between them (two graphs per forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return torch.tanh(self.fc2(x)) * 2


# -- recompiles ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dynamic", [None, False], ids=["automatic-dynamic", "static"])
def test_new_input_shapes_recompile_and_each_call_is_narrated_once_with_its_shapes(dynamic):
    """dynamic=None: dynamo recompiles for the second shape with the changed size marked dynamic,
    and reuses that graph for later sizes; dynamic=False: one static graph per shape. Either way
    each call is one pass whose op lines show that call's sizes."""
    model, sink = tiny_gpt(), Passes()
    compiled = tl.compile(model, narrate=sink, compiler="eager", dynamic=dynamic)
    shapes = [(1, 4), (1, 6), (1, 8), (2, 8), (1, 6), (1, 4)]
    graphs_before = unique_graphs()
    with torch.no_grad():
        for batch, length in shapes:
            x = tokens(batch, length)
            assert torch.equal(compiled(x), model(x))
    compiled_graphs, distinct_shapes = unique_graphs() - graphs_before, len(set(shapes))
    if dynamic is False:
        assert compiled_graphs == distinct_shapes, "one static graph per shape"
    else:
        assert 1 < compiled_graphs < distinct_shapes, "a recompile, then a graph with dynamic sizes reused"
    passes = sink.passes()
    assert sink.headers() == [f"-- pass {n}" for n in range(1, len(shapes) + 1)]
    for text, (batch, length) in zip(passes, shapes):
        assert ordinals(text) == list(range(1, GPT_OPS + 1))
        assert f"#1    input         [{batch},{length}] i64 cpu  idx" in text
        assert f"[{batch},{length},64] f32 cpu  @head" in text
        assert_one_narrated_pass(text, model, tokens(batch, length))


def test_recompiles_of_a_forward_with_graph_breaks_narrate_the_ops_between_graphs():
    model, sink = LoopBreak().eval(), Passes()
    compiled = tl.compile(model, narrate=sink, compiler="eager")
    lengths = [4, 6, 9, 6]
    with torch.no_grad():
        for length in lengths:
            x = torch.randn(1, length, 32)
            assert torch.equal(compiled(x), model(x))
    passes = sink.passes()
    assert len(passes) == len(lengths)
    for text, length in zip(passes, lengths):
        assert_one_narrated_pass(text, model, torch.randn(1, length, 32))
        assert "3 ops run eagerly between graphs" in text.splitlines()[-1]


class Positional(nn.Module):
    """Embeds positions and projects them: used only where dynamo gives up on recompiling, which
    marks the forward's code to run eagerly for the rest of the process."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        return self.proj(self.pos(torch.arange(x.shape[1])) + x)


def test_past_the_recompile_limit_dynamo_runs_eagerly_and_the_capture_narrates_the_same_pass():
    model, sink = Positional().eval(), Passes()
    compiled = tl.compile(model, narrate=sink, compiler="eager", dynamic=False)
    lengths = [3, 4, 5, 6]
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=False), torch.no_grad():
        for length in lengths:
            x = torch.randn(2, length, 8)
            assert torch.equal(compiled(x), model(x))
    passes = sink.passes()
    assert len(passes) == len(lengths)
    for text, length in zip(passes, lengths):
        assert_one_narrated_pass(text, model, torch.randn(2, length, 8))
    assert passes[0].splitlines()[-1].endswith("; 1 compiled graph call")
    assert passes[-1].splitlines()[-1].endswith("; 0 compiled graph calls, 4 ops run eagerly between graphs")


def test_tl_compile_takes_every_keyword_of_the_installed_torch_compile():
    """Newer torch.compile keywords (`name=`, `recompile_limit=`, ...) pass through, not refused."""
    import inspect

    parameters = inspect.signature(torch.compile).parameters
    keywords = {name: p.default for name, p in parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("backend", "options")}
    assert {"fullgraph", "dynamic", "mode", "disable"} <= set(keywords)
    for name, default in keywords.items():
        lines = []
        x = torch.randn(1, 2)
        model = Tiny()
        assert torch.equal(tl.compile(model, narrate=lines.append, compiler="eager", **{name: default})(x), model(x))
        assert lines[-1].startswith("-- end:"), name


# -- several compiled models in one process ------------------------------------------------------


def test_interleaved_compiled_models_each_narrate_only_their_own_passes_into_their_own_sink(capsys):
    gpt, conv, tiny, breaking = tiny_gpt(), conv_net(), Tiny(), Breaking().eval()
    sinks = {name: Passes() for name in ("gpt", "conv", "tiny", "breaking")}
    models = {
        "gpt": (gpt, tl.compile(gpt, narrate=sinks["gpt"], compiler="eager"), lambda: tokens(1, 8)),
        "conv": (conv, torch.compile(conv, backend="torchlens", options={"narrate": sinks["conv"], "compiler": "eager"}),
                 lambda: images(2)),
        "tiny": (tiny, tl.compile(tiny, narrate=sinks["tiny"], compiler="eager"), lambda: torch.randn(3, 2)),
        "breaking": (breaking, tl.compile(breaking, narrate=sinks["breaking"], compiler="eager"), lambda: tokens(1, 5)),
    }
    plain_gpt = torch.compile(gpt, backend="eager")  # the same model compiled without torchlens, too
    orders = [["gpt", "conv", "tiny", "breaking"], ["breaking", "tiny", "gpt", "conv"], ["conv", "gpt", "breaking", "tiny"]]
    with torch.no_grad():
        for order in orders:
            for name in order:
                model, compiled, make_input = models[name]
                x = make_input()
                assert torch.equal(compiled(x), model(x))
                assert torch.equal(plain_gpt(tokens(1, 8)), gpt(tokens(1, 8)))
    for name, (model, _compiled, make_input) in models.items():
        passes = sinks[name].passes()
        assert sinks[name].headers() == ["-- pass 1", "-- pass 2", "-- pass 3"], name
        for text in passes:
            assert_one_narrated_pass(text, model, make_input())
    assert "#" not in capsys.readouterr().err, "nothing narrated to stderr"


# -- torch._dynamo.reset() -----------------------------------------------------------------------


def _compile_with(how, model, sink):
    if how == "tl.compile":
        return tl.compile(model, narrate=sink, compiler="eager")
    return torch.compile(model, backend="torchlens", options={"narrate": sink, "compiler": "eager"})


@pytest.mark.parametrize("how", ["tl.compile", "string backend"])
def test_dynamo_reset_between_calls_of_a_compiled_model_keeps_one_pass_per_call(how):
    model, sink, x = LoopBreak().eval(), Passes(), torch.randn(1, 5, 32)
    compiled = _compile_with(how, model, sink)
    with torch.no_grad():
        compiled(x)
        torch._dynamo.reset()
        graphs_before = unique_graphs()
        out = compiled(x)
        assert unique_graphs() > graphs_before, "the reset made dynamo compile again"
        compiled(x)
        assert torch.equal(out, model(x))
    assert sink.headers() == ["-- pass 1", "-- pass 2", "-- pass 3"]
    for text in sink.passes():
        assert_one_narrated_pass(text, model, x)
        assert "3 ops run eagerly between graphs" in text, "the capture between graphs still runs eagerly"


@pytest.mark.parametrize("how", ["tl.compile", "string backend"])
def test_a_model_compiled_afresh_after_dynamo_reset_narrates_apart_from_the_old_one(how):
    model, old_sink, new_sink, x = Breaking().eval(), Passes(), Passes(), tokens(1, 6)
    old = _compile_with(how, model, old_sink)
    with torch.no_grad():
        old(x)
        torch._dynamo.reset()
        new = _compile_with(how, model, new_sink)
        new(x)
        new(x)
        old(x)
    assert old_sink.headers() == ["-- pass 1", "-- pass 2"]
    assert new_sink.headers() == ["-- pass 1", "-- pass 2"]
    for text in old_sink.passes() + new_sink.passes():
        assert_one_narrated_pass(text, model, x)


def test_a_compiled_trace_after_dynamo_reset_keeps_the_values_eager_computes():
    model, x = tiny_gpt(), tokens()
    eager = tl.trace(model, x)
    tl.trace(model, x, compiled={"compiler": "eager"})
    torch._dynamo.reset()
    compiled = tl.trace(model, x, compiled={"compiler": "eager"})
    assert compiled.narrate().splitlines()[-1].endswith("; 1 compiled graph call")
    assert len(compiled.values) == len(compiled.ops) == GPT_OPS
    report = tl.debug.compare(eager, compiled)
    assert report.first_divergence is None, str(report)


def test_after_dynamo_reset_plain_compiles_and_eager_records_are_untouched(capfd):
    model, sink, x = tiny_gpt(), Passes(), tokens()
    with torch.no_grad():
        tl.compile(model, narrate=sink, compiler="eager")(x)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(model, backend="eager")(x), model(x))
        assert capfd.readouterr() == ("", ""), "a plain compile narrates nothing"
        assert body(tl.record(model, x).narrate()) == eager_body(model, x)
        fresh = Passes()
        torch.compile(model, backend="torchlens", options={"narrate": fresh, "compiler": "eager"})(x)
    assert len(sink.passes()) == 1
    assert_one_narrated_pass(fresh.passes()[0], model, x)


# -- narration switched off ----------------------------------------------------------------------


def test_string_backend_without_narration_prints_nothing_and_equals_plain_inductor_bitwise(capfd):
    """Inductor underneath (the default): outputs are exactly plain torch.compile's, across a graph
    break, and nothing is written anywhere."""
    model, x = GraphBreakMLP().eval(), torch.randn(4, 16)
    with torch.no_grad():
        plain = torch.compile(model)
        expected = [plain(x), plain(x * 2)]
        capfd.readouterr()  # whatever torch itself logs about the graph break, once
        for options in (None, {"narrate": False}):
            compiled = torch.compile(model, backend="torchlens", options=options)
            outputs = [compiled(x), compiled(x * 2)]
            assert all(torch.equal(a, b) for a, b in zip(outputs, expected)), options
            assert capfd.readouterr() == ("", ""), f"options={options} printed something"


def test_narration_off_compiled_model_trains_like_the_plain_compiled_one(capfd):
    """Gradients through the graph break are those of plain torch.compile with the same compiler."""
    grads = []
    for backend, options in (("aot_eager", None), ("torchlens", {"narrate": False, "compiler": "aot_eager"})):
        model, x = GraphBreakMLP(), torch.randn(4, 16)
        torch.compile(model, backend=backend, options=options)(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert "#" not in capfd.readouterr().err


def test_narrated_and_silent_compiles_of_one_model_do_not_mix(capfd):
    model, sink, x = GraphBreakMLP().eval(), Passes(), torch.randn(2, 16)
    narrated = tl.compile(model, narrate=sink, compiler="eager")
    silent = torch.compile(model, backend="torchlens", options={"compiler": "eager"})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(silent(x), narrated(x))
    assert capfd.readouterr() == ("", "")
    assert sink.headers() == ["-- pass 1", "-- pass 2"]
    for text in sink.passes():
        ops = [OP_LINE.match(line).group("op") for line in op_lines(text)]
        assert ops == ["input", "linear", "relu", "linear", "tanh", "mul"]
        assert_one_narrated_pass(text, model, x)


def test_a_compiled_module_called_by_a_compiled_function_is_named_as_the_module_itself():
    """Through `torch.compile`'s wrapper (`_orig_mod`) the module keeps the names it has unwrapped."""
    model, x = Tiny(), torch.randn(1, 2)
    wrapped = tl.compile(model, compiler="eager")
    texts = []
    for inner in (model, wrapped):
        lines = []
        tl.compile(lambda t, inner=inner: inner(t) * 2, narrate=lines.append, compiler="eager")(x)
        texts.append("\n".join(lines))
    assert texts[0] == texts[1]
    assert "_orig_mod" not in texts[1] and "@proj" in texts[1]


# -- nothing left behind -------------------------------------------------------------------------


def _run_compiled(how, model, x):
    """Run `model(x)` through one torchlens entry point; return the output the caller gets."""
    if how == "tl.compile":
        return tl.compile(model, narrate=lambda line: None, compiler="eager")(x)
    if how == "string backend":
        return torch.compile(model, backend="torchlens", options={"narrate": lambda line: None, "compiler": "eager"})(x)
    if how == "string backend, silent":
        return torch.compile(model, backend="torchlens", options={"compiler": "eager"})(x)
    return tl.trace(model, x, compiled={"compiler": "eager"}).output


@pytest.mark.parametrize("how", ["tl.compile", "string backend", "string backend, silent", "tl.trace"])
def test_a_deleted_compiled_model_and_its_last_output_are_garbage_collected(how):
    model = tiny_gpt()
    with torch.no_grad():
        out = _run_compiled(how, model, tokens(2, 8))
    model_ref, out_ref = weakref.ref(model), weakref.ref(out)
    del model, out
    gc.collect()
    assert model_ref() is None, "the model outlives its compiled form"
    assert out_ref() is None, "the last forward's output outlives the model"


def test_a_repeated_compiled_trace_checks_its_selector_like_the_first():
    model, x = tiny_gpt(), tokens()
    narrate = NarrationOptions(sink=io.StringIO(), select=tl.in_module("blocks.1.atn"))
    with pytest.raises(tl.errors.UnknownModuleError):
        tl.trace(tiny_gpt(), x, narrate=narrate, compiled={"compiler": "eager"})  # a first trace checks
    tl.trace(model, x, compiled={"compiler": "eager"})
    with pytest.raises(tl.errors.UnknownModuleError, match="blocks.1.atn"):
        tl.trace(model, x, narrate=narrate, compiled={"compiler": "eager"})
    model.probe = nn.Linear(2, 2)  # added since the first trace: selectable now, as eagerly
    tl.trace(model, x, narrate=NarrationOptions(sink=io.StringIO(), select=tl.in_module("probe")),
             compiled={"compiler": "eager"})


@pytest.mark.slow
def test_in_a_fresh_process_ops_between_graphs_run_eagerly_and_dynamo_never_traces_the_capture():
    """`import torchlens` does not load dynamo; the capture must still be kept out of it once a
    compiled run starts, or dynamo compiles the capture mode itself: the op between graphs becomes
    a graph of its own, and a dynamic-shape recompile reports a graph break inside torchlens."""
    code = textwrap.dedent("""
        import sys
        import torch
        import torchlens as tl
        sys.path.insert(0, "tests")
        from models import LoopBreak, tiny_gpt, tokens
        assert "torch._dynamo" not in sys.modules, "the scenario: dynamo is loaded by tl.compile"
        model = LoopBreak().eval()
        compiled = tl.compile(model, compiler="eager")
        with torch.no_grad():
            compiled(torch.randn(1, 4, 32))
            gpt = tl.compile(tiny_gpt(), compiler="eager")
            for length in (4, 6):
                gpt(tokens(1, length))
        print("footer:", compiled.torchlens.last_recording.narrate().splitlines()[-1])
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    footer = next(line for line in result.stdout.splitlines() if line.startswith("footer:"))
    assert footer.endswith("2 compiled graph calls, 3 ops run eagerly between graphs"), footer
    assert "torchlens" not in result.stderr, result.stderr[-3000:]
