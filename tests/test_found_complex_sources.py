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


@pytest.mark.xfail(strict=True, reason="a complex buffer is never measured (isposinf rejects complex), "
                                        "so its NaN is reported as first seen at the reading op")
def test_a_nan_in_a_complex_buffer_is_named_by_the_buffer():
    rec = tl.record(ComplexBuffer(), torch.ones(3), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["NaN in phase (nan=1), first read by #2 mul"]


class ComplexNanScalar(nn.Module):
    def forward(self, x):
        return x * complex(float("nan"), 0.0)


@pytest.mark.xfail(strict=True, reason="only float scalars are taken as carrying a NaN in, "
                                        "so a complex NaN scalar's NaN is called born at the op")
def test_a_nan_carried_in_by_a_complex_scalar_is_written_by_it_not_born():
    rec = tl.record(ComplexNanScalar(), torch.ones(2, dtype=torch.complex64), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["NaN written by a scalar argument of #2 mul"]


class FloatNanScalar(nn.Module):
    def forward(self, x):
        return x * float("nan")


def test_a_nan_carried_in_by_a_float_scalar_is_written_by_it():
    rec = tl.record(FloatNanScalar(), torch.ones(2), on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["NaN written by a scalar argument of #2 mul"]
