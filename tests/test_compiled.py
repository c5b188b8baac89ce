"""The compiled substrate: `torch.compile(model, backend="torchlens")` and `tl.compile`.

Inductor compiles take seconds on two cores, so inductor is used where it is the point (outputs equal
plain `torch.compile`, a real GPT-2) and compiled models are shared within this module; elsewhere
the graph is compiled by the "eager" inner compiler, which exercises the same plan and runtime.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import OP_LINE, check_nesting, op_lines, ordinals
from models import Breaking, LoopBreak, Tiny, conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl

NarrationOptions = tl.options.NarrationOptions
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def body(text):
    """A transcript without its `--` notes (pass headers and footers differ between substrates)."""
    return [line for line in text.splitlines() if not line.startswith("--")]


def eager_text(model, x, **options):
    return tl.record(model, x, narrate=NarrationOptions(sink=io.StringIO(), **options)).narrate()


class Lines(list):
    """A callable sink that keeps lines, with the text of the latest pass at hand."""

    def __call__(self, line):
        self.append(line)

    def last_pass(self):
        start = max(i for i, line in enumerate(self) if line.startswith("-- pass "))
        return "".join(line + "\n" for line in self[start:])


@pytest.fixture(scope="module")
def gpt_inductor():
    """A small GPT compiled once by inductor through tl.compile, and plain torch.compile."""
    model, x = tiny_gpt(), tokens(2, 8)
    lines = Lines()
    with torch.no_grad():
        compiled = tl.compile(model, narrate=NarrationOptions(sink=lines, sites=True))
        out = compiled(x)
        plain = torch.compile(model)(x)
    return model, x, compiled, lines, out, plain


@pytest.mark.slow
def test_fused_outputs_equal_plain_torch_compile_bitwise(gpt_inductor):
    model, x, compiled, lines, out, plain = gpt_inductor
    assert torch.equal(out, plain)
    with torch.no_grad():
        assert torch.allclose(out, model(x), atol=1e-5)


def test_compiled_transcript_matches_eager_op_for_op(gpt_inductor):
    model, x, compiled, lines, out, plain = gpt_inductor
    compiled_text = lines.last_pass()
    assert body(compiled_text) == body(eager_text(model, x, sites=True))
    assert check_nesting(compiled_text) == 3
    assert compiled_text.splitlines()[0] == "-- pass 1"


def test_every_call_is_one_pass_with_its_own_ordinals(gpt_inductor):
    model, x, compiled, lines, out, plain = gpt_inductor
    with torch.no_grad():
        compiled(x)
    text = lines.last_pass()
    assert text.startswith("-- pass 2\n")
    assert ordinals(text) == list(range(1, len(op_lines(text)) + 1))
    recording = compiled.torchlens.last_recording
    assert recording.narrate() == text and torch.equal(recording.output, out)


@pytest.mark.slow
def test_conv_net_compiled_by_inductor_matches_eager_and_plain_compile():
    model, x = conv_net(), images(2)
    lines = Lines()
    with torch.no_grad():
        out = tl.compile(model, narrate=lines)(x)
        assert torch.equal(out, torch.compile(model)(x))
    assert body(lines.last_pass()) == body(eager_text(model, x))


def test_string_backend_narrates_from_the_first_call_without_recompiling():
    model, lines = Breaking(), Lines()
    compiled = torch.compile(model, backend="torchlens", options={"narrate": lines, "compiler": "eager"})
    with torch.no_grad():
        compiled(tokens())
        first = lines.last_pass()
        graphs_after_first_call = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled(tokens())
        second = lines.last_pass()
    assert body(first) == body(second) == body(eager_text(model, tokens()))
    assert " mean " in first, "the op between two graphs (before .item()) is narrated on the first call"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_after_first_call, "no recompile"


def test_graph_breaks_leave_no_hole_and_ordinals_keep_increasing(capsys):
    model, lines = Breaking(), Lines()
    compiled = tl.compile(model, narrate=lines, compiler="eager")
    with torch.no_grad():
        compiled(tokens())
    text = lines.last_pass()
    ops = [OP_LINE.match(line).group("op") for line in op_lines(text)]
    assert ops == ["input", "embedding", "mean", "linear", "tanh", "linear"]
    assert ordinals(text) == [1, 2, 3, 4, 5, 6]
    assert "@head" in op_lines(text)[-1] and "@embed" in op_lines(text)[1]
    assert "embedded (1, 8, 32)" in capsys.readouterr().out


def test_a_frame_dynamo_skips_is_narrated_by_the_eager_capture():
    model, x = LoopBreak().eval(), torch.randn(1, 4, 32)
    lines = Lines()
    with torch.no_grad():
        tl.compile(model, narrate=NarrationOptions(sink=lines, sites=True), compiler="eager")(x)
    text = lines.last_pass()
    assert body(text) == body(eager_text(model, x, sites=True))
    muls = [line for line in op_lines(text) if " mul " in line]
    assert len(muls) == 2 and all("@" not in line for line in muls), "the loop body's op runs in the root"


@pytest.mark.slow
def test_dynamic_shapes_show_each_calls_concrete_sizes_and_optionally_symbols():
    lines, symbolic = Lines(), Lines()
    model = tiny_gpt()
    concrete_model = tl.compile(model, narrate=NarrationOptions(sink=lines, select=tl.in_module("head")),
                                compiler="eager", dynamic=True)
    symbolic_model = tl.compile(model, narrate=NarrationOptions(sink=symbolic, select=tl.in_module("head"),
                                                                symbolic_shapes=True), compiler="eager", dynamic=True)
    with torch.no_grad():
        for batch, length in ((1, 5), (3, 7)):
            concrete_model(tokens(batch, length))
            assert f"[{batch},{length},64] f32 cpu" in lines.last_pass()
            symbolic_model(tokens(batch, length))
    head = next(line for line in op_lines(symbolic.last_pass()) if "@head" in line)
    assert re.search(r"\[s\d+,s\d+,64\] f32 cpu", head), head


def test_live_mode_writes_the_same_lines_as_fused(tmp_path):
    model, x = tiny_gpt(), tokens()
    live_path, fused_path = tmp_path / "live.log", tmp_path / "fused.log"
    with torch.no_grad():
        tl.compile(model, narrate=live_path, live=True)(x)
        tl.compile(model, narrate=fused_path, compiler="eager")(x)
    assert live_path.read_text() == fused_path.read_text()


def test_selection_max_lines_prefix_and_normalize_work_compiled():
    model, x = tiny_gpt(), tokens()
    options = dict(select=tl.in_module("blocks.1.mlp"), max_lines=4, prefix="[c] ", normalize=True, sites=True)
    lines = Lines()
    with torch.no_grad():
        tl.compile(model, narrate=NarrationOptions(sink=lines, **options), compiler="eager")(x)
    compiled_text = [line for line in lines if not line.startswith("[c] -- pass")]
    eager = eager_text(model, x, **options).splitlines()
    assert compiled_text[:-1] == eager[:-1]
    assert compiled_text[4] == "[c] -- max_lines=4 reached: narration stops here; the run goes on"
    assert all(line.startswith("[c] ") for line in lines)
    assert not any("/" in line for line in compiled_text[:4])


def test_recompiles_keep_one_ordinal_sequence_per_forward():
    model, lines = tiny_gpt(), Lines()
    compiled = tl.compile(model, narrate=lines, compiler="eager")
    with torch.no_grad():
        for length in (4, 6, 6):
            compiled(tokens(1, length))
            text = lines.last_pass()
            assert ordinals(text) == list(range(1, 62))


def test_function_compiled_with_tl_compile_is_narrated():
    model = Tiny()

    def step(x):
        return model(x) * 2

    lines = Lines()
    compiled = tl.compile(step, narrate=lines, compiler="eager")
    compiled(torch.randn(3, 2))
    text = lines.last_pass()
    assert [OP_LINE.match(line).group("op") for line in op_lines(text)] == ["input", "linear", "relu", "mul"]
    assert "#1    input         [3,2] f32 cpu  x" in text


def test_bad_options_are_typed_errors_listing_what_is_accepted():
    model = Tiny()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:  # dynamo wraps backend errors
        torch.compile(model, backend="torchlens", options={"narate": True})(torch.randn(1, 2))
    error = info.value.inner_exception
    assert isinstance(error, tl.errors.OptionTypeError) and isinstance(error, TypeError)
    assert "did you mean 'narrate'" in str(error) and "live" in str(error) and "compiler" in str(error)
    with pytest.raises(tl.errors.OptionValueError, match="value_stats='exactly'"):
        tl.compile(model, value_stats="exactly")
    with pytest.raises(tl.errors.OptionTypeError, match=r"live=\.\.\.\) takes True or False"):
        tl.compile(model, live="yes")
    with pytest.raises(tl.errors.OptionValueError, match="not a registered backend"):
        tl.compile(model, compiler="inductr")
    with pytest.raises(tl.errors.OptionTypeError, match="compiler="):
        tl.compile(model, backend="inductor")
    with pytest.raises(tl.errors.ModelTypeError):
        tl.compile(42)


def test_the_backend_is_listed_by_dynamo():
    assert "torchlens" in torch._dynamo.list_backends()


def _run(code, env=None):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_installed_backend_works_without_importing_torchlens():
    result = _run("""
        import sys
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        assert "torchlens" in torch._dynamo.list_backends()
        assert "torchlens" not in sys.modules
        compiled = torch.compile(model, backend="torchlens", options={"narrate": True, "compiler": "eager"})
        compiled(torch.randn(1, 2))
        print("modules imported lazily:", "torchlens" in sys.modules)
    """)
    assert "#2    linear        [1,2] f32 cpu  @0" in result.stderr
    assert "modules imported lazily: True" in result.stdout


@pytest.mark.slow
def test_source_checkout_registers_on_import():
    """Without an installed distribution (no entry point), importing torchlens registers the backend."""
    result = _run("""
        import importlib.metadata as metadata
        real = metadata.entry_points
        metadata.entry_points = lambda **kw: metadata.EntryPoints(()) if kw.get("group") == "torch_dynamo_backends" else real(**kw)
        import torch
        assert "torchlens" not in torch._dynamo.list_backends()
        import torchlens
        assert "torchlens" in torch._dynamo.list_backends()
        model = torch.nn.Linear(2, 2)
        torch.compile(model, backend="torchlens", options={"narrate": True, "compiler": "eager"})(torch.randn(1, 2))
    """, env={**os.environ, "PYTHONPATH": REPO})
    assert "#2    linear        [1,2] f32 cpu" in result.stderr



@pytest.mark.slow
def test_transformers_gpt2_compiles_narrates_and_matches_eager():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    lines = Lines()
    with torch.no_grad():
        out = tl.compile(model, narrate=NarrationOptions(sink=lines, sites=True))(ids)
        expected = model(ids)
    assert torch.allclose(out.logits, expected.logits, atol=1e-4, rtol=1e-4)
    text = lines.last_pass()
    assert body(text) == body(eager_text(model, ids, sites=True))
    assert "> transformer.h.1.attn.c_attn (Conv1D)" in text
    assert re.search(r"#\d+ +addmm +\[24,192\] f32 cpu  @transformer\.h\.0\.attn\.c_attn  transformers/pytorch_utils\.py:\d+", text)
    assert "=>    output        [2,12,128] f32 cpu  out['logits']" in text


# -- robustness ----------------------------------------------------------------------------------


def test_a_compiled_call_inside_an_except_block_is_not_a_failure():
    compiled = tl.compile(Tiny(), compiler="eager")
    try:
        raise KeyError("handled by the caller")
    except KeyError:
        out = compiled(torch.randn(1, 2))  # e.g. a retry after an error
    recording = compiled.torchlens.last_recording
    assert not isinstance(recording, tl.PartialTrace) and torch.equal(recording.output, out)


def test_dynamic_sizes_computed_with_floor_and_ceil_are_resolved():
    class Resample(torch.nn.Module):
        def forward(self, x):
            up = torch.nn.functional.interpolate(x, scale_factor=1.5, mode="nearest")
            return torch.nn.functional.max_pool1d(up, 2, ceil_mode=True)

    lines = Lines()
    compiled = tl.compile(Resample(), narrate=lines, compiler="eager", dynamic=True)
    for length in (6, 9):
        compiled(torch.randn(1, 2, length))
        up = int(length * 1.5)
        text = lines.last_pass()
        assert f"[1,2,{up}] f32 cpu" in text and f"[1,2,{-(-up // 2)}] f32 cpu" in text, text


def test_repeated_compiled_traces_reuse_the_compiled_graphs():
    model, x = tiny_gpt(), tokens()
    tl.trace(model, x, compiled={"compiler": "eager"})
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(10):  # more than dynamo's default limit of 8 recompiles
        trace = tl.trace(model, x, compiled={"compiler": "eager"})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert len(trace.values) == len(trace.ops)


def test_a_compiled_trace_that_compiled_nothing_says_so():
    class Skipped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Tiny()

        @torch.compiler.disable
        def forward(self, x):  # dynamo runs it as it is: no graph
            return self.inner(x)

    with pytest.warns(tl.errors.NarrationWarning, match="compiled no graph"):
        tl.trace(Skipped(), torch.randn(1, 2), compiled={"compiler": "eager"})


def test_kept_values_are_taken_before_later_in_place_ops():
    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            y += x
            return y.relu()

    model, x = Residual(), torch.randn(2, 4)
    report = tl.debug.compare(tl.trace(model, x), tl.trace(model, x, compiled={"compiler": "eager"}))
    assert report.first_divergence is None, str(report)


def test_compiled_entry_points_check_their_arguments():
    with pytest.raises(tl.errors.UnknownModuleError, match="blocks.1.atn"):
        tl.compile(tiny_gpt(), narrate=tl.in_module("blocks.1.atn"))
    with pytest.raises(tl.errors.OptionTypeError, match="keyword of tl.trace itself"):
        tl.trace(Tiny(), torch.randn(1, 2), compiled={"narrate": True})
    with pytest.raises(tl.errors.OptionTypeError, match="not options="):
        tl.compile(Tiny(), options={"narrate": True})
    with pytest.raises(tl.errors.OptionTypeError, match="did you mean 'dynamic'"):
        tl.compile(Tiny(), dynamc=True)


def test_planning_a_dynamic_graph_keeps_its_sizes_symbolic_and_the_lines_concrete():
    # A Linear compiled before at another batch size makes dynamo trace the next graph with a
    # symbolic batch: reading the graph for narration must not specialise it.
    torch.compile(nn.Linear(16, 16), backend="eager")(torch.randn(7, 16))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    trace = tl.trace(model, x, compiled={"compiler": "eager"})
    assert [list(e.outputs[0].shape) for e in trace.ops] == [[5, 8], [5, 16], [5, 16], [5, 4]]
    assert tl.debug.compare(tl.trace(model, x), trace).first_divergence is None


def test_on_error_only_writes_nothing_for_a_successful_compiled_call_and_the_pass_when_one_fails():
    sink = io.StringIO()
    compiled = tl.compile(Tiny(), narrate=NarrationOptions(sink=sink, on_error_only=True), compiler="eager")
    compiled(torch.randn(1, 2))
    compiled(torch.randn(1, 2))
    assert sink.getvalue() == ""
    with pytest.raises(RuntimeError) as info:
        compiled(torch.randn(1, 3))
    lines = sink.getvalue().splitlines()
    assert lines[0] == "-- pass 3" and lines[1].startswith("!! forward failed")
    assert info.value.partial_trace.narrate() == sink.getvalue()


def test_a_recorder_with_on_error_only_prints_only_the_failed_pass():
    sink = io.StringIO()
    model = Tiny()
    with tl.recording.Recorder(model, narrate=NarrationOptions(sink=sink, on_error_only=True)):
        model(torch.randn(1, 2))
        with pytest.raises(RuntimeError):
            model(torch.randn(1, 3))
    lines = sink.getvalue().splitlines()
    assert lines[0] == "-- pass 2" and lines[1].startswith("!! forward failed")


@pytest.mark.parametrize("entry", ["compile", "trace"])
def test_disable_true_is_refused_rather_than_narrating_nothing(entry):
    with pytest.raises(tl.errors.OptionValueError, match="disable=True turns torch.compile off"):
        if entry == "compile":
            tl.compile(Tiny(), disable=True)
        else:
            tl.trace(Tiny(), torch.randn(1, 2), compiled={"disable": True})


def test_generate_is_narrated_when_the_forward_itself_is_compiled():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.arange(4)[None]
    plain = model.generate(ids, max_new_tokens=3, do_sample=False)
    lines = []
    model.forward = tl.compile(model.forward, narrate=lines.append, compiler="eager")  # as docs/compiled.md says
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), plain)
    assert sum(line.startswith("-- pass") for line in lines) == 3  # one narrated pass per decoding step


class _BrokenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.fc(x))
        torch._dynamo.graph_break()
        return y * 2


class _BlockTwice(nn.Module):
    """The same graphs called twice in one pass, at the same module: the second call's events are
    not the first's (a replayed segment must be keyed by the pass's running ordinal)."""

    def __init__(self):
        super().__init__()
        self.block = _BrokenBlock()

    def forward(self, x):
        return self.block(self.block(x))


def test_a_graph_called_twice_in_one_pass_numbers_each_call_on():
    model, lines = _BlockTwice(), Lines()
    compiled = torch.compile(model, backend="torchlens", options={"narrate": lines, "compiler": "eager"})
    for _ in range(2):  # the second pass replays the segments the first remembered
        compiled(torch.randn(2, 4))
        text = lines.last_pass()
        assert ordinals(text) == list(range(1, 8)), text
        assert op_lines(text) == op_lines(eager_text(model, torch.randn(2, 4)))


@pytest.mark.parametrize("backend", ["tl.compile", "string"])
def test_a_compiled_forward_keeps_nothing_of_its_callers_alive(backend):
    """The pass reads the compile wrapper's frame while the call runs; once it ends, the callers'
    locals (a batch, a model's activations, anything a training loop holds) are theirs to free."""
    import gc
    import weakref

    class Held:
        pass

    torch.manual_seed(0)
    model = Tiny()
    compiled = (tl.compile(model, narrate=io.StringIO(), compiler="eager") if backend == "tl.compile" else
                torch.compile(model, backend="torchlens", options={"narrate": io.StringIO(), "compiler": "eager"}))

    def caller():
        held = Held()
        compiled(torch.randn(1, 2)).sum()
        return weakref.ref(held)

    caller()  # the first call compiles
    gc.collect()
    gc.disable()  # freed when the call returns, not at a collection
    try:
        assert caller()() is None, "a caller's local outlived its call"
    finally:
        gc.enable()


class JaggedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, nt):
        return (self.norm(self.fc(nt)).relu() * 2).sqrt()


def _jagged(nan: bool = False):
    generator = torch.Generator().manual_seed(1)
    parts = [torch.randn(2, 4, generator=generator), torch.randn(3, 4, generator=generator)]
    if nan:
        parts[1][2, 1] = float("nan")
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


@pytest.mark.parametrize("options", [{"value_stats": "exact"}, {"on_nonfinite": "track", "value_stats": "reuse"}],
                         ids=["exact", "track"])
def test_a_jagged_nested_tensor_is_narrated_compiled_as_eager(options):
    """A jagged dimension's size is a nested int (`j1`), not a number: shown as eager shows it."""
    torch.manual_seed(0)
    model = JaggedBlock()

    def transcript(lines):
        return [re.sub(r"\bj\d+\b", "jN", line) for line in lines if not line.startswith("--")]

    for nan in (False, True):
        eager, compiled = [], []
        expected = tl.record(model, _jagged(nan), narrate=eager.append, **options)
        torch._dynamo.reset()
        runner = tl.compile(model, narrate=compiled.append, compiler="eager", **options)
        out = runner(_jagged(nan))
        assert transcript(compiled) == transcript(eager)
        assert any(" layer_norm " in line and "[2,j" in line for line in compiled)
        assert torch.equal(out.values(), expected.output.values()) or nan
        if "on_nonfinite" in options:
            first = runner.torchlens.last_recording.first_nonfinite
            assert (first.op if first else None) == (expected.first_nonfinite.op if nan else None) == \
                ("input" if nan else None)
