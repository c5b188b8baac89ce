"""What the captures return: `Recording`, `Trace` (a recording that kept values) and `PartialTrace`.

(The public module for these is `torchlens.recording`, which also holds `Recorder`.)

All three render their transcript after the fact through the same narrator the live run used, so
`recording.narrate()` is byte-identical to what live narration printed.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_map

from .events import Attempt, Event, EventKind
from .narration import grammar
from .narration.narrator import failure_block, printed_events, render_lines
from .options import NarrationOptions, check_bool, check_count, check_prefix
from .selectors import as_selector

__all__ = ["Backward", "PartialTrace", "Recording", "Trace", "Transcript"]


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) and not value.is_leaf else value


def _check_last(last) -> None:
    check_count("narrate", "last", last, none_means="every line")


class Transcript(str):
    """Narration text. A `str`, whose repr is the text itself so it reads well at a prompt."""

    def __repr__(self) -> str:
        return str(self)

    @property
    def lines(self) -> List[str]:
        return self.splitlines()


def _transcript(lines: Sequence[str], prefix: str) -> Transcript:
    if prefix:
        lines = [prefix + line for line in lines]
    return Transcript("".join(line + "\n" for line in lines))


class Backward:
    """One backward through the graph a narrated forward built (`backward=True`).

    - `header`: `backward of pass 3` (a second backward through the same graph, with
      `retain_graph=True`, is `backward 2 of pass 3`).
    - `events`: `BackwardEvent`s in the order they ran: `~N` nodes (each tied to its forward op;
      `AccumulateGrad` nodes name the leaf, such as a parameter) and `<=` gradients received at
      the forward's outputs.
    - `findings`: with `on_nonfinite=`, where the first non-finite gradient was born; `verdict`
      the footer's words on it (None without tracking, or until the backward ended).
    - `error`, `attempt`: when the backward failed, what it raised and the node that was running.
    - `values`: for a `tl.trace(..., backward=True)`, each node's gradients (detached copies) by
      its `~N`, which `tl.debug.compare` aligns; None otherwise.
    """

    def __init__(self, header: str, settings):
        self.header = header
        self.settings = settings
        self.values: Optional[Dict[int, Tuple]] = {} if settings.keep_values else None
        self.events: List[Event] = []
        self.footer_extra: List[str] = []
        self.findings: tuple = ()
        self.verdict: Optional[str] = None
        self.error: Optional[str] = None
        self.attempt: Optional[Attempt] = None
        self.finished = False

    @property
    def nodes(self) -> List[Event]:
        return [e for e in self.events if e.kind is EventKind.NODE]

    @property
    def first_nonfinite(self) -> Optional[Event]:
        """The node (or received gradient) of the first finding, with tracking; else the first
        event whose measured gradients held NaN or Inf."""
        if self.settings.on_nonfinite is not None:
            return self.findings[0].event if self.findings else None
        return next((e for e in self.events if e.stats is not None and e.stats.nonfinite), None)

    def lines(self, options: NarrationOptions) -> List[str]:
        """This backward's lines as live narration printed them (the failure block ends a failed one)."""
        footer = self.footer_extra if self.finished else None
        lines = render_lines(self.events, options, self.header, footer, backward=True)
        if self.error is not None:
            shown = printed_events(self.events, options)
            lines += failure_block(self.events, self.attempt, self.error, options, options.tail_on_error, shown,
                                   "backward")
        return lines

    def narrate(self, *, normalize: Optional[bool] = None, prefix: Optional[str] = None) -> Transcript:
        options = self.settings.narration or NarrationOptions()
        changes = {"on_error_only": False, "prefix": ""}
        if normalize is not None:
            changes["normalize"] = check_bool("narrate", "normalize", normalize)
        prefix = options.prefix if prefix is None else check_prefix("narrate", prefix)
        return _transcript(self.lines(options.replace(**changes)), prefix)

    def __repr__(self) -> str:
        return f"<Backward ({self.header}): {len(self.nodes)} nodes>"


def _write_page(path, page: str) -> str:
    import os

    from .errors import OptionTypeError

    if not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError(f"to_html(path) takes a file path, got {type(path).__name__}")
    path = os.fspath(path)
    partial = f"{path}.{os.getpid()}.partial"  # written whole, then moved: a failure leaves the old page
    try:
        # (a file name that was not UTF-8 reaches error texts as surrogates: written as escapes)
        with open(partial, "w", encoding="utf-8", errors="backslashreplace") as out:
            out.write(page)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


class Recording:
    """The events of one forward pass, its output, and the settings it ran with.

    - `events`: every `Event` in order (input sources, ops, module enter/exit, outputs).
    - `ops`: just the `#` events (input sources and ops).
    - `output`: what the forward returned.
    - `findings`: with `on_nonfinite=`, the tracker's verdicts in order (`torchlens.measure.tracking`):
      NaN and infinity births, non-finite parameters or buffers, infinities reaching the output.
    - `verdict`: with `on_nonfinite=`, non-finite tracking's verdict as the footer words it
      (`no non-finite findings`, with what was absorbed; or `first non-finite: NaN in ...`); None
      without tracking. `findings` hold the same as fields (each `Finding`'s kind, op, module, source).
    - `first_nonfinite`: the op of the first finding (with tracking), else the first op whose
      measured output held NaN or Inf.
    - `backward`: with `backward=True`, each backward run through this forward's graph (`Backward`).
    - `narrate(...)`: the transcript (its backwards after the forward's footer).
    """

    def __init__(self, events: List[Event], output, settings, header: Optional[str] = None,
                 footer_extra: Sequence[str] = (), values: Optional[Dict[int, Tuple]] = None,
                 findings: Sequence = (), verdict: Optional[str] = None):
        self.events = events
        self.findings = tuple(findings)
        self.verdict = verdict
        self.output = output
        self.settings = settings
        self.header = header
        self.footer_extra = list(footer_extra)
        self._values = values
        self.backward: List[Backward] = []
        # ordinal -> the call and the inputs an op that first produced a non-finite value read
        # (with tracking; `torchlens.repro.kept`): what `repro()` replays
        self.kept_calls: Dict[int, object] = {}

    def __deepcopy__(self, memo):
        """A copy whose output tensors are detached: torch refuses to deep-copy a tensor that is
        part of an autograd graph, and a recording is a record of values, not of that graph."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            if name == "output":
                value = tree_map(_detached, value)
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    @property
    def ops(self) -> List[Event]:
        return [e for e in self.events if e.is_op]

    @property
    def value_stats(self) -> str:
        return self.settings.value_stats

    @property
    def first_nonfinite(self) -> Optional[Event]:
        if self.settings.on_nonfinite is not None:
            return self.findings[0].event if self.findings else None
        return next((event for event in self.events if event.stats is not None and event.stats.nonfinite), None)

    def _options(self, select=None, normalize=None, prefix=None, engine_ops=None) -> NarrationOptions:
        options = self.settings.narration or NarrationOptions()
        changes: Dict[str, object] = {"on_error_only": False}
        if engine_ops is not None:
            changes["engine_ops"] = check_bool("narrate", "engine_ops", engine_ops)
        if select is not None:
            changes["select"] = selector = as_selector(select)
            # the modules this forward called: the paths a selector can name after the fact
            selector.check_paths({e.scope.path for e in self.events} | {""},
                                 "this forward called no module at that path")
        if normalize is not None:
            changes["normalize"] = check_bool("narrate", "normalize", normalize)
        if prefix is not None:
            changes["prefix"] = check_prefix("narrate", prefix)
        return options.replace(**changes)

    def narrate(self, last: Optional[int] = None, select=None, *, normalize: Optional[bool] = None,
                prefix: Optional[str] = None, engine_ops: Optional[bool] = None) -> Transcript:
        """The transcript, as live narration printed it (or would have, had it been on).

        `last=N` keeps the last N lines; `select=` narrows it (a selector or predicate);
        `normalize=`, `prefix=` and `engine_ops=` override the run's options.
        """
        _check_last(last)
        options = self._options(select, normalize=normalize, prefix=prefix, engine_ops=engine_ops)
        lines = render_lines(self.events, options.replace(prefix=""), self.header, self.footer_extra)
        lines += self._backward_lines(options)
        if last is not None:
            lines = lines[-last:] if last else []
        return _transcript(lines, options.prefix)

    def _backward_lines(self, options: NarrationOptions) -> List[str]:
        # (`backward` is absent from a recording pickled before it existed)
        return [line for run in getattr(self, "backward", ()) for line in run.lines(options.replace(prefix=""))]

    def save(self, path, *, max_repro_bytes: Optional[int] = None) -> str:
        """Write this recording to `path` (a zip of JSON lines and a safetensors file, readable
        without torchlens); `tl.load(path)` gives it back, narrating byte-identically. A trace's
        kept values and the forward's output tensors are saved too, and the inputs of the op
        `repro()` replays, up to `max_repro_bytes` (None: 64 MiB), so that the loaded trace's
        `repro()` writes the same script; returns the path."""
        from .archive.files import save

        return save(self, path, max_repro_bytes)

    def repro(self, directory):
        """Write a standalone script (`repro.py`) and the inputs (`inputs.pt`) that replay, with
        plain torch, the op where tracking found the first non-finite value; returns the script's
        path. Needs `on_nonfinite=` and an eager run: the first op to produce each kind of
        non-finite value keeps a copy of its inputs (`tl.errors.ReproError` says when it did not);
        a saved trace keeps them (see `save`)."""
        from .repro.replay import nonfinite_repro

        return nonfinite_repro(self, directory)

    def to_html(self, path) -> str:
        """Write a self-contained HTML page of this run (a module tree that folds, each op with its
        shapes, site and statistics, non-finite values and the failure highlighted); returns the path."""
        from .view import recording_page

        return _write_page(path, recording_page(self))

    def _repr_html_(self) -> str:
        """The `to_html` page as a notebook cell shows it: embedded in the notebook's document, at
        most `torchlens.view.notebook.MAX_ROWS` rows, saying what it left out (docs/html-view.md)."""
        from .view import recording_view

        return recording_view(self)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self._glance()}>"

    def _glance(self) -> str:
        """What a prompt shows of a run: its ops and module calls, and what tracking found."""
        text = grammar.forward_counts(self.events)
        if self.findings:
            text += f"; {grammar.plural(len(self.findings), 'finding')}, the first: {self.findings[0].text}"
        elif self.verdict is not None:
            text += f"; {self.verdict}"
        if getattr(self, "backward", None):
            text += f"; {grammar.plural(len(self.backward), 'backward')}"
        return text


class Trace(Recording):
    """A recording that also kept each op's output value (detached copies).

    `values[ordinal]` is the tuple of tensors the op (or input source) with that ordinal produced.
    """

    _values: Dict[int, Tuple]  # (a Trace is made only with values kept)

    @property
    def values(self) -> Dict[int, Tuple]:
        return self._values

    def value(self, ordinal: int):
        """The output of op `#ordinal` (the tensor itself for single-output ops)."""
        kept = self._values[ordinal]
        return kept[0] if len(kept) == 1 else kept

    def _glance(self) -> str:
        size = sum(t.numel() * t.element_size() for kept in (self._values or {}).values() for t in kept
                   if isinstance(t, torch.Tensor))
        return f"{super()._glance()}; values kept: {_size_text(size)}"


def _size_text(size: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


class PartialTrace(Recording):
    """What a failed forward recorded up to the failure, plus the call that was in flight.

    Attached to the user's exception as `exc.partial_trace`; `narrate(last=20)` renders the tail:
    the failure, the last lines with the enter lines of the modules still open, and the
    attempted-op marker.
    """

    def __init__(self, *args, attempt: Optional[Attempt] = None, error: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.attempt = attempt
        self.error = error
        self.failed_backward: Optional[Backward] = None  # set when the failure was in a backward

    @classmethod
    def of_backward(cls, recording: Recording, run: Backward) -> "PartialTrace":
        """What a failed backward leaves: its forward's recording, the backwards so far (the failed
        one last), and the node that was running."""
        partial = cls(recording.events, recording.output, recording.settings, header=recording.header,
                      footer_extra=recording.footer_extra, values=recording._values, findings=recording.findings,
                      attempt=run.attempt, error=run.error or "")
        partial.backward = list(recording.backward)
        partial.failed_backward = run
        return partial

    @property
    def values(self) -> Optional[Dict[int, Tuple]]:
        return self._values

    def narrate(self, last: Optional[int] = None, select=None, *, normalize: Optional[bool] = None,
                prefix: Optional[str] = None, engine_ops: Optional[bool] = None) -> Transcript:
        """The tail (`last=N` lines), or with no `last` exactly what live narration printed."""
        _check_last(last)
        options = self._options(select, normalize=normalize, prefix=prefix, engine_ops=engine_ops)
        run = getattr(self, "failed_backward", None)
        if run is not None:  # the forward finished: its transcript, then the backwards, the failed one last
            if last is None:
                return super().narrate(select=select, normalize=normalize, prefix=prefix, engine_ops=engine_ops)
            lines = failure_block(run.events, self.attempt, self.error, options, last, what="backward")
            return _transcript(lines, options.prefix)
        if last is None:
            live = self.settings.narration
            if live is not None and live.on_error_only:
                lines = [grammar.render_note(self.header)] if self.header is not None else []
            else:
                lines = render_lines(self.events, options.replace(prefix=""), self.header)
            shown = printed_events(self.events, options.replace(on_error_only=bool(live and live.on_error_only)))
            lines += failure_block(self.events, self.attempt, self.error, options, options.tail_on_error, shown)
        else:
            lines = failure_block(self.events, self.attempt, self.error, options, last)
        return _transcript(lines, options.prefix)

    def repro(self, directory):
        """Write a standalone script and the inputs that replay the attempted op with plain torch
        and show the same exception (eager runs); a run stopped by `on_nonfinite="raise"`
        replays the op that produced the non-finite value. Returns the script's path."""
        from .repro.replay import failure_repro

        return failure_repro(self, directory)

    def _glance(self) -> str:
        attempt = self.attempt
        where = ""
        if attempt is not None and attempt.op is not None:
            where = f" in #{attempt.ordinal} {attempt.op}" + (f" @{attempt.scope.path}" if attempt.scope.path else "")
        return f"failed{where} ({self.error}); {super()._glance()}"

    def short_note(self) -> str:
        """One or two lines for the exception's notes (shown under the traceback)."""
        lines = grammar.render_attempt(self.attempt, normalize=False) if self.attempt else []
        lines = [line for line in lines if line.startswith("!! ")]
        text = "torchlens: " + " | ".join(line[3:] for line in lines)
        return text + "\ntorchlens: exc.partial_trace.narrate(last=20) shows the last lines before the failure"
