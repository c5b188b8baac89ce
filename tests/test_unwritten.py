"""Memory `torch.empty` allocated is never measured before an op writes it: a view of it reads
nothing, and what the allocator left there is not the model's value. With deterministic algorithms
torch fills such memory with NaN, which makes the stale bytes a NaN every time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl


@pytest.fixture
def nan_filled_empty():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


class Staged(nn.Module):
    """A buffer allocated empty, viewed before and after writes of part of it, then of all of it."""

    def __init__(self, strided_write: bool = False):
        super().__init__()
        self.strided_write = strided_write

    def forward(self, x):
        buf = torch.empty(8)
        early = buf[:4].view(2, 2)  # nothing written yet: stale bytes
        if self.strided_write:
            buf[::2].fill_(1.0)  # every other element: the view below is not wholly written
        else:
            buf[:4].fill_(1.0)
        written = buf[:4].view(2, 2)
        rest = buf[4:].view(2, 2)  # still unwritten
        buf.fill_(2.0)
        return x + early + written + rest


def _stats_of(rec, op, nth=0):
    return [e.stats for e in rec.events if e.op == op][nth]


@pytest.mark.parametrize("options", [{"value_stats": "exact"}, {"on_nonfinite": "track"},
                                     {"on_nonfinite": "track", "value_stats": "exact"}])
def test_views_of_unwritten_memory_are_not_read_and_no_nan_is_claimed(nan_filled_empty, options):
    rec = tl.record(Staged(), torch.ones(2, 2), **options)
    assert rec.findings == (), [f.text for f in rec.findings]
    assert torch.equal(rec.output, torch.full((2, 2), 7.0))  # all views read after `buf.fill_(2)`
    early, written, rest = (_stats_of(rec, "view", i) for i in range(3))
    assert early.kind == "na" and early.note == "uninitialized"
    assert rest.kind == "na" and rest.note == "uninitialized"
    assert written.kind != "na" and not written.nonfinite  # covered by the fill: measured
    if options.get("value_stats") == "exact":
        assert written.min == written.max == 1.0


def test_a_strided_write_does_not_count_as_writing_the_memory_it_spans(nan_filled_empty):
    """`buf[::2]` spans elements 0..6 but writes only half of them: a view of 0..3 stays unread."""
    rec = tl.record(Staged(strided_write=True), torch.ones(2, 2), value_stats="exact", on_nonfinite="track")
    assert _stats_of(rec, "view", 1).note == "uninitialized"
    assert rec.findings == ()


def test_an_op_that_reads_unwritten_memory_is_measured_as_computed(nan_filled_empty):
    """torch reads the stale bytes here, so the op's output is what it is: measured, and judged."""
    class ReadsIt(nn.Module):
        def forward(self, x):
            return x + torch.empty(4)

    rec = tl.record(ReadsIt(), torch.ones(4), on_nonfinite="track", value_stats="exact")
    assert _stats_of(rec, "add").nonfinite
    assert rec.findings and "add" in rec.findings[0].text


@pytest.mark.parametrize("strided_write", [False, True], ids=["written", "strided write"])
def test_compiled_graphs_leave_unwritten_memory_unread_exactly_where_eager_does(nan_filled_empty, strided_write):
    """The statistics pass applies the same rule to the graph's fake tensors: the same ops are not
    read, the same are measured, and neither claims a NaN."""
    import torch._dynamo

    def kinds(rec):
        return [(e.op, e.stats.kind == "na") for e in rec.events if e.is_op]

    options = dict(value_stats="exact", on_nonfinite="track")
    eager = tl.record(Staged(strided_write), torch.ones(2, 2), **options)
    torch._dynamo.reset()
    compiled = tl.compile(Staged(strided_write), compiler="eager", **options)
    compiled(torch.ones(2, 2))
    rec = compiled.torchlens.last_recording
    torch._dynamo.reset()
    assert kinds(rec) == kinds(eager)
    assert rec.findings == () == eager.findings
