"""Whether two tensors address the same elements: the one rule by which both substrates share a
view's statistics with the tensor it views instead of reducing the same values again.

Statistics depend only on the elements a tensor holds. A view (`view`, `transpose`, the `split` of
a fused projection and each part's heads, `contiguous` of what already is) holds elements of its
base's storage; when it holds exactly the elements a measured tensor holds, at the same offset, with
the same dtype, and nothing has written them since, the statistics are the same. The eager meter
applies this to real tensors (unchanged since: the version counter); the compiled statistics pass
applies it to the fake tensors dynamo recorded for each graph node (unchanged since: no node in
between may write). So the same views share in both, and a copy (`contiguous` of a transpose,
`clone`) is measured again in both.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["concrete", "element_key", "element_layout", "same_elements"]


def element_key(tensor: torch.Tensor) -> tuple:
    """(storage offset, elements, dtype) of a tensor with plain integer sizes and strides: two
    tensors of one storage with equal keys hold the same elements, each as many times. `elements`
    is the element count when they fill one block of memory (in any order of dimensions); otherwise
    the dimensions as (stride, size) pairs in stride order, size-1 dimensions dropped and a
    dimension that continues the one below it merged into it."""
    return tensor.storage_offset(), element_layout(tensor), tensor.dtype


def element_layout(tensor: torch.Tensor):
    """The `elements` part of `element_key` (the eager meter's per-op path builds its key from it
    directly, in as few calls as it can)."""
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
    """Whether a tensor (or a graph's fake one) has integer sizes, strides and offset (not symbolic)."""
    try:
        numbers = (tensor.storage_offset(), *tensor.shape, *tensor.stride())
    except RuntimeError:  # no plain strides (a nested tensor)
        return False
    return all(type(n) is int for n in numbers)


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` (real tensors, or the fake ones of a graph) address the same elements of
    one storage. Whether those were written in between is the caller's to tell."""
    if a.layout != torch.strided or b.layout != torch.strided or not (concrete(a) and concrete(b)):
        return False
    if element_key(a) != element_key(b):
        return False
    try:
        return StorageWeakRef(a.untyped_storage()).cdata == StorageWeakRef(b.untyped_storage()).cdata
    except Exception:  # no storage of its own
        return False
