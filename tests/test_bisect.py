"""`tl.debug.bisect`: a compiled run's real divergence traced to the compiler change that makes it,
or said to be rounding, or blamed on eager when eager is the side far from float64.

Each compiler fault is planted for the test only and removed after it: a wrong decomposition in
inductor's decomposition table, a post-grad graph pass that flips a sign, and a float32 eager
kernel that computes the wrong thing while inductor's own code computes it right.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl

pytestmark = pytest.mark.slow  # each test compiles with inductor several times

aten = torch.ops.aten


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.Mish()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.act(self.fc1(x))))


def _small():
    torch.manual_seed(0)
    return Small().eval(), torch.randn(4, 16)


@pytest.fixture
def wrong_mish_decomposition():
    """mish decomposed as its negative: what aot_eager_decomp_partition and inductor run (their
    table is a cached copy of inductor's decompositions, made again around the test)."""
    from torch._inductor.decomposition import decompositions, fast_random_decomps

    original = decompositions[aten.mish.default]
    decompositions[aten.mish.default] = lambda x: -(x * torch.tanh(F.softplus(x)))
    fast_random_decomps.cache_clear()
    torch._dynamo.reset()
    yield
    decompositions[aten.mish.default] = original
    fast_random_decomps.cache_clear()
    torch._dynamo.reset()


def test_a_wrong_decomposition_is_found_with_its_op(wrong_mish_decomposition):
    model, x = _small()
    report = tl.debug.bisect(model, x)
    assert report.verdict == "compiler", str(report)
    assert (report.backend, report.subsystem) == ("aot_eager_decomp_partition", "decomposition"), str(report)
    assert "mish" in report.detail and report.application is not None
    assert (report.row.op, report.row.module) == ("mish", "act") and report.row.closer == "a"
    text = str(report)
    assert text.startswith('real divergence at #3 mish @act appears with aot_eager_decomp_partition subsystem '
                           '"decomposition", application'), text
    assert report.runs >= 4 and report.seconds > 0


class _FlipErf:
    """A post-grad graph pass that negates the erf inside the gelu (decomposed by then)."""

    def __call__(self, graph):
        for node in graph.nodes:
            if node.op == "call_function" and node.target is aten.erf.default:
                with graph.inserting_after(node):
                    flipped = graph.call_function(aten.neg.default, (node,))
                node.replace_all_uses_with(flipped, delete_user_cb=lambda user, flipped=flipped: user is not flipped)
                return

    def uuid(self):
        return "torchlens-test-flip-erf"


@pytest.fixture
def sign_flipping_pass():
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    flip = type("FlipErf", (_FlipErf, CustomGraphPass), {})()
    torch._dynamo.reset()
    with config.patch(post_grad_custom_post_pass=flip, force_disable_caches=True):
        yield
    torch._dynamo.reset()


def test_a_graph_pass_that_flips_a_sign_is_found_among_inductors_passes(sign_flipping_pass):
    model, x = _small()
    report = tl.debug.bisect(model, x)
    assert report.verdict == "compiler", str(report)
    assert (report.backend, report.subsystem) == ("inductor", "post_grad_passes"), str(report)
    assert report.detail == "post_grad_custom_post_pass", str(report)
    assert (report.row.op, report.row.module) == ("gelu", "") and report.row.closer == "a", report.row


@pytest.fixture
def wrong_float32_gelu_kernel():
    """aten::gelu on the CPU, wrong for float32 only (right for float64, so the reference is
    right); inductor generates its own gelu and does not call this kernel."""
    library = torch.library.Library("aten", "IMPL")

    def gelu(x, approximate="none"):
        with torch._C._AutoDispatchBelowAutograd():
            exact = x * 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
        return exact * 1.01 if x.dtype == torch.float32 else exact

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        library.impl("gelu", gelu, "CPU")
    torch._dynamo.reset()
    yield
    library._destroy()
    torch._dynamo.reset()


def test_an_eager_kernel_that_is_wrong_is_blamed_on_eager_not_bisected(wrong_float32_gelu_kernel):
    model, x = _small()
    report = tl.debug.bisect(model, x)
    assert report.verdict == "eager", str(report)
    assert report.row.op == "gelu" and report.row.closer == "b" and report.runs == 0
    assert str(report).startswith("nothing to bisect: at #4 gelu eager is the side far from float64"), str(report)


def test_a_model_whose_compiled_run_only_rounds_is_not_bisected():
    model, x = _small()
    report = tl.debug.bisect(model, x)
    assert report.verdict == "rounding" and report.runs == 0, str(report)
    assert str(report).startswith("nothing to bisect: no real divergence"), str(report)


def test_a_model_in_training_mode_is_bisected_to_how_compiled_code_draws_its_dropout_masks():
    """Every try starts from the generator state the eager run started from, so only what draws
    the masks otherwise is found: the decomposition of native_dropout, not 'backend eager'."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.1), nn.Linear(32, 8)).train(), torch.randn(4, 32)
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    report = tl.debug.bisect(model, x)
    assert torch.equal(torch.rand(3), expected_draw), "the bisection consumed the user's random stream"
    assert (report.verdict, report.backend, report.subsystem) == \
        ("compiler", "aot_eager_decomp_partition", "decomposition"), str(report)
    assert report.detail == "aten.native_dropout.default" and report.row.op == "dropout"
    assert "dropout draws random numbers: compiled code draws them otherwise than eager's kernels" in str(report)
