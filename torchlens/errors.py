"""Typed errors and warnings.

Every error torchlens raises for bad input subclasses both `TorchlensError` and the built-in a
caller would naturally catch (`TypeError` for a wrong kind of argument, `ValueError` for a wrong
value, ...), and its message names the argument, what it accepts and, where one exists, the fix.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Iterable

__all__ = [
    "TorchlensError",
    "OptionTypeError",
    "OptionValueError",
    "ModelTypeError",
    "UnknownModuleError",
    "RecorderStateError",
    "TraceBudgetError",
    "NonFiniteError",
    "SpikeError",
    "CompareInputError",
    "TraceFileError",
    "ReproError",
    "NarrationWarning",
]


class TorchlensError(Exception):
    """Base class of every error torchlens raises on its own account."""


class OptionTypeError(TorchlensError, TypeError):
    """An argument has the wrong type, or an option name is unknown."""


class OptionValueError(TorchlensError, ValueError):
    """An argument has the right type but a value torchlens cannot use."""


class ModelTypeError(TorchlensError, TypeError):
    """The object passed as the model is not an `nn.Module`."""


class UnknownModuleError(TorchlensError, LookupError, ValueError):
    """A selector names a module path the model does not have."""


class RecorderStateError(TorchlensError, RuntimeError):
    """A `Recorder` was entered while already active."""


class TraceBudgetError(TorchlensError, MemoryError):
    """`tl.trace` would keep more tensor bytes than its `max_bytes` budget allows."""

    # Raised on purpose inside the user's forward to stop it: the capture lets it through
    # instead of treating it as a failure of its own.
    torchlens_stop = True


class NonFiniteError(TorchlensError, FloatingPointError):
    """`on_nonfinite="raise"` stopped the forward at the first op with a non-finite output."""

    torchlens_stop = True


class SpikeError(TorchlensError, ArithmeticError):
    """`tl.watch(on_spike="raise")` stopped training at a loss spike, before the update; the
    `Spike` is its `.spike`."""


class CompareInputError(TorchlensError, TypeError):
    """`tl.debug.compare` was given something other than two traces with kept values."""


class TraceFileError(TorchlensError, ValueError):
    """`tl.load` was given a file that is not a trace `save` wrote (or a damaged or crafted one)."""


class ReproError(TorchlensError, LookupError):
    """`.repro(directory)` has no op to reproduce, or the op's inputs were not kept."""


class NarrationWarning(UserWarning):
    """Narration was turned off mid-run (a sink failed, or torchlens hit an internal error)."""


def warn_safely(message: str, stacklevel: int = 3) -> None:
    """`warnings.warn(message, NarrationWarning)`, dropped if warnings are turned into errors:
    a warning about torchlens must never become the exception the user sees."""
    try:
        warnings.warn(message, NarrationWarning, stacklevel=stacklevel)
    except Exception:
        pass


def suggest(name: str, choices: Iterable[str], limit: int = 3) -> str:
    """A ' (did you mean ...?)' hint for a misspelt name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=limit, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def describe_choices(choices: Iterable[object]) -> str:
    """Render accepted values as `'a', 'b' or 'c'` for error messages."""
    items = [repr(c) for c in choices]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]
