"""A sink that breaks never breaks the run: one warning, the same output or the same exception, and
a recording that still holds every event.

Each fault is a real way a log stops accepting lines: a callable that raises, a stream closed while
the forward runs, the real `/dev/full` (ENOSPC on every write), a disk that fills part-way (and then
fails to close too), a read-only disk. Each runs through `tl.record`, a `Recorder` and a compiled
model, once succeeding and once failing, and is compared with the same run narrated to a working
sink. A path whose directory does not exist is instead an error before the forward runs.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import warnings

import pytest
import torch
from torch import nn

import torchlens as tl

NarrationOptions = tl.options.NarrationOptions
GOOD = torch.tensor([[1, 2, 3]])
BAD = torch.tensor([[1, 99, 3]])  # past the embedding's 16 rows: IndexError after a dozen lines


class Lookup(nn.Module):
    """A few narrated lines before an embedding that fails on an out-of-range index."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
        self.embed = nn.Embedding(16, 3)
        self.calls = 0

    def forward(self, idx):
        self.calls += 1
        return self.pre(idx.float()) + self.embed(idx)


# -- the faults ------------------------------------------------------------------------------------


class Fault:
    """A broken sink: `target` goes to `narrate=`; `delivered()` is the text it accepted before
    it broke (None where nothing can be read back); `calls`, for a callable, every line offered."""

    def __init__(self, target, delivered=lambda: None, calls=None):
        self.target = target
        self.delivered = delivered
        self.calls = calls


class ClosedMidRun(io.StringIO):
    """A log stream that the rest of the program closes while the forward runs (a handler torn
    down, a rotated log): after `lines_before_close` lines every write meets a closed stream."""

    def __init__(self, lines_before_close: int):
        super().__init__()
        self.lines_before_close = lines_before_close
        self.received = ""

    def write(self, text: str) -> int:
        if self.received.count("\n") >= self.lines_before_close and not self.closed:
            self.close()
        written = super().write(text)  # ValueError once closed
        self.received += text
        return written


def _raising_callable(tmp_path, monkeypatch) -> Fault:
    calls = []

    def sink(line):
        calls.append(line)
        raise OSError("the log server went away")

    return Fault(sink, lambda: "", calls)


def _stream_closed_mid_run(tmp_path, monkeypatch) -> Fault:
    stream = ClosedMidRun(lines_before_close=4)
    return Fault(stream, lambda: stream.received)


def _dev_full(tmp_path, monkeypatch) -> Fault:
    return Fault("/dev/full")


def _disk_fills_mid_run(tmp_path, monkeypatch) -> Fault:
    """The first 4 writes to the file land; then ENOSPC, on every write and on close (as NFS
    reports a full disk at close)."""
    path = tmp_path / "run.log"
    fds = set()
    writes = [0]
    real_open, real_write, real_close = os.open, os.write, os.close

    def open_(file, flags, *args, **kwargs):
        fd = real_open(file, flags, *args, **kwargs)
        if os.fspath(file) == str(path):
            fds.add(fd)
        return fd

    def write(fd, data):
        if fd in fds:
            writes[0] += 1
            if writes[0] > 4:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    def close(fd):
        real_close(fd)
        if fd in fds:
            fds.discard(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "close", close)
    return Fault(str(path), lambda: path.read_text() if path.exists() else "")


def _read_only_disk(tmp_path, monkeypatch) -> Fault:
    """A file system mounted read-only after the options were made (as root, chmod would not stop
    the writes): opening the file for writing fails with EROFS."""
    path = tmp_path / "run.log"
    real_open = os.open

    def open_(file, flags, *args, **kwargs):
        if os.fspath(file) == str(path) and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    return Fault(str(path), lambda: path.read_text() if path.exists() else "")


FAULTS = {
    "raising-callable": _raising_callable,
    "stream-closed-mid-run": _stream_closed_mid_run,
    "dev-full": _dev_full,
    "disk-fills-mid-run": _disk_fills_mid_run,
    "read-only-disk": _read_only_disk,
}


@pytest.fixture(params=list(FAULTS))
def fault(request, tmp_path, monkeypatch) -> Fault:
    if request.param == "dev-full" and not os.path.exists("/dev/full"):
        pytest.skip("this system has no /dev/full")
    return FAULTS[request.param](tmp_path, monkeypatch)


# -- helpers ---------------------------------------------------------------------------------------


class Warned:
    """Every `NarrationWarning` raised inside the block, with no filter hiding repeats."""

    def __enter__(self):
        self._catcher = warnings.catch_warnings(record=True)
        self._seen = self._catcher.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc_info):
        self._catcher.__exit__(*exc_info)
        return False

    @property
    def messages(self):
        return [str(w.message) for w in self._seen if issubclass(w.category, tl.errors.NarrationWarning)]


def _raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def _assert_same_failure(exc, plain):
    assert type(exc) is type(plain) and str(exc) == str(plain)
    assert isinstance(exc.partial_trace, tl.PartialTrace)


def _assert_prefix_of(delivered, reference: str):
    """What reached the sink before it broke is exactly the start of the full transcript."""
    if delivered is not None:
        assert reference.startswith(delivered)
        assert delivered.count("\n") < reference.count("\n")


# -- tl.record -------------------------------------------------------------------------------------


def test_record_completes_with_one_warning_and_every_event(fault):
    model = Lookup()
    reference = io.StringIO()
    expected = tl.record(model, GOOD, narrate=reference)

    with Warned() as warned:
        recording = tl.record(model, GOOD, narrate=fault.target)

    assert len(warned.messages) == 1 and "narration turned off" in warned.messages[0]
    assert torch.equal(recording.output, model(GOOD))
    assert recording.narrate() == expected.narrate() == reference.getvalue()
    _assert_prefix_of(fault.delivered(), reference.getvalue())
    if fault.calls is not None:
        assert fault.calls == reference.getvalue().splitlines()[:1]  # never offered another line


def test_record_of_a_failing_forward_raises_the_users_error_with_one_warning(fault):
    model = Lookup()
    plain = _raised(lambda: model(BAD))
    reference = io.StringIO()
    expected = _raised(lambda: tl.record(model, BAD, narrate=reference)).partial_trace

    with Warned() as warned:
        exc = _raised(lambda: tl.record(model, BAD, narrate=fault.target))

    assert len(warned.messages) == 1  # not again for the crash tail, nor when the sink is closed
    _assert_same_failure(exc, plain)
    assert exc.partial_trace.narrate() == expected.narrate() == reference.getvalue()
    assert exc.partial_trace.narrate(last=5) == expected.narrate(last=5)
    _assert_prefix_of(fault.delivered(), reference.getvalue())


def test_a_stream_closed_by_the_models_own_forward():
    class ClosesLog(Lookup):
        def __init__(self, log):
            super().__init__()
            self.log = log

        def forward(self, idx):
            hidden = self.pre(idx.float())
            self.log.close()
            return hidden + self.embed(idx)

    reference = io.StringIO()
    expected = tl.record(ClosesLog(io.StringIO()), GOOD, narrate=reference)
    log = io.StringIO()
    with Warned() as warned:
        recording = tl.record(ClosesLog(log), GOOD, narrate=log)
    assert log.closed and len(warned.messages) == 1 and "closed file" in warned.messages[0]
    assert torch.equal(recording.output, expected.output)
    assert recording.narrate() == reference.getvalue()


def test_a_sink_whose_error_cannot_even_be_printed():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no message either")

    def sink(line):
        raise Unprintable()

    with Warned() as warned:
        recording = tl.record(Lookup(), GOOD, narrate=sink)
    assert len(warned.messages) == 1 and "Unprintable" in warned.messages[0]
    assert len(recording.ops) == 7  # the input and six ops


def test_a_sink_that_only_fails_to_close_warns_once_and_keeps_every_line(tmp_path, monkeypatch):
    path = tmp_path / "run.log"
    real_close = os.close

    def close_then_report_eio(fd):  # what NFS does when the server lost the last writes
        real_close(fd)
        monkeypatch.setattr(os, "close", real_close)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    model = Lookup()
    with Warned() as warned:
        with tl.recording.Recorder(model, narrate=str(path)) as recorder:
            model(GOOD)
            monkeypatch.setattr(os, "close", close_then_report_eio)  # the next close is the sink's
    assert len(warned.messages) == 1 and "could not close its sink: OSError" in warned.messages[0]
    assert path.read_text() == recorder.recordings[0].narrate()


def test_warnings_as_errors_do_not_turn_a_broken_sink_into_an_exception(fault):
    model = Lookup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recording = tl.record(model, GOOD, narrate=fault.target)
        exc = _raised(lambda: tl.record(model, BAD, narrate=fault.target))
    assert torch.equal(recording.output, model(GOOD))
    if getattr(fault.target, "closed", False):  # closed by the first run: refused before the second
        assert isinstance(exc, tl.errors.OptionValueError) and "is not writable" in str(exc)
    else:
        assert isinstance(exc, IndexError) and exc.partial_trace is not None


# -- Recorder --------------------------------------------------------------------------------------


def _recorder_passes(model, target):
    """Two passes under one Recorder, the second failing; returns (recorder, the failure)."""
    with tl.recording.Recorder(model, narrate=target) as recorder:
        output = model(GOOD)
        failure = _raised(lambda: model(BAD))
    return recorder, output, failure


def test_recorder_warns_once_for_the_whole_block_and_keeps_every_pass(fault):
    model = Lookup()
    reference = io.StringIO()
    expected, _, _ = _recorder_passes(model, reference)
    plain = _raised(lambda: model(BAD))

    with Warned() as warned:
        recorder, output, failure = _recorder_passes(model, fault.target)

    assert len(warned.messages) == 1
    assert torch.equal(output, model(GOOD))
    _assert_same_failure(failure, plain)
    assert failure.partial_trace is recorder.recordings[1]
    assert [r.narrate() for r in recorder.recordings] == [r.narrate() for r in expected.recordings]
    assert "".join(r.narrate() for r in recorder.recordings) == reference.getvalue()
    _assert_prefix_of(fault.delivered(), reference.getvalue())


# -- compiled --------------------------------------------------------------------------------------


def _compiled_passes(target):
    """A compiled model called twice: a good call, then one that fails inside the graph."""
    model = Lookup()
    compiled = tl.compile(model, narrate=target, compiler="eager")
    with Warned() as first:
        output = compiled(GOOD)
    recording = compiled.torchlens.last_recording
    with Warned() as second:
        failure = _raised(lambda: compiled(BAD))
    return model, output, recording, failure, first.messages, second.messages


@pytest.fixture(scope="module")
def compiled_reference():
    stream = io.StringIO()
    model, output, recording, failure, first, second = _compiled_passes(stream)
    assert first == second == []
    return stream.getvalue(), recording.narrate(), failure.partial_trace.narrate()


def test_compiled_calls_warn_once_each_and_lose_nothing(fault, compiled_reference):
    live_text, good_text, failed_text = compiled_reference
    model, output, recording, failure, first, second = _compiled_passes(fault.target)

    assert len(first) == 1 and len(second) == 1  # each call is a run of its own: one warning each
    assert torch.equal(output, model(GOOD))
    _assert_same_failure(failure, _raised(lambda: model(BAD)))
    assert recording.narrate() == good_text
    assert failure.partial_trace.narrate() == failed_text
    assert live_text == good_text + failed_text
    _assert_prefix_of(fault.delivered(), live_text)


# -- a path in a directory that does not exist -------------------------------------------------------


def _entry_points(target):
    model = Lookup()
    return model, {
        "record": lambda: tl.record(model, GOOD, narrate=target),
        "trace": lambda: tl.trace(model, GOOD, narrate=target),
        "Recorder": lambda: tl.recording.Recorder(model, narrate=target),  # refused when constructed
        "compile": lambda: tl.compile(model, narrate=target, compiler="eager"),  # before the first call
    }


@pytest.mark.parametrize("entry", ["record", "trace", "Recorder", "compile"])
def test_a_path_in_a_missing_directory_is_refused_before_the_forward_runs(entry, tmp_path):
    target = tmp_path / "no-such-dir" / "run.log"
    model, calls = _entry_points(target)
    with pytest.raises(tl.errors.OptionValueError) as info:
        calls[entry]()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(target) in message and "does not exist" in message and "os.makedirs(" in message
    assert model.calls == 0
    assert not target.parent.exists()


def test_a_path_under_a_file_or_naming_a_directory_is_refused(tmp_path):
    (tmp_path / "plain-file").write_text("")
    with pytest.raises(tl.errors.OptionValueError, match="is not a directory"):
        tl.record(Lookup(), GOOD, narrate=str(tmp_path / "plain-file" / "run.log"))
    with pytest.raises(tl.errors.OptionValueError, match="is a directory; name a file inside it"):
        tl.record(Lookup(), GOOD, narrate=tmp_path)


def test_transcripts_render_after_the_log_directory_is_gone(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.chdir(tmp_path)
    recording = tl.record(Lookup(), GOOD, narrate="logs/run.log")
    failure = _raised(lambda: tl.record(Lookup(), BAD, narrate="logs/failed.log"))
    written = (logs / "run.log").read_text()
    shutil.rmtree(logs)
    assert recording.narrate() == written
    assert failure.partial_trace.narrate(last=3).splitlines()[0].startswith("!! forward failed: IndexError")
