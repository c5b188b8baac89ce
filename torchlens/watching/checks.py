"""The cheap check a healthy step pays for: one sum per tensor, read once per step.

A sum is non-finite when the tensor holds a NaN or an infinity, and, rarely, when finite values
overflow it: a screen with false alarms and no misses. So a step whose screen is finite is
healthy, and a step whose screen is not is confirmed element by element (`nonfinite_positions`)
before anything is called a fault. Sums are taken in float32 at least (a float16 gradient's sum
overflows long before its elements do) and stay on the tensors' device: the only host read is the
step's, of one number (`Screen.read`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["Screen", "floating_leaves", "local", "nonfinite_counts", "nonfinite_positions", "same_sums",
           "screen_sums"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The values this process holds: a DTensor's local shard, a sparse tensor's stored values."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and callable(to_local) and type(tensor).__name__ == "DTensor":
        tensor = to_local()
    if tensor.layout is torch.sparse_coo:
        tensor = tensor._values()
    return tensor


def floating_leaves(value) -> List[torch.Tensor]:
    """The floating (and complex) tensors in a forward's output: tuples, lists, dicts and
    transformers' `ModelOutput`s (a pytree) opened, anything else a leaf of its own."""
    return [leaf for leaf in tree_leaves(value)
            if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())]


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype is torch.float32 and tensor.layout is torch.strided and type(tensor) in _PLAIN:
        return tensor.sum()  # (the common case, first: this runs for every gradient and weight of every step)
    tensor = local(tensor)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype in _LOW_PRECISION:
        return tensor.sum(dtype=torch.float32)
    return tensor.sum().to(torch.float32) if tensor.dtype != torch.float32 else tensor.sum()


def screen_sums(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """Each tensor's sum, stacked (float32, on their device); None for no tensors. Computed
    under `no_grad`: the check builds no graph, whatever the mode it runs in."""
    if not tensors:
        return None
    with torch.no_grad():
        sums = [_sum(t) for t in tensors]
        devices = {s.device for s in sums}
        if len(devices) > 1:  # tensors on several devices: gathered where the first one is
            sums = [s.to(sums[0].device) for s in sums]
        return torch.stack(sums)


class Screen:
    """The step's screens, summed into one number on the device and read once: sums (non-finite
    when a tensor is) and counts of non-finite elements (exact, for the few small tensors counted)."""

    __slots__ = ("_parts", "_counts")

    def __init__(self):
        self._parts: List[torch.Tensor] = []
        self._counts: List[torch.Tensor] = []

    def add(self, sums: Optional[torch.Tensor]) -> None:
        if sums is not None:
            self._parts.append(sums.sum())

    def add_count(self, count: torch.Tensor) -> None:
        self._counts.append(count)

    def alarm(self) -> Optional[torch.Tensor]:
        """1 (int64, on the device) when a sum is not finite or a count is not 0, else 0; None with
        nothing screened."""
        if not self._parts and not self._counts:
            return None
        device = (self._parts or self._counts)[0].device
        with torch.no_grad():
            alarm = torch.zeros((), dtype=torch.bool, device=device)
            if self._parts:
                alarm = ~torch.isfinite(torch.stack([p.to(device) for p in self._parts]).sum())
            if self._counts:
                alarm = alarm | (torch.stack([c.to(device) for c in self._counts]).sum() > 0)
            return alarm.to(torch.int64)


def nonfinite_counts(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """Each tensor's count of non-finite elements, stacked (int64, on their device): exact where a
    sum could overflow, at the price of a mask per tensor; None for no tensors."""
    if not tensors:
        return None
    with torch.no_grad():
        counts = [(~torch.isfinite(_local_real(t))).sum() for t in tensors]
        return torch.stack([c.to(counts[0].device) for c in counts])


def nonfinite_positions(tensors: Sequence[torch.Tensor]) -> List[int]:
    """The positions of the tensors that hold a non-finite element (exact, one read each: only
    run when the screen raised an alarm)."""
    with torch.no_grad():
        return [i for i, t in enumerate(tensors) if not bool(torch.isfinite(_local_real(t)).all())]


def _local_real(tensor: torch.Tensor) -> torch.Tensor:
    tensor = local(tensor)
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def same_sums(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether two screens are bitwise the same, NaN equal to NaN (how a replay shows it
    recomputed the step's forward exactly)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
