"""A narration: events in, lines out, through selection, depth folding and `max_lines`.

What the narrator prints depends only on the event sequence and the options. Live narration feeds
it events as the forward runs; a recording renders its transcript after the fact by feeding the
same events to a fresh narrator with an in-memory sink. That is why the two are byte-identical.
(Statistics of a line are read before the line is printed; those of a line not printed may be read
later, at the end of the forward, and so the narrator only acts on statistics of printed lines.)

A sink that fails (raises on a write, a block, or when closed) turns the live narration off with
exactly one `NarrationWarning`; lines are still counted, and the run's events, from which any
transcript is rendered again, are untouched. Nothing a sink does reaches the user's forward.
"""

from __future__ import annotations

from typing import AbstractSet, List, Optional, Sequence, Tuple

from ..errors import warn_safely
from ..events import ENTER, EXIT, GRAD, INPUT, NODE, OP, Attempt, Event
from ..options import NarrationOptions
from . import grammar
from .ranks import shared_sink_tag
from .sinks import ListSink, Sink, open_sink

__all__ = ["Narrator", "PassCounts", "failure_block", "printed_events", "render_lines"]


class PassCounts:
    """What a narrator has counted and noted so far in a pass: besides the events and the options,
    the only thing its later lines and footer depend on.

    The block cache (`Narrator.feed_block`) keys on `snapshot()` and puts a cached block's end
    state back with `restored()`, both derived from `__slots__`: a counter added here is part of
    the cache key and of what is restored by construction, so cached narration cannot drift from
    event-by-event narration.
    """

    __slots__ = ("lines_written", "lines_suppressed", "ops", "inputs", "module_calls", "nodes", "leaves", "grads",
                 "unselected", "folded_total", "folded", "limit_noted", "nonfinite_noted", "engine_folded")
    # scope key -> ops folded into its exit line, while it is open; engine -> its ops folded
    _MAPPINGS = ("folded", "engine_folded")

    def __init__(self):
        self.lines_written = 0
        self.lines_suppressed = 0  # lines past `max_lines`
        self.ops = 0
        self.inputs = 0
        self.module_calls = 0
        self.nodes = 0  # backward nodes (a backward section counts these instead of ops)
        self.leaves = 0  # gradients accumulated into leaves (parameters), among the nodes
        self.grads = 0  # gradients received at the forward's outputs
        self.unselected = 0  # ops and inputs a selector left out
        self.folded_total = 0  # ops deeper than `depth`
        self.folded = {}
        self.limit_noted = False  # the `max_lines` note was printed
        self.nonfinite_noted = False  # the pass's `!!` finding line was printed
        self.engine_folded = {}  # ops distributed engines ran for themselves, not shown (`engine_ops`)

    def snapshot(self) -> tuple:
        """A hashable copy of every field."""
        return tuple(tuple(getattr(self, name).items()) if name in self._MAPPINGS else getattr(self, name)
                     for name in self.__slots__)

    @classmethod
    def restored(cls, snapshot: tuple) -> "PassCounts":
        counts = cls.__new__(cls)
        for name, value in zip(cls.__slots__, snapshot):
            setattr(counts, name, dict(value) if name in cls._MAPPINGS else value)
        return counts


class Narrator:
    """Writes the lines of one or more forward passes to one sink."""

    def __init__(self, options: NarrationOptions, sink: Optional[Sink] = None):
        self.options = options
        if sink is None:  # a live run: the sink is opened now, and may be shared by several ranks
            shared = shared_sink_tag(options.sink)  # (ranks writing one file: no run of theirs starts it)
            self.sink = open_sink(options.sink, options.first_opening() and not shared, options.overwrite)
            self._prefix = shared + options.prefix
        else:  # rendering into the caller's sink: the transcript of this process alone
            self.sink = sink
            self._prefix = options.prefix
        self._select = options.select
        self._depth = options.depth
        self._max_lines = options.max_lines
        self._sites = options.sites
        self._normalize = options.normalize
        self._quiet = options.on_error_only
        self._plain = self._select is None and self._depth is None and self._max_lines is None and not self._quiet
        self._engine_ops = options.engine_ops
        self._disabled = False
        self._captured: Optional[List[str]] = None  # lines held back while a block is being rendered for its cache
        self.begin_pass()

    # -- per pass -------------------------------------------------------------------------------

    def begin_pass(self, header: Optional[str] = None) -> None:
        """Reset the counters the footer reports; optionally print a pass header note."""
        self.counts = PassCounts()
        self._header = header
        if header is not None and not self._quiet:  # with on_error_only, only a failed pass shows it
            self._write(grammar.render_note(header))

    def feed(self, event: Event) -> None:
        """Narrate one event (or count why it is not narrated)."""
        kind = event.kind
        counts = self.counts
        if kind is OP:
            counts.ops += 1
        elif kind is INPUT:
            counts.inputs += 1
        elif kind is ENTER:
            counts.module_calls += 1
        elif kind is NODE:
            counts.nodes += 1
            if event.label:
                counts.leaves += 1
        elif kind is GRAD:
            counts.grads += 1
        if event.engine is not None and not self._engine_ops:  # an engine's own op: folded, counted
            counts.engine_folded[event.engine] = counts.engine_folded.get(event.engine, 0) + 1
            return
        if self._plain and event.stats is None:  # the common case, on every event: print it
            counts.lines_written += 1
            self._write(grammar.render_event(event, self._sites, self._normalize))
            return
        if self._quiet:
            return
        if self._select is not None and not self._select(event):
            if kind is OP or kind is INPUT or kind is NODE:
                counts.unselected += 1
            return
        folded = 0
        if self._depth is not None:
            depth = event.scope.depth
            if kind is OP and depth > self._depth:
                self._fold(event)
                return
            if kind is NODE and depth > self._depth:
                counts.folded_total += 1  # a backward has no exit lines to fold into: the footer counts it
                return
            if kind is ENTER and depth > self._depth:
                return
            if kind is EXIT:
                if depth > self._depth:
                    return
                folded = counts.folded.pop(event.scope.key, 0)
        printed = self._emit(grammar.render_event(event, self._sites, self._normalize, folded))
        # Only for a printed line whose finding was known as it was printed (`Finding.live`), so
        # the note appears after the fact exactly where it appeared live.
        finding = event.finding
        if printed and finding is not None and finding.live and not counts.nonfinite_noted:
            counts.nonfinite_noted = True
            self._emit(grammar.render_failure(finding.text))

    def prints(self, event: Event) -> bool:
        """Whether feeding `event` now would print its line (decides whether its stats are read now)."""
        if self._quiet or self._disabled or (self._select is not None and not self._select(event)):
            return False
        if event.engine is not None and not self._engine_ops:
            return False
        if self._depth is not None and event.scope.depth > self._depth and event.kind is not EXIT:
            return False
        return self._max_lines is None or self.counts.lines_written < self._max_lines

    def _fold(self, event: Event) -> None:
        """Count an op too deep to show against the innermost shown module call around it."""
        counts = self.counts
        counts.folded_total += 1
        scope = event.scope
        while scope.depth > self._depth:
            scope = scope.parent
        if scope.parent is not None:
            counts.folded[scope.key] = counts.folded.get(scope.key, 0) + 1

    def feed_block(self, events: Sequence[Event], cache: dict) -> None:
        """Narrate a run of events that recurs identically (a compiled graph's ops, call after call).

        The lines it produces and the narrator's state afterwards depend only on the events and
        the state before, so they are computed once per starting state and replayed: one sink
        write per graph call instead of one render per op.
        """
        before = self.counts.snapshot()
        hit = cache.get(before)
        if hit is None:
            self._captured = []
            try:
                for event in events:
                    self.feed(event)
                lines = tuple(self._captured)
            finally:
                self._captured = None
            if len(cache) < 8:
                cache[before] = hit = (lines, self.counts.snapshot())
            self._write_block(lines)
            return
        lines, after = hit
        self._write_block(lines)
        self.counts = PassCounts.restored(after)

    def end_pass(self, extra: Sequence[str] = (), backward: bool = False) -> None:
        """Print the footer that closes a pass (or, `backward`, a backward section)."""
        if self._quiet:
            return
        self._write(grammar.render_footer(self.footer_parts(extra, backward)))

    def footer_parts(self, extra: Sequence[str] = (), backward: bool = False) -> List[str]:
        parts = grammar.backward_footer_parts if backward else grammar.footer_parts
        return parts(self.counts, self._depth, self._max_lines, extra)

    # -- failures -------------------------------------------------------------------------------

    def fail(self, events: Sequence[Event], attempt: Optional[Attempt], error: str, what: str = "forward") -> None:
        """Print the failure block: what failed, the last lines with their module context, the marker.

        Never raises: it runs while the user's exception is on its way out, and must not replace it.
        """
        if self._disabled:
            return
        try:
            printed = printed_events(events, self.options)
            lines = failure_block(events, attempt, error, self.options, self.options.tail_on_error, printed, what)
        except Exception as exc:
            self._narration_failed(f"torchlens could not narrate the failure ({_describe(exc)}); "
                                   f"exc.partial_trace still holds every event")
            return
        if self._quiet and self._header is not None:
            lines = [grammar.render_note(self._header)] + lines  # which pass failed
        for line in lines:
            self._write(line)

    def write_lines(self, lines: Sequence[str]) -> None:
        """Write lines rendered by another narrator (a backward held back while this one was busy),
        with this narrator's prefix."""
        self._write_block(lines)

    def note(self, text: str) -> None:
        if not self._quiet:
            self._emit(grammar.render_note(text))

    # -- output ---------------------------------------------------------------------------------

    def _emit(self, line: str) -> bool:
        """A narrated line: counted against `max_lines`. Returns whether it was printed."""
        counts = self.counts
        if self._max_lines is not None and counts.lines_written >= self._max_lines:
            counts.lines_suppressed += 1
            if not counts.limit_noted:
                counts.limit_noted = True
                self._write(grammar.render_limit_note(self._max_lines))
            return False
        counts.lines_written += 1
        self._write(line)
        return True

    def _write(self, line: str) -> None:
        if self._captured is not None:  # held for a block cache: prefixed when the block is written
            self._captured.append(line)
            return
        if self._disabled:
            return
        if self._prefix:
            line = self._prefix + line
        try:
            self.sink.write(line)
        except Exception as exc:  # a broken sink must not break the user's forward
            self._sink_failed(exc)

    def _write_block(self, lines: Sequence[str]) -> None:
        """Write cached lines; the prefix is added here, as it may differ between the runs that
        share a cache (the rank tag of a process group initialised between two calls)."""
        if self._disabled or not lines:
            return
        if self._prefix:
            lines = [self._prefix + line for line in lines]
        try:
            self.sink.write_block(lines)
        except Exception as exc:
            self._sink_failed(exc)

    def _sink_failed(self, exc: Exception) -> None:
        self._narration_failed(
            f"torchlens narration turned off: the sink raised {_describe(exc)}; the run goes on, and "
            f"its recording still holds every event (recording.narrate() renders the whole transcript)"
        )

    def _narration_failed(self, message: str) -> None:
        """Turn live narration off, with the run's only warning about it."""
        if self._disabled:
            return
        self._disabled = True
        warn_safely(message, stacklevel=5)

    def close(self) -> None:
        """Release the sink. Never raises; warns only if narration has not already warned (a sink
        that failed while writing usually fails again when closed)."""
        try:
            self.sink.close()
        except Exception as exc:
            self._narration_failed(f"torchlens could not close its sink: {_describe(exc)}")
        self._disabled = True  # a closed narrator writes nothing more


def _describe(exc: BaseException) -> str:
    """`Type: message` of an exception, even one whose message cannot be rendered."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:
        return f"{type(exc).__name__} (its message could not be rendered)"


def render_lines(events: Sequence[Event], options: NarrationOptions, header=None, footer_extra=None,
                 backward: bool = False) -> List[str]:
    """Render events to lines exactly as a live narration with these options would have
    (`backward`: a backward section, whose footer counts nodes)."""
    sink = ListSink()
    narrator = Narrator(options, sink)
    narrator.begin_pass(header)
    for event in events:
        narrator.feed(event)
    if footer_extra is not None:
        narrator.end_pass(footer_extra, backward)
    return sink.lines


def printed_events(events, options: NarrationOptions) -> set:
    """The ids of the events whose lines a live narration with `options` printed (none with
    `on_error_only`): run again over the events, only when a forward has failed."""
    if options.on_error_only:
        return set()
    sink = ListSink()
    narrator = Narrator(options.replace(prefix=""), sink)
    printed = set()
    for event in events:
        narrator.feed(event)
        if sink.lines:
            printed.add(id(event))
            sink.lines.clear()
    return printed


def failure_block(events, attempt, error: str, options: NarrationOptions, last: Optional[int],
                  printed: AbstractSet[int] = frozenset(), what: str = "forward") -> List[str]:
    """`!! forward failed`, the last lines (with the enter lines of still-open modules), the marker.

    The window ignores selection, depth folding and `max_lines`: after a failure what matters is
    what ran last, wherever it was. Lines of `printed` events (shown just above, by the same
    narration) are not repeated: each line appears once, and the failure block ends the transcript.
    """
    plain = options.replace(select=None, depth=None, max_lines=None, on_error_only=False, prefix="")
    sink = ListSink()
    narrator = Narrator(plain, sink)
    rendered: List[Tuple[str, Event]] = []  # (line, event that produced it)
    for event in events:
        narrator.feed(event)
        if id(event) not in printed:
            rendered.extend((line, event) for line in sink.lines)
        sink.lines.clear()
    start = 0 if last is None else max(0, len(rendered) - last)
    out = [grammar.render_failure_header(error, what)]
    if start:
        out.extend(_open_enter_lines(rendered[:start]))
        out.append(grammar.render_earlier_lines_note(start))
    out.extend(line for line, _ in rendered[start:])
    if attempt is not None:
        out.extend(grammar.render_attempt(attempt, options.normalize))
    return out


def _open_enter_lines(rendered) -> List[str]:
    """Enter lines of the modules still open at the end of `rendered`, outermost first."""
    stack = []
    for line, event in rendered:
        if event.kind is ENTER:
            stack.append(line)
        elif event.kind is EXIT and stack:
            stack.pop()
    return stack

