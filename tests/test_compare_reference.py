"""`tl.debug.reference` and `compare(..., reference=)`: is a divergence rounding or a bug, and
which side is off.

Rounding-only differences come from implementations that sum in another order (a linear layer
computed in two halves, inductor's fused kernels); real ones from a planted sign flip, a wrong
kernel, a wrong decomposition. Each is judged against the model run in float64.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_html_view import page_data, page_of
from torch import nn

import torchlens as tl
from torchlens.debug.rounding import ulp
from torchlens.errors import CompareInputError


class Mlp(nn.Module):
    """An MLP whose first layer can be computed in two halves (`split=True`: reassociated, rounding
    only) and whose activation can have its sign flipped (`flip=True`: a bug)."""

    def __init__(self, split: bool = False, flip: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(256, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = nn.Linear(128, 16)
        self.split, self.flip = split, flip

    def forward(self, x):
        if self.split:
            w = self.fc1.weight
            h = x[:, :128] @ w[:, :128].T + x[:, 128:] @ w[:, 128:].T + self.fc1.bias
        else:
            h = self.fc1(x)
        h = F.gelu(self.norm(h))
        if self.flip:
            h = -h
        return self.fc2(h)


def _pair(**variant):
    torch.manual_seed(0)
    model = Mlp()
    other = copy.deepcopy(model)
    for name, value in variant.items():
        setattr(other, name, value)
    return model, other, torch.randn(8, 256)


def test_ulp_is_the_spacing_of_the_dtype_at_a_magnitude():
    assert ulp(torch.float32, 1.0) == 2 ** -23
    assert ulp(torch.float32, 1.9) == 2 ** -23
    assert ulp(torch.float32, 2.0) == 2 ** -22
    assert ulp(torch.bfloat16, 3.0) == 2 ** -6
    assert ulp(torch.float16, 0.0) == torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps


class Casting(nn.Module):
    """Casts on purpose, as RMSNorm and mixed-precision code do."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        h = x.float()
        scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        bias = torch.zeros(8, dtype=torch.float32) + 0.1
        return (self.weight * (h * scale).to(torch.float32) + bias + torch.tensor(0.1)).half().float()


def test_the_reference_is_float64_throughout_even_where_the_model_casts_and_leaves_the_run_alone():
    torch.manual_seed(0)
    model, x = Casting(), torch.randn(3, 8)
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    ref = tl.debug.reference(model, x)
    assert torch.equal(torch.rand(3), expected_draw), "the reference consumed the user's random stream"
    dtypes = {meta.dtype for event in ref.trace.ops for meta in event.outputs}
    assert dtypes == {torch.float64}, dtypes
    assert model.weight.dtype == torch.float32 and x.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    assert ref.terms[next(e.ordinal for e in ref.trace.ops if e.op == "mean")] == 8


def test_the_reduction_length_is_read_from_matmuls_convolutions_and_reductions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5), nn.Softmax(-1))
    ref = tl.debug.reference(model, torch.randn(2, 3, 8, 8))
    terms = {event.op: ref.terms.get(event.ordinal) for event in ref.trace.ops}
    assert terms["conv2d"] == 27 and terms["linear"] == 144 and terms["softmax"] == 5, terms


def test_a_reassociated_sum_is_rounding_and_no_divergence_is_called_real():
    model, split, x = _pair(split=True)
    ref = tl.debug.reference(model, x)
    report = tl.debug.compare(tl.trace(model, x), tl.trace(split, x), reference=ref)
    judged = [row for row in report.rows if row.judgement]
    assert judged and all(row.judgement == "rounding" for row in judged)
    assert report.first_real is None and report.counts["rounding"] == len(judged) and report.counts["real"] == 0
    assert str(report).startswith("no real divergence: all ")
    for row in judged:
        assert row.ulps_a is not None and row.ulps_b is not None and row.ulps_b <= row.allowed


def test_a_sign_flip_is_real_and_the_side_nearer_float64_is_named():
    model, flipped, x = _pair(flip=True)
    ref = tl.debug.reference(model, x)
    report = tl.debug.compare(tl.trace(model, x), tl.trace(flipped, x), reference=ref)
    real = report.first_real
    assert (real.op, real.module) == ("linear", "fc2"), real
    assert real.closer == "a" and real.ulps_b > 1e5 and real.ulps_a < real.allowed
    assert real.off == "b" and str(report).splitlines()[0].startswith(
        "first real divergence: #6 linear @fc2: b's op computes something else")
    # the same divergence seen from the other side: a is the one off
    swapped = tl.debug.compare(tl.trace(flipped, x), tl.trace(model, x), reference=ref)
    assert swapped.first_real.closer == "b"


def test_a_bf16_run_is_held_to_bf16_rounding_and_a_bug_under_bf16_is_still_real():
    model, flipped, x = _pair(flip=True)
    ref = tl.debug.reference(model, x)
    full = tl.trace(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, mixed_flipped = tl.trace(model, x), tl.trace(flipped, x)
    healthy = tl.debug.compare(full, mixed, reference=ref)
    assert healthy.counts["rounding"] > 0 and healthy.first_real is None, healthy.verdict()
    assert tl.debug.compare(full, mixed_flipped, reference=ref).first_real.closer == "a"


def test_the_reference_must_come_from_tl_debug_reference():
    model, _, x = _pair()
    trace = tl.trace(model, x)
    with pytest.raises(CompareInputError, match=r"tl\.debug\.reference\(model, \*inputs\)"):
        tl.debug.compare(trace, trace, reference=trace)


def test_without_a_reference_nothing_is_judged():
    model, flipped, x = _pair(flip=True)
    report = tl.debug.compare(tl.trace(model, x), tl.trace(flipped, x))
    assert report.first_real is None and not report.judged and "rounding" not in report.counts
    assert all(row.judgement is None for row in report.rows)


def test_the_page_and_the_rows_carry_the_judgement(tmp_path):
    model, flipped, x = _pair(flip=True)
    report = tl.debug.compare(tl.trace(model, x), tl.trace(flipped, x), reference=tl.debug.reference(model, x))
    row = report.first_real.to_dict()
    assert row["judgement"] == "real" and row["closer"] == "a" and row["ulps_b"] > row["allowed"]
    [table] = page_data(page_of(report, tmp_path))["tables"]
    assert table["verdict"].startswith("first real divergence: #6 linear @fc2")
    marked = table["rows"][table["real"]]
    assert (marked["o"], marked["p"], marked["j"], marked["c"]) == ("linear", "fc2", "real", "a")
    assert "rounding" in table["tally"] and "real" in table["tally"]


# -- real models, compiled by inductor --------------------------------------------------------------

def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval(), (torch.randint(0, 211, (1, 12)),)


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=173, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval(), (torch.randint(0, 173, (1, 10)),)


def _convnet():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    return model.eval(), (torch.randn(2, 3, 16, 16),)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_gpt2, _llama, _convnet], ids=["gpt2", "llama", "convnet"])
def test_inductors_divergences_on_real_models_are_rounding(build):
    torch.manual_seed(0)
    model, inputs = build()
    with torch.no_grad():
        ref = tl.debug.reference(model, *inputs)
        report = tl.debug.compare(tl.trace(model, *inputs), tl.trace(model, *inputs, compiled=True), reference=ref)
    assert report.counts["rounding"] > 0, "inductor computed every op bit for bit as eager: nothing was judged"
    assert report.first_real is None, report.verdict()


# -- what cannot be judged is said, never called rounding ------------------------------------------

def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), torch.randn(2, 6, 32)


def test_a_fused_fast_path_is_judged_against_its_own_float64_run():
    """nn.TransformerEncoder under no_grad takes its fused kernel; the float64 run must take it
    too, or the diverging fused row has nothing to be judged against."""
    model, x = _encoder()
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.layers[1].linear2.weight.mul_(-1.0)
        ref = tl.debug.reference(model, x)
        report = tl.debug.compare(tl.trace(model, x), tl.trace(broken, x), reference=ref)
    assert [event.op for event in ref.trace.ops][1:] == ["_transformer_encoder_layer_fwd"] * 2
    real = report.first_real
    assert (real.op, real.module, real.closer) == ("_transformer_encoder_layer_fwd", "layers.1", "a"), report.verdict()


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 32), nn.Dropout(0.3), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.fc1(x)))


def _drawn(model, x, seed):
    torch.manual_seed(seed)
    return tl.trace(model, x)


def test_a_random_op_is_judged_only_where_float64_drew_what_a_run_drew():
    torch.manual_seed(0)
    model, x = Noisy().train(), torch.randn(8, 16)
    a, b = _drawn(model, x, 1), _drawn(model, x, 2)
    torch.manual_seed(1)  # the state trace a started from: float64 draws a's masks
    report = tl.debug.compare(a, b, reference=tl.debug.reference(model, x))
    assert (report.first_real.op, report.first_real.closer) == ("dropout", "a")
    torch.manual_seed(3)  # a state neither started from: nothing after the dropout can be judged
    report = tl.debug.compare(a, b, reference=tl.debug.reference(model, x))
    assert report.first_real is None and report.counts["rounding"] == 0 and report.counts["unjudged"] == 2
    assert all(row.judgement in (None, "unjudged") for row in report.rows)
    line = str(report).splitlines()[0]
    assert line.startswith("not judged against float64: 2 ops whose sides differ could not be judged (the first: "
                           "#3 dropout @drop: the float64 run drew other random numbers than both runs at #3 dropout")
    assert "unjudged: the float64 run drew other random numbers" in str(report)


def test_integer_outputs_that_differ_are_unjudged_not_rounding():
    class Picks(Mlp):
        def forward(self, x):
            return super().forward(x).argmax(-1)

    torch.manual_seed(0)
    model = Picks()
    flipped = copy.deepcopy(model)
    flipped.flip = True
    x = torch.randn(8, 256)
    report = tl.debug.compare(tl.trace(model, x), tl.trace(flipped, x), reference=tl.debug.reference(model, x))
    argmax = next(row for row in report.rows if row.op == "argmax")
    assert argmax.judgement == "unjudged" and argmax.reason == "integer outputs: no ulps to judge them by"
    assert report.first_real.op == "linear" and report.counts["unjudged"] == 1
    assert report.verdict().endswith("; 1 op whose sides differ could not be judged (the first: #7 argmax: integer "
                                     "outputs: no ulps to judge them by)")


# -- mixed precision: each op judged in the precision it computed in -------------------------------

def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _small_llama():
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _small_gpt2():
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64))


def _small_bert():
    t = _transformers()
    return t.BertModel(t.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, max_position_embeddings=64))


def _small_qwen2():
    t = _transformers()
    return t.Qwen2ForCausalLM(t.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


_SMALL = {"llama": _small_llama, "gpt2": _small_gpt2, "bert": _small_bert, "qwen2": _small_qwen2}
_IDS = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _lower(model, precision: str, *inputs, **kwargs):
    """`model` traced in a lower precision: bf16 or fp16 autocast, or a bf16 copy of its weights."""
    if precision == "bf16 weights":
        return tl.trace(copy.deepcopy(model).to(torch.bfloat16),
                        *(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs), **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16 autocast" else torch.float16):
        return tl.trace(model, *inputs, **kwargs)


_FAST = [("llama", "bf16 autocast"), ("gpt2", "fp16 autocast"), ("qwen2", "bf16 weights"), ("bert", "bf16 autocast")]
_ALL = [(name, precision) for name in _SMALL for precision in ("bf16 autocast", "fp16 autocast", "bf16 weights")]


@pytest.mark.parametrize("name, precision", _FAST + [pytest.param(*case, marks=pytest.mark.slow)
                                                      for case in _ALL if case not in _FAST])
def test_a_healthy_transformers_model_in_lower_precision_is_only_rounding_off_its_fp32_run(name, precision):
    """"Is my bf16 run only rounding off my fp32 run?" An op computing in float32 on values that
    came out of bf16 ops carries bf16's rounding, 2^16 float32 ulps: judged by its dtype alone it
    was called real (Llama's rotary `mul`, GPT-2's residual `add`, a bf16 model's `to` of its
    `inv_freq` buffer). Each op is judged on what it adds, in the precision it computed in."""
    torch.manual_seed(0)
    model = _SMALL[name]().eval()
    ref = tl.debug.reference(model, _IDS)
    report = tl.debug.compare(tl.trace(model, _IDS), _lower(model, precision, _IDS), reference=ref)
    assert report.first_real is None, report.verdict()
    counts = report.counts
    assert counts["rounding"] > 20 and counts["real"] == counts["carried"] == counts["unjudged"] == 0, counts
    assert report.verdict().startswith("no real divergence: all ")
    assert any(row.own_b is not None for row in report.rows), "no op was judged on its own inputs"


def test_a_model_in_training_mode_is_judged_through_its_dropouts_from_the_same_generator_state():
    """GPT-2 training: attention's dropout draws inside `scaled_dot_product_attention`, an op no
    schema marks random. Its replay draws from the generator states the float64 run drew from,
    so a bf16 run drawn from the same state is judged op by op, not left unjudged."""
    torch.manual_seed(0)
    model = _small_gpt2().train()
    torch.manual_seed(1)
    full = tl.trace(model, _IDS)
    torch.manual_seed(1)
    mixed = _lower(model, "bf16 autocast", _IDS)
    torch.manual_seed(1)
    report = tl.debug.compare(full, mixed, reference=tl.debug.reference(model, _IDS))
    assert report.first_real is None and report.counts["unjudged"] == 0 and report.counts["rounding"] > 20, \
        report.verdict()


@pytest.mark.parametrize("precision", ["bf16 autocast", "fp16 autocast", "bf16 weights"])
def test_a_conv_net_with_batch_norm_in_lower_precision_is_only_rounding_off_its_fp32_run(precision):
    torch.manual_seed(0)
    model, (x,) = _convnet()
    ref = tl.debug.reference(model, x)
    report = tl.debug.compare(tl.trace(model, x), _lower(model, precision, x), reference=ref)
    assert report.first_real is None and report.counts["rounding"] > 0, report.verdict()


def _with_bug(model, bug: str):
    """A copy of a transformers model with a real bug planted: a changed norm epsilon, the sign of
    one projection's weight flipped, a square projection's weight transposed."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        if bug == "norm eps":
            norm = next(m for m in broken.modules() if hasattr(m, "variance_epsilon") or isinstance(m, nn.LayerNorm))
            setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", 0.1)
        else:
            square = [m for m in broken.modules() if isinstance(m, nn.Linear) and m.in_features == m.out_features]
            weight = square[1].weight
            weight.copy_(-weight if bug == "sign flip" else weight.T.clone())
    return broken


@pytest.mark.parametrize("precision", ["fp32", "bf16 autocast"])
@pytest.mark.parametrize("name, bug, op, module", [
    ("llama", "norm eps", "add", "model.layers.0.input_layernorm"),
    ("bert", "norm eps", "layer_norm", "embeddings.LayerNorm"),
    ("llama", "sign flip", "linear", "model.layers.0.self_attn.o_proj"),
    ("bert", "transpose", "linear", "encoder.layer.0.attention.self.key"),
])
def test_a_real_bug_is_real_at_its_own_op_in_same_and_mixed_precision_and_what_follows_is_carried(
        name, bug, op, module, precision):
    torch.manual_seed(0)
    model = _SMALL[name]().eval()
    ref = tl.debug.reference(model, _IDS)
    broken = _with_bug(model, bug)
    b = tl.trace(broken, _IDS) if precision == "fp32" else _lower(broken, precision, _IDS)
    report = tl.debug.compare(tl.trace(model, _IDS), b, reference=ref)
    real = report.first_real
    assert (real.op, real.module, real.off, real.closer) == (op, module, "b", "a"), report.verdict()
    assert real.own_b > real.allowed and report.counts["real"] == 1 and report.counts["carried"] > 5, report.counts
    after = report.rows[report.rows.index(real) + 1:]
    assert all(row.judgement in (None, "carried", "rounding") for row in after)
    assert report.verdict().startswith(f"first real divergence: #{real.ordinal} {real.where}: b's op computes "
                                       f"something else")


def test_a_different_attention_mask_is_real_where_it_enters_and_nothing_before_is():
    """A wrong mask: the runs were given different integer inputs. Nothing computed them, so the
    difference is no rounding; what takes another path because of it is never called rounding."""
    torch.manual_seed(0)
    model = _small_llama().eval()
    mask = torch.ones_like(_IDS)
    wrong = mask.clone()
    wrong[1, :3] = 0
    ref = tl.debug.reference(model, _IDS, attention_mask=mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = tl.trace(model, _IDS, attention_mask=wrong)
    report = tl.debug.compare(tl.trace(model, _IDS, attention_mask=mask), b, reference=ref)
    real = report.first_real
    assert (real.op, real.ordinal, real.off) == ("input", 2, "b")
    assert report.verdict().startswith("first real divergence: #2 input: b's input differs from the float64 run's")
    assert not [row for row in report.rows[:report.rows.index(real)] if row.judgement]
    attention = [row for row in report.rows if row.module == "model.layers.0.self_attn.o_proj"]
    assert attention and all(row.judgement in ("carried", "unjudged") for row in attention)


@pytest.mark.slow
def test_eager_fp32_against_compiled_bf16_is_only_rounding_and_a_compiler_bug_under_bf16_is_real():
    torch.manual_seed(0)
    model, (ids,) = _gpt2()

    def buggy_compiler(gm, example_inputs):
        """A stand-in for a wrong kernel: GPT-2's tanh-form GELU computed with a sigmoid."""
        for node in gm.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "__name__", "") == "tanh":
                node.target = torch.sigmoid
        gm.recompile()
        return gm.forward

    with torch.no_grad():
        ref = tl.debug.reference(model, ids)
        eager = tl.trace(model, ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled = tl.trace(model, ids, compiled=True)
            broken = tl.trace(model, ids, compiled={"compiler": buggy_compiler})
    healthy = tl.debug.compare(eager, compiled, reference=ref)
    assert healthy.first_real is None and healthy.counts["rounding"] > 0, healthy.verdict()
    real = tl.debug.compare(eager, broken, reference=ref).first_real
    assert (real.op, real.module, real.off, real.closer) == ("tanh", "transformer.h.0.mlp.act", "b", "a"), real


# -- the pieces of the judgement, each where it can go wrong ---------------------------------------

def test_each_op_of_the_float64_run_is_paired_with_its_own_call_and_replays_to_its_output():
    """Two consecutive linears share a name, not a shape: each has its own reduction length and
    its own call, which replayed on the run's own inputs gives back its output."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), nn.Softmax(-1)), torch.randn(3, 4)
    ref = tl.debug.reference(model, x)
    first, second = [event.ordinal for event in ref.trace.ops if event.op == "linear"]
    assert (ref.terms[first], ref.terms[second]) == (4, 8)
    for event in ref.trace.ops[1:]:
        replayed = ref.replay(event.ordinal, lambda produced, own: ref.trace.values[produced.ordinal][produced.index])
        assert replayed is not None and torch.equal(replayed[0], ref.trace.values[event.ordinal][0]), event
    report = tl.debug.compare(tl.trace(model, x), tl.trace(model, x, compiled={"compiler": "eager"}), reference=ref)
    assert report.first_real is None


class _Masked(nn.Module):
    """Causal attention written with a float `-inf` mask, the scores optionally scaled wrong."""

    def __init__(self, wrong_scale: bool = False):
        super().__init__()
        self.qk = nn.Linear(16, 32)
        self.wrong_scale = wrong_scale

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        scores = q @ k.transpose(-1, -2)
        if self.wrong_scale:
            scores = scores * 1.5
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        return scores.masked_fill(mask, float("-inf")).softmax(-1)


def test_an_op_whose_float64_output_holds_an_infinity_is_still_judged_in_ulps_of_its_finite_values():
    """The ulp scale is the largest *finite* reference magnitude: taken over the `-inf` of a mask,
    every error would read 0 ulps and a wrong scale before the mask would be called rounding."""
    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(2, 6, 16)
    wrong = _Masked(wrong_scale=True)
    wrong.load_state_dict(model.state_dict())
    report = tl.debug.compare(tl.trace(model, x), tl.trace(wrong, x), reference=tl.debug.reference(model, x))
    real = report.first_real
    assert (real.op, real.off) == ("masked_fill", "b"), report.verdict()
    assert real.own_b > 1e5 and math.isfinite(real.own_b)


def test_rows_after_a_random_op_both_runs_drew_alike_but_float64_did_not_are_unjudged():
    """Both runs drew the same dropout masks (equal rows), float64 other ones: every later row is
    judged against another draw, so none is judged, however far its sides are apart."""
    torch.manual_seed(0)
    model, x = Noisy().train(), torch.randn(8, 16)
    patched = copy.deepcopy(model)
    with torch.no_grad():
        patched.fc2.weight.mul_(-1.0)
    a, b = _drawn(model, x, 1), _drawn(patched, x, 1)
    torch.manual_seed(3)
    report = tl.debug.compare(a, b, reference=tl.debug.reference(model, x))
    dropout = next(row for row in report.rows if row.op == "dropout")
    assert dropout.max_abs == 0 and dropout.judgement is None
    fc2 = next(row for row in report.rows if row.module == "fc2")
    assert fc2.judgement == "unjudged" and "drew other random numbers" in fc2.reason
    assert report.first_real is None


def test_an_integer_row_the_float64_run_has_no_op_for_is_unjudged_not_a_crash():
    class Rounds(nn.Module):
        def __init__(self, to_int: bool):
            super().__init__()
            self.to_int = to_int

        def forward(self, x):
            y = x * 2
            return y.round().long() if self.to_int else y

    x = torch.tensor([[0.2, 1.4, 2.6]])
    report = tl.debug.compare(tl.trace(Rounds(True), x), tl.trace(Rounds(True), x + 0.5),
                              reference=tl.debug.reference(Rounds(False), x))
    rows = {row.op: row for row in report.rows}
    assert rows["long"].judgement == "unjudged" and rows["long"].reason.startswith("integer outputs")
