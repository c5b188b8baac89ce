"""Things that must not break a run: odd outputs, odd dtypes, strict warnings, broken exceptions,
sinks that use torch, modules called from unexpected places."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from helpers import OP_LINE, check_nesting, op_lines
from models import Block, Tiny, tiny_gpt, tokens
from torch import nn

import torchlens as tl


def ops_of(text):
    return [OP_LINE.match(line).group("op") for line in op_lines(text)]


class NamedTupleOps(nn.Module):
    """Ops whose result is a named tuple (`torch.return_types`): values and indices."""

    def forward(self, x):
        values, indices = torch.max(x, dim=1)
        ordered = x.sort(dim=-1).values
        return values + ordered[:, 0] + indices


def test_ops_returning_named_tuples_are_narrated_eagerly_and_compiled():
    x = torch.randn(3, 4)
    eager = tl.record(NamedTupleOps(), x).narrate()
    assert ops_of(eager) == ["input", "max", "sort", "getitem", "add", "add"]
    assert "[3] f32 cpu, [3] i64 cpu" in op_lines(eager)[1]
    lines = []
    tl.compile(NamedTupleOps(), narrate=lines.append, compiler="eager")(x)
    compiled = "\n".join(lines)
    assert ops_of(compiled) == ops_of(eager)


def test_a_module_called_from_inside_another_nests_under_its_caller():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.GELU()
            self.block = Block(8, 2)

        def forward(self, x):
            return self.block(x) + self.act(x)

    class Caller(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = act  # registered here too, but called by `inner` below

        def forward(self, x):
            return self.act(self.fc(x))

    model = Shared()
    model.block.mlp = Caller(model.act)
    text = tl.record(model, torch.randn(1, 3, 8)).narrate()
    assert check_nesting(text) >= 3
    assert "    > act (GELU)" in text.splitlines(), "called by block.mlp: indented under it"


def test_depth_on_a_module_list_model_folds_into_each_called_block():
    text = tl.record(tiny_gpt(), tokens(), narrate=tl.options.NarrationOptions(sink=io.StringIO(), depth=1)).narrate()
    exits = [line for line in text.splitlines() if line.startswith("< blocks.")]
    assert len(exits) == 2 and all(line.endswith("ops folded]") for line in exits)


def test_strict_warnings_never_turn_a_torchlens_problem_into_the_users_error():
    def broken(line):
        raise OSError("sink gone")

    model, x = Tiny(), torch.randn(1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec = tl.record(model, x, narrate=broken)  # the warning is dropped, not raised
        assert torch.equal(rec.output, model(x))
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            tl.record(model, torch.randn(1, 3), narrate=broken)


def test_an_exception_whose_message_itself_fails_still_propagates_unchanged():
    class Unprintable(Exception):
        def __str__(self):
            raise ValueError("no message")

    class Raises(nn.Module):
        def forward(self, x):
            raise Unprintable()

    with pytest.raises(Unprintable) as info:
        tl.record(Raises(), torch.randn(1), narrate=lambda line: None)
    assert "<message could not be rendered>" in info.value.partial_trace.error


def test_a_sink_that_calls_torch_is_not_narrated_as_the_models_op():
    seen = []

    def torchy(line):
        seen.append(torch.tensor([len(line)]).sum())  # torch work inside the sink

    text = tl.record(tiny_gpt(), tokens(), narrate=torchy)
    assert [e.op for e in text.ops].count("tensor") == 0 and len(seen) > 50


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_statistics_of_dtypes_that_cannot_be_reduced_say_so_and_the_capture_goes_on():
    class Quantizes(nn.Module):
        def forward(self, x):
            q = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
            return q.dequantize() * 2

    rec = tl.record(Quantizes(), torch.randn(4), value_stats="exact", on_nonfinite="track",
                    narrate=lambda line: None)
    text = rec.narrate()
    assert "stats n/a (qint8)" in text
    assert ops_of(text)[-1] == "mul" and "| min=" in op_lines(text)[-1], "ops after it are still measured"


def test_max_lines_with_tracking_renders_the_same_after_the_fact():
    class LogNeg(nn.Module):
        def forward(self, x):
            return torch.log(x - 1).exp().sum()

    sink = io.StringIO()
    rec = tl.record(LogNeg(), torch.arange(4.0), on_nonfinite="track",
                    narrate=tl.options.NarrationOptions(sink=sink, max_lines=2))
    assert rec.narrate() == sink.getvalue()


def test_recorder_keeps_the_last_passes_when_asked():
    model = Tiny()
    with tl.recording.Recorder(model, keep=2) as recorder:
        for _ in range(5):
            model(torch.randn(1, 2))
    assert recorder.passes == 5 and len(recorder.recordings) == 2
    assert recorder.recordings[-1].header == "pass 5"
    with pytest.raises(tl.errors.RecorderStateError):
        with recorder:
            with recorder:
                pass
    with pytest.raises(ValueError, match="keep="):
        tl.recording.Recorder(model, keep=-1)


def test_bad_arguments_after_the_fact_are_typed_errors():
    rec = tl.record(tiny_gpt(), tokens())
    with pytest.raises(tl.errors.OptionValueError, match="last=-1"):
        rec.narrate(last=-1)
    with pytest.raises(tl.errors.OptionTypeError, match=r"^narrate\(normalize=\.\.\.\) takes True or False"):
        rec.narrate(normalize=3)
    with pytest.raises(tl.errors.UnknownModuleError, match="blocks.9"):
        rec.narrate(select=tl.in_module("blocks.9"))
    with pytest.raises(tl.errors.OptionTypeError, match="sink="):
        tl.options.NarrationOptions(sink=tl.in_module("blocks.0"))
    with pytest.raises(tl.errors.OptionTypeError, match="value_stats="):
        tl.record(Tiny(), torch.randn(1, 2), value_stats=3)
    with pytest.raises(tl.errors.OptionValueError, match="max_bytes=-1"):
        tl.trace(Tiny(), torch.randn(1, 2), max_bytes=-1)


def test_import_is_cheap_for_eager_use():
    import subprocess
    import sys

    code = "import sys, torchlens; print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
