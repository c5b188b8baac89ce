"""Each divergence of a comparison judged against the float64 reference: rounding, real, carried.

`compare` pairs the reference's ops with each trace's as the traces are paired with each other
(module, op, output shapes), then hands every row whose two sides differ to `judge_rows`. For each
such row the reference's op is replayed in float64 on each side's own inputs: the outputs that
side's ops, paired with the ones the float64 op read, gave (`Reference.replay`). That separates
what an op adds from what its inputs carried in, so a side is judged in the precision its op
computed in (`rounding.judge`).

A row where neither side's op adds more than rounding carried its divergence in from its inputs.
It is **carried** when one of the ops it read from (in the float64 run's data flow) was real or
carried itself: the consequence of a real op, never one itself. Otherwise what it carried in was
rounding — from a lower precision upstream (a float32 `add` of a bf16 matmul's output), or
accumulated op after op — and it is judged **rounding**. One that read from an op that could not
be judged is not judged either.

Parameters, buffers and inputs are not in a trace: a side may hold them in a lower precision than
the float64 run's (a bf16 model's `inv_freq` buffer), so an op that reads them is replayed with
them rounded through each floating dtype the side computed in, too, and judged against the
nearest replay.
"""

from __future__ import annotations

import functools
from typing import Dict, Mapping, Optional

import torch

from ..events import INPUT, Event
from .reference import Produced, Reference, random_ops
from .rounding import CARRIED, INHERITED, REAL, ROUNDING, UNJUDGED, drew_alike, error, judge

__all__ = ["judge_rows", "precisions"]


def precisions(trace) -> frozenset:
    """The floating dtypes a trace's ops computed in (their outputs' dtypes)."""
    return frozenset(meta.dtype for event in trace.ops for meta in event.outputs
                     if meta.dtype.is_floating_point or meta.dtype.is_complex)


class _Side:
    """One trace of the comparison as the judging sees it: its kept values, its ops paired with
    the reference's (reference ordinal -> its ordinal), and the dtypes it computed in."""

    def __init__(self, trace, values: dict, by_reference: Dict[int, int], inputs):
        self.values = values
        self.by_reference = by_reference
        self.precisions = precisions(trace)
        self.inputs = inputs  # the reference ordinals of the forward's inputs

    def value_of(self, produced: Produced, own: torch.Tensor) -> Optional[torch.Tensor]:
        """This side's value of what the float64 run's op `produced` made (`own`), or None: not
        paired, not kept, or of another shape (a pair on the op's name alone)."""
        ordinal = self.by_reference.get(produced.ordinal)
        kept = self.values.get(ordinal) if ordinal is not None else None
        if kept is None or produced.index >= len(kept) or kept[produced.index].shape != own.shape:
            return None
        return kept[produced.index]

    def replayed(self, reference: Reference, ordinal: int, nearest=None) -> Optional[tuple]:
        """What this side's op should have given: the reference's op replayed on this side's
        inputs (a forward input: the float64 run's own value). With `nearest` (this side's
        outputs), where sources are read, they are also rounded through each lower precision this
        side computed in, and the replay nearest `nearest` is taken."""
        if ordinal in reference.calls:
            replay = functools.partial(reference.replay, ordinal, self.value_of)
        elif ordinal in self.inputs:
            replay = functools.partial(_input_value, reference.trace.values or {}, ordinal)
        else:
            return None
        best = replay()
        if best is None or nearest is None or not _reads_floating_sources(reference, ordinal):
            return best
        for dtype in self.precisions:
            if dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(torch.float64).eps:
                other = replay(sources_in=dtype)
                if other is not None and _distance(nearest, other) < _distance(nearest, best):
                    best = other
        return best


def _input_value(values: dict, ordinal: int, sources_in: Optional[torch.dtype] = None) -> Optional[tuple]:
    """A forward input of the float64 run, as it was or rounded through `sources_in`."""
    kept = values.get(ordinal)
    if kept is None or sources_in is None:
        return kept
    return tuple(value.to(sources_in).to(value.dtype) if value.is_floating_point() else value for value in kept)


def _reads_floating_sources(reference: Reference, ordinal: int) -> bool:
    """Whether op `ordinal` reads a floating tensor no op produced (or is a forward input)."""
    call = reference.calls.get(ordinal)
    if call is None:
        return True  # a forward input: a source itself
    return any(isinstance(value, torch.Tensor) and value.is_floating_point()
               for value in (*call.args, *call.kwargs.values()))


def _distance(outputs, replayed) -> float:
    return error(outputs, replayed).absolute


def judge_rows(rows: list, trace_a, trace_b, values_a: dict, values_b: dict, reference: Reference,
               pairs_a: Mapping[int, Event], pairs_b: Mapping[int, Event]) -> None:
    """Judge each compared row whose sides differ against the float64 reference's op (`pairs_a`,
    `pairs_b`: each trace's ordinal -> the reference event paired with it). A row takes the
    reference op paired with its sides (with one side's when the other's has none). A row that
    cannot be judged says why (`UNJUDGED`, `reason`), and so does every row after a random op
    where the reference drew other numbers than both runs: from there on it computes something
    else than either."""
    inputs = {event.ordinal for event in reference.trace.ops if event.kind is INPUT}
    side_a = _Side(trace_a, values_a, {ref.ordinal: ordinal for ordinal, ref in pairs_a.items()}, inputs)
    side_b = _Side(trace_b, values_b, {ref.ordinal: ordinal for ordinal, ref in pairs_b.items()}, inputs)
    judging = _Judging(reference, side_a, side_b)
    for row in rows:
        if row.status == "both" and row.verdict in ("within", "diverged"):
            ref_a, ref_b = pairs_a.get(row.ordinal_a), pairs_b.get(row.ordinal_b)
            judging.row(row, ref_a or ref_b, ref_a is not None and ref_b is not None and ref_a is not ref_b)


class _Judging:
    """The rows of one comparison judged in order: what the random ops drew, what each op of the
    float64 run's data flow passed on (`_Upstream`)."""

    def __init__(self, reference: Reference, side_a: _Side, side_b: _Side):
        self.reference, self.side_a, self.side_b = reference, side_a, side_b
        self.same_precision = side_a.precisions == side_b.precisions
        floating = [dtype for dtype in side_a.precisions | side_b.precisions if dtype.is_floating_point]
        self.coarsest = max(floating, key=lambda dtype: torch.finfo(dtype).eps) if floating else None
        self.random, self.upstream = random_ops(), _Upstream(reference)
        self.drawn_apart: Optional[str] = None  # why every row from a random op on is unjudged

    def row(self, row, ref, paired_apart: bool) -> None:
        kept = (self.reference.trace.values or {}).get(ref.ordinal) if ref is not None else None
        a, b = self.side_a.values[row.ordinal_a], self.side_b.values[row.ordinal_b]
        why = _why_unjudged(a, kept)
        if self.drawn_apart is None and row.op in self.random:
            self.drawn_apart = _drew_apart(row, a, b, kept, why)
        if not row.max_abs:
            return  # the two sides are equal: nothing to judge
        why = self.drawn_apart or (_PAIRED_APART if paired_apart else None) or why
        if why == _INTEGERS and kept is not None and ref.ordinal in self.side_a.inputs:
            _different_inputs(row, a, b, kept)
            self.upstream.note(ref.ordinal, REAL)
        elif why is not None:
            row.judgement, row.reason = UNJUDGED, why
            if why == _INTEGERS and ref is not None:  # a discrete op passes on what its inputs carried
                self.upstream.note(ref.ordinal, self.upstream.carried_from(ref.ordinal))
        else:
            verdict = _judge_row(row, self.reference, ref.ordinal, (self.side_a, a), (self.side_b, b), kept,
                                 self.same_precision, self.coarsest)
            self.upstream.note(ref.ordinal, _status(row, verdict, self.upstream, ref.ordinal))


_UNFOLLOWED = ("its op adds only rounding, but its sides are farther apart than rounding carries, and no op "
               "paired with the float64 run's made them so: the divergence came in through ops the comparison "
               "could not pair")
_PAIRED_APART = "its two sides pair with different ops of the float64 run: they are not the same computation"


def _different_inputs(row, a, b, kept) -> None:
    """Integer inputs (token ids, a mask) that differ: nothing computed them, so it is no rounding;
    the side that is not the float64 run's input is off."""
    same = [all(torch.equal(x.cpu(), r.cpu()) for x, r in zip(values, kept)) for values in (a, b)]
    row.judgement, row.reason = REAL, "its integer input differs from the float64 run's"
    row.off = "b" if same[0] and not same[1] else "a" if same[1] and not same[0] else None
    row.closer = {"a": "b", "b": "a"}.get(row.off)


class _Upstream:
    """What the ops of the float64 run's data flow were: real or carrying a real one's divergence
    (`REAL`), not judged (`UNJUDGED`), or neither; by reference ordinal."""

    def __init__(self, reference: Reference):
        self.reference = reference
        self.status: Dict[int, str] = {}

    def note(self, ordinal: int, status: Optional[str]) -> None:
        if status is not None:
            self.status[ordinal] = status

    def carried_from(self, ordinal: int) -> Optional[str]:
        """REAL when an op `ordinal` read from was real or carried one's divergence; else UNJUDGED
        when one could not be judged; else None."""
        found = {self.status.get(produced.ordinal) for produced in self.reference.inputs(ordinal)}
        return REAL if REAL in found else UNJUDGED if UNJUDGED in found else None


def _status(row, verdict, upstream: _Upstream, ordinal: int) -> Optional[str]:
    """Settle a judged row by what it read, and say what it passes on downstream: an op that added
    only rounding carries a real op's divergence, or rounding, or what could not be judged."""
    source = upstream.carried_from(ordinal)
    if row.judgement == INHERITED:
        if source == REAL:
            row.judgement = CARRIED
        elif source == UNJUDGED:
            row.judgement, row.reason = UNJUDGED, "its divergence came in from an op that could not be judged"
        elif not verdict.rounding_carried():
            row.judgement, row.reason = UNJUDGED, _UNFOLLOWED
        else:
            row.judgement = ROUNDING  # what it carried in was rounding: no real op upstream
    elif row.judgement == UNJUDGED and source == REAL:
        row.judgement, row.reason = CARRIED, ""  # whatever it adds, it carries a real op's divergence
    if row.judgement in (REAL, CARRIED):
        return REAL
    return UNJUDGED if row.judgement == UNJUDGED else None


def _drew_apart(row, a, b, kept, why) -> Optional[str]:
    """Why every row from this random op on cannot be judged, or None when float64 drew as a run did."""
    if why is not None:
        return f"after #{row.ordinal} {row.op}, a random op the float64 run could not be checked at ({why})"
    if not drew_alike(a, kept) and not drew_alike(b, kept):
        return (f"the float64 run drew other random numbers than both runs at #{row.ordinal} {row.op}: make the "
                f"reference from the generator state they started from, or compare in eval()")
    return None


def _judge_row(row, reference: Reference, ordinal: int, side_a, side_b, kept, same_precision: bool, coarsest):
    (a_side, a), (b_side, b) = side_a, side_b
    verdict = judge(a, b, kept, reference.terms.get(ordinal, 1),
                    functools.partial(a_side.replayed, reference, ordinal),
                    functools.partial(b_side.replayed, reference, ordinal), same_precision, coarsest)
    row.judgement, row.closer, row.allowed = verdict.verdict, verdict.closer, verdict.allowed
    row.ulps_a, row.ulps_b = verdict.a.ulps, verdict.b.ulps
    row.own_a = verdict.own_a.ulps if verdict.own_a is not None else None
    row.own_b = verdict.own_b.ulps if verdict.own_b is not None else None
    row.off = verdict.off
    if verdict.verdict == UNJUDGED:
        row.reason = ("the runs computed in different precisions and the float64 op could not be replayed on "
                      "each side's own inputs, so what the op itself added is unknown")
    return verdict


_INTEGERS = "integer outputs: no ulps to judge them by"


def _why_unjudged(values, kept) -> Optional[str]:
    """Why a side's outputs cannot be judged against the reference's op (None when they can)."""
    if not any(value is not None and (value.is_floating_point() or value.is_complex()) for value in values):
        return _INTEGERS
    if kept is None:
        return "the float64 run has no op paired with it (it took another path there)"
    if any(v is None for v in kept) or len(kept) != len(values) or \
            any(tuple(r.shape) != tuple(x.shape) for r, x in zip(kept, values) if x is not None):
        return "the float64 run's op there has other outputs"
    return None
