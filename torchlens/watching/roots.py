"""The tensors each backward starts from: the loss, even one the loop computes outside the model.

The model's hooks see its outputs and the gradients into them, not the loss the loop computes
from them. A loss can be NaN while every output and gradient is finite: `F.cross_entropy` over a
batch whose labels are all `ignore_index` is 0/0, and its backward sends exactly zero into the
logits. So while a watch is open `torch.autograd.backward` (which `Tensor.backward` calls) is
wrapped: after a backward on the watch's thread returns, the watch is told the tensors it started
from, and keeps a `Root` for each backward that reached its model. One wrapper serves every watch;
it is put back when the last one closes (`listen` returns the handle). Given a `GradScaler`, the
loss is seen where the scaler scales it instead (`ScalerHooks`).

Where such a loss went non-finite is on its autograd graph: the nodes between it and the model's
outputs are the loss's own ops. They are told from the model's by autograd's sequence numbers
(each watched forward notes the range its nodes got): `loss_ops`.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from ..errors import warn_safely
from ..torch_internals.seams import degraded
from .checks import Screen, nonfinite_counts

__all__ = ["LossOps", "Root", "ScalerHooks", "listen", "loss_ops", "next_node_number"]

OPS_SHOWN = 6  # the loss's ops a finding lists (the rest counted)
OPS_WALKED = 64  # the nodes a walk of the loss's graph visits at most
_LEAF = 2 ** 63  # sequence numbers from here up are AccumulateGrad's (a leaf: a parameter, an input)


def next_node_number() -> Optional[int]:
    """The sequence number autograd gives the next node made on this thread (None where torch no
    longer says: the loss's ops then go unnamed)."""
    try:
        return torch._C._autograd._get_sequence_nr()
    except Exception as exc:
        degraded("autograd sequence numbers", exc)
        return None


class LossOps(NamedTuple):
    """The loss's ops outside the model, from its autograd graph (`loss_ops`)."""

    names: Tuple[str, ...]  # in the order they were made, at most OPS_SHOWN, then "..." if the walk stopped
    more: int  # how many more it found
    read: Tuple[int, ...]  # the forwards whose outputs they read
    unscreened: Tuple[int, ...]  # the forwards they read a tensor of that is not an output (not screened)


def loss_ops(tensors: Sequence[torch.Tensor], forwards) -> LossOps:
    """Walk the graph from `tensors` to the watched `forwards`: a node a forward made (its sequence
    number in the forward's range) ends the walk there, and so does a leaf; the others are the
    loss's own ops."""
    ranges = [(f.nodes[0], f.nodes[1], f) for f in forwards if f.nodes is not None]
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: Set[int] = set()
    ops: List[Tuple[int, str]] = []
    read: Set[int] = set()
    unscreened: Set[int] = set()
    try:
        while stack and len(seen) < OPS_WALKED:
            node = stack.pop()
            number = node._sequence_nr()
            if number >= _LEAF or number in seen:
                continue
            seen.add(number)
            forward = next((f for first, last, f in ranges if first <= number < last), None)
            if forward is not None:
                (read if number in forward.output_nodes else unscreened).add(forward.number)
                continue
            ops.append((number, node.name()))
            stack.extend(following for following, _ in node.next_functions if following is not None)
    except Exception as exc:  # (a node type that does not answer: the walk stops, what it found stands)
        degraded("autograd sequence numbers", exc)
    ops.sort()
    names = tuple(name for _, name in ops)
    return LossOps(names[:OPS_SHOWN] + (("...",) if stack else ()), max(len(names) - OPS_SHOWN, 0),
                   tuple(sorted(read)), tuple(sorted(unscreened)))


class Root:
    """What the watch keeps of the tensors one backward started from (or of the loss a GradScaler
    scaled), for the step's screen: the loss's value when it is one number (detached: no graph),
    else a count of their non-finite elements (on their device); where the call was made, and the
    ops of the loss outside the model (`loss_ops`). Nothing is read until the step's screen is."""

    __slots__ = ("value", "count", "via", "site", "ops", "after")

    def __init__(self, tensors: Sequence[torch.Tensor], forwards, via: str, site: Optional[str]):
        one = len(tensors) == 1 and tensors[0].numel() == 1 and not tensors[0].is_complex()
        # a loss of one number is its own screen (exact; copied when it views a larger tensor, which
        # it would keep alive); anything else, its non-finite elements counted
        self.value = (tensors[0].detach() if tensors[0]._base is None else tensors[0].detach().clone()) if one else None
        counts = None if one else nonfinite_counts(tensors)  # (not None: there are tensors)
        self.count = counts.sum() if counts is not None else None
        self.via = via  # "backward()" or "scaler.scale"
        self.site = site
        self.ops = loss_ops(tensors, forwards)
        self.after = len(forwards)  # the forwards run before it: its micro-batch

    def screen(self, screen: Screen) -> None:
        """Add this to the step's screen."""
        if self.value is not None:
            screen.add_loss(self.value)
        else:
            assert self.count is not None  # (kept whenever the value is not)
            screen.add_count(self.count)

    @property
    def bad(self) -> int:
        """How many of the tensors' elements are not finite (a host read: an alarm's question)."""
        if self.value is not None:
            return int(not bool(torch.isfinite(self.value)))
        assert self.count is not None  # (kept whenever the value is not)
        return int(self.count)

    def what(self) -> str:
        """The loss, as the fault's check saw it."""
        if self.via == "scaler.scale":
            return "a non-finite loss (given to scaler.scale)"
        return "a non-finite loss (the tensor backward() started from)"

    def finding(self) -> str:
        """Where the loss went non-finite: outside the model, after its finite outputs (the fault is
        only blamed on the loss when they were finite, and a replay found nothing in the model), in
        the loss's ops, in what it read of the model that is not an output (not screened), or in an
        input without a gradient (labels, class weights: not on the graph, so not told apart)."""
        ops = self.ops
        read = f" ({_forwards(ops.read)})" if ops.read else ""
        places = []
        if ops.names:
            listed = " -> ".join(ops.names) + (f" and {ops.more} more" if ops.more else "")
            places.append(f"in its ops outside the model ({listed}, as autograd names them)")
        if ops.unscreened:
            places.append(f"in a tensor of {_forwards(ops.unscreened)} that is not an output (not screened)")
        places.append("in an input of theirs without a gradient (labels, say: not on the graph)")
        where = ", ".join(places[:-1]) + f" or {places[-1]}" if len(places) > 1 else places[0]
        site = f"; {self.via} called at {self.site}" if self.site else ""
        return f"{self._kind()} from the model's finite outputs{read}: it went non-finite {where}{site}"

    def _kind(self) -> str:
        if self.value is not None:
            value = float(self.value)
            return "NaN loss" if value != value else f"{'-' if value < 0 else ''}inf loss"
        return f"a loss with {int(self.bad)} non-finite elements"


def _forwards(numbers: Sequence[int]) -> str:
    return f"forward{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"


# -- the wrapper: one for every open watch, on the threads that listen --------------------------

_lock = threading.Lock()
_listeners: Dict[int, List[Tuple[Callable, Callable]]] = {}  # thread id -> [(before, after)]
_wrapper: Optional[Callable] = None  # ours, while it is installed (or left idle under another's)


def listen(before: Callable[[], object], after: Callable[[object, tuple, object], None]) -> "_Listening":
    """Tell this thread's backwards to `after(before(), tensors, caller_frame)` once they return
    (not when they raise). Returns the handle whose `remove()` stops it; the last one removed puts
    `torch.autograd.backward` back."""
    global _wrapper
    entry = (before, after)
    thread = threading.get_ident()
    with _lock:
        if _wrapper is None:
            _wrapper = _wrap(torch.autograd.backward)
            torch.autograd.backward = _wrapper
        _listeners.setdefault(thread, []).append(entry)
    return _Listening(thread, entry)


class _Listening:
    """The handle `listen` returns (removed like a hook's)."""

    def __init__(self, thread: int, entry):
        self.thread, self.entry = thread, entry

    def remove(self) -> None:
        global _wrapper
        with _lock:
            entries = _listeners.get(self.thread, [])
            if self.entry not in entries:
                return
            entries.remove(self.entry)
            if not entries:
                del _listeners[self.thread]
            if not _listeners and torch.autograd.backward is _wrapper:
                # (functools.wraps set __wrapped__, an attribute a function's type does not declare)
                torch.autograd.backward, _wrapper = _wrapper.__wrapped__, None  # type: ignore[attr-defined]
            # (another library that wrapped it after us keeps ours under its own, idle: no listener)


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def backward(tensors, *args, **kwargs):
        """`torch.autograd.backward`, telling this thread's listeners the tensors it started from."""
        entries = tuple(_listeners.get(threading.get_ident(), ()))
        if not entries or torch.compiler.is_compiling():
            return original(tensors, *args, **kwargs)
        marks = [_quietly(before) for before, _ in entries]
        result = original(tensors, *args, **kwargs)
        roots = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        roots = tuple(t for t in roots if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))
        if roots:
            frame = sys._getframe(1)
            for (_, after), mark in zip(entries, marks):
                _quietly(after, mark, roots, frame)
        return result

    return backward


def _quietly(function, *args):
    """A listener's call; what it raises is said, never given to the user's backward."""
    try:
        return function(*args)
    except Exception as exc:
        warn_safely(f"torchlens watch: an internal error watching a backward ({type(exc).__name__}: {exc})")
        return None


class ScalerHooks:
    """`scaler.scale` and `scaler.update` wrapped on the instance: `scaled(loss)` sees each loss
    the scaler scales (the loss itself, even one computed outside the model), `updated()` runs
    once `update` returns. `remove()` puts the originals back (a handle, like the hooks')."""

    def __init__(self, scaler, scaled, updated):
        self.scaler = scaler
        self.wrappers = {"scale": self._wrap(scaler.scale, before=scaled),
                         "update": self._wrap(scaler.update, after=updated)}
        for name, wrapper in self.wrappers.items():
            setattr(scaler, name, wrapper)

    @staticmethod
    def _wrap(original, before=None, after=None):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if before is not None and args:
                before(args[0])
            result = original(*args, **kwargs)
            if after is not None:
                after()
            return result

        return wrapper

    def remove(self) -> None:
        for name, wrapper in self.wrappers.items():
            if self.scaler.__dict__.get(name) is wrapper:
                delattr(self.scaler, name)
