"""Value statistics at their edges: what a line claims is what was measured, for every element
the claim covers."""

from __future__ import annotations

import io

import torch
from torch import nn

import torchlens as tl
from torchlens.measure.stats import SAMPLE_SIZE, sample_indices


def narrated(model, *args, **options):
    sink = io.StringIO()
    rec = tl.record(model, *args, narrate=tl.options.NarrationOptions(sink=sink), **options)
    return sink.getvalue(), rec


def op_line(text: str, op: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("#") and f" {op} " in line)


class Times(nn.Module):
    def forward(self, x):
        return x * 1


def test_an_exact_line_counts_a_positive_infinity_and_never_claims_finite():
    text, rec = narrated(Times(), torch.tensor([1.0, float("inf"), 2.0]), value_stats="exact")
    line = op_line(text, "mul")
    assert line.endswith("| min=1 max=2 mean=1.5 sd=0.7071 +inf=1")
    assert rec.ops[-1].stats.posinf == 1 and "finite" not in line


def test_exact_statistics_and_tracking_agree_on_a_positive_infinity():
    _, rec = narrated(Times(), torch.tensor([1.0, float("inf"), 2.0]), value_stats="exact", on_nonfinite="track")
    assert [f.text for f in rec.findings] == ["+inf reaches the output out (from the input x)"]


def test_sampled_tracking_counts_a_nan_the_sample_did_not_read():
    numel = 2 * SAMPLE_SIZE
    read = set(sample_indices(numel, torch.device("cpu")).tolist())
    outside = next(i for i in range(numel) if i not in read)
    x = torch.ones(numel)
    x[outside] = float("nan")
    text, rec = narrated(Times(), x, value_stats="sampled", on_nonfinite="track")
    assert rec.ops[-1].stats.nan == 1
    assert op_line(text, "mul").endswith("sampled=4096/8192 nan=1")
    assert [f.text for f in rec.findings] == ["NaN in the input x (nan=1)"]


def test_a_sampled_line_of_a_tensor_no_larger_than_a_sample_reads_every_element():
    text, rec = narrated(Times(), torch.arange(float(SAMPLE_SIZE)), value_stats="sampled")
    assert op_line(text, "mul").endswith("| min=0 max=4095 mean=2048 sd=1183 finite")
    assert not rec.ops[-1].stats.sampled


class RealPart(nn.Module):
    def forward(self, z):
        w = z * 1
        return w.real * 1


def test_the_real_part_of_a_complex_value_has_its_own_statistics():
    text, _ = narrated(RealPart(), torch.tensor([3 + 4j]), value_stats="exact")
    assert op_line(text, "mul").endswith("| min=5 max=5 mean=5 sd=0 finite")  # the complex one: its magnitude
    assert op_line(text, "real").endswith("| min=3 max=3 mean=3 sd=0 finite")


class Positive(nn.Module):
    def forward(self, x):
        return x > 0


def test_reuse_shows_nothing_for_a_bool_output():
    text, rec = narrated(Positive(), torch.tensor([1.0, -1.0]), value_stats="reuse", on_nonfinite="track")
    assert "|" not in op_line(text, "gt")
    assert rec.ops[-1].stats is None or not rec.ops[-1].stats.shown


class Transposed(nn.Module):
    def forward(self, x):
        return (x * 1).t()


def test_a_sampled_line_depends_on_the_values_it_shows_not_on_what_was_measured_before():
    x = torch.randn(100, 100, generator=torch.Generator().manual_seed(0))
    after_its_base, _ = narrated(Transposed(), x, value_stats="sampled")
    on_its_own, _ = narrated(Times(), x.t().contiguous(), value_stats="sampled")
    shown = op_line(after_its_base, "t").split("|", 1)[1]
    assert shown == op_line(on_its_own, "mul").split("|", 1)[1]
    assert "sampled=4096/10000" in shown
