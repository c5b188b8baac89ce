"""Long runs under a `Recorder`: bounded memory, a complete file, a tail of the last events.

The soak itself is `benchmarks/soak.py` (10,000 forwards by default); here a short run of it, next
to the same run keeping every pass, shows that the measurement sees growth when there is some.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import Tiny, tiny_gpt, tokens
from torch import nn

import torchlens as tl

pytestmark = pytest.mark.slow  # hundreds of forwards, in a fresh process

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def run_soak(tmp_path, keep: str, forwards: int = 600) -> dict:
    report = tmp_path / f"soak-{keep}.json"
    done = subprocess.run([sys.executable, str(SOAK), "--forwards", str(forwards), "--keep", keep, "--tail", "150",
                           "--json", str(report)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(report.read_text())


def test_a_short_soak_keeps_memory_flat_and_the_file_complete(tmp_path):
    bounded = run_soak(tmp_path, keep="1")
    assert bounded["file_lines"] == bounded["expected_lines"] and bounded["footers"] == 600
    assert bounded["recordings_kept"] == 1 and bounded["tail_events"] == 150 and bounded["tail_is_the_last_events"]
    unbounded = run_soak(tmp_path, keep="all")
    assert unbounded["recordings_kept"] == 600
    # keeping every pass grows by ~15 KB a pass (~8 MB here): the bounded run must not
    assert unbounded["rss_growth_mb"] > 4
    assert bounded["rss_growth_mb"] < 1.5, bounded["samples"]


def test_the_tail_holds_the_last_events_across_passes():
    model, x = tiny_gpt(), tokens()
    per_pass = len(tl.record(model, x).events)
    with tl.recording.Recorder(model, keep=0, tail=per_pass + 10) as recorder:
        for _ in range(3):
            model(x)
    assert recorder.passes == 3 and len(recorder.recordings) == 0
    second = tl.record(model, x).events
    assert [(e.kind, e.ordinal, e.op) for e in recorder.tail] == \
        [(e.kind, e.ordinal, e.op) for e in second[-10:] + second]
    text = recorder.narrate_tail()
    assert text.startswith(f"-- pass 2\n-- ... {per_pass - 10} earlier events of pass 2 not kept\n")
    assert "\n-- pass 3\n#1    input" in text
    assert text.rstrip().endswith("=>    output        [1,8,64] f32 cpu  out")


def test_the_tail_ends_with_a_failed_pass():
    class FailsOnSecondCall(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.calls = Tiny(), 0

        def forward(self, x):
            self.calls += 1
            y = self.inner(x)
            return y @ torch.ones(3, 3) if self.calls == 2 else y

    model, sink = FailsOnSecondCall(), io.StringIO()
    with pytest.raises(RuntimeError):
        with tl.recording.Recorder(model, narrate=sink, tail=50) as recorder:
            model(torch.randn(1, 2))
            model(torch.randn(1, 2))
    assert recorder.tail[-1].op == "ones"  # the last event recorded before the matmul raised
    assert isinstance(recorder.recordings[-1], tl.PartialTrace)
    assert "-- pass 1" in recorder.narrate_tail() and "-- pass 2" in recorder.narrate_tail()


@pytest.mark.parametrize("keyword, value, error", [
    ("keep", -1, tl.errors.OptionValueError), ("keep", 1.5, tl.errors.OptionTypeError),
    ("tail", 0, tl.errors.OptionValueError), ("tail", "20", tl.errors.OptionTypeError),
])
def test_bad_keep_or_tail_is_a_typed_error_naming_it(keyword, value, error):
    with pytest.raises(error, match=rf"Recorder\({keyword}="):
        tl.recording.Recorder(Tiny(), **{keyword: value})


def test_narrate_tail_without_a_tail_says_how_to_get_one():
    with tl.recording.Recorder(Tiny()) as recorder:
        pass
    with pytest.raises(tl.errors.OptionValueError, match="tail=N"):
        recorder.narrate_tail()
