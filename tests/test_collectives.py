"""`torch.distributed` collectives are ops: a line each with its group, measured once their values
are there, and a NaN another rank sent is "carried in", never born here. Real gloo ranks."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

import torchlens as tl
from torchlens.core.collectives import COLLECTIVES

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch was built without gloo")

WORLD_SIZE = 2


def test_the_table_names_every_collective_torch_dispatches_to_a_capture():
    """A c10d function torch routes through `handle_torch_function` reaches the capture's mode: the
    table must say what it writes, or a torch upgrade's new collective is a silent hole."""
    from torch.distributed import distributed_c10d

    dispatched = {name for name, function in vars(distributed_c10d).items()
                  if inspect.isfunction(function) and function.__module__ == distributed_c10d.__name__
                  and "handle_torch_function(" in inspect.getsource(function)}
    assert dispatched, "no c10d function dispatches to torch function modes any more: collectives are unseen"
    assert dispatched <= set(COLLECTIVES), sorted(dispatched - set(COLLECTIVES))
    for name, entry in COLLECTIVES.items():
        if name in dispatched:
            assert entry.outputs in inspect.signature(getattr(distributed_c10d, name)).parameters, name


class Exchanges(nn.Module):
    """Every kind of collective a training step uses, sync and async, c10d and functional."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        y = self.lin(x)
        dist.all_reduce(y)  # in place, sync
        work = dist.all_reduce(y, async_op=True)
        early = y.view(-1)  # made before the wait: a view reads nothing
        work.wait()
        gathered = torch.empty(self.world_size * y.shape[0], y.shape[1])
        dist.all_gather_single(gathered, y)
        shard = torch.empty(y.shape[0] // self.world_size, y.shape[1])
        dist.reduce_scatter_single(shard, y)
        dist.broadcast(y, src=0)
        z = funcol.all_reduce(y, "sum", dist.group.WORLD)
        return z.sum(0) + gathered.sum(0) + shard.sum(0) + early.view(y.shape).sum(0)


class PoisonedOnRankOne(nn.Module):
    """Rank 1's activations hold a NaN; an all-reduce (sync or async) brings it to every rank."""

    def __init__(self, async_op: bool):
        super().__init__()
        self.async_op = async_op

    def forward(self, x):
        y = x * 2
        work = dist.all_reduce(y, async_op=self.async_op)
        if work is not None:
            work.wait()
        return y + 1


class ReadAfterTheWait(nn.Module):
    """After the wait, the all-reduced values are read by an op that may return its argument
    (`to` another dtype: a copy) or by one that reads and writes them in place (`div_`, as DDP
    averages), or overwritten unread (`copy_`)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        y = x * 2
        dist.all_reduce(y, async_op=True).wait()
        if self.how == "to":
            return y.to(torch.float64) + 1
        if self.how == "div_":
            return y.div_(2) + 1
        return y.copy_(torch.zeros_like(y)) + 1


def _scenarios(rank: int, workdir: str) -> dict:
    result = {}
    torch.manual_seed(0)
    model = Exchanges(WORLD_SIZE)
    torch.set_grad_enabled(False)  # (c10d collectives write in place: not on tensors autograd tracks)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    plain = model(x)
    lines = []
    rec = tl.record(model, x, narrate=lines.append, value_stats="exact", on_nonfinite="track")
    result["equal"] = torch.equal(rec.output, plain)
    result["lines"] = lines
    result["findings"] = [f.text for f in rec.findings]
    lean = []
    tl.record(model, x, narrate=lean.append)
    result["lean"] = lean
    for async_op in (False, True):
        x = torch.ones(2, 2)
        if rank == 1:
            x[0, 0] = float("nan")
        rec = tl.record(PoisonedOnRankOne(async_op), x, on_nonfinite="track")
        result[f"poisoned_async={async_op}"] = [(f.text, f.kind.name) for f in rec.findings]
    for how in ("to", "div_", "copy_"):
        rec = tl.record(ReadAfterTheWait(how), x, on_nonfinite="track", value_stats="exact")
        result[f"read_by_{how}"] = [(f.text, f.kind.name) for f in rec.findings], rec.narrate().splitlines()[-1]
    # compiled: dynamo turns the c10d all_reduce into a functional one, its wait and a copy back
    torch._dynamo.reset()
    lines = []
    compiled = tl.compile(PoisonedOnRankOne(False), compiler="aot_eager", on_nonfinite="track", narrate=lines.append)
    compiled(x)
    torch._dynamo.reset()
    result["poisoned_compiled"] = lines, [(f.text, f.kind.name) for f in compiled.torchlens.last_recording.findings]
    torch.set_grad_enabled(True)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        x[0, 0] = float("nan")
    with tl.recording.Recorder(ddp, backward=True, on_nonfinite="track") as recorder:
        ddp(x).square().mean().backward()
    recording = recorder.recordings[0]
    result["ddp_forward"] = [f.text for f in recording.findings]
    result["ddp_backward"] = [(f.text, f.kind.name) for b in recording.backward for f in b.findings]
    result["ddp_footer"] = recording.backward[0].narrate().splitlines()[-1]
    result["ddp_grads_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
    report = tl.debug.across_ranks(recording)
    result["across"] = [report.first_rank, list(report.tied), report.finding, report.where, report.carried,
                        report.per_rank, str(report)]
    result["across_per_rank"] = tl.debug.across_ranks(recorder, per_rank=True).per_rank
    clean = tl.record(ddp, torch.ones(3, 4), on_nonfinite="track")
    result["across_clean"] = str(tl.debug.across_ranks(clean))
    tl.trace(ddp.module, x, on_nonfinite="track").save(os.path.join(workdir, f"trace-{rank}.tl"))
    # gradients accumulated over two backwards (no zero_grad), the first's NaN rank 0's own
    torch.manual_seed(0)
    linear = nn.Linear(2, 2)
    with tl.recording.Recorder(linear, backward=True, on_nonfinite="track") as recorder:
        poisoned = torch.ones(1, 2)
        if rank == 0:
            poisoned[0, 0] = float("nan")
        linear(poisoned).sum().backward()
        linear(torch.ones(1, 2)).sum().backward()
    result["accumulated"] = [[(f.text, f.kind.name) for b in r.backward for f in b.findings]
                             for r in recorder.recordings]
    # replicas that drifted apart: rank 1's first weight nudged after DDP synchronised them
    torch.manual_seed(0)
    replica = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    if rank == 1:
        with torch.no_grad():
            replica.module[0].weight[0, 0] += 1e-3
    same = torch.ones(3, 4)  # the same batch on every rank: replicated values must agree
    tl.trace(replica, same).save(os.path.join(workdir, f"replica-{rank}.tl"))
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_ranks(_scenarios, WORLD_SIZE, tmp_path_factory.mktemp("collectives"))


def _line(lines, op, nth=0):
    return [line for line in lines if f" {op} " in line][nth]


@pytest.mark.slow
def test_each_collective_has_a_line_with_its_group_and_changes_nothing(job):
    for result in job:
        assert result["equal"]
        assert result["findings"] == []
        lines = result["lines"]
        for op in ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast"):
            assert "group of 2" in _line(lines, op), (op, lines)
        assert "group of 2, async" in _line(lines, "all_reduce", 1)
        assert "group of 2, async" in _line(lines, "all_reduce", 2)  # the functional one
        for op in ("all_reduce", "all_gather_single", "broadcast"):
            assert "finite" in _line(lines, op), _line(lines, op)  # sync: measured as it returned
        assert "stats n/a (in flight)" in _line(lines, "all_reduce", 1)
        assert "stats n/a (in flight)" in _line(lines, "view", 0)  # the view made before the wait
        assert "group of 2" in _line(result["lean"], "all_reduce")


@pytest.mark.slow
def test_a_nan_another_rank_sent_is_carried_in_not_born_sync_and_async(job):
    rank0, rank1 = job
    for async_op in (False, True):
        key = f"poisoned_async={async_op}"
        assert rank1[key][0] == ["NaN in the input x (nan=1)", "NONFINITE_INPUT"], rank1[key]
        assert all(kind != "CARRIED_IN" for _, kind in rank1[key])  # rank 1 sent it: nothing carried in
        assert rank0[key] == [["NaN carried in by #3 all_reduce from its group of 2 (nan=1)", "CARRIED_IN"]], rank0[key]


@pytest.mark.slow
def test_what_reads_the_collective_after_the_wait_lands_it_and_only_an_overwrite_does_not(job):
    """A copy (`to` float64) or an in-place op that reads (`div_`) is where the values arrived: rank 0
    is told the NaN was carried in, not born at the copy nor first seen at the division; `copy_`
    overwrites them unread, and the footer says so."""
    rank0, rank1 = job
    carried = ["NaN carried in by #3 all_reduce from its group of 2 (nan=1)", "CARRIED_IN"]
    for how in ("to", "div_"):
        findings, footer = rank0[f"read_by_{how}"]
        assert findings == [carried], (how, findings)
        assert "overwritten" not in footer, (how, footer)
        assert rank1[f"read_by_{how}"][0][0] == ["NaN in the input x (nan=1)", "NONFINITE_INPUT"]
    findings, footer = rank0["read_by_copy_"]
    assert findings == [] and "1 not measured (1 overwritten by #5 before it was read)" in footer, footer


@pytest.mark.slow
def test_a_compiled_collective_says_its_group_and_carries_in_what_another_rank_sent(job):
    """In the graph the all-reduce is a functional collective whose values arrive at `wait_tensor`:
    its line says its group, and the NaN rank 1 sent is carried in on rank 0, as eager says."""
    (lines0, findings0), (lines1, findings1) = (rank["poisoned_compiled"] for rank in job)
    for lines in (lines0, lines1):
        assert _line(lines, "all_reduce").endswith("group of 2, async"), lines
    assert findings0 == [["NaN carried in by #3 all_reduce from its group of 2 (nan=1)", "CARRIED_IN"]], lines0
    assert lines0[-1].endswith("first non-finite: NaN carried in by #3 all_reduce from its group of 2 (nan=1)")
    assert findings1[0] == ["NaN in the input x (nan=1)", "NONFINITE_INPUT"], findings1
    assert all(kind != "CARRIED_IN" for _, kind in findings1)


@pytest.mark.slow
def test_the_rank_ddp_poisoned_through_its_gradient_all_reduce_is_told_so(job):
    """Rank 1's batch holds a NaN; DDP's all-reduce (C++, in the backward's final callback) brings it
    into every gradient of rank 0, whose own forward and backward were finite."""
    rank0, rank1 = job
    assert not rank0["ddp_grads_finite"] and not rank1["ddp_grads_finite"]
    assert rank0["ddp_forward"] == []
    (text, kind), = rank0["ddp_backward"]
    assert kind == "CARRIED_IN"
    assert text.startswith("NaN in the gradients of 4 parameters (module.2.bias, module.2.weight, module.0.bias, ...) "
                           "after the backward: ~"), text
    assert "tl.debug.across_ranks" in text
    assert "first non-finite gradient: NaN in the gradients of 4 parameters" in rank0["ddp_footer"]
    assert rank1["ddp_forward"][0] == "NaN in the input inputs[0] (nan=1)"  # where it came from
    assert all(kind != "CARRIED_IN" for _, kind in rank1["ddp_backward"]), rank1["ddp_backward"]


@pytest.mark.slow
def test_a_nan_a_gradient_held_before_the_backward_is_not_said_to_be_carried_in(job):
    """Accumulating gradients, the second backward adds a finite gradient to rank 0's NaN `.grad`:
    nothing outside the graph wrote it, so nothing was carried in (the first backward named the NaN
    input its weight's gradient was made of)."""
    rank0, rank1 = job
    first, second = rank0["accumulated"]
    assert first == [["NaN gradient at ~1 AddmmBackward0, the backward of #2 linear (nan=2), out of the forward's "
                      "NaN: #2 linear read NaN from the input input", "GRADIENT_FROM_FORWARD"]], first  # (through JSON)
    assert second == [], second
    assert rank1["accumulated"] == [[], []]


@pytest.mark.slow
def test_every_rank_gets_the_same_answer_to_which_rank(job):
    rank0, rank1 = job
    assert rank0["across"] == rank1["across"]
    first_rank, tied, finding, where, carried, per_rank, text = rank0["across"]
    assert (first_rank, tied, finding, where, carried, per_rank) == (
        1, [1], "NaN in the input inputs[0] (nan=1)", "the forward of pass 1", 1, None)
    assert text == ("first on rank 1, in the forward of pass 1: NaN in the input inputs[0] (nan=1)\n"
                    "1 rank received non-finite values through a collective")
    assert rank0["across_per_rank"] == rank1["across_per_rank"] == [None, "NaN in the input inputs[0] (nan=1)"]
    assert rank0["across_clean"] == rank1["across_clean"] == "no non-finite value on any of the 2 ranks"


@pytest.mark.slow
def test_saved_traces_of_every_rank_give_the_verdict_without_a_process_group(job, tmp_path_factory):
    workdir = next(tmp_path_factory.getbasetemp().glob("collectives*"))
    report = tl.debug.across_ranks([tl.load(workdir / f"trace-{rank}.tl") for rank in range(WORLD_SIZE)])
    assert (report.first_rank, report.tied, report.where) == (1, (1,), "the forward of pass 1")
    assert report.per_rank == [None, "NaN in the input input (nan=1)"]  # (nn.Sequential names it `input`)


def test_across_ranks_without_a_process_group_says_how_to_call_it():
    recording = tl.record(nn.Linear(2, 2), torch.ones(1, 2), on_nonfinite="track")
    with pytest.raises(RuntimeError, match="init_process_group"):
        tl.debug.across_ranks(recording)
    with pytest.raises(TypeError, match="a recording, a trace, a Recorder"):
        tl.debug.across_ranks([object()])


@pytest.mark.slow
def test_compare_finds_where_two_ranks_replicated_values_first_diverge(job, tmp_path_factory):
    """The desynchronised-rank bug: DDP replicas given the same batch must compute the same values;
    comparing two ranks' saved traces names the first op where they do not."""
    workdir = next(tmp_path_factory.getbasetemp().glob("collectives*"))
    report = tl.debug.compare(tl.load(workdir / "replica-0.tl"), tl.load(workdir / "replica-1.tl"))
    first = report.first_divergence
    assert first is not None and (first.op, first.module) == ("linear", "module.0"), str(report)
    assert all(row.verdict == "within" for row in report.rows[:[r.ordinal for r in report.rows].index(first.ordinal)]
               if row.status == "both")


class FunctionalReduce(nn.Module):
    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(torch.sin(x), "sum", dist.group.WORLD) * 2


def test_a_compiled_functional_collective_is_measured_after_its_wait_not_before(group_of_one):
    """In a graph, the collective's output holds nothing until its `wait_tensor`: measuring it in
    between is reading memory the collective is still writing. The statistics pass leaves it unread
    and measures the waited value, as eager narration does."""
    import torch._dynamo

    torch._dynamo.reset()
    lines = []
    compiled = tl.compile(FunctionalReduce(), compiler="aot_eager", value_stats="exact", on_nonfinite="track",
                          narrate=lines.append)
    out = compiled(torch.ones(2, 3))
    torch._dynamo.reset()
    assert torch.equal(out, torch.sin(torch.ones(2, 3)) * 2)
    reduce_line = next(line for line in lines if " all_reduce " in line)
    wait_line = next(line for line in lines if " wait_tensor " in line)
    assert reduce_line.endswith("stats n/a (in flight)"), reduce_line
    assert "min=0.8415" in wait_line and wait_line.endswith("finite"), wait_line
    assert lines[-1].endswith("no non-finite values"), lines[-1]
    eager = []
    tl.record(FunctionalReduce(), torch.ones(2, 3), value_stats="exact", narrate=eager.append)
    assert next(line for line in eager if " all_reduce " in line).endswith("group of 1, async  | stats n/a (in flight)")
