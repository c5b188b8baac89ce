"""Narration under torch.distributed: a file per rank from a path template, `[rank N] ` on lines that
ranks write to a shared sink, and a failure on one rank that leaves the other running.

One job of two gloo processes (started once for the module, a few seconds) runs every scenario and
writes what it saw to `result-{rank}.json`; the tests read those and the narration files. Template
rules that need no process group are tested in this process.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from helpers import check_nesting, op_lines
from ranks import exit_without_finalizing, fail_on_unwaited_collectives
from torch import nn

import torchlens as tl

NarrationOptions = tl.options.NarrationOptions
WORLD_SIZE = 2

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch was built without gloo")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def _train(model, steps: int, rank: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        optimizer.step()


# -- what each rank runs ---------------------------------------------------------------------------


def _worker(rank: int, workdir: str) -> None:
    """One rank of the job. Everything it asserts on is written down for the parent to check."""
    path = lambda name: os.path.join(workdir, name)  # noqa: E731
    result = {}
    # Made before the process group exists: the rank is read when a run opens its sink.
    per_rank_options = NarrationOptions(sink=path("plain-{rank}-of-{world_size}.log"))
    dist.init_process_group("gloo", init_method="file://" + path("rendezvous"), rank=rank,
                            world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=60))
    try:
        plain = _model()
        tl.record(plain, _batch(rank), narrate=per_rank_options)

        ddp = nn.parallel.DistributedDataParallel(_model())
        recording = tl.record(ddp, _batch(rank), narrate=path("ddp-{rank}.log"))
        result["ddp_output_matches"] = torch.equal(recording.output, ddp(_batch(rank)))

        with tl.recording.Recorder(ddp, narrate=path("train-{rank}.log")) as recorder:
            _train(ddp, 3, rank)
        reference = nn.parallel.DistributedDataParallel(_model())
        _train(reference, 3, rank)
        result["passes"] = recorder.passes
        result["trained_like_without_narration"] = all(
            torch.equal(a, b) for a, b in zip(ddp.parameters(), reference.parameters()))
        result["weights"] = [p.detach().sum().item() for p in ddp.parameters()]

        with tl.recording.Recorder(ddp, narrate=path("shared.log")):
            _train(ddp, 2, rank)

        stream, log_text = io.StringIO(), io.StringIO()
        logger = logging.getLogger(f"narration.rank{rank}")
        logger.addHandler(logging.StreamHandler(log_text))
        logger.setLevel(logging.INFO)
        logger.propagate = False
        tl.record(plain, _batch(rank), narrate=NarrationOptions(sink=stream, prefix="[eval] "))
        tl.record(plain, _batch(rank), narrate=logger)
        with contextlib.redirect_stderr(io.StringIO()) as stderr:
            tl.record(plain, _batch(rank), narrate=True)
        result["stream"] = stream.getvalue()
        result["logger"] = log_text.getvalue()
        result["stderr"] = stderr.getvalue()
        result["recording_text"] = recording.narrate()

        dist.barrier()
        try:  # rank 1 gets a batch its model cannot take; rank 0 goes on
            batch = torch.randn(3, 5) if rank == 1 else _batch(rank)
            result["failed_output"] = tl.record(plain, batch, narrate=path("failures.log")).output.shape[0]
        except RuntimeError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["tail"] = exc.partial_trace.narrate(last=3)
            result["partial_ops"] = len(exc.partial_trace.ops)
        dist.barrier()
        fail_on_unwaited_collectives()
    finally:
        dist.destroy_process_group()
    with open(path(f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    exit_without_finalizing()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the two-rank job once; return (workdir, [result of rank 0, result of rank 1])."""
    workdir = tmp_path_factory.mktemp("ddp")
    torch.multiprocessing.spawn(_worker, args=(str(workdir),), nprocs=WORLD_SIZE, join=True)
    results = [json.loads((workdir / f"result-{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    return workdir, results


# -- a file per rank -------------------------------------------------------------------------------


@pytest.mark.slow
def test_each_rank_writes_its_own_file_from_a_rank_template(job):
    workdir, results = job
    for rank in range(WORLD_SIZE):
        text = (workdir / f"ddp-{rank}.log").read_text()
        assert not text.startswith("[rank")  # a per-rank file needs no tag
        assert text == results[rank]["recording_text"]
        assert [line.split()[1] for line in op_lines(text)] == ["input", "linear", "relu", "linear"]
        assert "> module (Sequential)" in text
        check_nesting(text)
        assert results[rank]["ddp_output_matches"]


def test_a_template_made_before_the_process_group_uses_the_groups_rank(job):
    workdir, _ = job
    assert sorted(p.name for p in workdir.glob("plain-*.log")) == ["plain-0-of-2.log", "plain-1-of-2.log"]


def test_a_recorder_narrates_ddp_training_steps_without_changing_them(job):
    workdir, results = job
    assert results[0]["weights"] == results[1]["weights"]  # gradients were all-reduced as usual
    for rank in range(WORLD_SIZE):
        assert results[rank]["trained_like_without_narration"] and results[rank]["passes"] == 3
        text = (workdir / f"train-{rank}.log").read_text()
        assert [line for line in text.splitlines() if line.startswith("-- pass")] == \
            ["-- pass 1", "-- pass 2", "-- pass 3"]
        assert text.count("-- end: 1 input, 3 ops") == 3


# -- shared sinks ----------------------------------------------------------------------------------


def test_lines_ranks_write_to_one_file_carry_the_rank(job):
    workdir, _ = job
    lines = (workdir / "shared.log").read_text().splitlines()
    assert lines and all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in lines)
    for rank in range(WORLD_SIZE):
        own = "\n".join(line[len(f"[rank {rank}] "):] for line in lines if line.startswith(f"[rank {rank}] "))
        assert own.count("-- pass") == 2 and len(op_lines(own)) == 8
        check_nesting(own.replace("-- pass 1\n", "").replace("-- pass 2\n", ""))


def test_stderr_streams_and_loggers_get_the_rank_tag_before_the_users_prefix(job):
    _, results = job
    for rank, result in enumerate(results):
        tag = f"[rank {rank}] "
        for text in (result["logger"], result["stderr"]):
            assert text.splitlines()[0] == tag + "#1    input         [3,4] f32 cpu  input"
            assert all(line.startswith(tag) for line in text.splitlines())
        assert all(line.startswith(tag + "[eval] ") for line in result["stream"].splitlines())


def test_a_failure_on_one_rank_gives_its_partial_trace_while_the_other_completes(job):
    workdir, results = job
    assert results[0]["failed_output"] == 3 and "error" not in results[0]
    failed = results[1]
    assert failed["error"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert failed["partial_ops"] == 1
    tail = failed["tail"].splitlines()
    assert tail[0].startswith("!! forward failed: RuntimeError") and tail[-1].startswith("!! attempted #2 linear @0")
    shared = (workdir / "failures.log").read_text().splitlines()
    assert "[rank 0] -- end: 1 input, 3 ops, 3 module calls" in shared
    assert not any(line.startswith("[rank 0] !!") for line in shared)
    ours = [line for line in shared if line.startswith("[rank 1] ")]
    assert ours[-1].startswith("[rank 1] !! attempted #2 linear @0")
    assert any(line.startswith("[rank 1] !! forward failed: RuntimeError") for line in ours)


# -- templates without a process group (this process) ----------------------------------------------


def test_without_a_process_group_the_rank_comes_from_torchrun_or_is_zero(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    template = str(tmp_path / "run-{rank}-of-{world_size}.log")
    tl.record(_model(), _batch(0), narrate=template)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    stream = io.StringIO()
    tl.record(_model(), _batch(0), narrate=template)
    tl.record(_model(), _batch(0), narrate=stream)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-0-of-1.log", "run-3-of-4.log"]
    assert stream.getvalue().startswith("#1 ")  # no process group: nothing is shared, no tag


def test_a_process_group_of_one_adds_no_tag(tmp_path):
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "rendezvous"), rank=0, world_size=1)
    try:
        stream = io.StringIO()
        tl.record(_model(), _batch(0), narrate=stream)
        tl.record(_model(), _batch(0), narrate=str(tmp_path / "solo-{rank}.log"))
    finally:
        dist.destroy_process_group()
    assert stream.getvalue().startswith("#1 ")
    assert (tmp_path / "solo-0.log").read_text() == stream.getvalue()


@pytest.mark.parametrize("template, complaint", [
    ("run-{node}.log", "names {node}"),
    ("run-{0}.log", "names {0}"),
    ("run-{rank!r}.log", "names {rank!r}"),
    ("run-{rank:s}.log", "names {rank:s}"),
    ("run-{rank:03}.log", "names {rank:03}"),
    ("run-{rank.log", "expected '}'"),
])
def test_a_template_field_torchlens_cannot_fill_is_refused_up_front(template, complaint, tmp_path):
    calls = []
    model = _model()
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    target = str(tmp_path / template)
    for start in (lambda: tl.record(model, _batch(0), narrate=target),
                  lambda: tl.recording.Recorder(model, narrate=target),
                  lambda: tl.compile(model, narrate=target, compiler="eager")):
        with pytest.raises(tl.errors.OptionValueError) as info:
            start()
        assert complaint in str(info.value) and "{rank} and {world_size}" in str(info.value)
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_doubled_braces_are_literal(tmp_path):
    tl.record(_model(), _batch(0), narrate=str(tmp_path / "run-{{rank}}.log"))
    assert [p.name for p in tmp_path.iterdir()] == ["run-{rank}.log"]
