"""The cheap check a healthy step pays for: one sum of squares per tensor, read once per step.

A sum of squares is non-finite when the tensor holds a NaN or an infinity, and, rarely, when finite
values overflow it: a screen with false alarms and no misses. So a step whose screen is finite is
healthy, and a step whose screen is not is confirmed element by element (`nonfinite_positions`)
before anything is called a fault. It costs what a plain sum costs (one read of the tensor, a dot
product with itself), and it is also the tensor's norm squared: the gradients' norm, the outputs'
and the weights' magnitudes, which the spike check judges (`spikes`), come with the screen. Sums
are taken in float32 at least (a float16 gradient's sum overflows long before its elements do)
and stay on the tensors' device: the only host read is the step's (`Screen.read`).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["Screen", "ScreenRead", "floating_leaves", "local", "nonfinite_counts", "nonfinite_positions",
           "same_screens", "sample", "screen_squares", "shares"]

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


def shares(tensors: Sequence[torch.Tensor], world: int) -> Optional[List[float]]:
    """What each tensor's sum of squares counts for in the norm of the whole, summed over `world`
    ranks: 1 / the ranks that hold the same values. A plain tensor is replicated on every rank
    (DDP's gradients after their all-reduce); a DTensor is split in as many shards as its mesh's
    sharded dimensions make (FSDP2's, tensor parallel's). None in a single process (all 1)."""
    if world <= 1:
        return None
    counts = []
    for tensor in tensors:
        placements = getattr(tensor, "placements", None) if type(tensor).__name__ == "DTensor" else None
        if placements is None:
            counts.append(world)
            continue
        mesh, shards = tensor.device_mesh, 1  # type: ignore[attr-defined]  # (a DTensor)
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                shards *= mesh.size(dim)
        counts.append(max(world // shards, 1))
    return [1.0 / count for count in counts]


def sample(tensor: torch.Tensor, count: int = 64) -> torch.Tensor:
    """Up to `count` of `tensor`'s values, at fixed places spread over every dimension (a strided
    view, copied: a few dozen numbers, float32, on its device, no host read): what tells two
    outputs of the same magnitude apart (a sign flipped, a direction changed)."""
    with torch.no_grad():
        tensor = local(tensor.detach())
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        if tensor.dim() == 0:
            return tensor.reshape(1).float()
        per_dim = max(2, round(count ** (1 / tensor.dim())))
        view = tensor[tuple(slice(0, None, max(1, -(-size // per_dim))) for size in tensor.shape)]
        return view.reshape(-1)[:count].float().clone()


def floating_leaves(value) -> List[torch.Tensor]:
    """The floating (and complex) tensors in a forward's output: tuples, lists, dicts and
    transformers' `ModelOutput`s (a pytree) opened, anything else a leaf of its own."""
    return [leaf for leaf in tree_leaves(value)
            if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())]


def _squares(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of `tensor`'s elements (of their moduli, complex), in float32."""
    if (tensor.dtype is torch.float32 and tensor.layout is torch.strided and type(tensor) in _PLAIN
            and tensor.is_contiguous()):
        flat = tensor.reshape(-1)  # (the common case, first: this runs for every gradient and weight of every step)
        return torch.dot(flat, flat)
    tensor = local(tensor)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype in _LOW_PRECISION:
        return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()
    return torch.linalg.vector_norm(tensor).to(torch.float32).square()


def screen_squares(tensors: Sequence[torch.Tensor], scales: Optional[Sequence[float]] = None) -> Optional[torch.Tensor]:
    """Each tensor's sum of squares, stacked (float32, on their device), each times its `scales`
    entry when given (a Python number: no copy to the device); None for no tensors. Computed
    under `no_grad`: the check builds no graph, whatever the mode it runs in."""
    if not tensors:
        return None
    with torch.no_grad():
        sums = [_squares(t) for t in tensors]
        if scales is not None:
            sums = [s if scale == 1.0 else s * scale for s, scale in zip(sums, scales)]
        devices = {s.device for s in sums}
        if len(devices) > 1:  # tensors on several devices: gathered where the first one is
            sums = [s.to(sums[0].device) for s in sums]
        return torch.stack(sums)


class ScreenRead(NamedTuple):
    """What the step's one read says: whether anything screened is not finite (`alarm`), and the
    two numbers the spike check judges: the step's loss (the one-number losses its backwards
    started from, summed; under a process group, their mean over the ranks) and its gradients'
    norm (all ranks' shards together). None where the step had none; an overflowed norm is inf."""

    alarm: bool
    loss: Optional[float]
    grad_norm: Optional[float]


class Screen:
    """The step's screens, put together on the device and read once: sums of squares (non-finite
    when a tensor is), counts of non-finite elements (exact, for the few small tensors counted),
    the losses and the gradients' squares (see `ScreenRead`)."""

    __slots__ = ("_parts", "_counts", "_losses", "_grads")

    def __init__(self):
        self._parts: List[torch.Tensor] = []
        self._counts: List[torch.Tensor] = []
        self._losses: List[torch.Tensor] = []
        self._grads: List[torch.Tensor] = []

    def add(self, squares: Optional[torch.Tensor]) -> None:
        if squares is not None:
            self._parts.append(squares.sum())

    def add_count(self, count: torch.Tensor) -> None:
        self._counts.append(count)

    def add_loss(self, loss: torch.Tensor) -> None:
        """A one-number loss a backward started from (screened, and summed into the step's loss)."""
        loss = loss.detach().reshape(()).to(torch.float32)
        self._parts.append(loss)
        self._losses.append(loss)

    def add_grads(self, squares: Optional[torch.Tensor]) -> None:
        """The gradients' sums of squares, each scaled by its share of the whole (`shares`)."""
        if squares is None:
            return
        total = squares.sum()
        self._parts.append(total)
        self._grads.append(total)

    def read(self, total) -> Optional[ScreenRead]:
        """The one read (`total`: `agreement.total`, summing over the ranks); None with nothing
        screened here."""
        if not self._parts and not self._counts:  # (the ranks still read together: one may have screens)
            total(torch.zeros(5, dtype=torch.float64))
            return None
        device = (self._parts or self._counts)[0].device
        with torch.no_grad():
            alarm = torch.zeros((), dtype=torch.bool, device=device)
            if self._parts:
                alarm = ~torch.isfinite(torch.stack([p.to(device) for p in self._parts]).sum())
            if self._counts:
                alarm = alarm | (torch.stack([c.to(device) for c in self._counts]).sum() > 0)
            zero = torch.zeros((), dtype=torch.float64, device=device)
            loss = torch.stack([v.to(device) for v in self._losses]).double().sum() if self._losses else zero
            grads = torch.stack([g.to(device) for g in self._grads]).double().sum() if self._grads else zero
            had = (float(bool(self._losses)), float(bool(self._grads)))
            row = torch.stack([alarm.double(), loss, zero + had[0], grads, zero + had[1]])
        alarmed, loss_sum, losses, squares, graded = total(row)
        return ScreenRead(alarmed > 0, loss_sum / losses if losses else None, math.sqrt(squares) if graded else None)


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


def same_screens(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether two screens are bitwise the same, NaN equal to NaN (how a replay shows it
    recomputed the step's forward exactly)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
