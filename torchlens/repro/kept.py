"""The calls a one-op repro needs: kept only when something goes wrong.

A failed call is remembered by reference while the forward unwinds (an op that raises may be
caught by the model, which goes on: that costs nothing), and copied only when the forward really
fails, so a partial trace holds neither the forward's activations nor its autograd graph, and
later passes or optimizer steps cannot change what it replays.

A non-finite value keeps a copy of what the op that *introduced* it read, taken as that op
returns (later ops may write into those tensors in place; an optimizer step changes weights).
An op introduces a kind of non-finite value (NaN, +inf, -inf) when its output holds it and none
of its inputs did: not carried in by a scalar argument (a mask's `masked_fill(m, -inf)`), not
read from an earlier op's output that held it, nor an infinity read from a tensor no op produced
(a mask buffer; a NaN in a weight is kept at the op that first reads it, where tracking reports
it). So a healthy causal mask keeps nothing, and the first op of each kind that computed one is
kept — where tracking looks for the birth. Each copy is bounded by `MAX_BYTES`; at most one op per
kind is kept per forward.
"""

from __future__ import annotations

import functools
import pickle
from typing import Dict, Optional, TypeGuard

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..findings import NEGINF, POSINF
from ..measure.provenance import Source
from ..measure.tracking import held

__all__ = ["MAX_BYTES", "InputKeeper", "KeptCall", "NamedFunction", "inputs_kept"]

MAX_BYTES = 256 * 1024 * 1024  # the inputs one op may keep (copies, on their device)


class NamedFunction:
    """The function of a call loaded from a saved trace: the dotted name a script imports it by
    (`torch.nn.functional.linear`), checked against torch when the trace was saved. torchlens
    writes the name into a repro script and never imports or calls it itself."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return NamedFunction, (self.name,)

    def __repr__(self) -> str:
        return f"NamedFunction({self.name!r})"


class KeptCall:
    """A torch call and its arguments, as the repro replays it.

    `context` is the grad mode and autocast state it ran under (replayed around the call); `notes`
    say where the kept inputs may differ from what the op read, or why none were kept. `places`
    (a call loaded from a saved trace, whose tensors are on the CPU) gives each tensor's device and
    strides as the op saw them, in `tensors()` order; None: the tensors' own."""

    __slots__ = ("func", "args", "kwargs", "notes", "copied", "error", "context", "origins", "places")

    def __init__(self, func, args, kwargs, notes=(), copied: bool = False, error: Optional[str] = None,
                 context: Optional[dict] = None, origins=None, places=None):
        self.func = func
        self.args = args
        self.kwargs = dict(kwargs or {})
        self.notes = tuple(notes)
        self.copied = copied  # the tensors are copies (not the forward's own)
        self.error = error  # what the call raised (`RuntimeError: ...`), for a failed call
        self.context = context if context is not None else call_context(args, kwargs)
        # (requires_grad, is_leaf) of each tensor argument as the op saw it, in `tensors()` order:
        # a copy is a detached leaf, and an activation is replayed as one made inside a graph
        self.origins = tuple(origins) if origins is not None else tuple(
            (t.requires_grad, t.is_leaf) for t in self.tensors())
        self.places = None if places is None else tuple(places)  # (device, strides or None) per tensor

    def copy(self) -> "KeptCall":
        """The same call with its tensors copied (once: a copy is returned as it is)."""
        if self.copied:
            return self
        return kept_copy(self.func, (), self.args, self.kwargs, self.notes, self.error, self.context)

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
        return (KeptCall, (func, detach(self.args), detach(self.kwargs), self.notes, self.copied, self.error,
                           self.context, self.origins, self.places))

    def tensors(self):
        return [leaf for leaf in tree_flatten((self.args, self.kwargs))[0] if isinstance(leaf, torch.Tensor)]

    def __repr__(self) -> str:
        return f"KeptCall({getattr(self.func, '__name__', self.func)!r}, {len(self.tensors())} tensors)"


def call_context(args, kwargs) -> dict:
    """Grad mode and, for the device of the first tensor argument, the autocast state."""
    leaves = tree_flatten((args, kwargs or {}))[0]
    device = next((leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)), "cpu")
    context: Dict[str, object] = {"grad": torch.is_grad_enabled(), "autocast": None}
    try:
        if torch.is_autocast_enabled(device):
            context["autocast"] = (device, str(torch.get_autocast_dtype(device)).replace("torch.", ""))
    except (RuntimeError, TypeError):  # a device type autocast does not know
        pass
    return context


def _read_kinds(ref) -> int:
    """The kinds an input explains: those an earlier op's measured output held, and the infinities
    of a tensor no op produced (a mask buffer). A NaN in a weight is not explained away: the op
    that first reads it is where tracking reports it, and its repro shows the weight's NaN."""
    if isinstance(ref, Source):
        return (ref.kinds() or 0) & (POSINF | NEGINF)  # measured once per tensor, and only on a non-finite op
    return held(ref) or 0


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


class InputKeeper:
    """One forward's kept inputs of the ops that introduced a non-finite value, by ordinal."""

    __slots__ = ("calls", "_kinds")

    def __init__(self):
        self.calls: Dict[int, KeptCall] = {}
        self._kinds = 0  # kinds an op already kept its inputs for

    def consider(self, event, func, out, args, kwargs) -> None:
        """After an op whose statistics were read and hold a non-finite value: keep its inputs if it
        introduced a kind of value no earlier op kept inputs for."""
        kinds = (held(event) or 0) & ~self._kinds
        if not kinds or func is None:
            return
        if event.reads is not None:
            refs, carried = event.reads
            kinds &= ~carried
            for ref in refs:
                if not kinds:
                    return
                kinds &= ~_read_kinds(ref)
        if not kinds:
            return
        call = kept_copy(func, out, args, kwargs)
        self.calls[event.ordinal] = call
        if call.args or call.kwargs:
            self._kinds |= kinds  # (over the bound: a later op introducing the same kind may still keep)


def kept_copy(func, out, args, kwargs, notes=(), error=None, context=None) -> KeptCall:
    """`func`'s arguments copied (detached, on their device), or a call that says why they were not."""
    leaves = [leaf for leaf in tree_flatten((args, kwargs or {}))[0] if isinstance(leaf, torch.Tensor)]
    notes = list(notes)
    context = context if context is not None else call_context(args, kwargs)
    outputs = {id(t) for t in ((out,) if isinstance(out, torch.Tensor) else out) if isinstance(t, torch.Tensor)}
    if any(id(leaf) in outputs for leaf in leaves):
        notes.append("the op wrote its result into one of its inputs: the kept input holds what it wrote, not "
                     "what it read, so replaying it shows the non-finite values already in its input")
    size = sum(leaf.numel() * leaf.element_size() for leaf in leaves if leaf.layout is torch.strided)
    if size > MAX_BYTES:
        notes.append(f"its inputs ({size} bytes) are over the {MAX_BYTES}-byte bound a repro keeps: none were kept")
        return KeptCall(func, (), {}, notes, True, error, context, ())
    origins = [(leaf.requires_grad, leaf.is_leaf) for leaf in leaves]
    try:
        args, kwargs = tree_map(_snapshot, tuple(args)), tree_map(_snapshot, dict(kwargs or {}))
    except Exception as exc:  # a tensor subclass that will not clone: say so rather than fail the forward
        notes.append(f"its inputs could not be copied ({type(exc).__name__}: {exc})")
        return KeptCall(func, (), {}, notes, True, error, context, ())
    return KeptCall(func, args, kwargs, notes, True, error, context, origins)


def inputs_kept(call: Optional[KeptCall]) -> TypeGuard[KeptCall]:
    return call is not None and call.func is not None and bool(call.args or call.kwargs or not call.notes)
