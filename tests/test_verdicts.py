"""Verdicts that hold on the models people run: nothing missed, nothing mis-blamed, nothing changed.

Each case is one way the tracker's or the narration's verdict went wrong on a real model:
inference mode, functorch transforms, indexed writes, module fast paths, `-inf` attention masks,
claims about what was not measured. Eager and compiled wherever the path exists.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from helpers import check_nesting, count_host_syncs, op_lines
from models import tiny_gpt, tokens
from torch import nn

import torchlens as tl
import torchlens.measure.meter


def narrated(model, *args, **options):
    sink = io.StringIO()
    rec = tl.record(model, *args, narrate=tl.options.NarrationOptions(sink=sink), **options)
    return sink.getvalue(), rec


def footer(text):
    return text.splitlines()[-1]


def finite_stats_of(t: torch.Tensor):
    v = t.detach().double()
    return v.min().item(), v.max().item(), v.mean().item(), v.std().item() if v.numel() > 1 else 0.0


class TwoLayers(nn.Module):
    def __init__(self, poison=None):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        if poison is not None:
            with torch.no_grad():
                getattr(self, poison).weight[1, 2] = float("nan")

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


# -- inference mode ---------------------------------------------------------------------------------


def test_inference_mode_statistics_are_measured_exactly():
    model, x = TwoLayers(), torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        text, rec = narrated(model, x, value_stats="exact", on_nonfinite="track")
        trace = tl.trace(model, x, value_stats="exact")
    assert "n/a" not in text
    assert footer(text).endswith("no non-finite values")
    for event in trace.ops:
        mn, mx, mean, sd = finite_stats_of(trace.value(event.ordinal))
        assert (event.stats.min, event.stats.max) == pytest.approx((mn, mx), abs=1e-6)
        assert (event.stats.mean, event.stats.sd) == pytest.approx((mean, sd), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_inference_mode_tracking_finds_a_nan_weight_and_raise_stops_there(compiled):
    model, x = TwoLayers(poison="fc2"), torch.randn(2, 4)
    with torch.inference_mode():
        if compiled:
            lines = []
            tl.compile(model, narrate=lines.append, on_nonfinite="track", compiler="eager")(x)
            text = "\n".join(lines)
            first = tl.compile(model, on_nonfinite="track", compiler="eager")
            first(x)
            rec = first.torchlens.last_recording
        else:
            text, rec = narrated(model, x, on_nonfinite="track")
        assert (rec.first_nonfinite.op, rec.first_nonfinite.module) == ("linear", "fc2")
        assert "NaN in fc2.weight (nan=1), first read by #4 linear @fc2" in footer(text)
        with pytest.raises(tl.errors.NonFiniteError, match=r"NaN in fc2\.weight"):
            tl.record(model, x, on_nonfinite="raise")


def test_inference_mode_gpt_is_narrated_with_statistics_and_unchanged_outputs():
    model, x = tiny_gpt(), tokens()
    with torch.inference_mode():
        plain = model(x)
        text, rec = narrated(model, x, value_stats="exact", on_nonfinite="track")
    assert torch.equal(rec.output, plain)
    assert "n/a" not in text
    check_nesting(text)


# -- functorch transforms ---------------------------------------------------------------------------


def test_vmap_statistics_cover_the_batch_and_a_nan_in_one_example_is_found():
    layer = nn.Linear(4, 4)
    batch = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))
    batch[1, 0, 2] = float("nan")
    seen = {}

    def narrate_one(x):
        for live in (True, False):  # printed lines are read at once; unprinted ones at the end
            rec = tl.record(layer, x, value_stats="exact", on_nonfinite="track",
                            narrate=True if live else None)
            seen[live] = rec
        return rec.output

    out = torch.func.vmap(narrate_one)(batch)
    torch.testing.assert_close(out, torch.func.vmap(layer)(batch), rtol=0, atol=0, equal_nan=True)
    expected_nan = int(torch.isnan(layer(batch)).sum())
    for rec in seen.values():
        stats = rec.ops[-1].stats
        assert stats.kind == "exact" and stats.nan == expected_nan
        assert rec.first_nonfinite.op == "input" and "no non-finite values" not in rec.footer_extra[-1]


def test_vmap_exact_statistics_equal_those_of_the_whole_batch():
    layer = nn.Linear(4, 4)
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    recs = []

    def one(x):
        recs.append(tl.record(layer, x, value_stats="exact"))
        return recs[-1].output

    torch.func.vmap(one)(batch)
    mn, mx, mean, sd = finite_stats_of(layer(batch))
    stats = recs[0].ops[-1].stats
    assert (stats.min, stats.max) == pytest.approx((mn, mx), abs=1e-6)
    assert (stats.mean, stats.sd) == pytest.approx((mean, sd), rel=1e-5)


def test_grad_transform_statistics_are_read():
    layer = nn.Linear(3, 1)
    recs = []

    def loss(x):
        recs.append(tl.record(layer, x, value_stats="exact", on_nonfinite="track"))
        return recs[-1].output.sum()

    torch.func.grad(loss)(torch.ones(3))
    assert all(e.stats.kind == "exact" for e in recs[0].ops)
    assert recs[0].footer_extra[-1] == "no non-finite values"


def test_one_vector_that_cannot_be_read_leaves_the_others_and_is_counted_as_unmeasured(deferred_reads):
    from torchlens.events import Stats
    from torchlens.measure.meter import Meter, Pending
    from torchlens.measure.recipes import recipe
    from torchlens.measure.tracking import Tracker

    meter = Meter("exact", tracking=True)
    good = meter.measure(torch.tensor([1.0, 2.0, 3.0]), live=False)

    class Unreadable(torch.Tensor):  # a vector whose read fails, as a batched one would
        def tolist(self):
            raise RuntimeError("cannot read")

        def to(self, *args, **kwargs):
            raise RuntimeError("cannot read")

    bad = Stats("exact", 3, True)
    meter.pending.append(Pending(bad, torch.zeros(7, dtype=torch.float64).as_subclass(Unreadable),
                                 recipe("float", "exact")))
    meter.flush()
    assert (good.min, good.max, good.nan) == (1.0, 3.0, 0)
    assert bad.kind == "na" and "RuntimeError" in bad.note
    assert Tracker(dict).summary() == "no non-finite values"


# -- indexed writes ---------------------------------------------------------------------------------


class WritesNaN(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y = self.fc1(x)
        if self.how == "slice":
            y[:, 0] = float("nan")
        elif self.how == "mask":
            y[y > 1e9] = 0.0  # writes nothing non-finite
            y[y < 1e9] = torch.log(-torch.ones(()))  # a NaN made by log, then written through a mask
        return self.fc2(y)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_indexed_write_of_nan_is_named_at_the_write_not_at_the_next_op(compiled):
    model, x = WritesNaN("slice"), torch.randn(2, 4)
    if compiled:
        lines = []
        with torch.no_grad():
            tl.compile(model, narrate=lines.append, on_nonfinite="track", value_stats="reuse", compiler="eager")(x)
        text = "\n".join(lines)
    else:
        text, rec = narrated(model, x, on_nonfinite="track", value_stats="reuse")
        assert (rec.first_nonfinite.op, rec.first_nonfinite.module) == ("setitem", "")
    setitem = next(line for line in op_lines(text) if " setitem " in line)
    assert setitem.startswith("#3    setitem       [2,4] f32 cpu") and setitem.endswith("| nan=2")
    assert "!! NaN written by a scalar argument of #3 setitem" in text
    assert "#4 linear" not in footer(text)


def test_a_masked_write_of_a_tensor_is_followed_to_the_op_that_made_the_nan():
    text, rec = narrated(WritesNaN("mask"), torch.randn(2, 4), on_nonfinite="track", value_stats="reuse")
    writes = [line for line in op_lines(text) if " setitem " in line]
    assert len(writes) == 2 and writes[0].endswith("| finite")
    assert rec.first_nonfinite.op == "log"
    assert "NaN born at" in footer(text) and " log " in footer(text) + " "


def test_a_steering_hook_writing_into_a_gpt_block_output_is_narrated_and_blamed():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2Model(config).eval()

    def steer(module, args, output):
        output[0][:, 1] = float("nan")  # an indexed write into the block's hidden states

    model.h[0].register_forward_hook(steer)
    with torch.no_grad():
        text, rec = narrated(model, torch.arange(6)[None], on_nonfinite="track", value_stats="reuse")
    assert rec.first_nonfinite.op == "setitem"
    assert "NaN written by a scalar argument of" in footer(text) and "setitem" in footer(text)


def test_the_write_table_is_read_from_torch_schemas():
    from torchlens.measure.writes import writes_without_returning, written_tensor

    assert writes_without_returning("setitem") and writes_without_returning("_foreach_add_")
    assert not writes_without_returning("add_") and not writes_without_returning("relu")
    tensors = [torch.zeros(2), torch.zeros(2)]
    assert written_tensor("_foreach_add_", (tensors, 1.0), {}) == tuple(tensors)


def test_foreach_writes_are_narrated_on_the_tensors_they_wrote():
    class Foreach(nn.Module):
        def forward(self, a, b):
            a, b = a * 1, b * 1
            torch._foreach_mul_([a, b], float("inf"))
            return a + b

    text, rec = narrated(Foreach(), torch.ones(2), torch.zeros(2), on_nonfinite="track", value_stats="reuse")
    line = next(line for line in op_lines(text) if "_foreach_mul_" in line)
    assert "[2] f32 cpu, [2] f32 cpu" in line or line.count("[2] f32") == 2
    assert rec.first_nonfinite.op in ("_foreach_mul_", "add")


# -- fast paths -------------------------------------------------------------------------------------


def fast_path_ops_in_plain_run(run) -> set:
    """The fused ops torch's own fast-path conditions chose in a plain run (seen by the profiler,
    which captures without a torch-function override)."""
    with torch.autograd.profiler.profile() as prof:
        run()
    names = {event.name for event in prof.function_events}
    return {name.split("::")[-1] for name in names
            if name in ("aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention")}


def encoder(seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.1)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


PADDING = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])


@pytest.mark.parametrize("situation", ["eval_no_grad", "eval_inference", "eval_grad", "train_no_grad"])
@pytest.mark.parametrize("rung", ["off", "exact", "track"])
def test_encoder_outputs_are_bitwise_those_of_plain_torch_and_its_fast_path_is_kept(situation, rung):
    model = encoder()
    model.train(situation.startswith("train"))
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(3))
    context = {"eval_no_grad": torch.no_grad, "eval_inference": torch.inference_mode,
               "eval_grad": torch.enable_grad, "train_no_grad": torch.no_grad}[situation]
    options = {"on_nonfinite": "track"} if rung == "track" else {"value_stats": rung}
    with context():
        torch.manual_seed(5)
        plain = model(x, src_key_padding_mask=PADDING)
        fused = fast_path_ops_in_plain_run(lambda: model(x, src_key_padding_mask=PADDING))
        torch.manual_seed(5)
        text, rec = narrated(model, x, src_key_padding_mask=PADDING, **options)
    assert torch.equal(rec.output, plain)
    narrated_ops = {line.split()[1] for line in op_lines(text)}
    # the layer's fused kernel calls the attention one inside: the narration shows the outer call
    took_fast_path = "_transformer_encoder_layer_fwd" in fused
    assert took_fast_path == ("_transformer_encoder_layer_fwd" in narrated_ops)
    assert narrated_ops & {"_transformer_encoder_layer_fwd", "_native_multi_head_attention"} <= fused
    assert took_fast_path == (situation in ("eval_no_grad", "eval_inference"))
    check_nesting(text)
    assert torch.overrides.has_torch_function is torch._C._has_torch_function


def test_multihead_attention_fast_path_is_one_op_with_statistics():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        plain = mha(x, x, x, need_weights=False)[0]
        text, rec = narrated(mha, x, x, x, need_weights=False, value_stats="exact")
    assert torch.equal(rec.output[0], plain)
    assert [e.op for e in rec.ops if e.kind.value == "op"] == ["_native_multi_head_attention"]
    assert rec.ops[-1].stats.parts[0].kind == "exact"


def test_a_subclass_or_another_mode_still_sends_the_encoder_down_its_slow_path():
    class Other(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model = encoder().eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad(), Other():
        plain = model(x, src_key_padding_mask=PADDING)
        text, rec = narrated(model, x, src_key_padding_mask=PADDING)
    assert torch.equal(rec.output, plain)
    assert "_transformer_encoder_layer_fwd" not in text


def test_compiled_encoder_equals_plain_compile():
    model = encoder().eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        plain = torch.compile(model, backend="eager")(x)
        ours = tl.compile(model, narrate=lambda line: None, compiler="eager", value_stats="exact")(x)
    assert torch.equal(ours, plain)


# -- -inf masks -------------------------------------------------------------------------------------


def test_raise_runs_a_healthy_causal_gpt_through():
    model, x = tiny_gpt(), tokens()
    with torch.no_grad():
        plain = model(x)
        rec = tl.record(model, x, on_nonfinite="raise")
    assert torch.equal(rec.output, plain)
    assert rec.findings == ()
    assert rec.footer_extra[-1].startswith("no non-finite findings (-inf from #")
    assert "masked_fill @blocks.0.attn absorbed by later ops" in rec.footer_extra[-1]


class MaskThenLog(nn.Module):
    """A healthy causal mask, then a real NaN birth after it."""

    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa

    def forward(self, x):
        t = x.shape[-2]
        if self.sdpa:
            mask = torch.full((t, t), float("-inf")).triu(1)
            y = nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        else:
            scores = x @ x.transpose(-1, -2)
            y = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ x
        return torch.log(y - 10.0)  # negative: NaN born here


@pytest.mark.parametrize("sdpa", [False, True], ids=["masked_fill", "sdpa"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_raise_passes_the_mask_and_stops_at_the_nan_born_after_it(sdpa, compiled):
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    model = MaskThenLog(sdpa)
    if compiled:
        run = tl.compile(model, on_nonfinite="raise", compiler="eager")
    else:
        def run(x):
            return tl.record(model, x, on_nonfinite="raise")
    with pytest.raises(tl.errors.NonFiniteError, match=r"NaN born at #\d+ log") as info:
        run(x)
    ops = [e.op for e in info.value.partial_trace.ops]
    assert ops[-1] == "log"


def test_transformer_encoder_with_a_float_causal_mask_is_healthy_under_raise():
    model = encoder().train()  # the slow path: the -inf mask goes through softmax in view
    x = torch.randn(2, 6, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    torch.manual_seed(1)
    plain = model(x, mask=causal)
    torch.manual_seed(1)
    rec = tl.record(model, x, mask=causal, on_nonfinite="raise")
    assert torch.equal(rec.output, plain)
    assert rec.findings == ()
    assert "no non-finite findings (-inf from the input mask absorbed by later ops)" == rec.footer_extra[-1]


class Overflow(nn.Module):
    def forward(self, x):
        big = (x * 100).exp()
        return big - big


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_overflow_that_becomes_a_nan_names_both(compiled):
    x = torch.ones(3)
    if compiled:
        run = tl.compile(Overflow(), on_nonfinite="track", compiler="eager")
        run(x)
        rec = run.torchlens.last_recording
    else:
        rec = tl.record(Overflow(), x, on_nonfinite="track")
    texts = [f.text for f in rec.findings]
    assert texts[0] == "+inf born at #3 exp (+inf=3: an overflow, a division by zero or a log of zero)"
    assert texts[1] == "NaN born at #4 sub (nan=3) (out of +inf born at #3 exp)"
    assert "then NaN born at #4 sub" in rec.footer_extra[-1]


def test_an_infinity_born_in_one_output_of_a_two_output_op_is_found():
    """`var_mean` of values whose square overflows: an infinite variance beside a finite mean."""

    class Spread(nn.Module):
        def forward(self, x):
            var, mean = torch.var_mean(x)
            return var + mean

    rec = tl.record(Spread(), torch.tensor([3e38, -3e38]), on_nonfinite="track")
    assert rec.first_nonfinite.op == "var_mean"
    assert rec.findings[0].text.startswith("+inf born at #2 var_mean (+inf=1")


def test_an_integer_op_writing_nan_bits_seen_through_a_float_view_is_born_at_the_view():
    """Integer outputs hold no NaN, so the tracker skips what integer ops read; a float view of
    integer memory is where the NaN first exists, and where it is named."""

    class BitCast(nn.Module):
        def forward(self, x):
            bits = torch.zeros(4, dtype=torch.int32)
            bits.fill_(0x7FC00000)  # a float32 NaN's bits
            return x + bits.view(torch.float32)

    rec = tl.record(BitCast(), torch.ones(4), on_nonfinite="track")
    assert rec.findings[0].text == "NaN born at #4 view (nan=4)"


class MaskedMean(nn.Module):
    def forward(self, x):
        mask = x > 5
        return (x * mask).sum() / mask.sum()  # 0 / 0: no element passes the mask


class ZeroedThroughIntView(nn.Module):
    def forward(self, x):
        y = torch.exp(x * 1000)  # +inf everywhere
        y.view(torch.int32).zero_()  # then cleared through an integer view of the same memory
        return y


def test_integer_ops_are_still_origins_and_writers_on_cpu_and_accelerator(deferred_reads):
    """An integer op's reads are never asked for, but what it produced and wrote still is: read
    once per forward (the tensor gone by then), `mask.sum()` is known to hold no NaN, so the NaN is
    born at the division; an integer write that cleared an infinity leaves nothing to report."""
    for read_now in (set(), {"cpu"}):
        torchlens.measure.meter.READ_NOW = read_now
        rec = tl.record(MaskedMean(), torch.ones(4), on_nonfinite="track")
        assert [f.text for f in rec.findings] == ["NaN born at #6 div (nan=1)"]
        rec = tl.record(ZeroedThroughIntView(), torch.ones(4), on_nonfinite="track")
        assert rec.findings == (), rec.findings
        assert rec.footer_extra[-1].startswith("no non-finite findings")


def test_an_infinity_carried_in_that_reaches_the_output_is_a_finding():
    class Leaky(nn.Module):
        def forward(self, x):
            return x.masked_fill(x > 0, float("inf"))

    rec = tl.record(Leaky(), torch.tensor([1.0, -1.0]), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["+inf reaches the output out (from #3 masked_fill)"]


class Empty(nn.Module):
    def forward(self, x):
        out = torch.empty(64)
        out.copy_(x)
        return out * 2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_uninitialized_outputs_are_not_measured_or_judged(compiled):
    if compiled:
        lines = []
        tl.compile(Empty(), narrate=lines.append, on_nonfinite="track", value_stats="exact", compiler="eager")(
            torch.ones(64))
        text = "\n".join(lines)
    else:
        text, _ = narrated(Empty(), torch.ones(64), on_nonfinite="track", value_stats="exact")
    assert next(line for line in op_lines(text) if " empty " in line).endswith("| stats n/a (uninitialized)")
    assert footer(text).endswith("no non-finite values")


# -- claims about what was not measured -------------------------------------------------------------


def test_ops_that_could_not_be_measured_are_counted_not_claimed_finite():
    class Sparse(nn.Module):
        def forward(self, x):
            s = x.to_sparse()
            return s.to_dense() * 2

    text, _ = narrated(Sparse(), torch.eye(3), on_nonfinite="track", value_stats="reuse")
    assert "no non-finite values" not in footer(text).replace("no non-finite values in the", "")
    assert footer(text).endswith("no non-finite values in the 3 measured; 1 not measured (1 sparse_coo)")


def test_module_outputs_only_names_the_first_measured_op_and_says_so():
    model = TwoLayers(poison="fc1")
    run = tl.compile(model, on_nonfinite="track", compiler="eager", stats_on="module_outputs")
    with torch.no_grad():
        run(torch.randn(2, 4))
    rec = run.torchlens.last_recording
    assert rec.first_nonfinite.op == "linear" and rec.first_nonfinite.module == "fc1"
    summary = rec.footer_extra[-1]
    assert "NaN in fc1.weight" in summary or "first seen" in summary
    assert "not measured (1 no statistics taken)" in summary


def test_a_sample_that_reads_every_element_is_exact_and_may_say_finite():
    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    text, rec = narrated(Double(), torch.arange(10.0), value_stats="sampled", on_nonfinite="track")
    assert rec.ops[-1].stats.kind == "exact"
    assert op_lines(text)[-1].endswith("| min=0 max=18 mean=9 sd=6.055 finite")
    big, rec = narrated(Double(), torch.arange(5000.0), value_stats="sampled")
    assert "~=" in op_lines(big)[-1] and "finite" not in op_lines(big)[-1]


@pytest.mark.parametrize("live", [True, False])
def test_moments_of_values_whose_sums_overflow_are_measured_or_dropped_never_inf(live):
    """Sums of values near float32's largest overflow: mean and sd are measured on the values
    scaled by a power of two. An sd past even float64's range is dropped and named."""
    class Identity(nn.Module):
        def forward(self, x):
            return x * 1

    def line_for(x):
        sink = io.StringIO()
        rec = tl.record(Identity(), x, value_stats="exact", on_nonfinite="track",
                        narrate=tl.options.NarrationOptions(sink=sink) if live else None)
        return op_lines(sink.getvalue() if live else rec.narrate())[-1], rec.ops[-1].stats

    line, stats = line_for(torch.tensor([3e38, -3e38, 3e38, -3e38]))
    assert line.endswith("| min=-3e+38 max=3e+38 mean=0 sd=3.464e+38 finite")
    assert stats.sd == pytest.approx(3e38 * math.sqrt(4 / 3), rel=1e-6)
    line, stats = line_for(torch.tensor([1.7e308, 1.7e308, -1.7e308], dtype=torch.float64))
    assert "inf" not in line.split("|")[1] and line.endswith("finite (sd overflowed)")
    assert stats.mean == pytest.approx(1.7e308 / 3) and stats.sd is None


def test_an_accelerators_deferred_sd_that_overflows_float32_is_dropped_and_named(deferred_reads):
    """Read once per forward, the tensor is gone: an sd its float32 reduction overflowed cannot be
    measured again, so it is left out and said to be, never printed as `inf`."""
    class Identity(nn.Module):
        def forward(self, x):
            return x * 1

    rec = tl.record(Identity(), torch.tensor([3e38, -3e38, 3e38, -3e38]), value_stats="exact")
    line = op_lines(rec.narrate())[-1]
    assert "inf" not in line.split("|")[1] and line.endswith("(sd overflowed)")
    assert rec.ops[-1].stats.sd is None and rec.ops[-1].stats.max == pytest.approx(3e38)


def test_tracking_still_reads_once_per_forward_without_narration(deferred_reads):
    model, x = tiny_gpt(), tokens()
    with count_host_syncs() as syncs:
        tl.record(model, x, on_nonfinite="track")
    assert len(syncs) == 1, syncs


# -- provenance through writes, sources and outputs --------------------------------------------------


class Sanitize(nn.Module):
    def __init__(self, divide: bool = False):
        super().__init__()
        self.divide = divide

    def forward(self, x):
        y = (x * 100).exp()  # +inf born here
        flat = y.view(-1)  # a view taken before the clean-up
        y[torch.isinf(y)] = 0.0  # covers all of y: flat holds no inf any more
        return flat / 0.0 if self.divide else flat


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_write_covering_a_view_replaces_what_the_view_held(compiled):
    x = torch.tensor([1.0, 2.0, 0.001])
    recs = []
    for divide in (False, True):
        if compiled:
            run = tl.compile(Sanitize(divide), on_nonfinite="track", compiler="eager")
            run(x)
            recs.append(run.torchlens.last_recording)
        else:
            recs.append(tl.record(Sanitize(divide), x, on_nonfinite="track"))
    assert recs[0].findings == ()
    assert "+inf born at #3 exp" in recs[0].footer_extra[-1] and "absorbed" in recs[0].footer_extra[-1]
    texts = [f.text for f in recs[1].findings]
    assert texts[0].startswith("NaN born at #7 div") and "out of" not in texts[0]  # 0/0, not exp's inf


def test_a_write_through_out_is_the_op_that_wrote():
    class OutKw(nn.Module):
        def forward(self, x):
            buf = torch.zeros(4)
            head = buf[:2]  # a view, taken before the write
            torch.exp(x * 100, out=buf)
            return head.sum() - head.sum()

    rec = tl.record(OutKw(), torch.tensor([1.0, 2.0, 0.0, 0.0]), on_nonfinite="track")
    assert [f.text.split(" (")[0] for f in rec.findings] == ["+inf born at #5 exp", "NaN born at #8 sub"]


def test_an_infinity_returned_straight_from_a_buffer_reaches_the_output():
    class ReturnsMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))

        def forward(self, x):
            return x * 2, self.mask

    rec = tl.record(ReturnsMask(), torch.ones(2), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["-inf reaches the output out[1] (from mask)"]
    assert "no non-finite" not in rec.footer_extra[-1]


def test_a_numpy_infinity_is_carried_in_like_a_python_one():
    np = pytest.importorskip("numpy")

    class Mask(nn.Module):
        def forward(self, x):
            return x.masked_fill(x < 0, np.float64("-inf")).softmax(-1)

    rec = tl.record(Mask(), torch.tensor([1.0, -1.0]), on_nonfinite="raise")
    assert rec.findings == () and "absorbed" in rec.footer_extra[-1]


def test_a_buffer_rewritten_after_it_was_read_is_not_claimed_from_its_later_state(monkeypatch):
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("state", torch.tensor([float("nan"), 0.0, 0.0]))

        def forward(self, x):
            out = x + self.state  # reads the NaN
            self.state.copy_(x)  # then the state is replaced
            return out

    live = tl.record(Stateful(), torch.ones(3), on_nonfinite="track", narrate=lambda line: None)
    assert live.findings[0].text == "NaN in state (nan=1), first read by #2 add"
    unprinted = tl.record(Stateful(), torch.ones(3), on_nonfinite="track")  # CPU: read as each op ends
    assert [f.text for f in unprinted.findings] == [f.text for f in live.findings]
    monkeypatch.setattr(torchlens.measure.meter, "READ_NOW", set())  # an accelerator's: read at the end
    deferred = tl.record(Stateful(), torch.ones(3), on_nonfinite="track")
    # read at the end of the forward, the buffer no longer holds what #2 read: no false birth
    assert deferred.findings[0].text.startswith("NaN first seen at #2 add")


def test_a_jagged_view_is_measured_over_its_own_elements():
    class NarrowLog(nn.Module):
        def forward(self, x):
            nt = torch.nested.narrow(x, 1, torch.tensor([0, 0]), torch.tensor([2, 1]), layout=torch.jagged)
            return torch.stack([part.sum() for part in nt.log().unbind()])

    x = torch.tensor([[1.0, 2.0, -1.0], [3.0, 4.0, -1.0]])  # the -1s are outside the view
    rec = tl.record(NarrowLog(), x, on_nonfinite="raise", value_stats="exact")
    log = next(e for e in rec.ops if e.op == "log")
    assert log.stats.max == pytest.approx(math.log(3.0))
    assert rec.findings == ()


# -- the `!!` line, selections and what is kept -----------------------------------------------------


class Selected(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Identity(), nn.Sequential(nn.Identity())

    def forward(self, x):
        return torch.log(self.b(self.a(x) * 2) - 10)


def test_a_selection_still_gets_the_alarm_line_after_the_op():
    text, _ = narrated(Selected(), torch.ones(3), on_nonfinite="track")
    sink = io.StringIO()
    tl.record(Selected(), torch.ones(3), on_nonfinite="track",
              narrate=tl.options.NarrationOptions(sink=sink, select=lambda e: e.op in ("log", "sub")))
    lines = sink.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if " log " in line)
    assert lines[at + 1] == "!! NaN born at #4 log (nan=3)"


def test_the_alarm_line_is_the_same_live_and_after_the_fact():
    text, rec = narrated(Overflow(), torch.ones(3), on_nonfinite="track")
    assert rec.narrate() == text  # the transcript after the fact is the live one, byte for byte
    after = tl.record(Overflow(), torch.ones(3), on_nonfinite="track").narrate()
    alarms = [[line for line in t.splitlines() if line.startswith("!!")] for t in (text, after)]
    assert alarms[0] == alarms[1] == ["!! NaN born at #4 sub (nan=3) (out of +inf born at #3 exp)"]


@pytest.mark.slow
def test_a_recorder_tail_with_tracking_keeps_no_whole_pass_alive():
    import gc

    from torchlens.events import Event

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])
    counts = []
    for track in (None, "track"):
        with tl.recording.Recorder(model, keep=0, tail=5, on_nonfinite=track) as recorder:
            for _ in range(2):
                model(torch.randn(1, 4))
        gc.collect()
        counts.append(sum(type(o) is Event for o in gc.get_objects()))
        del recorder
        gc.collect()
    assert counts[1] <= counts[0] + 5, counts


def test_an_internal_failure_mid_forward_withdraws_the_claim(monkeypatch):
    import torchlens.eager.capture as capture

    real = capture.op_name

    def failing(func):
        if real(func) == "relu":
            raise RuntimeError("planted")
        return real(func)

    monkeypatch.setattr(capture, "op_name", failing)
    with pytest.warns(tl.errors.NarrationWarning):
        rec = tl.record(TwoLayers(), torch.randn(2, 4), on_nonfinite="track")
    assert rec.footer_extra[-1].startswith("no non-finite values in the 2 measured; not everything after an "
                                           "internal error recording an op was recorded, so nothing is claimed")


# -- compiled: gaps and stops ---------------------------------------------------------------------


class EncodedEagerly(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = encoder().eval()
        self.head = nn.Linear(16, 4)

    @torch.compiler.disable
    def encode(self, x, mask):
        return self.enc(x, src_key_padding_mask=mask)

    def forward(self, x, mask):
        return self.head(self.encode(x * 1.0, mask))


def test_a_fast_path_run_between_compiled_graphs_is_kept():
    model = EncodedEagerly()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        plain = model(x, PADDING)
        lines = []
        ours = tl.compile(model, narrate=lines.append, compiler="eager")(x, PADDING)
    assert torch.equal(ours, plain)
    assert any("_transformer_encoder_layer_fwd" in line for line in lines)
    assert torch.overrides.has_torch_function is torch._C._has_torch_function


def _compiled_raising(model, spelling):
    torch._dynamo.reset()
    if spelling == "tl.compile":
        return tl.compile(model, on_nonfinite="raise", compiler="eager")
    return torch.compile(model, backend="torchlens", options={"on_nonfinite": "raise", "compiler": "eager"})


@pytest.mark.parametrize("spelling", ["tl.compile", "string backend"])
def test_compiled_raise_stops_at_a_nan_input_with_its_partial_trace(spelling):
    """The string backend first sees the model while dynamo compiles its first call: the stop is
    not raised inside the compile (dynamo would wrap it in BackendCompilerFailed)."""
    class Log(nn.Module):
        def forward(self, x):
            return x.log()

    compiled = _compiled_raising(Log(), spelling)
    with pytest.raises(tl.errors.NonFiniteError, match=r"NaN in the input x \(nan=1\)") as info:
        compiled(torch.tensor([1.0, float("nan")]))
    assert [e.op for e in info.value.partial_trace.ops] == ["input"]
    assert torch.overrides.has_torch_function is torch._C._has_torch_function
    assert torch.equal(compiled(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]).log()), "the next call runs"


@pytest.mark.parametrize("spelling", ["tl.compile", "string backend"])
def test_compiled_raise_on_a_first_call_of_a_transformers_model_with_nan_embeddings(spelling):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaModel(config).eval()
    embeds = torch.randn(1, 6, 32)
    embeds[0, 2, 5] = float("nan")
    with pytest.raises(tl.errors.NonFiniteError, match=r"NaN in the input inputs_embeds") as info:
        _compiled_raising(model, spelling)(inputs_embeds=embeds)
    assert info.value.partial_trace is not None and not isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)


def test_a_failed_op_on_a_nested_tensor_is_still_named():
    class Nested(nn.Module):
        def forward(self, x):
            nt = torch.nested.nested_tensor([x[0, :3], x[1, :2]])
            return torch.matmul(nt, torch.ones(5, 5))  # nested self, dense other: raises

    with pytest.raises(RuntimeError) as info:
        tl.record(Nested(), torch.randn(2, 3, 4))
    tail = info.value.partial_trace.narrate(last=1).lines[-1]
    assert tail.startswith("!! attempted #") and " matmul " in tail and "[2,*,4] f32 cpu" in tail


# -- torchvision (benchmark environments) --------------------------------------------------------


def test_roi_align_results_written_into_zeros_are_narrated_as_the_write():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.ops import MultiScaleRoIAlign

    pool = MultiScaleRoIAlign(["0", "1"], output_size=2, sampling_ratio=2)
    features = {"0": torch.rand(1, 3, 16, 16), "1": torch.rand(1, 3, 8, 8)}
    boxes = [torch.tensor([[0.0, 0.0, 4.0, 4.0], [1.0, 1.0, 15.0, 15.0]])]
    plain = pool(features, boxes, [(32, 32)])
    text, rec = narrated(pool, features, boxes, [(32, 32)], value_stats="exact", on_nonfinite="track")
    assert torch.equal(rec.output, plain)
    ops = [e.op for e in rec.ops]
    assert "roi_align" in ops and "setitem" in ops[ops.index("roi_align"):], ops
    last_write = max(e.ordinal for e in rec.ops if e.op == "setitem")
    assert rec.ops[-1].ordinal >= last_write  # the output's values come from the writes, not `zeros`
    assert torchvision.__version__


def test_vmap_over_a_transformer_encoder_layer_measures_every_op_over_the_batch():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0).train()  # the slow path
    batch = torch.randn(3, 5, 16)
    recs = []

    def one(sequence):
        recs.append(tl.record(layer, sequence[None], value_stats="exact", on_nonfinite="track"))
        return recs[-1].output[0]

    out = torch.func.vmap(one)(batch)
    torch.testing.assert_close(out, torch.func.vmap(lambda s: layer(s[None])[0])(batch), rtol=0, atol=0)
    rec = recs[0]
    parts = [p for e in rec.ops for p in getattr(e.stats, "parts", (e.stats,))]
    assert parts and all(part.kind != "na" or part.note == "empty" for part in parts), parts
    assert rec.footer_extra[-1] == "no non-finite values"
    mn, mx, mean, sd = finite_stats_of(out)
    last = rec.ops[-1].stats
    assert (last.min, last.max) == pytest.approx((mn, mx), abs=1e-6)
    assert (last.mean, last.sd) == pytest.approx((mean, sd), rel=1e-4, abs=1e-6)


def test_tracking_works_out_what_an_op_read_only_for_ops_whose_output_is_not_finite(monkeypatch):
    from torchlens.measure import tracking

    asked = []
    reads_of = tracking.Tracker.reads_of
    monkeypatch.setattr(tracking.Tracker, "reads_of", lambda self, args, kwargs: asked.append(1) or
                        reads_of(self, args, kwargs))
    model = tiny_gpt()
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[0, 0] = float("nan")
    recording = tl.record(model, tokens(), on_nonfinite="track")
    nonfinite = [e for e in recording.ops if e.stats is not None and e.stats.nonfinite]
    assert 0 < len(asked) == len(nonfinite) < len(recording.ops) / 2
    assert recording.findings[0].text.startswith("NaN in blocks.1.mlp.fc.weight")


class WritesItsBuffer(nn.Module):
    """Ops that write NaN or -inf into a buffer no op produced, in place or through `out=`."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        y = x + self.b
        if self.how == "div_":
            self.b.div_(self.b)  # 0/0: the NaN is born here, in the buffer
        elif self.how == "log_":
            self.b.log_()  # log(0): -inf
        else:
            torch.div(x * 0, x * 0, out=self.b)
        return y + self.b


@pytest.mark.parametrize("device_reads_later", [False, True])
@pytest.mark.parametrize("how", ["div_", "log_", "out="])
def test_an_op_that_writes_its_buffer_is_never_told_the_buffer_held_what_it_wrote(how, device_reads_later,
                                                                                    monkeypatch):
    if device_reads_later:
        monkeypatch.setattr(torchlens.measure.meter, "READ_NOW", set())
    findings = [f.text for f in tl.record(WritesItsBuffer(how), torch.ones(4), on_nonfinite="track").findings]
    op = "div" if how == "out=" else how
    assert findings and findings[0].startswith(("NaN first seen at #", "-inf first seen at #")), findings
    assert f" {op} (" in findings[0] and not any(text.startswith(("NaN in b", "-inf in b")) for text in findings)


class ReadThenOverwritten(nn.Module):
    """`sqrt` reads `t`, which is finite then; later `t` is overwritten with NaN in place."""

    def forward(self, x):
        t = x - 5
        root = torch.sqrt(t)
        t.mul_(float("nan"))
        return root, t


class ReturnsItsArgument(nn.Module):
    """`contiguous` returns the very tensor it read: it carries the NaN, it does not make it."""

    def forward(self, x):
        t = torch.sqrt(x - 5)
        return t.contiguous() * 2


@pytest.mark.parametrize("device_reads_later", [False, True])
def test_what_an_op_read_is_fixed_when_it_ran_not_when_its_verdict_is_drawn(device_reads_later, monkeypatch):
    """Read once per forward (an accelerator's way), verdicts are drawn at the end: what each op
    read must still be what it read when it ran, not the memory as later writes left it, and not
    the op's own output (an op that returns its argument)."""
    if device_reads_later:
        monkeypatch.setattr(torchlens.measure.meter, "READ_NOW", set())
    rec = tl.record(ReadThenOverwritten(), torch.ones(4), on_nonfinite="track")
    assert rec.findings[0].text == "NaN born at #3 sqrt (nan=4)", [f.text for f in rec.findings]
    rec = tl.record(ReturnsItsArgument(), torch.ones(4), on_nonfinite="track")
    texts = [f.text for f in rec.findings]
    assert texts[0] == "NaN born at #3 sqrt (nan=4)", texts
    assert not any("contiguous" in t and "born" in t for t in texts), texts
