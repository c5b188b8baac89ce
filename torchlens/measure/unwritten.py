"""Memory a pass has no proof was written: never measured, because torch itself has not read it.

A view (`buf[:8]`, `buf.view(2, 4)`, an op that returns its argument) reads nothing: its bytes
are whatever its memory holds. Measuring them is safe when that memory holds values, and prints a
NaN that is not there when it does not. Two kinds of memory hold no values yet:

- **uninitialized**: `torch.empty` and friends hand out what the allocator left behind;
- **not seen written**: memory the pass first meets through a view, that no op it narrated wrote
  and that is neither an input of the pass nor a tensor the model holds (a parameter, a buffer, a
  tensor attribute of one of its modules). Engines keep such memory: FSDP2 frees its unsharded
  parameters' memory after a forward (`untyped_storage().resize_(0)`) and gets it back, unwritten,
  before the next, then views it and copies the all-gathered values into the views; a collective
  may still be writing a tensor when code views it. None of that is an op the pass sees.

So a pass remembers, by storage, what it saw: the memory ops produced, the inputs, the model's
tensors (`SeenMemory`), and the memory of the two kinds above with the byte spans ops have
written into it since (`UnwrittenMemory`). A tensor in unwritten memory is measured once writes
covered all of it. An op that reads such memory (`x + buf`) computes with it, and its output is
measured as it computed: only views are left unread.

A write counts only where its span is exact (a contiguous tensor): a strided write's first and last
byte bound memory it may not all have written, and an unsure answer must be "not measured", never
a reading of stale bytes.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .memory import covers, held_tensors, memory_span, storage_key, storage_ref, tensors_of
from .provenance import passed_in, tensor_arguments
from .stats import unwrapped

__all__ = ["IN_FLIGHT", "NOT_SEEN_WRITTEN", "UNINITIALIZED_NOTE", "SeenMemory", "UnwrittenMemory",
           "returns_an_argument"]

UNINITIALIZED_NOTE = "uninitialized"
NOT_SEEN_WRITTEN = "not seen written"
IN_FLIGHT = "in flight"  # an asynchronous collective's output before anything read it (`collectives`)


def returns_an_argument(value, args, kwargs) -> bool:
    """Whether an op's output is (or holds) one of its tensor arguments (eval-mode `dropout`, `to`
    of the dtype it has): memory the op did not produce."""
    if value.__class__ is torch.Tensor:
        return passed_in(value, args, kwargs)
    return any(passed_in(tensor, args, kwargs) for tensor in tensors_of(value))


def _byte_span(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """[first, last] byte a tensor covers in its storage (views of one storage may differ in dtype)."""
    span = memory_span(tensor)
    if span is None:
        return None
    size = tensor.element_size()
    return span[0] * size, (span[1] + 1) * size - 1


class _Unwritten(NamedTuple):
    """One storage that held no values when the pass met it."""

    ref: StorageWeakRef  # (its key stands for it only while it lives)
    note: str  # why it held none: `UNINITIALIZED_NOTE`, `NOT_SEEN_WRITTEN`, `IN_FLIGHT`
    spans: List[Tuple[int, int]]  # the byte spans exactly written since
    address: Optional[int]  # where its bytes were: bytes it got back since (`resize_`) hold none again


class UnwrittenMemory:
    """Storages a pass met holding no values yet, each with why and the exact byte spans written
    since. An entry stands for the bytes it was made with: memory a storage got back since
    (`resize_`, at a new address) holds no values again."""

    def __init__(self):
        self._storages: Dict[int, _Unwritten] = {}  # by storage key (`memory.storage_key`)

    def __bool__(self) -> bool:
        return bool(self._storages)

    def allocated(self, value) -> None:
        """`value` was just allocated by an op that writes nothing into it (`empty`)."""
        for tensor in tensors_of(value):
            self._remember(tensor, UNINITIALIZED_NOTE, keep=False)

    def unseen(self, tensor: torch.Tensor) -> None:
        """`tensor` views memory the pass never saw written (see the module's docstring); memory
        already remembered with the same bytes (`empty`'s, and what was written since) stays as it is."""
        self._remember(tensor, NOT_SEEN_WRITTEN, keep=True)

    def in_flight(self, tensors: Iterable[torch.Tensor]) -> None:
        """An asynchronous collective will write these: until it lands, their memory holds nothing."""
        for tensor in tensors:
            self._remember(tensor, IN_FLIGHT, keep=False)

    def landed(self, tensors: Iterable[torch.Tensor]) -> None:
        """The collective's values are there: its tensors are written (what it wrote, no more)."""
        self.wrote(tensors)

    def _remember(self, tensor: torch.Tensor, note: str, keep: bool) -> None:
        ref = storage_ref(tensor)
        if ref is None:  # no plain storage: nothing to remember
            return
        address = _address(tensor)
        known = self._storages.get(ref.cdata)
        if not (keep and known is not None and not known.ref.expired() and known.address == address):
            self._storages[ref.cdata] = _Unwritten(ref, note, [], address)

    def _entry(self, tensor: torch.Tensor):
        """The live entry of a tensor's memory, or None (never remembered, freed, or new bytes)."""
        key = storage_key(tensor)
        if key is None:
            return None
        entry = self._storages.get(key)
        if entry is None:
            return None
        if entry.ref.expired():  # freed, its address perhaps reused: not the memory remembered
            del self._storages[key]
            return None
        address = _address(tensor)
        if address != entry.address:  # new bytes (`resize_`): nothing written into them yet
            entry = self._storages[key] = _Unwritten(entry.ref, entry.note, [], address)
        return entry

    def wrote(self, tensors: Iterable[torch.Tensor]) -> None:
        """An op wrote these tensors in place (or as its `out=`)."""
        for tensor in tensors:
            entry = self._entry(tensor)
            if entry is not None and _is_exact(tensor):
                entry.spans.append(_byte_span(tensor))

    def unwritten(self, value) -> Optional[str]:
        """Why a tensor of `value` holds no values yet (`UNINITIALIZED_NOTE`, `NOT_SEEN_WRITTEN`),
        or None when writes covered all of every one that lies in remembered memory."""
        for tensor in tensors_of(value):
            entry = self._entry(tensor)
            if entry is None:
                continue
            span = _byte_span(tensor)
            if not any(covers(written, span) for written in entry.spans):
                return entry.note
        return None


class SeenMemory:
    """The tensors a pass saw hold values: what its ops produced (and views of those), its inputs,
    the model's tensors. Kept by identity, the cheapest key an op can add on every call: a tensor
    made before the pass and alive through it (an engine's buffer) cannot share an identity with
    one the pass made. The model's tensors (`held()`) are looked up when an op first views memory
    of a tensor its ops did not produce (rare, and walking a model's modules costs more than most
    ops)."""

    def __init__(self, held: Callable[[], Iterable[torch.Tensor]] = tuple):
        self._ids: Set[int] = set()
        self._held: Optional[Callable[[], Iterable[torch.Tensor]]] = held  # None once read

    def saw(self, value) -> None:
        """An op produced `value` in fresh memory (or it is an input, or a compiled graph's output)."""
        if value.__class__ is torch.Tensor:
            self._ids.add(id(value))
            return
        for tensor in tensors_of(value):
            self._ids.update(map(id, _with_inner(tensor)))

    def unseen_views(self, value, args, kwargs) -> List[torch.Tensor]:
        """For an op that may return memory of its first tensor argument (a view, an in-place op):
        the tensors of its output that do, when that argument is not one the pass saw. The others
        are seen from now on."""
        source = next(iter(tensor_arguments(args, kwargs)), None)
        outputs = tensors_of(value)
        if source is None or id(source) in self._ids:
            for tensor in outputs:
                self._ids.update(map(id, _with_inner(tensor)))
            return []
        if self._held is not None:  # (once per pass, when first needed)
            self._ids.update(map(id, self._held()))
            self._held = None
            if id(source) in self._ids:
                self._ids.update(map(id, outputs))
                return []
        memory = storage_key(source)
        unseen = [tensor for tensor in outputs if memory is not None and storage_key(tensor) == memory]
        self._ids.update(id(tensor) for tensor in outputs if not any(tensor is other for other in unseen))
        return unseen


def _with_inner(tensor: torch.Tensor) -> list:
    """A tensor, and the tensors a wrapper subclass holds (a DTensor's local shard)."""
    held = held_tensors(tensor)
    return held if held[0] is tensor else [tensor, *held]


def _address(tensor: torch.Tensor) -> Optional[int]:
    """Where the bytes of a tensor's storage are; None for a graph's fake tensor, which has none."""
    try:
        return unwrapped(tensor).untyped_storage().data_ptr()
    except Exception:
        return None


def _is_exact(tensor: torch.Tensor) -> bool:
    """Whether the tensor's span is exactly the elements it holds (so a write over it wrote them all)."""
    try:
        return tensor.is_contiguous()
    except RuntimeError:
        return False
