"""The rank harness itself: its ranks skip interpreter teardown, so the one thing that teardown
told a test (a collective left unwaited) must fail the run instead."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

import torchlens as tl

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                                   reason="needs torch.distributed with gloo")]


class SumAcrossRanks(torch.nn.Module):
    def forward(self, t):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(t, "sum", dist.group.WORLD)


def _functional_all_reduce(rank: int, workdir: str, wait: bool) -> dict:
    recording = tl.record(SumAcrossRanks(), torch.full((2,), float(rank)))
    if wait:
        return {"sum": recording.output.tolist()}
    return {}


def test_a_rank_that_never_waits_for_its_collective_fails_the_run(tmp_path):
    with pytest.raises(Exception, match="1 collective call\\(s\\) were never waited for"):
        run_ranks(_functional_all_reduce, 2, tmp_path, False)


def test_a_rank_that_reads_its_collective_passes_with_its_result(tmp_path):
    assert run_ranks(_functional_all_reduce, 2, tmp_path, True) == [{"sum": [1.0, 1.0]}] * 2
