"""Where narrated lines go: a file path, a text stream, a callable, a `logging.Logger`.

- A path is opened for appending with an unbuffered descriptor, and each line is one `os.write`:
  the bytes are in the kernel once the call returns, so they survive a SIGKILL or a segfault of the
  process a moment later. It is closed when the run ends.
- A stream gets `write` + `flush` per line and is never closed (it is the caller's).
- A callable gets each line without its newline; a `Logger` gets `logger.info(line)`.

Failures are the narrator's business (it turns narration off with one warning): sinks just raise.
"""

from __future__ import annotations

import logging
import os
import sys


class Sink:
    """Receives finished lines (no trailing newline)."""

    def write(self, line: str) -> None:
        raise NotImplementedError

    def write_block(self, lines) -> None:
        """Several lines at once (a compiled graph's narration); sinks that can, write them in one go."""
        for line in lines:
            self.write(line)

    def close(self) -> None:
        """Release what the sink opened; a sink never closes what the caller passed in."""


class FileSink(Sink):
    def __init__(self, path):
        self.path = os.fspath(path)
        self._fd = None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._fd

    def write(self, line: str) -> None:
        os.write(self._fd if self._fd is not None else self._open(), (line + "\n").encode("utf-8"))

    def write_block(self, lines) -> None:
        self._open()
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        while data:  # os.write may write less than asked for a large block
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class StreamSink(Sink):
    def __init__(self, stream):
        self.stream = stream

    def write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def write_block(self, lines) -> None:
        self.stream.write("".join(line + "\n" for line in lines))
        self.stream.flush()


class StderrSink(StreamSink):
    """`narrate=True`: the process's stderr as it is when the run starts (pytest may swap it)."""

    def __init__(self):
        super().__init__(sys.stderr)


class CallableSink(Sink):
    def __init__(self, fn):
        self.fn = fn

    def write(self, line: str) -> None:
        self.fn(line)


class LoggerSink(Sink):
    def __init__(self, logger: logging.Logger, level: int = logging.INFO):
        self.logger = logger
        self.level = level

    def write(self, line: str) -> None:
        self.logger.log(self.level, line)


class ListSink(Sink):
    """Collects lines in memory: how recordings render transcripts after the fact."""

    def __init__(self):
        self.lines = []

    def write(self, line: str) -> None:
        self.lines.append(line)

    def write_block(self, lines) -> None:
        self.lines.extend(lines)


def is_stream(obj) -> bool:
    return callable(getattr(obj, "write", None)) and not isinstance(obj, (str, bytes, os.PathLike))


def open_sink(target) -> Sink:
    """Build the sink for an already-validated `NarrationOptions.sink` value."""
    if target is None or target is True:
        return StderrSink()
    if isinstance(target, Sink):
        return target
    if isinstance(target, (str, os.PathLike)):
        return FileSink(target)
    if isinstance(target, logging.Logger):
        return LoggerSink(target)
    if is_stream(target):
        return StreamSink(target)
    return CallableSink(target)


def is_sink_target(obj) -> bool:
    """Whether `open_sink` knows what to do with `obj` (used to validate options). A selector is
    callable but is not a sink: `NarrationOptions(select=...)` is where it goes."""
    from .selectors import Selector

    if isinstance(obj, Selector):
        return False
    return (
        obj is None
        or obj is True
        or isinstance(obj, (Sink, str, os.PathLike, logging.Logger))
        or is_stream(obj)
        or callable(obj)
    )
