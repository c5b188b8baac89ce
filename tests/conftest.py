"""Shared fixtures: every test ends with no torchlens hook or mode left in torch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import leftover_state  # noqa: E402

# Many tests compile the same small models with different backends: give dynamo room, and fail
# loudly rather than fall back to eager silently when the room runs out.
torch._dynamo.config.recompile_limit = 64
torch._dynamo.config.fail_on_recompile_limit_hit = True


@pytest.fixture(autouse=True)
def no_residue():
    """Fail any test after which a global module hook or a torch function mode is still installed."""
    before = leftover_state()
    yield
    assert leftover_state() == before, "torchlens left hooks or modes behind"


@pytest.fixture
def deferred_reads(monkeypatch):
    """Measure CPU tensors as an accelerator's are: statistics vectors read once per forward, not
    as each op completes. How the read-once discipline is checked on a machine without one."""
    import torchlens.measure.meter

    monkeypatch.setattr(torchlens.measure.meter, "READ_NOW", set())


@pytest.fixture
def group_of_one(tmp_path):
    """A gloo process group of this process alone (collectives run; their group is 1)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
