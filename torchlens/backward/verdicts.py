"""Where the first non-finite gradient of a backward was born, from what each node produced and
what the nodes before it sent it."""

from __future__ import annotations

import weakref
from typing import Dict, List, NamedTuple, Optional

import torch

from ..events import GRAD, NODE, StatsGroup
from ..findings import Finding, FindingKind, kind_names
from ..findings import bits as _bits
from ..measure.memory import version
from ..measure.stats import unwrapped
from ..measure.tracking import Verdicts, count_text, held, stats_known, unmeasured_reason
from .graph import NodeRecord

__all__ = ["UNREAD", "GradTracker"]

UNREAD = -1  # what a node received could not be read (it overwrote it in place as it ran)
_NOT_ALL_MEASURED = "not everything it received was measured, so it may have come from earlier"


class _Added(NamedTuple):
    """A leaf's gradient the graph added finite to its `.grad`, as noted then (metadata, no read)."""

    label: str  # the leaf's name
    leaf: weakref.ref  # the leaf
    event: object  # its `AccumulateGrad` node's
    grad: weakref.ref  # the `.grad` the gradient was added to
    version: Optional[int]  # its version then


class GradTracker(Verdicts):
    """Where the first non-finite gradient was born: the first node that produced one although
    nothing it received was non-finite.

    What a node received is what the nodes that ran before it sent it, summed, so the tracker
    follows the graph: a node that produced a non-finite gradient marks the nodes it sent it to,
    and a node that received one only passes it on. What a node received is also measured where
    that is cheap (on the CPU, when it produced a non-finite value; on an accelerator, in the same
    single read as everything else), because not everything it receives comes from a watched node:
    a gradient hook, a loss term computed outside the forward, a sum of finite gradients that
    overflowed. A non-finite gradient that no watched node sent is "first seen", never "born",
    and once a run has a finding such gradients are taken as coming from it.
    """

    HEADLINE = "first non-finite gradient"

    def __init__(self):
        super().__init__()
        self.received: Dict[object, int] = {}  # record key -> non-finite kinds sent to its node
        self.unknown: set = set()  # keys of nodes sent something that was not measured
        self.leaves: List[str] = []  # leaves whose accumulated gradient was non-finite
        self._accumulated: List[_Added] = []
        self._nonfinite_before: set = set()  # ids of the parameters whose `.grad` was so as the backward began

    def _ready(self, event, record, positions, direct) -> bool:
        """(what a node received, read on an accelerator, may be read later than what it produced)"""
        return stats_known(event) and _kinds_of(direct) is not None

    def accumulated(self, event, record: Optional[NodeRecord]) -> None:
        """A leaf's gradient was added to its `.grad`: if it was finite, `written_after` looks again.
        The `.grad` and its version are noted (metadata, no read) to tell, at the end, whether
        anything wrote it since."""
        if record is not None and record.leaf is not None and held(event) == 0:
            leaf = record.leaf
            grad = getattr(leaf(), "grad", None)
            if isinstance(grad, torch.Tensor):
                self._accumulated.append(_Added(record.label, leaf, event, weakref.ref(grad), version(grad)))

    def note_gradients_before(self, parameters) -> None:
        """As the backward begins: which of the model's `parameters` ((name, weak reference))
        already hold a non-finite `.grad` (accumulated from an earlier backward: no `zero_grad`, or
        DDP's `no_sync`). Finding it non-finite after this backward is then no sign of a collective.
        One flag per gradient, read in one transfer per device."""
        candidates = [(id(tensor), None, tensor) for tensor in (ref() for _, ref in parameters)]
        self._nonfinite_before = {key for key, _, _ in _not_all_finite(_gradients(candidates))}

    def written_after(self, parameters=(), distributed: bool = True) -> List[Finding]:
        """After the backward and whatever ran at its end (DDP's gradient all-reduce, FSDP2's
        reduce-scatter into the sharded parameters, a callback a hook queued): the leaves whose
        gradient the graph added finite but whose `.grad` is non-finite now, and, when this
        backward's own gradients were all finite, the model's `parameters` ((name, weak
        reference)) whose `.grad` is non-finite. Something outside the graph wrote them, and under
        a process group that is a collective bringing another rank's values. One finding for all.

        Out of one (`distributed=False`), only the gradients written since they were added (another
        tensor, or a new version) are read: nothing is read when nothing wrote them, and a write
        that bypasses the version counter (through `.grad.data`) goes unseen. Under one, every
        added gradient is read: a collective writes DDP's bucket views without a new version."""
        candidates = [(added.label, added.event, added.leaf()) for added in self._accumulated
                      if distributed or _rewritten(added.leaf(), added.grad, added.version)]
        self._accumulated = []
        if not self.findings:
            seen = {id(leaf) for _, _, leaf in candidates}
            candidates += [(name, None, ref()) for name, ref in parameters if id(ref()) not in seen]
        before = self._nonfinite_before  # (non-finite already: this backward added to it, nobody else wrote it)
        candidates = [candidate for candidate in candidates if id(candidate[2]) not in before]
        changed, kinds = [], 0  # (name, the node that added it finite) of each gradient now non-finite; their kinds
        for name, event, grad in _not_all_finite(_gradients(candidates)):
            kinds |= _bits(*(bool(test(grad).any()) for test in (torch.isnan, torch.isposinf, torch.isneginf)))
            changed.append((name, event))
        if not changed:
            return []
        names = ", ".join(name for name, _ in changed[:3]) + (", ..." if len(changed) > 3 else "")
        what = (f"the gradient of {changed[0][0]}" if len(changed) == 1
                else f"the gradients of {len(changed)} parameters ({names})")
        first = next((event for _, event in changed if event is not None), None)
        how = (f"~{first.ordinal} added it finite" if first is not None and changed[0][1] is not None
               else "this backward's own gradients were finite")
        who = ("under a process group, a collective such as DDP's all-reduce or FSDP2's reduce-scatter brought "
               "another rank's value: tl.debug.across_ranks says whose" if distributed else
               "a callback a hook queued to run at the backward's end")
        return self._note(Finding(
            f"{kind_names(kinds)} in {what} after the backward: {how}, then something outside the graph wrote it "
            f"({who})", first, FindingKind.CARRIED_IN))

    def _judge_one(self, event, record, positions, direct) -> List[Finding]:
        """A node, or a gradient reaching an output, as `judge` was given it: `record` is the node's
        (the gradient's: the node it feeds); `positions`: its gradient slots the measured tensors
        came from; `direct`: the statistics of what it received (perhaps still to be read), None
        when not measured, or `UNREAD`."""
        leaf = record is not None and event.kind is NODE and record.label is not None
        kinds = None if leaf and not event.outputs else held(event)
        if kinds is None:
            self.unmeasured["leaves that received no gradient" if leaf and not event.outputs
                            else unmeasured_reason(event)] += 1
            if record is not None and not leaf and event.kind is NODE:
                self.unknown.update(target.key for target in record.edges if target is not None)
            return []
        self.measured += 1
        if event.kind is GRAD:
            return self._arrived(event, record, kinds)
        if not kinds:
            return []
        received = self.received.get(record.key, 0)
        if leaf:
            self.leaves.append(record.label)
            if received:
                return []
            why = _NOT_ALL_MEASURED if record.key in self.unknown else (
                "a loss term computed outside the narrated forward, or a sum of finite gradients that overflowed")
            return self._unexplained(event, kinds, f"in the gradient of {record.label} at ~{event.ordinal} "
                                                   f"AccumulateGrad", why)
        self._send(record, event, positions)
        if received:
            return []  # it received a non-finite gradient: it passes it on
        where = f"at ~{event.ordinal} {event.op}, the backward of {record.forward}"
        if direct == UNREAD:
            return self._unexplained(event, kinds, where, "it may have received it: it overwrote what it received in "
                                                          "place before that could be measured")
        if _kinds_of(direct):
            return self._unexplained(event, kinds, where.replace("at ~", "entering ~", 1),
                                     "a gradient hook, a node outside the narrated forward, or a sum of finite "
                                     "gradients that overflowed")
        if record.key in self.unknown:
            return self._unexplained(event, kinds, where, _NOT_ALL_MEASURED)
        cause = record.forward_cause()
        if cause is not None:
            return self._from_forward(event, kinds, where, cause)
        return self._note(Finding(f"{kind_names(kinds)} gradient born {where} ({count_text(event, kinds)})", event,
                                  FindingKind.GRADIENT_BORN))

    def _from_forward(self, event, kinds: int, where: str, cause) -> List[Finding]:
        """A node made a non-finite gradient from finite ones while its forward op read or produced
        a non-finite value (`cause`, a `tracking.ForwardCause`), which it computes with: that value's
        consequence, no birth; a finding when it is the run's first (the forward's own findings name
        the value). Not knowing whether the forward's values were finite, it is first seen here."""
        if cause.kind is None:
            return self._unexplained(event, kinds, where, f"it may have computed it from the forward's values: "
                                                          f"{cause.text}")
        if self.findings:
            return []
        return self._note(Finding(f"{kind_names(kinds)} gradient {where} ({count_text(event, kinds)}), out of the "
                                  f"forward's {cause.kind}: {cause.text}", event, FindingKind.GRADIENT_FROM_FORWARD))

    def _unexplained(self, event, kinds: int, where: str, why: str) -> List[Finding]:
        """A non-finite gradient no watched node sent: a finding only when it is the run's first."""
        if self.findings:
            return []
        return self._note(Finding(f"{kind_names(kinds)} gradient first seen {where} ({count_text(event, kinds)}); "
                                  f"no watched node sent it: {why}", event, FindingKind.GRADIENT_FIRST_SEEN))

    def _arrived(self, event, node: Optional[NodeRecord], kinds) -> List[Finding]:
        """The gradient of a forward output (`node`: the record of the node it feeds, or of the
        leaf the output is): non-finite from outside unless the forward's own nodes sent it."""
        if not kinds:
            return []
        inside = self.received.get(node.key, 0) if node is not None else 0
        if node is not None:
            self.received[node.key] = inside | kinds
        if inside or self.findings:  # sent by its own nodes, or by what a finding already names
            return []
        held = node.forward_held() if node is not None else None
        if held is not None:  # what was computed from it outside (the loss) read the forward's value
            return self._note(Finding(f"{kind_names(kinds)} in the gradient reaching the output {event.label} "
                                      f"({count_text(event, kinds)}), out of the forward's {held.kind}: the output "
                                      f"held {held.held}", event, FindingKind.GRADIENT_FROM_FORWARD))
        return self._note(Finding(f"{kind_names(kinds)} in the gradient reaching the output {event.label} "
                                  f"({count_text(event, kinds)}): no node of the narrated forward sent it; it came "
                                  f"from outside, such as the loss", event, FindingKind.GRADIENT_FROM_OUTSIDE))

    def _send(self, record: NodeRecord, event, positions) -> None:
        """Mark the nodes this one sent a non-finite gradient to (by gradient slot)."""
        parts = event.stats.parts if isinstance(event.stats, StatsGroup) else (event.stats,)
        edges = record.edges
        for part, position in zip(parts, positions):
            sent = _bits(part.nan, part.posinf, part.neginf) if part.nan is not None else 0
            target = edges[position] if sent and position < len(edges) else None
            if target is not None:
                self.received[target.key] = self.received.get(target.key, 0) | sent

    def _claim(self) -> str:
        return "no non-finite gradients"

    def _after(self) -> str:
        """The leaves non-finite gradients reached."""
        if not self.leaves:
            return ""
        shown = ", ".join(self.leaves[:3]) + (f" and {len(self.leaves) - 3} more" if len(self.leaves) > 3 else "")
        count = len(self.leaves)
        return f"; non-finite gradients reached {count} lea{'f' if count == 1 else 'ves'} ({shown})"


def _kinds_of(direct) -> Optional[int]:
    """Kinds a node received, read from the statistics of what it received (None while they are
    still on the device; 0 when nothing was measured)."""
    if direct is None or isinstance(direct, int):  # nothing measured, or UNREAD
        return 0
    parts = direct.parts if isinstance(direct, StatsGroup) else (direct,)
    kinds = 0
    for part in parts:
        if part.kind == "na":
            continue
        if part.nan is None:
            return None
        kinds |= _bits(part.nan, part.posinf, part.neginf)
    return kinds


def _not_all_finite(items):
    """The (record, event, gradient) items whose gradient holds a non-finite value: one flag per
    gradient, read in one transfer per device (an accelerator's every read is a sync)."""
    by_device: Dict[object, list] = {}
    for item in items:
        by_device.setdefault(item[2].device, []).append(item)
    for group in by_device.values():
        flags = torch.stack([torch.isfinite(grad).all() for _, _, grad in group]).tolist()
        yield from (item for item, finite in zip(group, flags) if not finite)


def _rewritten(leaf, grad_ref, seen: Optional[int]) -> bool:
    """Whether `leaf.grad` is no longer the tensor noted (`grad_ref`) at version `seen`."""
    grad = getattr(leaf, "grad", None)
    return grad is not None and (grad is not grad_ref() or version(grad) != seen)


def _gradients(candidates):
    """(name, event, gradient) of the candidates (name, event, tensor) holding a floating gradient;
    a DTensor's local shard (its global value would take a collective)."""
    for name, event, tensor in candidates:
        grad = getattr(tensor, "grad", None) if tensor is not None else None
        if isinstance(grad, torch.Tensor):
            grad = unwrapped(grad)
            if grad.is_floating_point() and grad.layout is torch.strided:
                yield name, event, grad.detach()
