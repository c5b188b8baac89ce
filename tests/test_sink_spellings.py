"""`narrate=` spellings: the standard streams by name, no file made from a switch word, no
unwritable stream accepted only to fail inside the forward."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch import nn

import torchlens as tl


@pytest.fixture
def in_empty_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", ["stdout", "stderr"])
def test_stdout_and_stderr_name_the_streams_not_files(name, in_empty_directory, capsys):
    tl.record(nn.Linear(2, 2), torch.ones(1, 2), narrate=name)
    captured = capsys.readouterr()
    assert " linear " in getattr(captured, "out" if name == "stdout" else "err")
    assert os.listdir(in_empty_directory) == []


@pytest.mark.parametrize("word", ["yes", "no", "on", "true", "YES", "verbose"])
def test_a_switch_word_is_refused_before_the_forward(word, in_empty_directory):
    calls = []
    model = nn.Linear(2, 2)
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(tl.errors.OptionValueError, match="reads as a switch, not a file"):
        tl.record(model, torch.ones(1, 2), narrate=word)
    assert calls == [] and os.listdir(in_empty_directory) == []


def test_a_file_name_that_is_not_a_switch_word_is_still_a_file(in_empty_directory):
    tl.record(nn.Linear(2, 2), torch.ones(1, 2), narrate="yes.log")
    assert " linear " in (in_empty_directory / "yes.log").read_text()


@pytest.mark.parametrize("how", ["read", "closed"])
def test_a_stream_that_cannot_be_written_is_refused_before_the_forward(how, tmp_path):
    path = tmp_path / "existing.txt"
    path.write_text("x\n")
    stream = open(path, "r")
    if how == "closed":
        stream.close()
    with pytest.raises(tl.errors.OptionValueError, match="is not writable"):
        tl.record(nn.Linear(2, 2), torch.ones(1, 2), narrate=stream)
    stream.close()
    with pytest.raises(tl.errors.OptionValueError, match="is not writable"):
        tl.compile(nn.Linear(2, 2), narrate=stream)
    with pytest.raises(tl.errors.OptionValueError, match="is not writable"):
        tl.recording.Recorder(nn.Linear(2, 2), narrate=stream)


def test_a_stream_closed_after_the_run_still_renders_the_transcript():
    sink = io.StringIO()
    recording = tl.record(nn.Linear(2, 2), torch.ones(1, 2), narrate=sink)
    text = sink.getvalue()
    sink.close()
    assert recording.narrate() == text


def test_a_selector_is_not_a_sink_even_though_it_is_callable():
    """`narrate=tl.in_module(...)` selects; as `sink=` it would swallow every line: refused."""
    selector = tl.in_module("proj")
    assert tl.options.NarrationOptions(sink=None, select=selector).select is not None
    with pytest.raises(tl.errors.OptionTypeError, match="sink="):
        tl.options.NarrationOptions(sink=selector)
