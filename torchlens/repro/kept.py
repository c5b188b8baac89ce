"""The calls a one-op repro needs: kept only when something goes wrong.

A failed call keeps a reference to its function and arguments, as the exception leaves it (no
copy: nothing of the forward runs after the failure). A non-finite value keeps a copy of what the
op that produced it read, taken as that op returns: later ops may write into those tensors in
place, and an optimizer step will change the weights. Only the first op to produce each kind of
non-finite value (NaN, +inf, -inf) keeps its inputs, at most `MAX_BYTES` of them: that first op
is where tracking looks for the birth, and three copies bound what a forward can hold.
"""

from __future__ import annotations

import functools
import pickle
from typing import Dict, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

MAX_BYTES = 256 * 1024 * 1024  # the inputs one non-finite op may keep (copies, on their device)

_NAN, _POSINF, _NEGINF = 1, 2, 4


class KeptCall:
    """A torch call and its arguments, as the repro replays it.

    `notes` say where the kept inputs may differ from what the op read (it wrote into one of them;
    they were over the size bound and only described)."""

    __slots__ = ("func", "args", "kwargs", "notes", "copied", "error")

    def __init__(self, func, args, kwargs, notes=(), copied: bool = False, error: Optional[str] = None):
        self.func = func
        self.args = args
        self.kwargs = dict(kwargs or {})
        self.notes = tuple(notes)
        self.copied = copied  # the tensors are copies taken as the op returned (not the live ones)
        self.error = error  # what the call raised (`RuntimeError: ...`), for a failed call

    def __reduce__(self):
        """Copied or pickled with the recording that holds it: tensors detached (a tensor inside an
        autograd graph refuses to be copied), a function pickle cannot name dropped (its repro then
        says the call was lost)."""
        try:
            pickle.dumps(self.func)
            func = self.func
        except Exception:
            func = None
        detach = functools.partial(tree_map, _detached)
        return (KeptCall, (func, detach(self.args), detach(self.kwargs), self.notes, self.copied, self.error))

    def tensors(self):
        return [leaf for leaf in tree_flatten((self.args, self.kwargs))[0] if isinstance(leaf, torch.Tensor)]

    def __repr__(self) -> str:
        return f"KeptCall({getattr(self.func, '__name__', self.func)!r}, {len(self.tensors())} tensors)"


def _kinds_of(stats) -> int:
    parts = getattr(stats, "parts", (stats,))
    kinds = 0
    for part in parts:
        kinds |= (_NAN if part.nan else 0) | (_POSINF if part.posinf else 0) | (_NEGINF if part.neginf else 0)
    return kinds


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


class InputKeeper:
    """One forward's kept inputs of non-finite ops, by ordinal."""

    __slots__ = ("calls", "_kinds")

    def __init__(self):
        self.calls: Dict[int, KeptCall] = {}
        self._kinds = 0

    def consider(self, event, func, out, args, kwargs) -> None:
        """After an op whose statistics were read: keep its inputs if its output holds a kind of
        non-finite value no earlier op produced. Called only when the statistics say non-finite."""
        kinds = _kinds_of(event.stats) & ~self._kinds
        if not kinds or func is None:
            return
        self._kinds |= kinds
        self.calls[event.ordinal] = kept_copy(func, out, args, kwargs)


def kept_copy(func, out, args, kwargs) -> KeptCall:
    leaves = [leaf for leaf in tree_flatten((args, kwargs or {}))[0] if isinstance(leaf, torch.Tensor)]
    notes = []
    outputs = {id(t) for t in ((out,) if isinstance(out, torch.Tensor) else out) if isinstance(t, torch.Tensor)}
    if any(id(leaf) in outputs for leaf in leaves):
        notes.append("the op wrote its result into one of its inputs: the kept input holds what it wrote, not "
                     "what it read, so replaying it shows the non-finite values already in its input")
    size = sum(leaf.numel() * leaf.element_size() for leaf in leaves if leaf.layout is torch.strided)
    if size > MAX_BYTES:
        return KeptCall(func, (), {}, notes + [f"its inputs ({size} bytes) are over the {MAX_BYTES}-byte bound a "
                                               f"repro keeps: none were kept"], copied=True)
    try:
        return KeptCall(func, tree_map(_snapshot, tuple(args)), tree_map(_snapshot, dict(kwargs or {})), notes,
                        copied=True)
    except Exception as exc:  # a tensor subclass that will not clone: say so rather than fail the forward
        return KeptCall(func, (), {}, notes + [f"its inputs could not be copied ({type(exc).__name__}: {exc})"],
                        copied=True)


def inputs_kept(call: Optional[KeptCall]) -> bool:
    return call is not None and call.func is not None and bool(call.args or call.kwargs or not call.notes)
