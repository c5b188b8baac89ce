"""`tl.debug.reference`: the forward again in float64, the yardstick a divergence is judged by.

Two float32 runs that differ (eager against compiled) cannot say which one is right; a float64 run
of the same model can, to within float64's rounding, some nine decimal digits finer than float32's.
The reference is an eager trace of a float64 copy of the model (the user's model is not touched)
on the inputs with their floating tensors cast to float64 (integer ones, token ids, unchanged).

A float64 copy alone is not float64 throughout: models cast on purpose (Llama's RMSNorm computes in
float32 and casts back, code calls `.float()` or builds `torch.zeros(..., dtype=torch.float32)`),
and autocast would run matmuls in bf16. So the reference runs with autocast off, float64 as the
default dtype, and under `_Float64`, a torch function mode that turns every floating dtype a call
names into float64 (`.float()`, `.half()` and `.bfloat16()` into `.double()`). The same mode notes
each op's reduction length (`reduction_terms`): how many terms a value of its output sums (the
inner dimension of a matmul, a convolution's input channels times its kernel, the reduced size of
a sum, softmax or norm; 1 for an elementwise op), which bounds the rounding a lower precision may
add at that op (`torchlens.debug.rounding`).

The random generators are forked around the run: a model in training mode draws its dropout masks
from the generators' current state, as the runs being compared did when started from it, and the
user's random stream goes on as if the reference never ran.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..errors import ModelTypeError
from ..naming import op_name
from ..results import Trace
from ..structure import check_model

__all__ = ["Reference", "random_ops", "reference", "reduction_terms"]


class Reference:
    """A float64 run of a model (`tl.debug.reference`): `trace`, the eager `Trace` of the float64
    copy, and `terms`, each op's reduction length by its ordinal (see `reduction_terms`)."""

    __slots__ = ("trace", "terms")

    def __init__(self, trace: Trace, terms: Dict[int, int]):
        self.trace = trace
        self.terms = terms

    def __repr__(self) -> str:
        return f"<Reference: float64 trace of {len(self.trace.ops)} ops>"


def reference(model: nn.Module, *args, **kwargs) -> Reference:
    """Trace `model(*args, **kwargs)` in float64: a copy of the model with its floating parameters
    and buffers in float64, the floating inputs cast, every cast the model makes kept in float64.
    Pass it to `tl.debug.compare(a, b, reference=ref)` to learn which side is nearer the truth
    and whether a divergence is rounding or real."""
    from ..api import trace

    check_model(model, "tl.debug.reference")
    original = getattr(model, "_orig_mod", model)  # a torch.compile'd module: its eager model
    try:
        wide = copy.deepcopy(original).double()
    except Exception as exc:
        raise ModelTypeError(f"tl.debug.reference copies the model to run it in float64, and copying failed "
                             f"({type(exc).__name__}: {exc}); give it a model copy.deepcopy can copy") from exc
    args, kwargs = tree_map(_widen_tensor, (args, kwargs))
    mode = _Float64()
    with _float64_run(), mode:
        result = trace(wide, *args, **kwargs)
    return Reference(result, _terms_by_ordinal(result, mode.calls))


@contextlib.contextmanager
def _float64_run():
    """Autocast off, float64 the default dtype, the random generators forked."""
    default = torch.get_default_dtype()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if device == "cpu" or torch.cuda.is_available():
                stack.enter_context(torch.autocast(device, enabled=False))
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(default)


def _widen_tensor(value):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return value.detach().to(torch.float64).requires_grad_(value.requires_grad)
        if value.is_complex():
            return value.detach().to(torch.complex128).requires_grad_(value.requires_grad)
    return value


def _widen_dtype(value):
    if isinstance(value, torch.dtype):
        if value.is_complex:
            return torch.complex128
        if value.is_floating_point:
            return torch.float64
    return value


_TO_DOUBLE = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}
# A dtype here reinterprets bits, it does not cast: left alone.
_BIT_VIEWS = {torch.Tensor.view}


class _Float64(TorchFunctionMode):
    """Keeps a run in float64: each floating dtype a call names becomes float64; records each
    call's name and reduction length, in order (`calls`).

    Fused fast paths (`nn.TransformerEncoderLayer`'s, `nn.MultiheadAttention`'s) look for any
    torch-function mode and take their slow path when they find one; the runs being judged took
    the fast path, so the reference must too (`torchlens_keeps_fast_paths`, see `fastpaths`)."""

    torchlens_keeps_fast_paths = True

    def __init__(self):
        super().__init__()
        self.calls: List[Tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TO_DOUBLE:
            func = torch.Tensor.double
        elif func not in _BIT_VIEWS:
            args, kwargs = tree_map(_widen_dtype, (args, kwargs))
        result = func(*args, **kwargs)
        try:
            self.calls.append((op_name(func), reduction_terms(func, args, kwargs, result)))
        except Exception:  # a name or a length we cannot tell costs the bound, not the run
            self.calls.append(("", 1))
        return result


def _terms_by_ordinal(result: Trace, calls: List[Tuple[str, int]]) -> Dict[int, int]:
    """Each op of the trace paired with the call the mode saw for it, in order, by name. The
    mode also sees the calls the capture makes for itself (copies of kept values), which no op
    of the trace names: they are passed over."""
    terms, position = {}, 0
    for event in result.ops:
        for index in range(position, len(calls)):
            if calls[index][0] == event.op:
                terms[event.ordinal] = calls[index][1]
                position = index + 1
                break
    return terms


@functools.lru_cache(maxsize=None)
def random_ops() -> frozenset:
    """The names of ops whose values are random draws: aten's ops tagged `nondeterministic_seeded`
    (`bernoulli`, `randn`, `native_dropout`, `lstm` with dropout...) and torch.nn.functional's
    dropouts, whose composite kernels call them. A float64 run reproduces such an op only when it
    draws from the generator state the runs drew from."""
    names = {name for name in dir(torch.nn.functional) if "dropout" in name}
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket) and any(
                torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags for overload in packet.overloads()):
            names.add(name)
    return frozenset(names)


_MATMULS = {"mm", "bmm", "matmul", "mv", "dot", "vdot", "inner", "linear", "bilinear"}
_MATMULS_AFTER_BIAS = {"addmm", "baddbmm", "addbmm", "addmv", "addr"}
_CONVOLUTIONS = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                 "convolution", "_convolution"}
_ALONG_DIM = {"softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "cumprod", "logcumsumexp"}
_NORMS = {"layer_norm", "rms_norm"}


def reduction_terms(func, args, kwargs, result=None) -> int:
    """How many terms a value of the call's output sums, at most: what its rounding grows with.

    Matmuls, convolutions, attention, softmax and norms by their contracted or reduced size;
    any other op by how many elements of its largest input each output element stands for (a sum
    or mean over dims, a pooling: its length; an elementwise or broadcasting op: 1). An op that
    selects (indexing, slicing) also reads as a ratio above 1: it loosens that op's bound by the
    square root, far less than what a wrong kernel is off by."""
    name = op_name(func)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return 1
    first = tensors[0]
    if name in _MATMULS:
        return max(1, first.shape[-1]) if first.dim() else 1
    if name in _MATMULS_AFTER_BIAS and len(tensors) > 1:
        return max(1, tensors[1].shape[-1]) if tensors[1].dim() else 1
    if name in _CONVOLUTIONS and len(tensors) > 1:
        return max(1, math.prod(tensors[1].shape[1:]))
    if name == "scaled_dot_product_attention" and len(tensors) > 1:
        return max(first.shape[-1], tensors[1].shape[-2])
    if name in _ALONG_DIM:
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
        return max(1, first.shape[dim]) if first.dim() else 1
    if name in _NORMS:
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
        return max(1, math.prod(shape)) if isinstance(shape, (tuple, list, torch.Size)) else 1
    outputs = [t for t in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(t, torch.Tensor)]
    if not outputs:
        return 1
    produced = max(1, max(t.numel() for t in outputs))
    return max(1, max(t.numel() for t in tensors) // produced)
