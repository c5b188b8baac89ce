"""Memory allocated without being initialized, and what has been written into it since.

`torch.empty` and friends hand out whatever bytes the allocator left behind. An op that reads
those bytes (`x + buf`) computes with them, and its output is what it is; but a view of them
(`buf[:8]`, `buf.view(2, 4)`, an op that returns its argument) reads nothing: measuring it would
read memory torch itself has not read, and print a NaN that is not there. So a pass remembers the
storages uninitialized ops allocated, and the spans later ops wrote into them; a tensor in such a
storage is measured only once a write covered all of it.

A write counts only where its span is exact (a contiguous tensor): a strided write's first and last
element bound memory it may not all have written, and an unsure answer must be "not measured",
never a reading of stale bytes.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .provenance import covers, memory_span
from .stats import unwrapped

__all__ = ["UnwrittenMemory", "tensors_of"]


def tensors_of(value) -> List[torch.Tensor]:
    """The tensors of an op's output: one tensor, or those of a tuple or list."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _memory(tensor: torch.Tensor):
    """(storage key, weak reference) of a tensor's memory; None for one without plain storage."""
    try:
        ref = StorageWeakRef(unwrapped(tensor).untyped_storage())
    except Exception:  # a nested tensor, a wrapper without storage
        return None
    return ref.cdata, ref


class UnwrittenMemory:
    """The storages one pass allocated uninitialized, each with the exact spans written since."""

    def __init__(self):
        self._storages: Dict[int, Tuple[StorageWeakRef, list]] = {}

    def __bool__(self) -> bool:
        return bool(self._storages)

    def allocated(self, value) -> None:
        """`value` was just allocated by an op that writes nothing into it (`empty`)."""
        for tensor in tensors_of(value):
            memory = _memory(tensor)
            if memory is not None:
                self._storages[memory[0]] = (memory[1], [])

    def wrote(self, tensors: Iterable[torch.Tensor]) -> None:
        """An op wrote these tensors in place (or as its `out=`)."""
        for tensor in tensors:
            memory = _memory(tensor)
            entry = self._storages.get(memory[0]) if memory is not None else None
            if entry is None:
                continue
            if entry[0].expired():  # freed, its address perhaps reused: not the memory remembered
                del self._storages[memory[0]]
                continue
            if _is_exact(tensor):
                entry[1].append(memory_span(tensor))

    def unwritten(self, value) -> bool:
        """Whether any tensor of `value` lies in remembered memory not wholly written since."""
        for tensor in tensors_of(value):
            memory = _memory(tensor)
            entry = self._storages.get(memory[0]) if memory is not None else None
            if entry is None or entry[0].expired():
                continue
            span = memory_span(tensor)
            if not any(covers(written, span) for written in entry[1]):
                return True
        return False


def _is_exact(tensor: torch.Tensor) -> bool:
    """Whether the tensor's span is exactly the elements it holds (so a write over it wrote them all)."""
    try:
        return tensor.is_contiguous()
    except RuntimeError:
        return False
