"""Value statistics (`value_stats=`) and non-finite tracking (`on_nonfinite=`), eager."""

from __future__ import annotations

import io
import re
import warnings

import pytest
import torch
from helpers import count_host_syncs, op_lines
from models import conv_net, images, tiny_gpt, tokens
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchlens as tl
import torchlens.fx_backend.compiled_pass
import torchlens.measure.meter

NarrationOptions = tl.options.NarrationOptions


class LogOfNegative(nn.Module):
    """`log` of a linear's output: negative entries become NaN, which then spread."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.log(self.fc(x))).relu()


def narrated(model, x, **kwargs):
    sink = io.StringIO()
    options = kwargs.pop("options", {})
    rec = tl.record(model, x, narrate=NarrationOptions(sink=sink, **options), **kwargs)
    return sink.getvalue(), rec


def line_of(text, op):
    return next(line for line in op_lines(text) if f" {op} " in line)


def test_tracking_names_log_as_the_first_nonfinite_op_and_shows_its_counts():
    model, x = LogOfNegative(), torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    expected_nan = int(torch.isnan(torch.log(model.fc(x))).sum())
    assert expected_nan > 0
    text, rec = narrated(model, x, on_nonfinite="track", value_stats="reuse")
    assert line_of(text, "log").endswith(f"| nan={expected_nan}")
    assert line_of(text, "linear").endswith("| finite")
    assert text.count("!! ") == 1
    assert f"!! NaN born at #3 log (nan={expected_nan})" in text
    assert rec.first_nonfinite.op == "log" and rec.first_nonfinite.ordinal == 3 and rec.first_nonfinite.module == ""
    assert text.splitlines()[-1].endswith(f"first non-finite: NaN born at #3 log (nan={expected_nan})")


def test_tracking_without_narration_reads_once_per_forward_and_still_finds_the_op(deferred_reads):
    model, x = LogOfNegative(), torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with count_host_syncs() as syncs:
        rec = tl.record(model, x, on_nonfinite="track")
    assert len(syncs) == 1, syncs
    assert rec.first_nonfinite.op == "log"
    assert "!! NaN born at #3 log" in rec.narrate()


def test_reuse_adds_no_read_beyond_tracking():
    model, x = tiny_gpt(), tokens()
    with count_host_syncs() as tracking:
        tl.record(model, x, on_nonfinite="track", narrate=lambda line: None)
    with count_host_syncs() as reusing:
        tl.record(model, x, on_nonfinite="track", value_stats="reuse", narrate=lambda line: None)
    assert len(reusing) == len(tracking)
    with count_host_syncs() as off:
        tl.record(model, x, value_stats="off", narrate=lambda line: None)
    assert off == []


def test_raise_stops_at_the_first_nonfinite_op_with_a_typed_error_and_the_partial_trace():
    model, x = LogOfNegative(), torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(tl.errors.NonFiniteError, match=r"NaN born at #3 log \(nan=\d+\)") as info:
        tl.record(model, x, on_nonfinite="raise")
    assert isinstance(info.value, FloatingPointError)
    partial = info.value.partial_trace
    assert [e.op for e in partial.ops] == ["input", "linear", "log"], "the forward stopped right after log"
    assert partial.narrate(last=2).splitlines()[-1].startswith("!! NaN born at #3 log")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_nonfinite_values_in_half_bfloat_and_double_outputs_are_flagged(dtype):
    class LogIn(nn.Module):
        def forward(self, x):
            return torch.log(x.to(dtype) - 2)

    text, rec = narrated(LogIn(), torch.tensor([1.0, 2.0, 3.0, 4.0]), on_nonfinite="track", value_stats="exact")
    assert line_of(text, "log").endswith("nan=1 -inf=1")
    assert rec.first_nonfinite.op == "log" and rec.first_nonfinite.outputs[0].dtype == dtype


def test_float8_infinity_from_overflow_is_flagged():
    class Cast(nn.Module):
        def forward(self, x):
            return x.to(torch.float8_e5m2)

    text, rec = narrated(Cast(), torch.tensor([1.0, 1e6]), on_nonfinite="track", value_stats="reuse")
    assert line_of(text, "to").endswith("| +inf=1")  # e5m2 overflows to infinity
    assert rec.first_nonfinite.op == "to"


def test_float8_nan_is_flagged():
    class Cast(nn.Module):
        def forward(self, x):
            return torch.sqrt(x).to(torch.float8_e4m3fn)  # e4m3fn has no infinity, but keeps NaN

    text, rec = narrated(Cast(), torch.tensor([1.0, -1.0, 4.0]), on_nonfinite="track", value_stats="reuse")
    assert line_of(text, "to").endswith("| nan=1")
    assert rec.first_nonfinite.op == "sqrt"


def test_exact_values_equal_torch_reductions():
    model, x = conv_net(), images(2)
    text, rec = narrated(model, x, value_stats="exact")
    trace = tl.trace(model, x)
    for event in rec.ops:
        value = trace.value(event.ordinal).double()
        stats = event.stats
        mn, mx = torch.aminmax(value)
        assert stats.min == pytest.approx(mn.item(), rel=1e-6, abs=1e-6)
        assert stats.max == pytest.approx(mx.item(), rel=1e-6, abs=1e-6)
        assert stats.mean == pytest.approx(value.mean().item(), rel=1e-5, abs=1e-6)
        assert stats.sd == pytest.approx(value.std().item(), rel=1e-5, abs=1e-6)
        assert stats.nan == stats.posinf == stats.neginf == 0
    assert re.search(r"\| min=-?[\d.e+-]+ max=[\d.e+-]+ mean=-?[\d.e+-]+ sd=[\d.e+-]+ finite$", line_of(text, "conv2d"))


class Reductions(TorchDispatchMode):
    """Counts the aminmax reductions run: one per tensor the exact statistics actually measure."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.aminmax.default
        return func(*args, **(kwargs or {}))


class Reshapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 6) / 6)

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)  # [3, 4]
        y = y.view(12).view(4, 3).t()   # views of the same 12 elements: measured once
        y = y.relu_()                   # changed in place: measured again
        return y.reshape(12)[:6].sum(0)  # a copy (the view is transposed), half of it, a sum: measured


def test_views_of_a_measured_tensor_share_its_statistics_until_it_changes():
    x = torch.arange(18.0).reshape(3, 6) - 9
    model = Reshapes().requires_grad_(False)
    for live in (False, True):
        with Reductions() as counter:
            rec = tl.record(model, x, value_stats="exact", narrate=(lambda line: None) if live else None)
        ops = {event.op: event.stats for event in rec.ops}
        trace = tl.trace(model, x)
        for event in rec.ops:
            value = trace.value(event.ordinal).double()
            assert event.stats.min == pytest.approx(value.min().item()), (live, event.op)
            assert event.stats.mean == pytest.approx(value.mean().item()), (live, event.op)
        assert ops["relu_"].min == 0 and ops["linear"].min < 0
        assert counter.count == 6, live  # input, linear, relu_, reshape, [:6], sum; not the 3 views


def test_exact_stats_of_a_tensor_with_nan_summarise_its_finite_values(monkeypatch):
    class Holes(nn.Module):
        def forward(self, x):
            return torch.where(x > 2, float("nan"), x) + 0

    x = torch.arange(6.0)
    live = tl.record(Holes(), x, value_stats="exact", narrate=lambda line: None).ops[-1].stats
    assert (live.min, live.max, live.mean, live.nan) == (0, 2, 1, 3)
    assert live.sd == pytest.approx(1.0)
    assert str(live) == "min=0 max=2 mean=1 sd=1 nan=3"
    # on the CPU, read as the op completes even with no line printed: the same statistics
    unprinted = tl.record(Holes(), x, value_stats="exact").ops[-1].stats
    assert str(unprinted) == str(live)
    # read at the end of the forward (an accelerator's), the tensor is gone: the counts are exact,
    # the rest not claimed
    monkeypatch.setattr(torchlens.measure.meter, "READ_NOW", set())
    later = tl.record(Holes(), x, value_stats="exact").ops[-1].stats
    assert (later.nan, later.min, later.mean) == (3, None, None) and str(later) == "nan=3"
    finite = tl.record(Holes(), x - 10, value_stats="exact").ops[-1].stats
    assert (finite.min, finite.max, finite.nan) == (-10, -5, 0)


def test_sampled_reads_a_bounded_sample_and_says_how_many():
    class Big(nn.Module):
        def forward(self, x):
            return x * 2

    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    reduced = []

    class Reductions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name().split("::")[1].split(".")[0] in ("aminmax", "mean", "sum", "linalg_vector_norm", "amin", "amax"):
                reduced.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    sink = io.StringIO()
    rec = tl.record(Big(), x, value_stats="sampled", narrate=sink)
    with Reductions():
        tl.record(Big(), x, value_stats="sampled", narrate=lambda line: None)
    assert reduced and max(reduced) <= 4096
    line = line_of(sink.getvalue(), "mul")
    assert re.search(r"\| min~=\S+ max~=\S+ mean~=\S+ sd~=\S+ sampled=4096/1048576$", line), line
    assert "finite" not in line, "a sample never claims finiteness"
    assert rec.ops[-1].stats.sd == pytest.approx(2.0, rel=0.05)


def test_every_dtype_and_layout_is_handled_without_errors():
    class Many(nn.Module):
        def forward(self, x):
            return (
                x.to(torch.complex64) * 1j,
                x.long() + 1,
                x > 0,
                x[:0] * 2,
                x.double().exp(),
            )

    text, rec = narrated(Many(), torch.randn(2, 3), value_stats="exact", on_nonfinite="track")
    assert "| min=" in line_of(text, "mul")  # complex: statistics of magnitudes
    assert re.search(r"add .*\| min=-?\d+ max=-?\d+ mean=", text)  # integers: no finiteness to claim
    assert re.search(r"gt .*\| true=\d+/6", text)
    assert "stats n/a (empty)" in text
    meta_text, _ = narrated(tiny_gpt().to("meta"), torch.zeros(1, 4, dtype=torch.long, device="meta"),
                            value_stats="exact", on_nonfinite="track")
    assert "stats n/a (meta)" in meta_text and "first non-finite" not in meta_text


def test_stats_never_change_outputs_or_gradients():
    model = tiny_gpt()
    x = tokens(2, 6)
    plain = model(x)
    for rung in ("reuse", "sampled", "exact"):
        rec = tl.record(model, x, value_stats=rung, on_nonfinite="track", narrate=lambda line: None)
        assert torch.equal(rec.output, plain)
    loss = tl.record(model, x, value_stats="exact").output.sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_rungs_and_tracking_modes_are_typed_errors():
    model, x = LogOfNegative(), torch.randn(1, 4)
    with pytest.raises(tl.errors.OptionValueError, match=r"'off', 'reuse', 'sampled' or 'exact'"):
        tl.record(model, x, value_stats="full")
    with pytest.raises(tl.errors.OptionValueError, match=r"None, 'track' or 'raise'"):
        tl.record(model, x, on_nonfinite="warn")
    with pytest.raises(tl.errors.OptionValueError, match="on_nonfinite='track'"):
        tl.record(model, x, value_stats="reuse")


# -- compiled ------------------------------------------------------------------------------------


def body(text):
    return [line for line in text.splitlines() if not line.startswith("--")]


def test_compiled_tracking_matches_eager_and_names_the_same_op():
    model, x = LogOfNegative(), torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    lines = []
    with torch.no_grad():
        out = tl.compile(model, narrate=lines.append, on_nonfinite="track", value_stats="reuse")(x)
        plain = torch.compile(model)(x)
    eager, _ = narrated(model, x, on_nonfinite="track", value_stats="reuse")
    assert body("\n".join(lines)) == body(eager)
    assert "first non-finite: NaN born at #3 log" in lines[-1]
    assert torch.allclose(out, plain, equal_nan=True)


def test_compiled_exact_stats_agree_with_eager_and_leave_outputs_alone():
    model, x = conv_net(), images(2)
    compiled = tl.compile(model, value_stats="exact")
    with torch.no_grad():
        out = compiled(x)
        plain = torch.compile(model)(x)
    # fusing the reductions into the producing kernels may move the output's last bit, no more
    assert torch.allclose(out, plain, rtol=1e-6, atol=1e-6)
    eager = tl.record(model, x, value_stats="exact")
    compiled_ops = compiled.torchlens.last_recording.ops
    assert [e.op for e in compiled_ops] == [e.op for e in eager.ops]
    for mine, theirs in zip(compiled_ops[1:], eager.ops[1:]):
        for name in ("min", "max", "mean", "sd"):
            assert getattr(mine.stats, name) == pytest.approx(getattr(theirs.stats, name), rel=1e-4, abs=1e-5)
        assert mine.stats.nan == 0


class Holes3(nn.Module):
    """3 NaN, 5 +inf and 7 -inf among 20 values: each count is told apart from the others."""

    def forward(self, x):
        x = x * 1
        x = torch.where(x < 3, float("nan"), x)
        x = torch.where((x >= 3) & (x < 8), float("inf"), x)
        return torch.where((x >= 8) & (x < 15), -float("inf"), x)


def test_compiled_exact_stats_count_each_kind_of_nonfinite_value_as_eager_does(deferred_reads):
    x = torch.arange(20.0)
    lines = []
    tl.compile(Holes3(), narrate=lines.append, value_stats="exact", on_nonfinite="track")(x)
    # as eager statistics read at the end of the forward (not live): counts only for such a tensor
    eager = tl.record(Holes3(), x, value_stats="exact", on_nonfinite="track").narrate()
    assert body("\n".join(lines)) == body(eager)
    last = [line for line in lines if line.startswith("#") and " where " in line][-1]
    assert last.endswith("| nan=3 +inf=5 -inf=7"), last


@pytest.mark.parametrize("numel", [(1 << 17) - 1, 1 << 17, (1 << 24) - 1, 1 << 24])
def test_lean_counts_are_exact_on_each_side_of_their_limits(numel):
    from torchlens.measure.stats import count_vector, lean_count_vector

    x = torch.full((numel,), -float("inf"))
    x[:2], x[2:5] = float("nan"), float("inf")
    expected = [2, 3, numel - 5]
    assert lean_count_vector(x, torch.float64, numel).tolist() == count_vector(x, torch.float64).tolist() == expected
    traced = torch.compile(lambda t: lean_count_vector(t, torch.float64, numel), backend="aot_eager", fullgraph=True)
    assert traced(x).tolist() == expected


class ViewsAroundInPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        a = y.view(-1)      # the same elements as y: shares its statistics
        y.relu_()           # changed in place: what follows is measured again
        b = y.transpose(0, 1)
        return a.sum() + b.contiguous().sum()


@pytest.mark.parametrize("where", ["after_call", "fused"])
def test_compiled_views_share_statistics_unless_changed_in_place_between(monkeypatch, where):
    from torchlens.fx_backend import stats_pass

    measured = []
    if where == "fused":  # an accelerator's way: vectors traced into the graph
        monkeypatch.setattr(torchlens.measure.meter, "READ_NOW", set())
        original = stats_pass._vector_for
        monkeypatch.setattr(stats_pass, "_vector_for", lambda output, fake, *a: (measured.append(1), original(output, fake, *a))[1])
    else:  # the CPU's: outputs returned by the graph, measured after the call
        returned = stats_pass.measure_returned
        monkeypatch.setattr(stats_pass, "measure_returned", lambda slots, tensors, m, n: (measured.extend(tensors), returned(slots, tensors, m, n))[1])
        monkeypatch.setattr(torchlens.fx_backend.compiled_pass, "measure_returned", stats_pass.measure_returned)
    x = torch.arange(-6.0, 6.0).reshape(3, 4)
    compiled = tl.compile(ViewsAroundInPlace(), value_stats="exact", compiler="eager")
    compiled(x)
    ops = compiled.torchlens.last_recording.ops
    trace = tl.trace(ViewsAroundInPlace(), x)
    assert [e.op for e in ops] == [e.op for e in trace.ops]
    for event, eager in zip(ops, trace.ops):
        value = trace.value(eager.ordinal).double()
        assert (event.stats.min, event.stats.max) == (value.min().item(), value.max().item()), event.op
        assert event.stats.mean == pytest.approx(value.mean().item()), event.op
    by_op = {e.op: e.stats for e in ops}
    assert by_op["view"] is by_op["mul"] and by_op["view"].min < 0
    # the graph's transpose reads `mul`'s node, written in place since: measured again, not shared
    assert by_op["transpose"].min == 0 and by_op["transpose"] is not by_op["mul"]
    # `contiguous` of a transpose is a copy: measured again, as the eager meter measures it
    assert by_op["contiguous"] is not by_op["transpose"] and by_op["contiguous"].min == by_op["transpose"].min
    assert len(measured) == 7  # mul, relu_, transpose, contiguous, two sums, add (inputs are measured on entry)


def test_compiled_tracking_reads_once_per_graph_call(monkeypatch, deferred_reads):
    class TwoGraphs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            print("graph break")
            return self.b(x).log()

    model = TwoGraphs()
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")
    x = torch.randn(2, 4)
    compiled(x)
    # A counting torch-function mode would be traced into the graphs by dynamo: count host reads
    # by wrapping the tensor methods that perform them instead.
    reads = []
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    compiled(x)
    monkeypatch.undo()
    recording = compiled.torchlens.last_recording
    assert reads == ["tolist", "tolist"], reads  # one read per graph call, nothing else
    assert recording.first_nonfinite.op == "log"
    assert recording.footer_extra[0].startswith("2 compiled graph calls")


def test_compiled_raise_stops_with_the_partial_trace():
    model, x = LogOfNegative(), torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(tl.errors.NonFiniteError, match="#3 log"):
        tl.compile(model, on_nonfinite="raise", compiler="eager")(x)
    with pytest.raises(tl.errors.NonFiniteError) as info:
        tl.compile(model, on_nonfinite="raise", live=True)(x)
    assert [e.op for e in info.value.partial_trace.ops] == ["input", "linear", "log"]


def test_stats_on_module_outputs_measures_only_the_last_op_of_each_module_call():
    lines = []
    tl.compile(tiny_gpt(), narrate=lines.append, value_stats="exact", stats_on="module_outputs",
               compiler="eager")(tokens())
    ops = [i for i, line in enumerate(lines) if line.lstrip().startswith("#") and " input " not in line]
    measured = [i for i in ops if "| min=" in lines[i]]
    assert measured == [i for i in ops if lines[i + 1].lstrip().startswith("<")]
    assert len(measured) < len(ops) / 2
    with pytest.raises(tl.errors.OptionValueError, match="'ops' or 'module_outputs'"):
        tl.compile(tiny_gpt(), stats_on="modules")


def test_compiled_statistics_of_data_dependent_sizes_empty_or_not():
    class Positions(nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 100) + 1  # an unbacked size, zero for small inputs

    for scale, expected in ((1, None), (300, "| min=")):
        lines = []
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), warnings.catch_warnings():
            warnings.simplefilter("error", tl.errors.NarrationWarning)
            tl.compile(Positions(), narrate=lines.append, value_stats="exact", on_nonfinite="track",
                       compiler="eager")(torch.randn(5, generator=torch.Generator().manual_seed(0)) * scale)
        add = next(line for line in lines if " add " in line)
        assert (expected in add) if expected else ("|" not in add), add
        assert lines[-1].endswith("no non-finite values")
