"""TorchScript modules run as opaque calls: never a silent gap in the narration."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import check_nesting, op_lines
from torch import nn

import torchlens as tl

# TorchScript is deprecated in torch, and still in models people debug.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 3)

    def forward(self, x):
        return torch.relu(self.fc(x))


class WithScripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.scripted = torch.jit.script(Inner())
        self.traced = torch.jit.trace(nn.Linear(3, 2), torch.ones(1, 3))
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.traced(self.scripted(x)))


def narrated(model, x, **options):
    sink = io.StringIO()
    recording = tl.record(model, x, narrate=sink, **options)
    return sink.getvalue(), recording


def test_each_scripted_call_is_one_op_line_with_its_outputs_and_statistics():
    model = WithScripted()
    text, rec = narrated(model, torch.ones(1, 2), value_stats="exact")
    check_nesting(text)
    lines = op_lines(text)
    assert [line.split()[1] for line in lines] == ["input", "scripted", "scripted", "linear"]
    assert "[1,3] f32 cpu  @scripted" in lines[1] and "[1,2] f32 cpu  @traced" in lines[2]
    assert rec.ops[1].stats.kind == "exact" and rec.ops[1].stats.max == pytest.approx(
        model.scripted(torch.ones(1, 2)).max().item())
    assert "2 TorchScript calls narrated as one op each (`scripted`): their insides are not visible" in text
    assert torch.equal(rec.output, model(torch.ones(1, 2)))


def test_a_whole_scripted_model_is_not_zero_ops():
    text, rec = narrated(torch.jit.script(Inner()), torch.ones(1, 2))
    assert [e.op for e in rec.ops] == ["input", "scripted"]
    assert "1 TorchScript call narrated as one op each" in text.splitlines()[-1]


def test_a_nan_made_inside_a_scripted_module_is_found_there():
    model = WithScripted()
    with torch.no_grad():
        model.scripted.fc.weight[0, 0] = float("nan")
    rec = tl.record(model, torch.ones(1, 2), on_nonfinite="track")
    assert (rec.first_nonfinite.op, rec.first_nonfinite.module) == ("scripted", "scripted")
    with pytest.raises(tl.errors.NonFiniteError, match="scripted"):
        tl.record(model, torch.ones(1, 2), on_nonfinite="raise")
