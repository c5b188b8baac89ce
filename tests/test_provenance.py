"""Provenance, one rule for both substrates (`provenance.origin_chain`): a value comes from the op
that produced it, then from every write into its memory since, from the last write that covered
all of it on. Eager tracking applies it to tensors as they run, the compiled plan to a graph's
fake tensors at compile time; their verdicts agree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.measure.provenance import origin_chain


def test_the_last_write_that_covers_everything_starts_the_chain_again():
    span = (0, 9)
    writes = [("early", 1, (0, 9)), ("part", 3, (0, 4)), ("whole", 4, (0, 9)), ("tail", 5, (5, 9))]
    assert origin_chain("producer", writes, after=2, span=span) == ("whole", "tail")
    assert origin_chain("producer", writes[:2], after=2, span=span) == ("producer", "part")
    assert origin_chain("producer", writes, after=9, span=span) == ("producer",)
    assert origin_chain("producer", [("unknown", 3, None)], after=0, span=span) == ("producer", "unknown")


class PartialWrite(nn.Module):
    """A NaN written into part of a buffer through indexed assignment, then read as a whole."""

    def forward(self, x):
        y = x * 1.0
        y[:, :2] = torch.log(x[:, :2] - 10)
        return y.sum(dim=1)


class OverwrittenBuffer(nn.Module):
    """A buffer holding NaN, overwritten before it is read: whole (`copy_`, no finding) or in part
    (the NaN left is the buffer's, named at the op that reads it)."""

    def __init__(self, whole: bool):
        super().__init__()
        self.whole = whole
        self.register_buffer("cache", torch.full((2, 4), float("nan")))

    def forward(self, x):
        if self.whole:
            self.cache.copy_(x)
        else:
            self.cache[:, :2].copy_(x[:, :2])
        return self.cache * 2


CASES = {
    "a NaN written in part": (PartialWrite, ["NaN born at #5 log (nan=4)"]),
    "a NaN buffer overwritten whole": (lambda: OverwrittenBuffer(whole=True), []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_eager_and_compiled_tracking_follow_writes_alike(name):
    model, expected = CASES[name]
    x = torch.rand(2, 4) + 1
    eager = tl.record(model(), x, on_nonfinite="track")
    assert [f.text for f in eager.findings] == expected
    compiled = tl.compile(model(), on_nonfinite="track", compiler="eager")
    compiled(x)
    assert [f.text for f in compiled.torchlens.last_recording.findings] == expected


def test_a_graph_input_the_graph_writes_is_not_measured_as_if_it_were_read():
    """Eager measures the buffer as the slice reads it (8 NaN); a compiled graph's inputs are seen
    after the call, when the graph has overwritten half of it: its count would not be what was
    read, so the compiled verdict says the NaN was first seen there, not how many the buffer held."""
    x = torch.rand(2, 4) + 1
    [eager] = tl.record(OverwrittenBuffer(whole=False), x, on_nonfinite="track").findings
    assert eager.kind is tl.FindingKind.NONFINITE_SOURCE
    assert eager.text == "NaN in cache (nan=8), first read by #2 getitem"
    compiled = tl.compile(OverwrittenBuffer(whole=False), on_nonfinite="track", compiler="eager")
    compiled(x)
    [finding] = compiled.torchlens.last_recording.findings
    assert finding.kind is tl.FindingKind.FIRST_SEEN, finding.text
    assert finding.text.startswith("NaN first seen at #2 getitem (nan=4); not everything it read was measured")
