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
from torch import nn

import torchlens as tl
from torchlens.debug.rounding import ulp
from torchlens.errors import CompareInputError

from test_html_view import page_data, page_of


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
    assert str(report).splitlines()[0].startswith("first real divergence: #6 linear @fc2: b is off float64 by")
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
