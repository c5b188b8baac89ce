"""Facts about a tensor's memory, each answered here by the one function every substrate asks.

The eager capture sees real tensors, the compiled passes see the fake tensors dynamo recorded for
each graph node; both ask the same questions of them, and must get the same answers, or eager and
compiled narration disagree on what an op read, wrote or shares:

- **which memory** a tensor's values are in (`storage_key`, `storage_ref`, `storage_keys`): the
  identity of its storage, which views of it share; a DTensor's or a functorch wrapper's is that of
  the tensor it holds (`stats.unwrapped`). A key is trusted only while the storage lives: freed
  memory comes back under the same key holding another tensor (hence the weak references);
- **written since?** (`version`, `Versions`): torch's version counter, bumped by every in-place
  write and shared by a tensor's views (an inference tensor has none);
- **which elements** of its memory (`element_key`, `same_elements`, `elements_identity`,
  `memory_span`, `covers`): what a view addresses, so that statistics are shared between views of
  the same elements and a write is known to have replaced all of another view;
- **which tensors** a value holds (`tensors_of`, `held_tensors`): an op's output, a call's arguments;
- **which arguments a call writes** (`call_writes`, `node_writes`): read from torch's operator
  schemas in `torchlens.measure.writes`, which owns that table.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .stats import shareable, unwrapped
from .writes import call_writes, may_return_an_alias, node_writes

__all__ = ["Versions", "call_writes", "concrete", "covers", "element_key", "element_layout", "elements_identity",
           "held_tensors", "may_return_an_alias", "memory_span", "node_writes", "same_elements", "storage_key",
           "storage_keys", "storage_ref", "tensors_of", "version"]


# -- which memory ---------------------------------------------------------------------------------

def storage_key(tensor: torch.Tensor) -> Optional[int]:
    """The identity of a tensor's storage while it lives (what `StorageWeakRef.cdata` is); None for
    one without plain storage (a nested tensor)."""
    try:
        return unwrapped(tensor).untyped_storage()._cdata
    except Exception:
        return None


def storage_ref(tensor: torch.Tensor) -> Optional[StorageWeakRef]:
    """A weak reference to a tensor's storage, which says when the storage is freed (and its key
    may stand for other memory); None for one without plain storage."""
    try:
        return StorageWeakRef(unwrapped(tensor).untyped_storage())
    except Exception:
        return None


def storage_keys(tensor) -> List[int]:
    """The storages a tensor's values are in: its own, or those of the tensors a wrapper subclass
    holds (a functional collective's `AsyncCollectiveTensor`, a DTensor's local shard)."""
    return [key for key in map(storage_key, held_tensors(tensor)) if key is not None]


# -- written since? -------------------------------------------------------------------------------

def version(tensor) -> Optional[int]:
    """A tensor's version counter, which every in-place write into its memory bumps; None for one
    without a counter (an inference tensor, a nested or wrapped one, no tensor)."""
    try:
        return tensor._version
    except Exception:
        return None


class Versions:
    """Some tensors' version counters as they are now, to tell later which were written since:
    the only way to know what code torchlens cannot see into (a compiled graph) wrote."""

    __slots__ = ("_seen",)

    def __init__(self, tensors):
        self._seen = [(tensor, version(tensor)) for tensor in tensors]

    def written(self) -> Tuple[torch.Tensor, ...]:
        """The tensors whose counter moved (a tensor without one never was)."""
        return tuple(tensor for tensor, before in self._seen if version(tensor) != before)


# -- which elements -------------------------------------------------------------------------------

def element_key(tensor: torch.Tensor) -> tuple:
    """(storage offset, elements, dtype) of a tensor with plain integer sizes and strides: two
    tensors of one storage with equal keys hold the same elements, each as many times. Statistics
    depend only on the elements, so a view (`view`, `transpose`, the `split` of a fused projection
    and each part's heads, `contiguous` of what already is) with its base's key shares its base's
    statistics, and a copy (`contiguous` of a transpose, `clone`) is measured again."""
    return tensor.storage_offset(), element_layout(tensor), tensor.dtype


def element_layout(tensor: torch.Tensor):
    """The `elements` part of `element_key`: the element count when they fill one block of memory
    (in any order of dimensions); otherwise the dimensions as (stride, size) pairs in stride order,
    size-1 dimensions dropped and a dimension that continues the one below it merged into it."""
    if tensor.is_contiguous():
        return tensor.numel()
    merged: list = []
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0], merged[-1][1] * size)
        else:
            merged.append((stride, size))
    if len(merged) == 1 and merged[0][0] == 1:
        return merged[0][1]  # one dense block after all: the key a contiguous tensor has
    return tuple(merged)


def concrete(tensor: torch.Tensor) -> bool:
    """Whether a tensor (or a graph's fake one) has integer sizes, strides and offset: a symbolic
    one is never compared (converting it to an int would specialise the graph)."""
    try:
        numbers = (tensor.storage_offset(), *tensor.shape, *tensor.stride())
    except RuntimeError:  # no plain strides (a nested tensor)
        return False
    return all(type(n) is int for n in numbers)


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` (real tensors, or the fake ones of a graph) address the same elements of
    one storage. Whether those were written in between is the caller's to tell: the compiled
    statistics pass by the graph's nodes between them (`node_writes`), the eager meter by the
    version counter (`elements_identity`)."""
    if a.layout != torch.strided or b.layout != torch.strided or not (concrete(a) and concrete(b)):
        return False
    if element_key(a) != element_key(b):
        return False
    key = storage_key(a)
    return key is not None and key == storage_key(b)


def elements_identity(tensor: torch.Tensor, plain: bool = False) -> Optional[Tuple[torch.Tensor, tuple]]:
    """`same_elements` for real tensors met one at a time, with "not written since" included:
    (base, key) such that two tensors with equal keys, while `base` lives, hold the same elements
    with the same values. Keyed by the tensor a view views (`_base`), not by its storage: a view
    shares its base's version counter, which every in-place write bumps, whereas two tensors of
    one storage need not share one (`x.data`). None for a tensor without a version counter or
    plain strided storage; `plain`: the caller knows it is a plain strided tensor (the meter's
    per-op path, where this runs once an op and is written out in as few calls as it can)."""
    if plain:
        if torch.is_inference(tensor):
            return None
    elif tensor.layout != torch.strided or not shareable(tensor):
        return None
    base = tensor._base
    if base is None:
        base = tensor
    # (`element_key` and `version`, inline)
    return base, (id(base), tensor.storage_offset(), element_layout(tensor), tensor.dtype, tensor._version)


def memory_span(tensor) -> Optional[Tuple[int, int]]:
    """[first, last] element offsets a tensor (or a fake one in a graph) covers in its storage (a
    DTensor's in its shard's, the storage `storage_key` names); None when a size is symbolic or
    the tensor has no plain strides. An empty tensor covers nothing: (offset, offset - 1)."""
    tensor = unwrapped(tensor)
    if not concrete(tensor):
        return None
    offset = tensor.storage_offset()
    if any(size == 0 for size in tensor.shape):
        return offset, offset - 1
    return offset, offset + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))


def covers(span, other) -> bool:
    """Whether a write over `span` replaced everything in `other` (unknown spans never do)."""
    return span is not None and other is not None and span[0] <= other[0] and other[1] <= span[1]


# -- which tensors --------------------------------------------------------------------------------

def tensors_of(value) -> List[torch.Tensor]:
    """The tensors of a value: one tensor, or those in a tuple, list or dict (an op's outputs, a
    call's arguments, a `_foreach_` list, a collective's list of lists), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in tensors_of(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_of(item)]
    return []


def held_tensors(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The tensor, or the tensors a wrapper subclass holds (recursively: a DTensor's local shard,
    an `AsyncCollectiveTensor`'s): those whose storage holds its values."""
    if tensor.__class__ is torch.Tensor or not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [held for name in names for held in held_tensors(getattr(tensor, name))]
