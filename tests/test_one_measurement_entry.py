"""A value measured in the backward goes through the same entry as one measured in the forward:
`Meter.observe`, which decides when a value is read and measures it. A backward that measured on
its own again (the meter's kernels called directly, its own rule for when to read) fails here, as
one whose events entered their log past `EventLog.append`, or whose verdicts kept their own queue,
counts and footer beside the forward's (`tracking.Verdicts`)."""

from __future__ import annotations

import ast
import pathlib

import torch
import torch.nn as nn

import torchlens as tl
from torchlens.backward.verdicts import GradTracker
from torchlens.core.session import EventLog
from torchlens.measure.meter import Meter
from torchlens.measure.tracking import Tracker, Verdicts

BACKWARD = pathlib.Path(tl.__file__).resolve().parent / "backward"


def _spy(monkeypatch) -> list:
    """Every statistics object `Meter.observe` handed back, in order."""
    handed: list = []
    observe = Meter.observe

    def spied(self, value, printed=False):
        stats = observe(self, value, printed)
        handed.append(stats)
        return stats

    monkeypatch.setattr(Meter, "observe", spied)
    return handed


def test_every_statistic_of_a_forward_and_its_backward_came_through_the_one_entry(monkeypatch):
    handed = _spy(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    with tl.recording.Recorder(model, backward=True, value_stats="exact", on_nonfinite="track") as rec:
        model(torch.randn(5, 4)).sum().backward()
    [recording] = rec.recordings
    [backward] = recording.backward
    ops = [e for e in recording.events if e.kind is tl.EventKind.OP]
    assert ops and all(any(e.stats is s for s in handed) for e in ops)
    measured = [e for e in backward.events if e.stats is not None]
    assert len(measured) == len(backward.events) and backward.nodes
    assert all(any(e.stats is s for s in handed) for e in measured)


def test_a_backward_measured_under_raise_reads_through_the_entry_and_stops_at_its_finding(monkeypatch):
    handed = _spy(monkeypatch)

    class SqrtOfZero(nn.Module):
        def forward(self, x):
            return torch.sqrt(x * 0).sum()

    model = SqrtOfZero()
    try:
        with tl.recording.Recorder(model, backward=True, on_nonfinite="raise"):
            model(torch.randn(2, 3, requires_grad=True)).backward()
    except tl.errors.NonFiniteError as exc:
        backward = exc.partial_trace.failed_backward
    else:
        raise AssertionError("the backward's NaN did not stop it")
    [finding] = backward.findings
    assert any(finding.event.stats is s for s in handed)


def test_the_backward_reaches_the_meter_only_through_its_entry():
    """Structural: no module of the backward calls the meter's kernels (`measure_output`,
    `measure`) or reads its device rule (`READ_NOW`) to decide when to read on its own."""
    for path in BACKWARD.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("measure_output", "measure", "READ_NOW", "reads_now"), (path.name, node.attr)


def test_every_backward_event_enters_its_log_the_way_a_forward_event_does(monkeypatch):
    appended: list = []
    append = EventLog.append

    def spied(self, event):
        appended.append(event)
        return append(self, event)

    monkeypatch.setattr(EventLog, "append", spied)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(2, 4)).sum().backward()
    [recording] = rec.recordings
    [backward] = recording.backward
    assert backward.events and all(any(e is a for a in appended) for e in backward.events)
    assert all(any(e is a for a in appended) for e in recording.events)


def test_the_forward_and_backward_verdicts_share_their_queue_counts_and_footer():
    assert issubclass(Tracker, Verdicts) and issubclass(GradTracker, Verdicts)
    for shared in ("judge", "summary", "_note", "_judged"):  # (the forward's `judge_rest` also sorts its findings)
        assert shared not in vars(Tracker) and shared not in vars(GradTracker), shared
    assert "judge_rest" not in vars(GradTracker)
