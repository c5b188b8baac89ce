"""Non-finite tracking: where a NaN or an infinity was born, and whether it is a finding.

Counting non-finite values per op is not a verdict. Causal attention writes `-inf` on purpose
(`masked_fill(mask, float("-inf"))`, a float `-inf` mask for `scaled_dot_product_attention`) and
softmax absorbs it; a NaN in a weight shows up first in the op that reads the weight; a NaN written
by an indexed assignment is in the tensor before the next op reads it. So the tracker follows
where values come from — which op produced (or last wrote) each tensor an op read — and reports:

- a **NaN birth**: an op produced NaN although nothing it read, scalar arguments included, held
  NaN. Always a finding. When its inputs held an infinity (`inf - inf`, `0 * inf`), the finding
  also names where that infinity came from.
- an **infinity birth**: an op produced +inf or -inf although nothing it read held that kind: an
  overflow (`exp` of a large value), a division by zero, `log(0)`. A finding once it turns into a
  NaN or reaches the output; absorbed by later ops (T5's `log(0)` under a `where`), it is not.
- a **NaN source**: a tensor no tracked op produced (a parameter, a buffer, a constant, an input)
  holds NaN; reported at the first op that reads it, naming the tensor. An infinity in one (a
  float `-inf` attention mask passed in) is judged by its fate, as one carried in by a scalar.
- an infinity **reaching the output**, wherever it came from.

`raise` stops at NaN findings only: an infinity's fate is known later.

An infinity carried in by a scalar argument (`masked_fill(m, float("-inf"))`, `full(..., -inf)`)
and absorbed later (softmax, `where`, `max`) is not a finding: the run is healthy. When an op's
inputs were not all measured, a non-finite value it holds cannot be called a birth: it is
reported as first *seen* there, saying so.
"""

from __future__ import annotations

import collections
import math
from typing import Callable, Counter, Deque, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

import torch

from ..events import INPUT, OP, Event, Stats, StatsGroup
from ..findings import KINDS, NAN, NEGINF, POSINF, Finding, FindingKind, kind_names
from ..findings import bits as _bits
from ..narration.grammar import op_ref, plural
from ..narration.stats_text import counts_text
from .provenance import LazyReads, Provenance, Source, carried_kinds
from .provenance import tensor_arguments as _tensor_arguments
from .unwritten import IN_FLIGHT, NOT_SEEN_WRITTEN, UNINITIALIZED_NOTE

__all__ = ["UNINITIALIZED", "ForwardCause", "ForwardValues", "Tracker", "Verdicts", "can_hold_nonfinite", "count_text",
           "held", "measured_finite", "stats_known", "unmeasured_reason"]

UNINITIALIZED = ("empty", "new_empty")  # op names whose outputs hold no values yet (`empty_like`, ...)


def can_hold_nonfinite(metas) -> bool:
    """Whether any of these tensors (their `TensorMeta`) is of a floating or complex dtype."""
    for meta in metas:  # (once per op when tracking: a loop, not a generator)
        if meta.dtype.is_floating_point or meta.dtype.is_complex:
            return True
    return False


def measured_finite(stats) -> bool:
    """Whether `stats` (a `Stats` or `StatsGroup`) measured every output and found only finite
    values: the common case, which the trackers judge without looking further."""
    if stats.__class__ is Stats:
        return stats.nan == 0 and not stats.posinf and not stats.neginf
    if stats.__class__ is StatsGroup:
        return all(part.nan == 0 and not part.posinf and not part.neginf for part in stats.parts)
    return False


def stats_known(event: Event) -> bool:
    """Whether `event`'s statistics say all they will (not still waiting on the device)."""
    stats = event.stats
    if stats is None or not can_hold_nonfinite(event.outputs):
        return True
    parts = stats.parts if isinstance(stats, StatsGroup) else (stats,)
    return all(part.kind == "na" or part.nan is not None for part in parts)


def held(event: Event) -> Optional[int]:
    """The kinds of non-finite value `event`'s outputs held (bits), or None if not measured."""
    if not can_hold_nonfinite(event.outputs):
        return 0  # integers and bools cannot hold them
    stats = event.stats
    if stats is None:
        return None
    parts = stats.parts if isinstance(stats, StatsGroup) else (stats,)
    kinds = 0
    for part, meta in zip(parts, event.outputs):
        if not (meta.dtype.is_floating_point or meta.dtype.is_complex):
            continue
        if part.kind == "na" and part.note in (*_NO_VALUES_YET, "empty"):
            continue  # no values yet (`torchlens.measure.unwritten`), or none at all: nothing non-finite
        if part.nan is None:
            return None
        kinds |= _bits(part.nan, part.posinf, part.neginf)
    return kinds


def _unread(event: Event) -> bool:
    """Whether an output of `event` lies in memory that held no values when it was made."""
    stats = event.stats
    parts = stats.parts if isinstance(stats, StatsGroup) else (stats,)
    return any(part is not None and part.kind == "na" and part.note in _NO_VALUES_YET for part in parts)


_NO_VALUES_YET = (UNINITIALIZED_NOTE, NOT_SEEN_WRITTEN, IN_FLIGHT)


def unmeasured_reason(event: Event) -> str:
    stats = event.stats
    if stats is None:
        return "no statistics taken"
    parts = stats.parts if isinstance(stats, StatsGroup) else (stats,)
    return next((part.note for part in parts if part.kind == "na" and part.note), "not measured")


def _ref(event: Event) -> str:
    return op_ref(event.ordinal, event.op, event.scope.path)


class Verdicts:
    """What judging a pass's values takes, whichever way their provenance is followed (the forward's
    `Tracker`, a backward's `GradTracker`): the values waiting, in order, until their statistics are
    read; the findings; the counts of what was and was not measured; the footer's words on them."""

    HEADLINE = "first non-finite"  # the footer's words before the first finding
    INCOMPLETE = "; {}, so nothing is claimed of them"  # why part of the pass was not recorded
    _judge_one: Callable[..., List[Finding]]  # one value, with the `context` `judge` was given

    def __init__(self):
        self._queue: Deque[Tuple[Event, tuple]] = collections.deque()  # (event, context), judged in order
        self.findings: List[Finding] = []
        self.unmeasured: Counter[str] = collections.Counter()  # why -> how many values were not measured
        self.measured = 0

    def judge(self, event: Event, *context) -> List[Finding]:
        """Take `event` into account (and any events before it still waiting for statistics);
        return the findings made now."""
        if not self._queue and measured_finite(event.stats):
            self._finite(event)  # nothing waiting before it: `_judge_one` in short
            return []
        self._queue.append((event, context))
        made = []
        while self._queue and self._ready(self._queue[0][0], *self._queue[0][1]):
            made.extend(self._judged(*self._queue.popleft()))
        return made

    def judge_rest(self) -> List[Finding]:
        """At the end of the pass, once every statistic is read."""
        queue, self._queue = self._queue, collections.deque()
        return [finding for item in queue for finding in self._judged(*item)]

    def _judged(self, event: Event, context: tuple = ()) -> List[Finding]:
        """`_judge_one`'s findings, live when made at their own value (not a birth held back)."""
        findings = self._judge_one(event, *context)
        for finding in findings:
            finding.live = finding.event is event
        return findings

    def _ready(self, event: Event, *context) -> bool:
        return stats_known(event)

    def _finite(self, event: Event) -> None:
        self.measured += 1

    def _note(self, *findings: Finding) -> List[Finding]:
        self.findings.extend(findings)
        return list(findings)

    def summary(self, incomplete: Optional[str] = None) -> str:
        """The footer's words: the first finding (and those `_headline` adds), or a claim limited to
        what was measured; `incomplete`: why part of the pass was not recorded (nothing is claimed
        of the rest). `_after` adds its words before what was not measured."""
        missing = sum(self.unmeasured.values())
        why = ", ".join(f"{count} {reason}" for reason, count in sorted(self.unmeasured.items()))
        gap = (f"; {missing} not measured ({why})" if missing else "") + (
            self.INCOMPLETE.format(incomplete) if incomplete else "")
        if self.findings:
            shown = self._headline()
            more = len(self.findings) - len(shown)
            extra = f" (+{plural(more, 'more finding')})" if more else ""
            return f"{self.HEADLINE}: {'; then '.join(f.text for f in shown)}{extra}{self._after()}{gap}"
        if gap:
            return f"{self._claim()} in the {self.measured} measured{self._after()}{gap}"
        return self._claim() + self._after()

    def _headline(self) -> List[Finding]:
        return self.findings[:1]

    def _claim(self) -> str:
        return "no non-finite values"

    def _after(self) -> str:
        return ""


class Tracker(Verdicts):
    """The verdicts of one forward, drawn from its ops' statistics and their provenance.

    Substrates tell its `provenance` (`provenance.Provenance`) what each op read (`reads_of`, or a
    compiled plan's static reads) and what it produced (`produced`); the session hands it each op
    once its statistics are known (`judge`), in order, and asks for the footer at the end. The
    rules are `findings.FindingKind`'s table.
    """

    INCOMPLETE = "; not everything after {} was recorded, so nothing is claimed of what followed"

    def __init__(self, names: Callable[[], Dict[int, str]]):
        super().__init__()
        self.provenance = Provenance(names)  # what produced and wrote each tensor (`provenance`)
        provenance = self.provenance
        # (bound once: `produced` runs for every op a tracked forward records)
        self.origin_of, self.produced = provenance.origin_of, provenance.produced
        self._kinds: Dict[int, Optional[int]] = {}  # id(event) -> what it held
        self._origin: Dict[Tuple[int, int], object] = {}  # (id(event), kind) -> Event or Source
        self._seen_first = 0  # kinds already reported as "first seen" (not a birth)
        self.absorbed: Optional[Event] = None  # first op holding an infinity that was no finding
        # Infinity births whose verdict waits for their fate: a finding if they turn into a NaN or
        # reach the output, else absorbed (T5's `log(0)` under a `where`, a softmax-ed mask).
        self._infinities: Dict[Tuple[int, int], Finding] = {}
        self._born: Set[Tuple[int, int]] = set()  # (id(event), kind) of every infinity born, held back or not
        self._collectives: Dict[int, str] = {}  # id(event) -> its group, for collectives (`collectives`)
        # No value judged so far held a non-finite value or went unmeasured: an op cannot have read
        # one (a parameter's NaN no op's output showed aside), whatever it read (`forward_values`)
        self.clean = True

    # -- provenance -----------------------------------------------------------------------------

    def collective(self, event: Event, group: str) -> None:
        """`event` is a collective of `group` ("group of 2"): values it brings that nothing this
        rank sent held were carried in from the other ranks, not born here."""
        self._collectives[id(event)] = group

    def landed(self, event: Event, value, args, kwargs, position: float) -> List[Finding]:
        """An asynchronous collective's values arrived (its first reader ran at `position`): they
        are written now, and judged now (at its launch they were not there to judge)."""
        if value is not None:  # (a compiled graph's: its plan says where its values went)
            self.provenance.produced(event, value, args, kwargs, position)
        self._kinds.pop(id(event), None)
        return self._judged(event)

    def never_landed(self) -> None:
        """The forward ended before anything read what an asynchronous collective brought."""
        self.unmeasured["in flight at the end of the forward"] += 1

    def waiting(self, event: Event) -> bool:
        """Whether `event` still waits for its verdict (its statistics, or an earlier op's, are read later)."""
        return bool(self._queue) and self._queue[-1][0] is event

    def reads_of(self, args, kwargs):
        """(what each tensor argument came from, scalar kinds carried in) for an op's arguments."""
        refs = tuple(ref for tensor in _tensor_arguments(args, kwargs) for ref in self.origin_of(tensor))
        return refs, carried_kinds(args, kwargs)

    # -- verdicts -------------------------------------------------------------------------------

    def _finite(self, event: Event) -> None:
        self._kinds[id(event)] = 0
        self.measured += 1

    # -- a run of ops judged before: a compiled graph called again, all finite ----------------------

    def mark(self) -> tuple:
        """(how many values were judged finite, all else judging has found and holds so far): what
        `finite_since` compares."""
        return self.measured, (len(self.findings), sum(self.unmeasured.values()), len(self._queue), self.clean,
                               self.absorbed, len(self._origin), len(self._infinities), len(self._born),
                               len(self._collectives), self._seen_first)

    def finite_since(self, mark: tuple, ops: List[Event]) -> bool:
        """Whether all judging did since `mark` was to find each of `ops` finite, one value each:
        then judging them again, finite again, is `finite_again`."""
        now = self.mark()
        return (now[0] - mark[0] == len(ops) and now[1] == mark[1] and not self._queue
                and all(self._kinds.get(id(op)) == 0 for op in ops))

    def finite_again(self, ops: Tuple[int, ...]) -> bool:
        """Judge the ops of these ids (a run `finite_since` vouched for, recorded again) finite,
        as `judge` would one by one; False, judging nothing, when a value before them still waits
        for its statistics (they must then be judged in order)."""
        if self._queue:
            return False
        self._kinds.update(dict.fromkeys(ops, 0))
        self.measured += len(ops)
        return True

    def judge_rest(self) -> List[Finding]:
        made = super().judge_rest()
        # by where they happened, not when they were known
        self.findings.sort(key=lambda finding: finding.event.ordinal if finding.event is not None else math.inf)
        return made

    def _judge_one(self, event: Event) -> List[Finding]:
        kinds = held(event)
        if kinds == 0 and _unread(event):
            # memory that held no values yet (`torchlens.measure.unwritten`): nothing to find in the op
            # itself, but an op that reads it later read values nobody measured
            self._kinds[id(event)] = None
            self.clean = False
            return []
        self._kinds[id(event)] = kinds
        if kinds != 0:
            self.clean = False
        if kinds is None:
            self.unmeasured[unmeasured_reason(event)] += 1
            return []
        self.measured += 1
        if not kinds or event.kind is INPUT:
            for bit, _ in KINDS:
                if kinds & bit:
                    self._origin[(id(event), bit)] = event
            if kinds & NAN:  # an infinity in an input may be a mask (`attn_mask`): judged by its fate
                return self._note(Finding(f"NaN in the input {event.label} ({counts_text(event.stats)})", event,
                                          FindingKind.NONFINITE_INPUT, source=event.label))
            if kinds and self.absorbed is None:
                self.absorbed = event
            return []
        refs, carried = event.reads if event.reads is not None else ((), 0)
        findings = [finding for bit, name in KINDS if kinds & bit
                    for finding in self._trace_kind(event, bit, name, refs, carried)]
        if not findings and kinds & (POSINF | NEGINF) and self.absorbed is None:
            self.absorbed = event
        return self._note(*findings)

    def _trace_kind(self, event: Event, bit: int, name: str, refs, carried) -> List[Finding]:
        """Where `event`'s value of kind `bit` came from; the findings that makes (an infinity
        born here is held back until its fate is known: see `_infinity_fate`)."""
        key = (id(event), bit)
        if carried & bit:
            self._origin[key] = event
            if bit == NAN:  # writing NaN on purpose is still where the NaN came from
                return [Finding(f"NaN written by a scalar argument of {_ref(event)}", event, FindingKind.NAN_WRITTEN)]
            return []
        unknown = False
        for ref in refs:
            kinds = self._kinds.get(id(ref)) if isinstance(ref, Event) else None
            if isinstance(ref, Event) and kinds is not None and kinds & bit:
                self._origin[key] = self._origin.get((id(ref), bit), ref)
                return []
            unknown = unknown or (isinstance(ref, Event) and kinds is None)
        for ref in refs:
            if isinstance(ref, Source):
                kinds = ref.kinds()
                if kinds is not None and kinds & bit:
                    self._origin[key] = ref
                    # a NaN in a weight is a finding; an infinity (a mask buffer) is judged by its fate
                    return self._source_finding(ref, event) if bit == NAN else []
                unknown = unknown or kinds is None
        self._origin[key] = event
        count = count_text(event, bit)
        if unknown or event.reads is None:
            if self._seen_first & bit:
                return []  # reported once: later sightings of an unmeasured origin say nothing new
            self._seen_first |= bit
            text = (f"{name} first seen at {_ref(event)} ({count}); not everything it read was measured, "
                    f"so it may have come from earlier")
        elif id(event) in self._collectives:  # nothing this rank sent held it: another rank's
            return [Finding(f"{name} carried in by {_ref(event)} from its {self._collectives[id(event)]} ({count})",
                            event, FindingKind.CARRIED_IN)]
        elif bit == NAN:
            cause, origin = self._nan_cause(refs)
            return self._held_back(origin) + [Finding(f"NaN born at {_ref(event)} ({count}){cause}", event,
                                                                FindingKind.NAN_BORN)]
        else:
            text = f"{name} born at {_ref(event)} ({count}: an overflow, a division by zero or a log of zero)"
        if bit == NAN:
            return [Finding(text, event, FindingKind.FIRST_SEEN)]
        self._infinities[key] = Finding(text, event, FindingKind.FIRST_SEEN if unknown else FindingKind.INF_BORN)
        if not unknown:
            self._born.add(key)
        return []

    def _held_back(self, origin) -> List[Finding]:
        """The infinity birth `origin` stands for, now that it turned out to matter (once)."""
        for bit in (POSINF, NEGINF):
            finding = self._infinities.pop((id(origin), bit), None)
            if finding is not None:
                return [finding]
        return []

    def _source_finding(self, source: Source, event: Event) -> List[Finding]:
        if source.reported:
            return []
        source.reported = True
        return [Finding(f"NaN in {source.label} ({source.counts}), first read by {_ref(event)}", event,
                        FindingKind.NONFINITE_SOURCE, source=source.label)]

    def _nan_cause(self, refs):
        """(` (out of +inf born at #4 exp @m)`, its origin): the infinity a NaN was made of, if any."""
        for bit, name in ((POSINF, "+inf"), (NEGINF, "-inf")):
            for ref in refs:
                kinds = self._kinds.get(id(ref)) if isinstance(ref, Event) else (
                    ref.kinds() if isinstance(ref, Source) else None)
                if kinds and kinds & bit:
                    origin = self._origin.get((id(ref), bit), ref)
                    return f" (out of {name} {self._where(origin, bit)})", origin
        return "", None

    def output_reached(self, label: str, tensor: torch.Tensor) -> None:
        """An infinity in the forward's output is a finding, wherever it came from (an op, or a
        tensor no narrated op produced, such as a buffer returned as it is)."""
        for ref in self.origin_of(tensor):
            kinds = self._kinds.get(id(ref)) if isinstance(ref, Event) else ref.kinds()
            for bit, name in ((POSINF, "+inf"), (NEGINF, "-inf")):
                if kinds and kinds & bit:
                    origin = self._origin.get((id(ref), bit), ref)
                    shown = ref if isinstance(ref, Event) else None
                    reach = Finding(f"{name} reaches the output {label} ({self._where(origin, bit)})", shown,
                                    FindingKind.REACHES_OUTPUT)
                    self._note(*self._held_back(origin), reach)
                    return

    def _where(self, origin, bit: int) -> str:
        """`born at #4 exp @m` or `from #6 masked_fill` or `from blocks.0.mask`."""
        if isinstance(origin, Source):
            return f"from {origin.label}"
        if not isinstance(origin, Event):
            return "of unknown origin"
        if any((id(origin), b) in self._born for b in (POSINF, NEGINF) if b & bit):
            return f"born at {_ref(origin)}"
        return f"from the input {origin.label}" if origin.kind is INPUT else f"from {_ref(origin)}"

    # -- for the backward -----------------------------------------------------------------------

    def forward_values(self, events) -> "ForwardValues":
        """What each of the forward's `events` read or produced that was not finite (or may have
        been), for the backward's verdicts; called at the end of the forward, while each op's
        reads are still known."""
        causes: Dict[int, ForwardCause] = {}
        horizon = math.inf
        for event in events:
            if event.kind is OP or event.kind is INPUT:
                cause = self._forward_cause(event, horizon)
                if cause is not None:
                    causes[id(event)] = cause
                    horizon = min(horizon, event.ordinal)
        return ForwardValues(causes, horizon)

    def _forward_cause(self, event: Event, horizon: float) -> Optional["ForwardCause"]:
        """What `event` read or produced that was not finite: a known kind first (NaN before the
        infinities, what it produced before what it read), else why it is not known; None when it
        read and produced finite values. `horizon`: the first ordinal where one was not."""
        name = _ref(event) if event.kind is OP else f"the input {event.label}"
        produced = self._kinds.get(id(event), -1)
        if produced is None or produced == -1:
            return ForwardCause(None, f"{name} was not measured", None)
        reads = event.reads.resolved if isinstance(event.reads, LazyReads) else event.reads
        read: Dict[int, object] = {}  # kind -> the origin of what it read of that kind
        unknown = False
        for ref in (reads[0] if reads is not None else ()):
            origins: Iterable[Tuple[int, object]]
            if isinstance(ref, Source):
                kinds = ref.kinds() if ref.measured else 0  # (never measured: no op's output showed it)
                origins = ((bit, ref) for bit, _ in KINDS if kinds and kinds & bit)
            else:
                kinds = self._kinds.get(id(ref))
                origins = ((bit, self._origin.get((id(ref), bit), ref)) for bit, _ in KINDS if kinds and kinds & bit)
            unknown = unknown or kinds is None
            for bit, origin in origins:
                read.setdefault(bit, origin)
        for bit, kind in KINDS:
            if produced & bit:
                origin = self._origin.get((id(event), bit), event)
                held_text = f"{kind} {self._where(origin, bit)}"
                verb = "held" if event.kind is INPUT else "produced" if origin is event else "read"
                how = f"{name} {verb} {kind}" + ("" if origin is event else f" {self._where(origin, bit)}")
                return ForwardCause(kind, how, held_text)
        for bit, kind in KINDS:
            if bit in read:
                return ForwardCause(kind, f"{name} read {kind} {self._where(read[bit], bit)}", None)
        if reads is None and event.kind is OP and horizon < event.ordinal:
            return ForwardCause(None, f"what {name} read was not kept, and an earlier value was not finite "
                                      f"or not measured", None)
        if unknown:
            return ForwardCause(None, f"{name} read a value that was not measured", None)
        return None

    # -- the footer -----------------------------------------------------------------------------

    def _headline(self) -> List[Finding]:
        """The first finding, then the first NaN born when it came later."""
        nan = next((f for f in self.findings if f.kind is FindingKind.NAN_BORN), None)
        return self.findings[:1] + ([nan] if nan is not None and nan is not self.findings[0] else [])

    def _claim(self) -> str:
        if self.absorbed is None:
            return "no non-finite values"
        return (f"no non-finite findings ({kind_names((held(self.absorbed) or 0) & (POSINF | NEGINF))} "
                f"{self._where(self._absorbed_origin(), POSINF | NEGINF)} absorbed by later ops)")

    def _absorbed_origin(self):
        for bit in (NEGINF, POSINF):
            origin = self._origin.get((id(self.absorbed), bit))
            if origin is not None:
                return origin
        return self.absorbed


class ForwardCause(NamedTuple):
    """A non-finite value a forward op read or produced (`kind`: "NaN", "+inf", "-inf"), which a
    backward node computing with that op's values turns into a non-finite gradient of its own;
    `kind` None: whether the op's values were finite is not known, `text` says why. `held`: what
    the op's output held (`NaN from model.embed_tokens.weight`), None when it held no such value."""

    kind: Optional[str]
    text: str  # `#153 cross_entropy read NaN from model.embed_tokens.weight`, `#5 exp produced +inf`
    held: Optional[str]


class ForwardValues:
    """The forward's non-finite values by the op that read or produced them, for its backward
    (`Tracker.forward_values`). A backward node computes with what its forward op read and produced
    (what autograd saved for it): a non-finite gradient it made from finite ones is that value's
    consequence when one of those held one, a birth only when all were finite."""

    def __init__(self, causes: Dict[int, ForwardCause], horizon: float):
        self._causes = causes  # id(event) -> cause, for the ops that read or produced one (or may have)
        self._horizon = horizon  # the ordinal of the first value that was not finite, or not measured

    def of(self, ops, before: Optional[int] = None) -> Optional[ForwardCause]:
        """Why a backward node differentiating the forward's `ops` may not have made its non-finite
        gradient itself: a known cause first, else an unknown one; None when all was finite. A
        node no op stands for (a custom `autograd.Function`'s) computes with values made before
        the op `before` that read its output: finite when nothing before it was not."""
        unknown = None
        for op in ops:
            cause = self._causes.get(id(op))
            if cause is not None and cause.kind is not None:
                return cause
            unknown = unknown or cause
        if unknown is None and not ops and before is not None and self._horizon < before:
            return ForwardCause(None, f"a value the forward made before #{before} was not finite or not measured",
                                None)
        return unknown

    def held(self, ops) -> Optional[ForwardCause]:
        """The non-finite value the output of one of `ops` held, if any (what a loss computed
        outside the forward read)."""
        return next((cause for cause in map(self._causes.get, map(id, ops)) if cause and cause.held), None)


def count_text(event: Event, kinds: int) -> str:
    """`nan=3 +inf=1`: how many values of each of these kinds (bits) the event's outputs held."""
    parts = event.stats.parts if isinstance(event.stats, StatsGroup) else (event.stats,)
    return " ".join(f"{label}={sum(getattr(part, field) or 0 for part in parts)}" for bit, field, label in
                    ((NAN, "nan", "nan"), (POSINF, "posinf", "+inf"), (NEGINF, "neginf", "-inf")) if kinds & bit)
