"""The values of the integer tensors a failed call was given, read once the forward has failed.

A token id past the end of an embedding, labels that are all `ignore_index`, an index one past a
dimension: an integer input's shape and dtype say nothing of what went wrong, and its smallest and
largest values say it all. They are read only when a forward has failed (a healthy run reads none:
metadata narration still reads no tensor payload), and only where torch has finished writing them:

- never memory the pass knows holds no values yet (`empty`'s, an asynchronous collective's output
  nothing has waited on: the pipeline's `unread`);
- on an accelerator, on the stream the call ran on (`call_stream`, noted as it raised), so the read
  is ordered after what the call itself read; and never after the device faulted (a device-side
  assert leaves it unable to run the read).

What could not be read says why (`values not read: ...`); a read that fails says so too and never
replaces the user's exception. A tensor past `MAX_ELEMENTS` elements is not read.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["MAX_ELEMENTS", "Values", "call_stream", "device_faulted", "read_values"]

MAX_ELEMENTS = 1 << 24  # an integer tensor read after a failure: token ids, labels, indices
_UINT64 = getattr(torch, "uint64", None)
_INT64_MIN = -(1 << 63)
_INTEGERS = {dtype for dtype in (getattr(torch, name, None) for name in (
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")) if dtype is not None}


class Values(NamedTuple):
    """What an integer input held: its smallest and largest value, or why they were not read."""

    low: Optional[int]
    high: Optional[int]
    unread: Optional[str] = None


def device_faulted(exc: BaseException) -> bool:
    """Whether `exc` says the device itself faulted (a CUDA error, a device-side assert): nothing
    more can run on it, a read included."""
    if isinstance(exc, getattr(torch, "AcceleratorError", ())):
        return True
    text = str(exc)
    return "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text


def call_stream(tensors: Sequence[torch.Tensor]):
    """The stream a call on these tensors ran on (the current one of the first CUDA tensor's
    device), to read them on after it failed; None on the CPU, or where it cannot be told (they
    are then read on the current stream). Called as the call raises: no sync, never raises."""
    try:
        device = next((tensor.device for tensor in tensors if tensor.device.type == "cuda"), None)
        return torch.cuda.current_stream(device) if device is not None else None
    except Exception:
        return None


def read_values(tensors: Sequence[torch.Tensor], exc: BaseException,
                unread: Optional[Callable[[torch.Tensor], Optional[str]]] = None,
                stream=None) -> Optional[Tuple[Optional[Values], ...]]:
    """Per tensor, the `Values` of an integer one (None for any other), read on `stream` after
    `exc` ended the forward; None when none is an integer tensor. `unread(tensor)` says why its
    memory must not be read now (None: it may be). Never raises."""
    if not any(_integer(tensor) for tensor in tensors):
        return None
    faulted = device_faulted(exc)
    unread = unread or (lambda tensor: None)
    return tuple(_read(tensor, faulted, unread, stream) if _integer(tensor) else None for tensor in tensors)


def _integer(tensor) -> bool:
    return (isinstance(tensor, torch.Tensor) and tensor.dtype in _INTEGERS and tensor.layout is torch.strided
            and not tensor.is_nested and tensor.device.type != "meta" and not is_traceable_wrapper_subclass(tensor))


def _read(tensor: torch.Tensor, faulted: bool, unread, stream) -> Optional[Values]:
    numel = tensor.numel()
    if numel == 0:
        return None  # (its shape says it holds nothing)
    try:
        why = unread(tensor)
    except Exception as exc:
        why = f"{type(exc).__name__} telling whether it was written"
    if why is None and numel > MAX_ELEMENTS:
        why = f"over {MAX_ELEMENTS} elements"
    if why is None and faulted and tensor.device.type != "cpu":
        why = "the device faulted"
    if why is not None:
        return Values(None, None, why)
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            low, high = _extremes(tensor.detach())
    except Exception as exc:  # (a device that cannot run it: the line says so, the user's error stands)
        return Values(None, None, f"{type(exc).__name__} reading them")
    return Values(low, high)


def _extremes(values: torch.Tensor) -> Tuple[int, int]:
    """Smallest and largest value, exactly, at any integer width: the 64-bit dtypes reduced as int64
    in their own order (uint64 with its top bit flipped), the narrower ones widened to int64."""
    if values.dtype == _UINT64:
        low, high = torch.aminmax(values.view(torch.int64) ^ _INT64_MIN)
        low, high = torch.stack([low, high]).tolist()
        return low - _INT64_MIN, high - _INT64_MIN
    if values.dtype != torch.int64:
        values = values.to(torch.int64)
    low, high = torch.aminmax(values)
    low, high = torch.stack([low, high]).tolist()
    return low, high
