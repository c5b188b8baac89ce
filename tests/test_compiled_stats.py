"""Compiled statistics on the CPU: the graph returns the outputs to measure, the eager meter measures
them after the call. Results stay bitwise those of plain `torch.compile`, lines read as eager's."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import op_lines
from models import conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl
from torchlens.events import Stats
from torchlens.fx_backend import stats_pass


def body(text):
    return [line for line in text.splitlines() if not line.startswith("-- ")]


class Holes(nn.Module):
    """NaN, +inf and -inf among finite values, then an op that keeps them."""

    def forward(self, x):
        x = torch.where(x < 3, float("nan"), x)
        x = torch.where((x >= 3) & (x < 5), float("inf"), x)
        return torch.where((x >= 5) & (x < 8), -float("inf"), x) * 2


@pytest.fixture
def strategy(monkeypatch):
    """Which way each graph measured: "after_call" or "fused", one entry per graph compiled."""
    seen = []
    original = stats_pass.add_stats_output

    def spy(*args, **kwargs):
        layout = original(*args, **kwargs)
        seen.append("after_call" if layout.after_call else "fused")
        return layout

    monkeypatch.setattr(stats_pass, "add_stats_output", spy)
    import torchlens.fx_backend.graph as graph_module

    monkeypatch.setattr(graph_module, "add_stats_output", spy)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("make, inputs", [(conv_net, lambda: images(2)), (tiny_gpt, tokens)])
def test_inductor_outputs_stay_at_float_rounding_of_plain_with_exact_stats_and_tracking(make, inputs, strategy):
    """The graph computes no statistic, but returning its intermediates makes inductor store them,
    which changes what it fuses and in which order it sums: a result may move by a few ulps (the
    conv net's do, the transformer's here do not), as with fused statistics."""
    model, x = make().eval(), inputs()
    with torch.no_grad():
        plain = torch.compile(model)(x)
        out = tl.compile(model, value_stats="exact", on_nonfinite="track", narrate=lambda line: None)(x)
    plain = plain if isinstance(plain, torch.Tensor) else plain.last_hidden_state
    out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
    assert torch.allclose(out, plain, rtol=1e-6, atol=1e-7)
    assert strategy and set(strategy) == {"after_call"}


@pytest.mark.parametrize("make, inputs", [(conv_net, lambda: images(2)), (tiny_gpt, tokens)])
def test_compiled_exact_and_reuse_lines_are_eager_lines(make, inputs):
    model, x = make().eval(), inputs()
    for options in (dict(value_stats="exact"), dict(on_nonfinite="track", value_stats="reuse")):
        lines = []
        with torch.no_grad():
            tl.compile(model, narrate=lines.append, compiler="eager", **options)(x)
            eager = tl.record(model, x, **options).narrate()
        assert body("\n".join(lines)) == body(eager), options


def test_a_compiled_tensor_with_nonfinite_values_shows_its_finite_summary_and_counts(strategy):
    x = torch.arange(10.0)
    lines = []
    tl.compile(Holes(), narrate=lines.append, value_stats="exact", on_nonfinite="track")(x)
    last = [line for line in lines if line.startswith("#") and " mul " in line][-1]
    assert last.endswith("| min=16 max=18 mean=17 sd=1.414 nan=3 +inf=2 -inf=3")
    assert body("\n".join(lines)) == body(tl.record(Holes(), x, value_stats="exact", on_nonfinite="track").narrate())
    assert strategy == ["after_call"]


@pytest.mark.parametrize("through", ["itself", "a view", "an unrelated tensor"])
def test_an_output_changed_in_place_later_in_the_graph_is_measured_as_its_op_left_it(through):
    class LaterWrite(nn.Module):
        def forward(self, x):
            y = x * 2
            z = y + 1
            if through == "itself":
                y.mul_(0)  # `y` holds zeros from here on; #2's line must still show 2x
            elif through == "a view":
                y.view(2, 2)[0].mul_(0)  # half of `y`, through a view of it
            else:
                z.mul_(0)  # another tensor: `y` itself stays as it was
            return z + y

    x = torch.arange(4.0)
    compiled = tl.compile(LaterWrite(), value_stats="exact", compiler="eager")
    compiled(x)
    mul = compiled.torchlens.last_recording.ops[1]
    assert mul.op == "mul" and (mul.stats.min, mul.stats.max, mul.stats.mean) == (0, 6, 3)


@pytest.mark.slow
def test_past_the_memory_budget_a_graph_fuses_its_statistics(monkeypatch, strategy):
    monkeypatch.setattr(stats_pass, "AFTER_CALL_BYTES", 100)  # less than the model's outputs hold
    x = torch.arange(10.0)
    lines = []
    tl.compile(Holes(), narrate=lines.append, value_stats="exact", on_nonfinite="track")(x)
    assert strategy == ["fused"]
    last = [line for line in lines if line.startswith("#") and " mul " in line][-1]
    assert last.endswith("| nan=3 +inf=2 -inf=3")  # fused: the counts, as an accelerator's deferred vector


def test_dynamic_sizes_are_measured_after_the_call_with_no_padded_vector(strategy):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = tl.compile(model, value_stats="exact", dynamic=True, compiler="eager")
    for rows in (3, 5, 7):
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            compiled(x)
            eager = tl.record(model, x, value_stats="exact")
        got = [str(e.stats) for e in compiled.torchlens.last_recording.ops]
        assert got == [str(e.stats) for e in eager.ops], rows
    assert strategy and set(strategy) == {"after_call"}


def test_empty_dynamic_outputs_say_so():
    class Positive(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2

    sink = io.StringIO()
    compiled = tl.compile(Positive(), value_stats="exact", dynamic=True, compiler="eager",
                          narrate=tl.options.NarrationOptions(sink=sink))
    for x in (torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, -2.0])):
        compiled(x)
    lines = op_lines(sink.getvalue())
    assert any(line.endswith("| stats n/a (empty)") for line in lines)
    assert any("min=2 max=6" in line for line in lines)


def test_a_training_step_with_compiled_statistics_gives_plain_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(5, 4)
    compiled = tl.compile(model, value_stats="exact", on_nonfinite="track", compiler="eager")
    compiled(x).sum().backward()
    narrated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.compile(model, backend="eager")(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(narrated, model.parameters()))
    stats = [e.stats for e in compiled.torchlens.last_recording.ops]
    assert stats[1].min < 0 == stats[2].min  # the linear's output before the relu, the relu's after


class LeakyInPlace(nn.Module):
    """`inplace=True` reaches the graph positionally: `F.leaky_relu(x, 0.0, True)`."""

    def __init__(self):
        super().__init__()
        self.act = nn.LeakyReLU(0.0, inplace=True)

    def forward(self, x):
        y = x * 2
        return self.act(y) + 1


class Relu6InPlace(LeakyInPlace):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU6(inplace=True)


class OutKeyword(nn.Module):
    def forward(self, x):
        y = x * 2
        torch.add(x, 100, out=y)
        return y + 1


class AtenOverload(nn.Module):
    def forward(self, x):
        y = x * 2
        torch.ops.aten.mul_.Tensor(y, torch.zeros(()))
        return y + 1


class RunningStatsRead(nn.Module):
    """Batch norm in training writes its running mean (not its first argument) after it was read."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4, momentum=1.0)

    def forward(self, x):
        y = self.bn.running_mean.unsqueeze(0)  # a view of the buffer the call below updates
        return self.bn(x) + y


@pytest.mark.parametrize("make", [LeakyInPlace, Relu6InPlace, OutKeyword, AtenOverload, RunningStatsRead])
def test_every_kind_of_later_write_is_seen_and_the_output_measured_as_its_op_left_it(make):
    """Writes the graph records in many spellings (a positional `inplace`, `out=`, an operator
    overload, an argument other than the first): each op's line equals eager's."""
    x = torch.linspace(-3, 3, 8).reshape(2, 4)
    torch.manual_seed(0)
    eager_model, compiled_model = make().train(), make().train()
    eager = tl.record(eager_model, x, value_stats="exact")
    compiled = tl.compile(compiled_model, value_stats="exact", compiler="eager")
    compiled(x)
    got = compiled.torchlens.last_recording.ops
    assert [(e.op, str(e.stats)) for e in got] == [(e.op, str(e.stats)) for e in eager.ops]


def test_graph_inputs_that_alias_in_a_later_call_are_measured_before_the_write():
    """Dynamo does not recompile when two inputs start sharing memory: an output that views one
    input is copied whenever the graph writes into any input."""

    def views_then_writes(a, b):
        v = a.view(-1)
        b.mul_(100)
        return v + 1

    compiled = tl.compile(views_then_writes, value_stats="exact", compiler="eager")
    compiled(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    compiled(base[:2], base[:2])  # two views of one memory: the write to `b` reaches `a`
    view = [e for e in compiled.torchlens.last_recording.ops if e.op == "view"][0]
    assert (view.stats.min, view.stats.max) == (1, 2)


def test_an_integer_output_tracking_skips_keeps_its_element_count():
    class ArgMax(nn.Module):
        def forward(self, x):
            return (x * 2).argmax(-1)

    x = torch.randn(3, 5)
    compiled = tl.compile(ArgMax(), on_nonfinite="track", compiler="eager")
    compiled(x)
    eager = tl.record(ArgMax(), x, on_nonfinite="track")
    assert [e.stats.numel for e in compiled.torchlens.last_recording.ops] == [e.stats.numel for e in eager.ops]


def test_a_tracked_compiled_forward_works_out_what_an_op_read_only_when_its_verdict_needs_it(monkeypatch):
    """As eagerly: an op judged finite never asks where its values came from, so only the ops that
    hold a non-finite value (the causal mask's -inf) have their reads worked out; their verdicts are
    those of the eager run."""
    from torchlens.core.pipeline import Pipeline
    from torchlens.fx_backend import compiled_pass

    resolved, kept = [], []
    real, record = compiled_pass._reads, Pipeline.op
    monkeypatch.setattr(compiled_pass, "_reads", lambda *args: resolved.append(1) or real(*args))

    def op(self, *args, **kwargs):  # what each op keeps of its reads once recorded (a pass drops all at its end)
        event = record(self, *args, **kwargs)
        kept.append((event, event.reads))
        return event

    monkeypatch.setattr(Pipeline, "op", op)
    model, x = tiny_gpt(), tokens()
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")
    compiled(x)
    resolved.clear(), kept.clear()
    compiled(x)
    rec = compiled.torchlens.last_recording
    held = [e for e in rec.ops if e.stats is not None and e.stats.nonfinite]
    assert len(rec.ops) > 40 and len(held) == 2
    assert len(resolved) == len(held)
    assert [event for event, reads in kept if reads is not None] == held  # (no tensor kept alive by the rest)
    with torch.no_grad():  # a NaN in a weight: found at the first op that reads it, named, eager and compiled
        next(m for m in model.modules() if isinstance(m, nn.Linear)).weight[0, 0] = float("nan")
    compiled(x)
    findings = [f.text for f in compiled.torchlens.last_recording.findings]
    assert findings == [f.text for f in tl.record(model, x, on_nonfinite="track").findings] != [], findings


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "bf16 autocast", "training"])
@pytest.mark.parametrize("name,options", [("qwen2", dict(value_stats="exact", on_nonfinite="track")),
                                          ("bart", dict(value_stats="exact")),
                                          ("nn_transformer", dict(on_nonfinite="track"))])
def test_returned_outputs_read_together_are_what_each_gives_alone_on_real_models(monkeypatch, name, options, mode):
    """On models from transformers' configs and torch's own transformer, under no_grad,
    inference_mode, bf16 autocast and training: every statistic of a compiled graph's returned
    outputs, read together, is the one measuring each output alone gives (a fresh meter, the same
    tensors, at once)."""
    import contextlib

    from real_models import REAL_MODELS

    from torchlens.measure.meter import Meter

    compared = []
    together = Meter.measure_all

    def checked(self, tensors):
        got = together(self, tensors)
        alone = Meter(self.rung, self.tracking)
        for tensor, stats in zip(tensors, got):
            expected = alone.measure(tensor, False)
            assert [getattr(expected, f) for f in Stats.__slots__] == [getattr(stats, f) for f in Stats.__slots__]
            compared.append(tensor.dtype)
        return got

    monkeypatch.setattr(Meter, "measure_all", checked)
    monkeypatch.setattr(stats_pass, "_screenable", lambda *args: False)  # (tracked graphs return their outputs)
    model, args, kwargs = REAL_MODELS[name].build()
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "training": contextlib.nullcontext,
               "bf16 autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[mode]
    model.train(mode == "training")
    torch._dynamo.reset()
    try:
        with context():
            tl.compile(model, compiler="eager", **options)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    assert len(compared) > 20 and torch.float32 in compared, compared


class SplitHeads(nn.Module):
    """A fused projection split into query, key and value, each viewed as heads and transposed
    (GPT-2's attention): views of one part of a multi-output op."""

    def __init__(self, width=256, heads=8, scale_in_place=False):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.heads, self.scale_in_place = nn.Linear(width, 3 * width), heads, scale_in_place

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        if self.scale_in_place:
            q.mul_(2.0)
        q, k, v = (part.view(batch, length, self.heads, -1).transpose(1, 2) for part in (q, k, v))
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


@pytest.mark.slow
@pytest.mark.parametrize("options, screened", [(dict(value_stats="exact"), False), (dict(on_nonfinite="track"), False),
                                              (dict(on_nonfinite="track"), True)])
def test_the_heads_of_a_split_projection_share_their_part_s_statistics_as_eager(monkeypatch, options, screened):
    """A view of one output of a multi-output op (the heads of a split projection, then their
    transpose) holds that output's elements: it shares its statistics, as the eager meter shares
    them, and the graph returns, reduces or screens only the parts, not each view again (inductor
    stores a returned view in a buffer of its own, which would be measured as a different tensor)."""
    if not screened:
        monkeypatch.setattr(stats_pass, "_screenable", lambda *args: False)
    model, x = SplitHeads().eval(), torch.randn(2, 64, 256)
    compiled = tl.compile(model, **options)
    with torch.no_grad():
        compiled(x)
        eager = tl.record(model, x, **options)
    events = compiled.torchlens.last_recording.ops
    split = next(event for event in events if event.op == "split")
    heads = [event for event in events if event.ordinal > split.ordinal][:6]
    assert [event.op for event in heads] == ["view", "transpose"] * 3
    for i, (view, transpose) in enumerate(zip(heads[::2], heads[1::2])):
        assert view.stats is split.stats.parts[i] and transpose.stats is split.stats.parts[i]
    by_ordinal = {event.ordinal: event for event in eager.ops}
    for i, event in enumerate(heads):  # (the eager meter shares them too)
        assert by_ordinal[event.ordinal].stats is by_ordinal[split.ordinal].stats.parts[i // 2]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "bf16 autocast"])
def test_transformers_gpt2_s_attention_heads_share_their_part_s_statistics(mode):
    """transformers' GPT-2 splits one fused projection into query, key and value and views each as
    heads: compiled by inductor, every view of a part shows that part's statistics, as eager's
    meter shows them, and the verdict is eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model, ids = transformers.GPT2Model(config).eval(), torch.randint(0, 64, (2, 8))
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "bf16 autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[mode]
    torch._dynamo.reset()
    try:
        with context():
            compiled = tl.compile(model, value_stats="exact", on_nonfinite="track")
            compiled(ids, use_cache=False)
            eager = tl.record(model, ids, use_cache=False, value_stats="exact", on_nonfinite="track")
    finally:
        torch._dynamo.reset()
    events = compiled.torchlens.last_recording.ops
    splits = [i for i, event in enumerate(events) if event.op == "split"]
    assert len(splits) == 2, [event.op for event in events]
    for i in splits:
        heads = [event for event in events[i + 1:i + 7] if event.op in ("view", "transpose")]
        assert len(heads) >= 3 and all(any(head.stats is part for part in events[i].stats.parts) for head in heads)
    assert compiled.torchlens.last_recording.verdict == eager.verdict


@pytest.mark.slow
def test_a_split_part_written_in_place_before_its_heads_are_viewed_is_measured_again():
    """The query part scaled in place after the split: its heads hold the scaled values, not the
    ones the split's statistics saw, and read as eager's lines."""
    model, x = SplitHeads(scale_in_place=True).eval(), torch.randn(2, 64, 256)
    lines = []
    with torch.no_grad():
        tl.compile(model, value_stats="exact", narrate=lines.append)(x)
        eager = tl.record(model, x, value_stats="exact")
    compiled = op_lines("\n".join(lines))
    assert compiled == op_lines(eager.narrate())
    heads = [line for line in compiled if " view " in line or " transpose " in line]
    split = next(line for line in compiled if " split " in line)
    assert heads[0].split("|")[1].split()[0] not in split  # (the scaled query's min is no part's)


class SparseBetween(nn.Module):
    """Two graphs around an eager sparse round trip: the sparse value is not measured, so the
    verdict counts the values that were."""  # (dynamo runs `_sparse_round_trip` eagerly)

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(_sparse_round_trip(self.a(x).relu())).tanh()


@torch._dynamo.disable
def _sparse_round_trip(y):
    return y.to_sparse().to_dense()


def test_a_tracked_call_all_finite_replays_the_call_before_and_reads_as_eager(monkeypatch):
    """With tracking alone, a graph called again in the same situation with every output finite is
    the earlier call again: its events are replayed, no op recorded anew, and the lines and the
    verdict (with its count of values measured) are eager's. A NaN in a weight is then found as
    eagerly, and once it is gone the calls replay again."""
    from torchlens.fx_backend.compiled_pass import CompiledPass

    recorded = []
    real = CompiledPass.add_plan_ops
    monkeypatch.setattr(CompiledPass, "add_plan_ops", lambda *args, **kwargs: recorded.append(1) or real(*args, **kwargs))
    model, x = SparseBetween().eval(), torch.randn(2, 4)
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")

    def call():
        recorded.clear()
        compiled(x)
        eager = tl.record(model, x, on_nonfinite="track")
        rec = compiled.torchlens.last_recording
        assert body(rec.narrate()) == body(eager.narrate())
        assert (rec.verdict, [f.text for f in rec.findings]) == (eager.verdict, [f.text for f in eager.findings])
        return len(recorded), rec

    first, second, third = call(), call(), call()
    assert "in the 6 measured; 1 not measured" in third[1].verdict
    assert (first[0], second[0], third[0]) == (2, 0, 0)
    graphs = [[e for e in rec.ops if e.op in ("linear", "relu", "tanh")] for _, rec in (second, third)]
    assert len(graphs[0]) == 4 and all(a is b for a, b in zip(*graphs))  # the same events, replayed
    with torch.no_grad():
        model.b.weight[0, 0] = float("nan")
    count, rec = call()
    assert count == 1 and rec.findings and "b.weight" in rec.findings[0].text, rec.verdict  # (the first graph replays)
    with torch.no_grad():
        model.b.weight[0, 0] = 0.5
    assert call()[0] == 0 and not call()[1].findings


@pytest.mark.parametrize("fused", [False, True])
def test_a_measured_call_again_restates_the_call_before_with_its_own_statistics(monkeypatch, strategy, fused):
    """With statistics alone, a graph called again in the same situation records no op anew: the
    earlier call's events come again with this call's statistics. Every call's lines are eager's
    for its own input (measured after the call; fused, the graph's own), and a recording kept from
    an earlier call keeps its own statistics."""
    from torchlens.fx_backend.compiled_pass import CompiledPass

    if fused:
        monkeypatch.setattr(stats_pass, "AFTER_CALL_BYTES", 100)  # less than the model's outputs hold
    recorded = []
    real = CompiledPass.add_plan_ops
    monkeypatch.setattr(CompiledPass, "add_plan_ops", lambda *args, **kwargs: recorded.append(1) or real(*args, **kwargs))
    model, lines = conv_net().eval(), []
    compiled = tl.compile(model, value_stats="exact", narrate=lines.append, compiler="eager")

    def call(x):
        recorded.clear()
        lines.clear()
        with torch.no_grad():
            compiled(x)
            eager = tl.record(model, x, value_stats="exact").narrate()
        assert fused or body("\n".join(lines)) == body(eager)
        assert body("\n".join(lines)) == body(compiled.torchlens.last_recording.narrate())
        return len(recorded), compiled.torchlens.last_recording

    x = images(2)
    first, second, third = call(x), call(3 * x), call(x)
    assert first[0] >= 1 and (second[0], third[0]) == (0, 0), "a call in the same situation is restated"
    assert body(first[1].narrate()) == body(third[1].narrate()) != body(second[1].narrate())
    maxima = [[event.stats.max for event in rec.ops if event.op == "relu"] for _, rec in (first, second)]
    assert maxima[0] and all(b > a for a, b in zip(*maxima)), maxima
    assert not {id(e) for e in first[1].ops} & {id(e) for e in second[1].ops}  # (each call's events are its own)
    assert set(strategy) == {"fused" if fused else "after_call"}


def test_a_tracked_call_with_an_absorbed_infinity_is_recorded_afresh_each_time(monkeypatch):
    """A call whose judging found more than finite values (the causal mask's -inf, absorbed by the
    softmax) is not replayed: its verdict names where the infinity came from, each call."""
    from torchlens.fx_backend.compiled_pass import CompiledPass

    recorded = []
    real = CompiledPass.add_plan_ops
    monkeypatch.setattr(CompiledPass, "add_plan_ops", lambda *args, **kwargs: recorded.append(1) or real(*args, **kwargs))
    model, x = tiny_gpt(), tokens()
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")
    verdicts = []
    for _ in range(3):
        compiled(x)
        verdicts.append(compiled.torchlens.last_recording.verdict)
    assert len(recorded) == 3
    assert verdicts == [tl.record(model, x, on_nonfinite="track").verdict] * 3 and "absorbed" in verdicts[0]


def _layouts(monkeypatch):
    """The statistics layout of each graph compiled from now on, in order."""
    import torchlens.fx_backend.graph as graph_module

    made, real = [], graph_module.add_stats_output
    monkeypatch.setattr(graph_module, "add_stats_output", lambda *args, **kwargs: made.append(real(*args, **kwargs))
                        or made[-1])
    return made


def test_a_tracked_graph_is_screened_inside_and_counted_again_only_when_not_finite(monkeypatch):
    """Tracking alone: the graph returns one sum per output, not the outputs. Finite calls read
    exactly as eager's; a NaN in a weight makes the call run again by the graph that returns its
    outputs, whose findings are eager's, and that graph measures the calls after it."""
    from torchlens.fx_backend.recount import Recount

    layouts, runs = _layouts(monkeypatch), []
    real = Recount.outputs
    monkeypatch.setattr(Recount, "outputs", lambda self, args: runs.append(1) or real(self, args))
    model, x = conv_net(), images()
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")

    def same_as_eager():
        compiled(x)
        rec, eager = compiled.torchlens.last_recording, tl.record(model, x, on_nonfinite="track")
        assert body(rec.narrate()) == body(eager.narrate())
        assert (rec.verdict, [f.text for f in rec.findings]) == (eager.verdict, [f.text for f in eager.findings])
        return rec

    same_as_eager(), same_as_eager()
    assert len(layouts) == 1 and layouts[0].recount is not None and not layouts[0].after_call and runs == []
    with torch.no_grad():
        model.stem[0].weight[0, 0, 0, 0] = float("nan")
    assert "stem.0.weight" in same_as_eager().findings[0].text and runs == [1]
    with torch.no_grad():
        model.stem[0].weight[0, 0, 0, 0] = 0.25
    assert not same_as_eager().findings and runs == [1]
    with torch.no_grad():
        model.stem[0].weight[0, 0, 0, 0] = float("inf")
    assert same_as_eager().findings and runs == [1]  # (measured after the call now: no second run)


class _Drops(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return nn.functional.dropout(self.linear(x), 0.5, self.training)


class _Writes(nn.Module):
    def forward(self, x):
        return x.mul_(2).exp()


class _Masks(nn.Module):
    def forward(self, x):
        return (x.masked_fill(x > 0.5, float("-inf"))).softmax(-1)


class _Autocasts(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.linear(x).float().exp()


@pytest.mark.parametrize("make,training,screened", [
    (_Drops, True, False),  # draws random numbers: a second run would draw others
    (_Drops, False, True),  # an eval-mode dropout draws nothing
    (_Writes, False, False),  # writes into its input: a second run would start from what it wrote
    (_Masks, False, False),  # fills in -inf on purpose: every call would run twice
    (_Autocasts, False, False),  # switches autocast inside the graph: a run must leave no mode switched
])
def test_a_graph_whose_second_run_would_differ_or_always_happen_is_measured_after_the_call(
        monkeypatch, make, training, screened):
    layouts = _layouts(monkeypatch)
    model, x = make().train(training), torch.rand(3, 4)
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")
    compiled(x.clone())
    assert [layout.recount is not None for layout in layouts] == [screened]
    assert [layout.after_call for layout in layouts] == [not screened]
    eager = tl.record(model, x.clone(), on_nonfinite="track")
    if not training:  # (a dropout's lines in training depend on its draws)
        assert compiled.torchlens.last_recording.verdict == eager.verdict


def test_a_call_that_cannot_be_counted_again_says_what_was_not_measured(monkeypatch):
    """If the graph that counts a call again cannot be compiled or run, the call's measured ops
    say "n/a" and why, and the verdict claims nothing of them."""
    from torchlens.fx_backend.recount import Recount

    tries, real_init = [], Recount.__init__

    def fails(gm, example_inputs):
        tries.append(1)
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(Recount, "__init__", lambda self, gm, layout, compile: real_init(self, gm, layout, fails))
    model, x = conv_net(), images()
    with torch.no_grad():
        model.stem[0].weight[0, 0, 0, 0] = float("nan")
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")
    for _ in range(2):  # (tried once: the model's calls go on screened, each saying what it could not count)
        out = compiled(x)
        rec = compiled.torchlens.last_recording
        assert not rec.findings and f"in the 1 measured; {len(rec.ops) - 1} not measured" in rec.verdict, rec.verdict
        assert rec.ops[1].stats.note == "not shown finite; RuntimeError counting again"
    assert tries == [1] and torch.equal(out.isnan(), model(x).isnan())


def test_sums_of_values_near_float32_s_largest_stay_finite_and_a_second_run_that_finds_nothing_says_so(monkeypatch):
    """The screen is whether each value is finite: values near float32's largest (a `finfo.min`
    attention mask) never overflow it, so such a call is not run again. A call that is run again
    and whose second run holds no NaN or infinity (here its inputs cleaned, as if it rounded
    otherwise) claims nothing more than that run shows, and the footer says why it ran twice."""
    from torchlens.fx_backend.recount import Recount

    class Large(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.w * 3 - 1

    runs, real = [], Recount.outputs
    monkeypatch.setattr(Recount, "outputs", lambda self, args: runs.append(1) or real(self, [a.nan_to_num() for a in args]))
    model = Large()
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")
    compiled(torch.full((4,), 1e38))
    rec = compiled.torchlens.last_recording
    assert runs == [] and rec.verdict == tl.record(model, torch.full((4,), 1e38), on_nonfinite="track").verdict
    with torch.no_grad():
        model.w[1] = float("nan")
    compiled(torch.full((4,), 1e38))
    rec = compiled.torchlens.last_recording
    assert runs == [1] and rec.verdict == "no non-finite values"
    assert "a compiled graph's screen found a non-finite value, but its second run held none" in rec.narrate()


def test_a_float64_output_is_screened_by_whether_its_elements_are_finite(monkeypatch):
    """A narrower float's screen is its sum in float64, which nothing finite overflows; a float64
    output's sum could (its `finfo.min` mask, twice), so its screen is whether each element is
    finite: such a call runs once, and a NaN in it is still found (the call counted again)."""
    from torchlens.fx_backend.recount import Recount

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, dtype=torch.float64))

        def forward(self, x):
            return torch.where(x > 0, x * self.w, torch.finfo(torch.float64).min) + 1

    runs, real = [], Recount.outputs
    monkeypatch.setattr(Recount, "outputs", lambda self, args: runs.append(1) or real(self, args))
    model, x = Masked(), torch.tensor([1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    compiled = tl.compile(model, on_nonfinite="track", compiler="eager")
    compiled(x)
    assert runs == [] and compiled.torchlens.last_recording.verdict == "no non-finite values"
    with torch.no_grad():
        model.w[0] = float("nan")
    compiled(x)
    assert runs == [1] and compiled.torchlens.last_recording.verdict == tl.record(model, x,
                                                                                   on_nonfinite="track").verdict


def test_a_screened_graph_trains_bitwise_as_plain_torch_compile_through_a_nan_and_back():
    """With inductor, in training: the screened graph's outputs and gradients are plain
    `torch.compile`'s bit for bit; a NaN in a weight is found as eagerly (the graph counted
    again, compiled by inductor for it), and the graph that takes its place trains on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).train()
    twin = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).train()
    twin.load_state_dict(model.state_dict())
    compiled, plain, x = tl.compile(model, on_nonfinite="track"), torch.compile(twin), torch.randn(3, 8)
    torch._dynamo.reset()
    try:
        for step, weight in enumerate([None, None, float("nan"), 0.125, None]):
            if weight is not None:
                with torch.no_grad():
                    model[0].weight[0, 0] = twin[0].weight[0, 0] = weight
            model.zero_grad(), twin.zero_grad()
            out, expected = compiled(x), plain(x)
            out.sum().backward(), expected.sum().backward()
            rec = compiled.torchlens.last_recording
            assert rec.verdict == tl.record(model, x, on_nonfinite="track").verdict
            if step != 2:
                assert torch.equal(out, expected) and torch.equal(model[0].weight.grad, twin[0].weight.grad)
            else:
                assert "0.weight" in rec.findings[0].text
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "bf16 autocast", "training"])
@pytest.mark.parametrize("name", ["qwen2", "bart", "nn_transformer"])
def test_screened_graphs_read_as_graphs_measured_after_the_call_on_real_models(monkeypatch, name, mode):
    """On models from transformers' configs and torch's own transformer, under no_grad,
    inference_mode, bf16 autocast and training: a tracked compiled forward reads the same, line for
    line and verdict for verdict, whether its graphs are screened or return their outputs, clean
    and with a NaN in a norm's weight (counted again)."""
    import contextlib

    from real_models import REAL_MODELS

    from torchlens.fx_backend import stats_pass

    model, args, kwargs = REAL_MODELS[name].build()
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "training": contextlib.nullcontext,
               "bf16 autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[mode]
    model.train(mode == "training")
    norm = next(p for n, p in model.named_parameters() if "norm" in n and n.endswith("weight"))
    clean = norm.detach().clone()
    layouts = _layouts(monkeypatch)

    def transcripts():
        torch._dynamo.reset()
        compiled, texts = tl.compile(model, compiler="eager", on_nonfinite="track"), []
        for value in (None, float("nan")):
            with torch.no_grad():
                norm.copy_(clean)
                if value is not None:
                    norm.view(-1)[0] = value
            torch.manual_seed(0)
            with context():
                compiled(*args, **kwargs)
            rec = compiled.torchlens.last_recording
            texts.append((body(rec.narrate()), rec.verdict, [f.text for f in rec.findings]))
        return texts

    try:
        screened = transcripts()
        assert any(layout.recount is not None for layout in layouts) or mode == "training", mode
        monkeypatch.setattr(stats_pass, "_screenable", lambda *args: False)
        assert transcripts() == screened
    finally:
        torch._dynamo.reset()
    assert screened[1][2], screened[1][1]  # (the NaN is found)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "bf16", "fp16"])
def test_a_transformers_model_s_measured_calls_restated_read_as_recorded_afresh(monkeypatch, context):
    """A transformers BERT compiled with exact statistics, under no_grad, inference_mode and bf16 or
    fp16 autocast: its calls after the first are restated, and read exactly as calls recorded afresh."""
    transformers = pytest.importorskip("transformers")
    from torchlens.fx_backend.compiled_pass import CompiledPass

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100)
    scopes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
              "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
              "fp16": lambda: torch.autocast("cpu", dtype=torch.float16)}
    ids = [torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1, 0)]

    recorded: list = []
    real = CompiledPass.add_plan_ops
    monkeypatch.setattr(CompiledPass, "add_plan_ops", lambda *args, **kwargs: recorded.append(1) or real(*args, **kwargs))

    def transcripts() -> list:
        torch.manual_seed(0)
        compiled = tl.compile(transformers.BertModel(config).eval(), value_stats="exact", compiler="eager")
        texts = []
        for x in ids:
            recorded.clear()
            with torch.no_grad(), scopes[context]():
                compiled(x)
            texts.append((body(compiled.torchlens.last_recording.narrate()), len(recorded)))
        return texts

    again = transcripts()
    assert again[0][1] >= 1 and again[1][1] == again[2][1] == 0, again  # (calls after the first: restated)
    monkeypatch.setattr(CompiledPass, "_restates", lambda self, plan: False)
    fresh = transcripts()
    assert [text for text, _ in again] == [text for text, _ in fresh] and again[0][0] == again[2][0] != again[1][0]
