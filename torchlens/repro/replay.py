"""Which op a run's repro replays, and what it should show: the entry points behind `.repro()`.

Reads recordings by their attributes (no import of `torchlens.results`, which calls in here).
"""

from __future__ import annotations

from ..errors import ReproError
from ..grammar import op_ref
from .kept import inputs_kept
from .script import expected_counts, write

__all__ = ["failure_repro", "nonfinite_repro"]


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
        raise ReproError(_why_not_kept(recording, event, call))
    finding = event.finding.text if event.finding is not None else "non-finite output"
    return write(directory, call, _title(event, "Non-finite output of"), {"nonfinite": expected_counts(event.stats)},
                 (f"torchlens found: {finding}",))


def _why_not_kept(recording, event, call) -> str:
    where = op_ref(event.ordinal, event.op, event.scope.path)
    if call is not None:
        return f"the inputs of {where} were not kept: " + "; ".join(call.notes)
    return (f"the inputs of {where} were not kept: only an eager run keeps them, at the first op that introduced "
            f"each kind of non-finite value (its inputs held none), when its statistics are read as it returns (on "
            f"the CPU, or with on_nonfinite='raise'); a loaded trace or a compiled graph keeps none")


def failure_repro(partial, directory):
    """The repro of a failed run's attempted op (or, stopped by `on_nonfinite="raise"`, of the
    op that produced the non-finite value)."""
    attempt = partial.attempt
    call = getattr(attempt, "call", None)
    if call is not None and call.func is None:
        raise ReproError("the attempted op's function could not be copied with this partial trace (pickle cannot "
                         "name it): call repro() on the partial trace the exception carried")
    if call is not None:
        return write(directory, call, _title(attempt, "Failure of"), {"error": call.error or partial.error})
    if attempt is None and partial.settings.on_nonfinite is not None and partial.first_nonfinite is not None:
        return nonfinite_repro(partial, directory)
    if attempt is None or attempt.op is None:
        raise ReproError(f"the forward failed between ops ({partial.error}): there is no torch call to replay")
    raise ReproError(f"the attempted op {op_ref(attempt.ordinal, attempt.op, attempt.scope.path)} was located "
                     f"without its arguments (a compiled graph, a loaded trace): it cannot be replayed alone")
