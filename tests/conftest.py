"""Shared fixtures: every test ends with no torchlens hook or mode left in torch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import leftover_state  # noqa: E402


@pytest.fixture(autouse=True)
def no_residue():
    """Fail any test after which a global module hook or a torch function mode is still installed."""
    before = leftover_state()
    yield
    assert leftover_state() == before, "torchlens left hooks or modes behind"
