"""Behaviours earlier tests could not catch when they broke: each test here fails for one
realistic bug (a selector matching by prefix, a site keeping its directory under normalize=, the
attempted marker's ordinal, a device read per op past max_lines, exit lines lost after an
exception caught inside the forward, narration turned on by the environment)."""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import textwrap

import pytest
import torch
from helpers import check_nesting, count_host_syncs, op_lines
from models import tiny_gpt, tokens
from torch import nn

import torchlens as tl


class Twelve(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList(nn.Linear(2, 2) for _ in range(12))

    def forward(self, x):
        for layer in self.h:
            x = layer(x)
        return x


def narrated(model, *args, **options):
    sink = io.StringIO()
    recording = tl.record(model, *args, narrate=tl.options.NarrationOptions(sink=sink, **options))
    return sink.getvalue(), recording


def test_in_module_matches_whole_path_components_not_prefixes():
    text, _ = narrated(Twelve(), torch.ones(1, 2), select=tl.in_module("h.1"))
    assert [line.split("@")[1] for line in op_lines(text)] == ["h.1"]  # not h.10, not h.11


def test_normalize_drops_the_directory_of_a_site(tmp_path):
    folder = tmp_path / "deep" / "models"
    folder.mkdir(parents=True)
    (folder / "elsewhere.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Elsewhere(nn.Module):
            def forward(self, x):
                return torch.relu(x)
    """))
    spec = importlib.util.spec_from_file_location("elsewhere", folder / "elsewhere.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plain, _ = narrated(module.Elsewhere(), torch.ones(2), sites=True)
    normalized, _ = narrated(module.Elsewhere(), torch.ones(2), sites=True, normalize=True)
    relu = [line for line in op_lines(plain) if " relu " in line][0]
    assert "/" in relu.split()[-1] and relu.split()[-1].endswith("elsewhere.py:7")
    relu = [line for line in op_lines(normalized) if " relu " in line][0]
    assert relu.split()[-1] == "elsewhere.py:7"


def test_the_attempted_marker_numbers_the_op_that_failed():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(RuntimeError) as info:
        tl.record(model, torch.ones(1, 2))
    partial = info.value.partial_trace
    assert [e.ordinal for e in partial.ops] == [1, 2, 3]
    assert partial.attempt.ordinal == 4
    assert partial.narrate(last=1).splitlines()[-1].startswith("!! attempted #4 linear @2")


@pytest.mark.parametrize("max_lines", [None, 5])
def test_past_max_lines_statistics_are_read_once_per_forward_not_per_op(max_lines, deferred_reads):
    model, x = tiny_gpt(), tokens()
    sink = io.StringIO()
    with count_host_syncs() as syncs:
        tl.record(model, x, value_stats="exact",
                  narrate=tl.options.NarrationOptions(sink=sink, max_lines=max_lines) if max_lines else None)
    # with no narration: one read; with 5 lines: one read per printed op line, then one for the rest
    printed = len(op_lines(sink.getvalue()))
    assert len(syncs) <= printed + 1, (len(syncs), printed)


def test_exit_lines_survive_an_exception_caught_inside_the_forward():
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("caught by the caller")

    class Catches(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(2, 2), Fails())
            self.after = nn.Linear(2, 2)

        def forward(self, x):
            try:
                self.inner(x)
            except ValueError:
                pass
            return self.after(x)

    text, _ = narrated(Catches(), torch.ones(1, 2))
    check_nesting(text)
    lines = text.splitlines()
    assert lines.index("  < inner.1") < lines.index("< inner") < lines.index("> after (Linear)")


def test_torchlens_reads_no_environment_variable_of_its_own(monkeypatch, capsys):
    read = []

    class Spy(type(os.environ)):
        def __getitem__(self, key):
            self._note(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            self._note(key)
            return super().get(key, default)

        def __contains__(self, key):
            self._note(key)
            return super().__contains__(key)

        def _note(self, key):
            frame = sys._getframe(2)
            if os.sep + "torchlens" + os.sep in frame.f_code.co_filename:
                read.append(key)

    spy = Spy(os.environ._data, os.environ.encodekey, os.environ.decodekey, os.environ.encodevalue,
              os.environ.decodevalue)
    monkeypatch.setattr(os, "environ", spy)
    for name in ("TORCHLENS_NARRATE", "TORCHLENS", "NARRATE"):
        monkeypatch.setenv(name, "1")
    tl.record(tiny_gpt(), tokens(), value_stats="exact")
    assert read == [] and capsys.readouterr().err == ""
