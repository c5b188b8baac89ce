"""Which op a run's repro replays, and what it should show: the entry points behind `.repro()`.

Reads recordings by their attributes (no import of `torchlens.results`, which calls in here).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ..errors import ReproError
from ..narration.grammar import op_ref
from .kept import KeptCall, inputs_kept
from .script import expected_counts, write

__all__ = ["Replayed", "failure_repro", "nonfinite_repro", "replayed"]


class Replayed(NamedTuple):
    """The call a recording's `repro()` replays: `role` "attempt" (a failed forward's attempted
    op) or "nonfinite" (the op where tracking found the first non-finite value), that op's
    ordinal, and its kept call (None when none was kept)."""

    role: str
    ordinal: int
    call: Optional[KeptCall]


def replayed(recording) -> Optional[Replayed]:
    """What `repro()` replays for this recording, or None when it has no op to replay (what a saved
    trace keeps of it: `torchlens.archive.calls`)."""
    attempt = getattr(recording, "attempt", None)
    if attempt is not None and getattr(attempt, "call", None) is not None:
        return Replayed("attempt", attempt.ordinal, attempt.call)
    if hasattr(recording, "attempt") and attempt is not None:
        return None  # a failure located without its call
    if recording.settings.on_nonfinite is None:
        return None
    event = recording.first_nonfinite
    if event is None:
        return None
    return Replayed("nonfinite", event.ordinal, getattr(recording, "kept_calls", {}).get(event.ordinal))


def _title(event_or_attempt, what: str) -> str:
    site = f" ({event_or_attempt.site})" if event_or_attempt.site else ""
    return f"{what} {op_ref(event_or_attempt.ordinal, event_or_attempt.op, event_or_attempt.scope.path)}{site}"


def nonfinite_repro(recording, directory):
    """The repro of the op where the first non-finite value was found."""
    if recording.settings.on_nonfinite is None:
        raise ReproError("repro() replays the op where tracking found the first non-finite value: record with "
                         "on_nonfinite='track' (or 'raise') so that op keeps its inputs")
    event = recording.first_nonfinite
    if event is None:
        raise ReproError("this run found no non-finite value: there is no op to reproduce")
    call = getattr(recording, "kept_calls", {}).get(event.ordinal)
    if not inputs_kept(call):
        raise ReproError(_why_not_kept(event, call))
    finding = event.finding.text if event.finding is not None else "non-finite output"
    return write(directory, call, _title(event, "Non-finite output of"), {"nonfinite": expected_counts(event.stats)},
                 (f"torchlens found: {finding}",))


def _why_not_kept(event_or_attempt, call) -> str:
    where = op_ref(event_or_attempt.ordinal, event_or_attempt.op, event_or_attempt.scope.path)
    if call is not None and call.notes:
        return f"the inputs of {where} were not kept: " + "; ".join(call.notes)
    if call is not None:  # a call whose function could not be copied with the recording
        return (f"the function of {where} could not be copied with this recording (pickle cannot name it): call "
                f"repro() on the recording the run returned, or on the partial trace the exception carried")
    return (f"the inputs of {where} were not kept: only an eager run keeps them, at the first op that introduced "
            f"each kind of non-finite value (its inputs held none), when its statistics are read as it returns (on "
            f"the CPU, or with on_nonfinite='raise'); a compiled graph keeps none")


def failure_repro(partial, directory):
    """The repro of a failed run's attempted op (or, stopped by `on_nonfinite="raise"`, of the
    op that produced the non-finite value)."""
    attempt = partial.attempt
    call = getattr(attempt, "call", None)
    if call is not None:
        if not inputs_kept(call):
            raise ReproError(_why_not_kept(attempt, call))
        return write(directory, call, _title(attempt, "Failure of"), {"error": call.error or partial.error})
    if attempt is None and partial.settings.on_nonfinite is not None and partial.first_nonfinite is not None:
        return nonfinite_repro(partial, directory)
    if attempt is None or attempt.op is None:
        raise ReproError(f"the forward failed between ops ({partial.error}): there is no torch call to replay")
    raise ReproError(f"the attempted op {op_ref(attempt.ordinal, attempt.op, attempt.scope.path)} was located "
                     f"without its arguments: it cannot be replayed alone")
