"""A compiled graph that fails part-way keeps what its completed ops computed.

When a graph raises, it is replayed op by op to find the op in flight; the ops before it are
recorded. Their values come from that replay: a failed compiled `tl.trace` compares up to the
failure (docs/compare.md), and statistics and non-finite tracking cover those ops too, with a note
saying the values are the replay's.
"""

import pytest
import torch
from torch import nn

import torchlens as tl


class FailsLate(nn.Module):
    """Four ops (linear, relu, mul, add), then an embedding lookup with an index out of range."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.table = nn.Embedding(4, 4)

    def forward(self, x, ids):
        y = torch.relu(self.a(x)) * 2
        return self.table(ids + 3) + y.sin()


def _partial(compiled, **options):
    torch.manual_seed(0)
    model, x, ids = FailsLate(), torch.randn(2, 4), torch.tensor([0, 1])
    torch._dynamo.reset()
    try:
        with pytest.raises((IndexError, RuntimeError)) as caught:
            tl.trace(model, x, ids, compiled=compiled, **options)
    finally:
        torch._dynamo.reset()
    return caught.value.partial_trace


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_failed_compiled_trace_compares_up_to_the_failure(compiler):
    eager = _partial(False)
    compiled = _partial({"compiler": compiler})
    assert compiled.attempt.op == eager.attempt.op == "embedding"
    report = tl.debug.compare(eager, compiled)
    assert report.counts["unchecked"] == 0, str(report)
    assert report.first_divergence is None
    assert report.counts["within_tolerance"] == len([e for e in eager.events if e.kind in (tl.EventKind.INPUT, tl.EventKind.OP)])
    ordinals = sorted(compiled.values)
    assert ordinals == sorted(eager.values) and len(ordinals) == 6  # 2 inputs, linear, relu, mul, add


def test_statistics_and_tracking_cover_the_ops_before_a_failure_in_a_graph():
    class NaNThenFails(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(4, 4)

        def forward(self, x, ids):
            y = torch.log(x - 10)  # NaN: the first finding
            return self.table(ids + 3) + y

    model, x, ids = NaNThenFails(), torch.randn(2, 4), torch.tensor([0, 1])
    compiled = tl.compile(model, compiler="eager", value_stats="exact", on_nonfinite="track")
    torch._dynamo.reset()
    try:
        with pytest.raises(IndexError) as caught:
            compiled(x, ids)
    finally:
        torch._dynamo.reset()
    partial = caught.value.partial_trace
    ops = [e for e in partial.events if e.kind is tl.EventKind.OP]
    assert [e.op for e in ops] == ["sub", "log", "add"]
    assert all(e.stats is not None for e in ops)
    assert partial.first_nonfinite is not None and partial.first_nonfinite.op == "log"
    assert any("are the replay's" in note for note in partial.attempt.notes)


def test_a_write_before_the_failure_keeps_the_written_value():
    """`y[0] = 5` is a `setitem` op whose value is the tensor after the write, as eagerly."""

    class WritesThenFails(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(4, 3)

        def forward(self, x, ids):
            y = x * 2
            y[0] = 5.0
            return self.table(ids + 3) + (y + 1)

    def partial(compiled):
        torch.manual_seed(0)
        model, x, ids = WritesThenFails(), torch.randn(2, 3), torch.tensor([0, 1])
        torch._dynamo.reset()
        try:
            with pytest.raises((IndexError, RuntimeError)) as caught:
                tl.trace(model, x, ids, compiled=compiled)
        finally:
            torch._dynamo.reset()
        return caught.value.partial_trace

    eager, compiled = partial(False), partial({"compiler": "eager"})
    written = next(e.ordinal for e in compiled.events if e.kind is tl.EventKind.OP and e.op == "setitem")
    assert torch.equal(compiled.values[written][0], eager.values[written][0])
    assert (compiled.values[written][0][0] == 5.0).all()
    report = tl.debug.compare(eager, compiled)
    assert report.first_divergence is None and report.counts["unchecked"] == 0


def test_copies_that_fail_during_the_replay_are_never_taken_for_the_failing_op(monkeypatch):
    from torchlens.fx_backend import replay

    def out_of_memory(value):
        raise RuntimeError("out of memory copying a value")

    monkeypatch.setattr(replay, "_copied", out_of_memory)
    compiled = _partial({"compiler": "eager"})
    assert compiled.attempt.op == "embedding"
    assert any("could not be copied" in note for note in compiled.attempt.notes)
    assert sorted(compiled.values) == [1, 2]  # the inputs only: nothing from the replay
