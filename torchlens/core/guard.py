"""Failures inside torchlens while the user's code runs: contained, said, never the user's problem.

Two kinds of exception leave torchlens's own code during a forward or a backward:

- a deliberate **stop** (`on_nonfinite="raise"` at a NaN, a `tl.trace` budget exceeded): its class
  sets `torchlens_stop`, and it must end the run, so it propagates;
- a **failure of torchlens itself**: it must not change the user's run, so it is reported as a
  `NarrationWarning` (which must not itself become an exception: under `-W error` it would replace
  the user's own) and the pass is marked incomplete, so that its footer and verdict claim nothing
  of what went unrecorded.

`contain(exc, what, mark)` is that rule for an exception already caught; `guarded(what, mark)` is
the same rule as a `with` block. `mark` is how the pass in question is told it is incomplete
(`Session.mark_incomplete`, a backward run's), given the reason; None where nothing went
unrecorded (a partial trace that could not be built: the user's exception goes on regardless).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

from ..errors import warn_safely

__all__ = ["contain", "guarded", "internal_error", "is_stop"]


def is_stop(exc: BaseException) -> bool:
    """Whether `exc` is a deliberate stop of the run (`NonFiniteError`, `TraceBudgetError`)."""
    return getattr(exc, "torchlens_stop", False)


def contain(exc: Exception, what: str, mark: Optional[Callable[[str], None]] = None,
            why: Optional[str] = None) -> None:
    """Let a deliberate stop through; report any other failure of `what` ("recording an op") and
    mark the pass incomplete with `why` (by default "an internal error " + `what`)."""
    if is_stop(exc):
        raise exc
    if mark is not None:
        mark(why or f"an internal error {what}")
    internal_error(what, exc)


@contextlib.contextmanager
def guarded(what: str, mark: Optional[Callable[[str], None]] = None, why: Optional[str] = None):
    """`contain` for the body of a `with` block (for paths that run once per pass or per module
    call; the per-op path catches inline, a `with` costs a microsecond)."""
    try:
        yield
    except Exception as exc:
        contain(exc, what, mark, why)


def internal_error(what: str, exc: BaseException) -> None:
    """Report a failure inside torchlens without disturbing the user's run."""
    warn_safely(
        f"torchlens: {what} failed ({type(exc).__name__}: {exc}); narration is incomplete for this run",
        stacklevel=4,
    )
