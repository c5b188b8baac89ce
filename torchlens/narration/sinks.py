"""Where narrated lines go: a file path, a text stream, a callable, a `logging.Logger`.

- A path is opened for appending with an unbuffered descriptor, and each line is one `os.write`:
  the bytes are in the kernel once the call returns, so they survive a SIGKILL or a segfault of the
  process a moment later. It is closed when the run ends. A path may name `{rank}` and
  `{world_size}`, filled in when the run opens the sink (see `ranks`), so that each process of a
  distributed job writes its own file. Its directory must exist when the options are made: a typo
  there is an error before the forward, not a warning after it.
- A stream gets `write` + `flush` per line and is never closed (it is the caller's).
- A callable gets each line without its newline; a `Logger` gets `logger.info(line)`.

Failures while writing are the narrator's business (it turns narration off with one warning):
sinks just raise.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Dict, Optional

from ..errors import OptionTypeError, OptionValueError
from .ranks import expand_path, template_fields

__all__ = ["NEW_RUN", "CallableSink", "FileSink", "ListSink", "LoggerSink", "Sink", "SinkPath", "StandardStream",
           "StderrSink",
           "StreamSink", "check_writable", "checked_sink", "open_sink", "sink_kind"]


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


NEW_RUN = "-- new run (appended to a file that held earlier ones; NarrationOptions(overwrite=True) starts it afresh)"


class FileSink(Sink):
    """Appends to `path`, opened at the first line (a run that prints nothing creates no file).

    A sink that `starts` the file (the first opened with a narration's options) truncates it
    with `overwrite`, or else begins with the `NEW_RUN` note when the file already holds lines:
    runs appended to one file stay apart, and a file one run wrote holds that run's transcript
    byte for byte."""

    def __init__(self, path, starts: bool = False, overwrite: bool = False):
        self.path = os.fspath(path)
        self._fd: Optional[int] = None
        self._starts = starts
        self._overwrite = overwrite

    def _open(self) -> int:
        if self._fd is None:
            truncate = os.O_TRUNC if self._starts and self._overwrite else 0
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | truncate, 0o644)
            if self._starts and not truncate and os.fstat(self._fd).st_size:
                os.write(self._fd, (NEW_RUN + "\n").encode("utf-8"))
        return self._fd

    def write(self, line: str) -> None:
        os.write(self._fd if self._fd is not None else self._open(), (line + "\n").encode("utf-8"))

    def write_block(self, lines) -> None:
        fd = self._open()
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        while data:  # os.write may write less than asked for a large block
            data = data[os.write(fd, data):]

    def close(self) -> None:
        fd, self._fd = self._fd, None  # forgotten first: the descriptor is gone even if close fails
        if fd is not None:
            os.close(fd)


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


class StandardStream(str):
    """`narrate="stdout"` or `"stderr"`: that stream of the process, as it is when a run starts —
    not a file of that name in the working directory."""

    __slots__ = ()


# Bare words that read as a switch, not a file name: `narrate="yes"` must not create a file "yes".
_FLAG_WORDS = {"yes", "no", "true", "false", "on", "off", "y", "n", "none", "1", "0", "print", "console",
               "verbose", "stream"}


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


def sink_kind(target):
    """What a `narrate=` / `NarrationOptions(sink=)` value is as a sink — "stderr", "sink",
    "standard" (a checked "stdout"/"stderr"), "path", "logger", "stream", "callable" — or None
    when it is none of them. The one reading of a sink target: validating, checking and opening
    all go by it. A selector is callable but is not a sink: `NarrationOptions(select=...)` is
    where it goes."""
    from ..selectors import Selector

    if target is None or target is True:
        return "stderr"
    if isinstance(target, Sink):
        return "sink"
    if isinstance(target, StandardStream):
        return "standard"
    if isinstance(target, (str, os.PathLike)):
        return "path"
    if isinstance(target, logging.Logger):
        return "logger"
    if is_stream(target):
        return "stream"
    if callable(target) and not isinstance(target, Selector):
        return "callable"
    return None


_OPENERS: Dict[str, Callable[..., Sink]] = {
    "stderr": lambda target: StderrSink(),
    "sink": lambda target: target,
    "standard": lambda target: StreamSink(getattr(sys, target)),
    "path": lambda target, starting=False, overwrite=False: FileSink(expand_path(os.fsdecode(target)), starting,
                                                                     overwrite),
    "logger": LoggerSink,
    "stream": StreamSink,
    "callable": CallableSink,
}


def open_sink(target, starting: bool = False, overwrite: bool = False) -> Sink:
    """Build the sink for a value `checked_sink` returned; a path's file is started afresh or
    marked as a new run when `starting` (see `FileSink`)."""
    kind = sink_kind(target)
    if kind == "path":
        return _OPENERS[kind](target, starting, overwrite)
    return _OPENERS[kind](target)


class SinkPath(str):
    """A sink path that has been checked (its template fields, its directory).

    A `str`, equal to the path it was made from. Options made again from checked options (every
    `NarrationOptions.replace`, and so every `recording.narrate()`) do not check it again: a
    transcript rendered after the log directory was removed, or from another working directory,
    must not fail on a file it never writes.
    """

    __slots__ = ()


def checked_sink(target):
    """Check a sink target before any forward runs; return what to keep (and later open).

    Its kind must be one `sink_kind` knows. A path must name only fields `ranks` fills in, and its
    directory must exist: the file is created at the run's first line, inside the forward, where a
    failure could only turn narration off with a warning.
    """
    kind = sink_kind(target)
    if kind is None:
        raise OptionTypeError(
            f"NarrationOptions(sink=...) takes a path, a text stream, a callable taking one line, "
            f"a logging.Logger, or None for stderr; got {type(target).__name__}"
        )
    if kind != "path" or isinstance(target, SinkPath):
        return target
    path = os.fsdecode(target)
    if path in ("stdout", "stderr"):
        return StandardStream(path)
    if path.lower() in _FLAG_WORDS:
        raise OptionValueError(
            f"narration sink {path!r} (narrate= or NarrationOptions(sink=)) reads as a switch, not a file: "
            f"narrate=True or 'stderr' narrates to stderr, 'stdout' to stdout, None turns it off; a file "
            f"needs a name that is not a bare yes/no word (such as {path + '.log'!r})")
    template_fields(path)
    _check_directory(path)
    return SinkPath(path)


def check_writable(stream) -> None:
    """A stream opened for reading, or closed, would fail at the first line, inside the forward.

    Checked when an entry point is called, not whenever options are made: a transcript rendered
    after the run (`recording.narrate()`) must not fail because the stream was closed since."""
    if not is_stream(stream):
        return
    writable = getattr(stream, "writable", None)
    try:
        ok = writable() if callable(writable) else True
    except ValueError:  # a closed file
        ok = False
    if not ok:
        raise OptionValueError(f"narration sink {stream!r} (narrate= or NarrationOptions(sink=)) is not writable "
                               f"(closed, or opened for reading); open it for writing ('w' or 'a')")


def _check_directory(path: str) -> None:
    """The directory the narration file goes in must exist (its part before any template field:
    `logs/{rank}/run.log` needs `logs`, and each rank's own directory is its business)."""
    static = _static_part(os.path.dirname(path))
    where = f"narration sink {path!r} (narrate= or NarrationOptions(sink=))"
    if static and not os.path.isdir(static):
        problem = "is not a directory" if os.path.exists(static) else "does not exist"
        raise OptionValueError(
            f"{where}: the directory {static!r} {problem}, so the file cannot be created; create it "
            f"first (os.makedirs({static!r}, exist_ok=True)) or narrate to a file in an existing directory"
        )
    if "{" not in path and os.path.isdir(path):
        raise OptionValueError(f"{where} is a directory; name a file inside it, such as "
                               f"{os.path.join(path, 'narration.log')!r}")


def _static_part(directory: str) -> str:
    """The leading components of `directory` that name no template field."""
    if "{" not in directory:
        return directory
    head = directory[: directory.index("{")]
    return head if head.endswith(os.sep) or not head else os.path.dirname(head)
