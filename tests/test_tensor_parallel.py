"""Tensor parallel (`parallelize_module` with `ColwiseParallel` / `RowwiseParallel`, real gloo ranks):
DTensor lines say their placement and local shape, their statistics are the local shard's, and a NaN
in one rank's weight shard is found on that rank and "carried in" on the other."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

import torchlens as tl
from torchlens.narration.stats_text import fmt

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch was built without gloo")

WORLD_SIZE = 2


def _parallel_mlp(mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _parallel_llama(mesh) -> nn.Module:
    """A transformers Llama with the usual TP plan: q/k/v, gate and up column-wise, o and down
    row-wise (each rank computes its share of the heads)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    plan = {}
    for index in range(config.num_hidden_layers):
        layer = f"model.layers.{index}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[layer + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[layer + name] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _llama_scenarios(mesh, rank: int) -> dict:
    """A tracked forward and a tracked training step of the TP Llama, against plain ones."""
    result = {}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))  # the same on both ranks
    model = _parallel_llama(mesh)
    with torch.no_grad():
        plain = model(ids).logits
        lines = []
        rec = tl.record(model, ids, narrate=lines.append, value_stats="exact", on_nonfinite="track")
    result["equal"] = torch.equal(rec.output.logits, plain)
    result["findings"] = [f.text for f in rec.findings]
    result["lines"] = lines
    narrated, reference = _parallel_llama(mesh), _parallel_llama(mesh)
    for net, tracked in ((narrated, True), (reference, False)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        if tracked:
            with tl.recording.Recorder(net, backward=True, on_nonfinite="track") as recorder:
                net(ids, labels=ids).loss.backward()
            recording = recorder.recordings[0]
            result["step_findings"] = [f.text for f in recording.findings] + [
                f.text for b in recording.backward for f in b.findings]
        else:
            net(ids, labels=ids).loss.backward()
        optimizer.step()
    result["trained_alike"] = all(torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a,
                                              b.full_tensor() if hasattr(b, "full_tensor") else b)
                                  for a, b in zip(narrated.parameters(), reference.parameters()))
    return result


class ShardedScale(nn.Module):
    """A parameter used as rank 1's shard of a DTensor, holding a NaN on rank 1 only."""

    def __init__(self, mesh, rank: int):
        super().__init__()
        self.mesh = mesh
        self.pre = nn.Linear(4, 4)
        scale = torch.ones(2, 4)
        if rank == 1:
            scale[0, 0] = float("nan")
        self.scale = nn.Parameter(scale)

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Shard

        hidden = DTensor.from_local(self.pre(x), self.mesh, [Shard(0)])
        return (hidden * DTensor.from_local(self.scale, self.mesh, [Shard(0)])).sum().full_tensor()


def _scenarios(rank: int, workdir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    result = {}
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    model = _parallel_mlp(mesh)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))  # the same batch on both ranks
    plain = model(x)
    lines = []
    rec = tl.record(model, x, narrate=tl.options.NarrationOptions(sink=lines.append, engine_ops=True),
                    value_stats="exact", on_nonfinite="track")
    result["equal"] = torch.equal(rec.output, plain)
    result["lines"] = lines
    result["folded"] = rec.narrate(engine_ops=False).splitlines()
    result["findings"] = [f.text for f in rec.findings]

    # a training step, tracked forward and backward, against the same step without torchlens
    narrated, reference = _parallel_mlp(mesh), _parallel_mlp(mesh)
    for net, tracked in ((narrated, True), (reference, False)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        if tracked:
            with tl.recording.Recorder(net, backward=True, on_nonfinite="track") as recorder:
                net(x).square().mean().backward()
            recording = recorder.recordings[0]
            result["step_findings"] = [f.text for f in recording.findings] + [
                f.text for b in recording.backward for f in b.findings]
        else:
            net(x).square().mean().backward()
        optimizer.step()
    result["trained_alike"] = all(torch.equal(a.full_tensor(), b.full_tensor())
                                  for a, b in zip(narrated.parameters(), reference.parameters()))

    # saved and loaded: placements, local shapes and engine ops as they were
    path = os.path.join(workdir, f"tp-{rank}.tl")
    trace = tl.trace(model, x, value_stats="exact")
    trace.save(path)
    loaded = tl.load(path)
    result["saved"] = [trace.narrate(engine_ops=True), loaded.narrate(engine_ops=True), trace.narrate(),
                       loaded.narrate()]

    # the whole tensor's statistics, asked for: the same on every rank, those of the unsharded values
    whole = []
    rec = tl.record(model, x, narrate=whole.append, value_stats="exact", dtensor_stats="global")
    result["whole_equal"] = torch.equal(rec.output, plain)
    result["whole_lines"] = whole
    torch.manual_seed(0)
    unsharded = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # the same initial weights
    with torch.no_grad():
        hidden, out = unsharded[0](x), unsharded(x)
    result["whole_expected"] = [[fmt(hidden.min().item()), fmt(hidden.max().item())],
                                [fmt(out.min().item()), fmt(out.max().item())]]
    local = next(line for line in lines if " linear " in line and "@0" in line)
    result["local_min"] = local.split("min=")[1].split()[0]
    with tl.recording.Recorder(narrated, backward=True, on_nonfinite="track", value_stats="exact",
                               dtensor_stats="global") as recorder:
        narrated(x).square().mean().backward()
    recording = recorder.recordings[0]
    result["whole_step"] = [f.text for f in recording.findings] + [f.text for b in recording.backward
                                                                    for f in b.findings]
    result["whole_backward"] = recording.backward[0].narrate().splitlines()

    # whole-tensor statistics in a backward whose NaN is on one rank only: every rank measures the
    # same DTensors (a rank measuring one more would wait forever in its extra collective)
    torch.manual_seed(0)
    sharded = ShardedScale(mesh, rank)
    with tl.recording.Recorder(sharded, backward=True, on_nonfinite="track", value_stats="exact",
                               dtensor_stats="global") as recorder:
        sharded(torch.randn(2, 4)).backward()
    after = torch.full((3,), float(rank + 10))
    dist.all_reduce(after)  # the job's next collective: both ranks got here, in step
    result["one_rank_nan_backward"] = [f.text for b in recorder.recordings[0].backward for f in b.findings], after.tolist()

    result["llama"] = _llama_scenarios(mesh, rank)

    poisoned = _parallel_mlp(mesh)
    if rank == 1:
        with torch.no_grad():
            poisoned[2].weight.to_local()[0, 0] = float("nan")
    rec = tl.record(poisoned, x, on_nonfinite="track")
    result["poisoned"] = [(f.text, f.kind.name) for f in rec.findings]
    result["across"] = str(tl.debug.across_ranks(rec))
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_ranks(_scenarios, WORLD_SIZE, tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
def test_dtensor_lines_show_placement_and_local_shape_and_measure_the_local_shard(job):
    for result in job:
        assert result["equal"] and result["findings"] == []
        lines = result["lines"]
        column = next(line for line in lines if " linear " in line and "@0" in line)
        row = next(line for line in lines if " linear " in line and "@2" in line)
        assert "[3,16] f32 cpu Shard(1) local [3,8]  @0" in column, column
        assert "[3,8] f32 cpu Partial(sum) local [3,8]  @2" in row, row
        for line in (column, row):
            assert line.endswith("finite (local shard)") and "min=" in line, line
        assert not any("measuring" in line for line in lines), lines  # never n/a from an exception
        assert "group of 2, async  [DTensor]" in next(line for line in lines if " all_reduce " in line)
        folded = result["folded"]  # by default DTensor's own ops (its collectives too) are folded
        assert [line.split()[1] for line in folded if line.lstrip().startswith("#")] == [
            "input", "linear", "relu", "linear"], folded
        assert "6 engine ops folded (6 of DTensor; engine_ops=True shows them)" in folded[-1], folded[-1]


@pytest.mark.slow
def test_a_tracked_tensor_parallel_step_finds_nothing_and_trains_like_plain(job):
    for result in job:
        assert result["step_findings"] == []
        assert result["trained_alike"]


@pytest.mark.slow
def test_a_nan_in_one_ranks_weight_shard_is_named_there_and_carried_in_elsewhere(job):
    rank0, rank1 = job
    assert rank1["poisoned"] == [["NaN in 2.weight (nan=1), first read by #7 linear @2", "NONFINITE_SOURCE"]]
    assert rank0["poisoned"] == [["NaN carried in by #8 all_reduce @2 from its group of 2 (nan=3)", "CARRIED_IN"]]
    assert rank0["across"] == rank1["across"] == (
        "first on rank 1, in the forward of pass 1: NaN in 2.weight (nan=1), first read by #7 linear @2\n"
        "1 rank received non-finite values through a collective")


@pytest.mark.slow
def test_global_dtensor_statistics_are_the_whole_tensors_on_every_rank(job):
    """`dtensor_stats="global"`: one collective per measured DTensor gives every rank the statistics
    of the unsharded value (the Partial one's after its sum), said so, with outputs unchanged."""
    rank0, rank1 = job
    for result in job:
        assert result["whole_equal"]
        lines = result["whole_lines"]
        column = next(line for line in lines if " linear " in line and "@0" in line)
        row = next(line for line in lines if " linear " in line and "@2" in line)
        for line, (low, high) in zip((column, row), result["whole_expected"]):
            assert f"min={low} max={high}" in line and line.endswith("finite (global)"), (line, low, high)
        assert "Shard(1) local [3,8]" in column  # the placement is still said
        assert result["whole_step"] == []
        assert any("(global)" in line for line in result["whole_backward"]), result["whole_backward"]
    whole0, whole1 = ([line.split("] ", 1)[1] for line in result["whole_lines"] if "(global)" in line]
                      for result in job)
    assert len(whole0) == 2 and whole0 == whole1, (whole0, whole1)  # (the relu between is of a local tensor)
    assert rank0["local_min"] != rank1["local_min"]  # (each rank's shard holds other values)
    for result in job:  # the NaN is rank 1's, but the whole tensors hold it on both ranks
        findings, after = result["one_rank_nan_backward"]
        assert after == [21.0] * 3
        # (the mul multiplies the gradient by the NaN its forward read: the forward's NaN, no birth; where
        # that NaN came from is each rank's own forward's word: a tensor no op produced, or the mul)
        [finding] = findings
        assert finding.startswith("NaN gradient at ~4 MulBackward0, the backward of #5 mul (nan=1), out of the "
                                  "forward's NaN: #5 mul "), findings


def test_global_dtensor_statistics_are_refused_where_a_graph_measures():
    with pytest.raises(tl.errors.OptionValueError, match="trace eagerly"):
        tl.trace(nn.Linear(2, 2), torch.ones(1, 2), compiled=True, dtensor_stats="global")
    with pytest.raises(tl.errors.OptionValueError, match="accepted are 'local' or 'global'"):
        tl.record(nn.Linear(2, 2), torch.ones(1, 2), dtensor_stats="whole")


@pytest.mark.slow
def test_a_saved_trace_keeps_placements_local_shapes_and_engine_ops(job):
    for result in job:
        live_all, loaded_all, live, loaded = result["saved"]
        assert loaded_all == live_all and loaded == live
        assert "Shard(1) local [3,8]" in loaded and "[DTensor]" in loaded_all and "[DTensor]" not in loaded
        assert "engine ops folded (6 of DTensor" in loaded.splitlines()[-1]


@pytest.mark.slow
def test_a_transformers_llama_under_its_tp_plan_is_tracked_without_false_findings(job):
    """q/k/v and gate/up column-wise, o and down row-wise: the tracked forward and training step
    find nothing, return what plain TP returns and train alike; the projections say their placement."""
    for result in job:
        llama = result["llama"]
        assert llama["equal"] and llama["findings"] == [], llama["findings"][:3]
        assert llama["step_findings"] == [] and llama["trained_alike"], llama["step_findings"][:3]
        q_proj = next(line for line in llama["lines"] if " linear " in line and "q_proj" in line)
        assert "[2,8,32] f32 cpu Shard(2) local [2,8,16]" in q_proj and q_proj.endswith("(local shard)"), q_proj
        assert llama["lines"][-1].endswith("no non-finite values"), llama["lines"][-1]
