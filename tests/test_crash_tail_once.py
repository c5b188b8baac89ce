"""A failing forward narrated live prints each line once: the failure block ends the transcript
instead of repeating its last lines, live and after the fact."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from models import tiny_gpt

import torchlens as tl


def _failing_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=8)
    return transformers.GPT2Model(config).eval(), torch.arange(12)[None] % 50  # 12 positions of 8


def _live_and_partial(model, x, **narration):
    sink = io.StringIO()
    with pytest.raises(IndexError) as info:
        tl.record(model, x, narrate=tl.options.NarrationOptions(sink=sink, **narration))
    return sink.getvalue(), info.value.partial_trace


def test_each_line_is_printed_once_and_the_failure_block_ends_the_transcript():
    model, x = _failing_gpt2()
    live, partial = _live_and_partial(model, x)
    lines = live.splitlines()
    repeated = [line for line, count in Counter(lines).items() if count > 1 and line.lstrip().startswith("#")]
    assert repeated == []
    assert lines[-2].startswith("!! forward failed: IndexError") and lines[-1].startswith("!! attempted #")
    assert partial.narrate() == live


def test_with_a_selection_the_tail_shows_the_last_lines_that_were_not_printed():
    model, x = tiny_gpt(), torch.full((1, 40), 3)  # longer than the model's context
    live, partial = _live_and_partial(model, x, select=lambda event: event.op == "input")
    lines = live.splitlines()
    assert lines[0].startswith("#1    input")
    failed = lines.index(next(line for line in lines if line.startswith("!! forward failed")))
    tail = lines[failed + 1:]
    assert not any(line.startswith("#1 ") for line in tail)  # printed above: not repeated
    assert any(" embedding " in line for line in tail) and tail[-1].startswith("!! attempted #")
    assert partial.narrate() == live


def test_on_error_only_still_prints_the_tail():
    model, x = tiny_gpt(), torch.full((1, 40), 3)
    live, partial = _live_and_partial(model, x, on_error_only=True, tail_on_error=3)
    lines = live.splitlines()
    assert lines[0].startswith("!! forward failed") and len([line for line in lines if line.lstrip().startswith("#")]) >= 1
    assert partial.narrate() == live
