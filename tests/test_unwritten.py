"""Memory `torch.empty` allocated is never measured before an op writes it: a view of it reads
nothing, and what the allocator left there is not the model's value. With deterministic algorithms
torch fills such memory with NaN, which makes the stale bytes a NaN every time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fake_engine import ENGINE_FILE, EngineMemory
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


class Unshards(nn.Module):
    """The engine unshards into memory it got back (FSDP2's copy-out), then the model reads it."""

    def __init__(self, engine: EngineMemory, again: bool = False):
        super().__init__()
        self.engine = engine
        self.again = again
        self.table = torch.arange(8.0)  # a plain tensor attribute: the model's own, measured when viewed
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        unsharded = self.engine.unshard(x)
        y = unsharded * self.table[:8] + self.scale.view(8)
        if self.again:  # the engine takes the memory back and gives it again within the forward
            y = y + self.engine.unshard(x)
        return y


@pytest.fixture
def engine_code(tmp_path, monkeypatch):
    """Ops called from tests/fake_engine.py are an engine's, under a process group of one."""
    from torchlens.core import engines

    monkeypatch.setattr(engines, "_ENGINE_FILES", ((ENGINE_FILE, "FSDP2"),) + engines._ENGINE_FILES)
    monkeypatch.setattr(engines, "_BY_CODE", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _view_stats(rec):
    return [e.stats for e in rec.events if e.op == "view"]


@pytest.mark.parametrize("options", [{"value_stats": "exact"}, {"on_nonfinite": "track", "value_stats": "exact"},
                                     {"on_nonfinite": "track"}])
def test_a_view_of_memory_the_forward_never_saw_written_is_not_read(options, engine_code):
    engine = EngineMemory(8)
    model = Unshards(engine)
    x = torch.arange(8.0).view(2, 4)
    rec = tl.record(model, x, **options)
    assert torch.equal(rec.output, x.view(8) * torch.arange(8.0) + 2.0)
    assert rec.findings == (), [f.text for f in rec.findings]
    stale, written, scale = _view_stats(rec)
    assert stale.kind == "na" and stale.note == "not seen written"
    assert written.kind != "na" and not written.nonfinite  # after the copy into it: measured
    assert scale.kind != "na"  # a view of the model's buffer: memory the user's program set
    getitem = [e.stats for e in rec.events if e.op == "getitem"][0]
    assert getitem.kind != "na"  # a view of a plain tensor attribute of the model
    if options.get("value_stats") == "exact":
        assert (written.min, written.max) == (0.0, 7.0)


def test_memory_given_back_again_within_the_forward_is_unread_again(engine_code):
    """Written once, then resized and viewed again: the second view's bytes are new and stale."""
    rec = tl.record(Unshards(EngineMemory(8), again=True), torch.ones(2, 4), value_stats="exact",
                    on_nonfinite="track")
    assert rec.findings == (), [f.text for f in rec.findings]
    notes = [stats.note if stats.kind == "na" else "measured" for stats in _view_stats(rec)]
    assert notes == ["not seen written", "measured", "measured", "not seen written", "measured"], notes


def test_a_nan_in_memory_the_forward_never_saw_written_is_still_found_where_torch_reads_it(engine_code):
    """Not measuring a view is not hiding what it holds: the op that reads the stale bytes (here
    nothing overwrote them) computes a NaN, and tracking says it was first seen there, not born:
    what it read was not measured."""
    class ReadsStale(nn.Module):
        def __init__(self):
            super().__init__()
            self.engine = EngineMemory(4)

        def forward(self, x):
            self.engine.give_back()
            return x + self.engine.view(2, 2)

    rec = tl.record(ReadsStale(), torch.ones(2, 2), on_nonfinite="track")
    assert [f.text for f in rec.findings] == [
        "NaN first seen at #3 add (nan=4); not everything it read was measured, so it may have come from earlier"]
    assert rec.findings[0].kind is tl.FindingKind.FIRST_SEEN


TABLE = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])  # kept outside the model, set before the forward


class ReadsAGlobalTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x) * TABLE[0].nan_to_num(0)


def test_a_nan_in_a_tensor_the_model_keeps_outside_itself_is_found_where_it_views_it():
    """Only an engine's own views of memory the pass did not see written are left unread: the
    model's view of a table it keeps in a global is of values its program wrote, and a NaN there
    is named although `nan_to_num` removes it before anything else reads it; compiled alike."""
    import torch._dynamo

    expected = ["NaN in a [2,2] tensor no narrated op produced (nan=1), first read by #3 getitem"]
    rec = tl.record(ReadsAGlobalTable(), torch.ones(1, 2), on_nonfinite="track")
    assert [f.text for f in rec.findings] == expected
    assert not rec.narrate().splitlines()[-1].endswith("no non-finite values")
    torch._dynamo.reset()
    try:
        compiled = tl.compile(ReadsAGlobalTable(), compiler="eager", on_nonfinite="track")
        compiled(torch.ones(1, 2))
        assert [f.text for f in compiled.torchlens.last_recording.findings] == expected
    finally:
        torch._dynamo.reset()
