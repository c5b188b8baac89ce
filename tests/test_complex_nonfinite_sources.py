"""Non-finite values carried into an op by complex tensors and scalars no tracked op produced are
named by where they came from, as float ones are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl


class ComplexBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("phase", torch.tensor([1 + 1j, complex(float("nan"), 0.0), 1j]))

    def forward(self, x):
        return (x * self.phase).abs()


def test_a_nan_in_a_complex_buffer_is_named_by_the_buffer():
    rec = tl.record(ComplexBuffer(), torch.ones(3), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["NaN in phase (nan=1), first read by #2 mul"]
    assert not rec.findings[0].birth and rec.findings[0].event.op == "mul"


class ComplexParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1 + 0j, complex(0.0, float("inf"))]))

    def forward(self, x):
        return (x * self.weight).abs()


class FloatParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, float("inf")]))

    def forward(self, x):
        return (x * self.weight).abs()


def test_an_infinity_in_a_complex_parameter_is_named_by_the_parameter_as_a_float_one_is():
    complex_texts = [f.text for f in tl.record(ComplexParameter(), torch.ones(2), on_nonfinite="track").findings]
    float_texts = [f.text for f in tl.record(FloatParameter(), torch.ones(2), on_nonfinite="track").findings]
    assert complex_texts == float_texts == ["+inf reaches the output out (from weight)"]


class ComplexNanScalar(nn.Module):
    def forward(self, x):
        return x * complex(float("nan"), 0.0)


class ComplexInfinityScalar(nn.Module):
    def forward(self, x):
        return x * complex(0.0, float("-inf"))


def test_a_nan_carried_in_by_a_complex_scalar_is_written_by_it_not_born():
    rec = tl.record(ComplexNanScalar(), torch.ones(2, dtype=torch.complex64), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["NaN written by a scalar argument of #2 mul"]


def test_an_infinity_carried_in_by_a_complex_scalar_is_judged_by_its_fate_not_born():
    # an infinite magnitude (an infinite imaginary part), as complex tensors are measured
    rec = tl.record(ComplexInfinityScalar(), torch.ones(2, dtype=torch.complex64), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["+inf reaches the output out (from #2 mul)"]


class FloatNanScalar(nn.Module):
    def forward(self, x):
        return x * float("nan")


def test_a_nan_carried_in_by_a_float_scalar_is_written_by_it():
    rec = tl.record(FloatNanScalar(), torch.ones(2), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["NaN written by a scalar argument of #2 mul"]


class HugeComplexScalar(nn.Module):
    def forward(self, x):
        return x * complex(1.7e308, 1.7e308) + 1  # finite parts whose magnitude overflows


def test_a_complex_scalar_with_finite_parts_carries_nothing_in_even_when_its_magnitude_overflows(recwarn):
    rec = tl.record(HugeComplexScalar(), torch.ones(2, dtype=torch.complex128), on_nonfinite="track")
    # the capture goes on to the end (no internal error), and the infinite magnitude is the op's own
    assert [e.op for e in rec.ops] == ["input", "mul", "add"]
    assert [f.text for f in rec.findings] == [
        "+inf born at #2 mul (+inf=2: an overflow, a division by zero or a log of zero)",
        "+inf reaches the output out (born at #2 mul)"]
    assert not [w for w in recwarn if "torchlens" in str(w.message)]


@pytest.mark.parametrize("model, x", [
    (ComplexBuffer, torch.ones(3)),
    (ComplexParameter, torch.ones(2)),
    (ComplexNanScalar, torch.ones(2, dtype=torch.complex64)),
], ids=["buffer", "parameter", "nan-scalar"])
def test_a_compiled_graph_names_complex_sources_as_eager_does(model, x):
    # (not a complex infinity scalar: dynamo itself fails on one, `NameError: name 'infj' is not
    # defined`, with or without torchlens)
    compiled = tl.compile(model(), on_nonfinite="track", narrate=None, compiler="eager")
    compiled(x)
    eager = tl.record(model(), x, on_nonfinite="track")
    assert eager.findings
    assert [f.text for f in compiled.torchlens.last_recording.findings] == [f.text for f in eager.findings]


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_complex_sources_are_named_under_no_grad_and_inference_mode(grad_mode):
    with grad_mode():
        buffer = tl.record(ComplexBuffer(), torch.ones(3), on_nonfinite="track")
        scalar = tl.record(ComplexNanScalar(), torch.ones(2, dtype=torch.complex64), on_nonfinite="track")
    assert [f.text for f in buffer.findings] == ["NaN in phase (nan=1), first read by #2 mul"]
    assert [f.text for f in scalar.findings] == ["NaN written by a scalar argument of #2 mul"]
