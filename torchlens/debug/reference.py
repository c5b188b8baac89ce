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

The same mode also keeps each op's call (`Call`): the function, its arguments with every tensor an
earlier op of the run produced named by that op (`Produced`), and the parameters, buffers and
inputs as they were. `Reference.replay` calls an op again in float64 on *another run's* inputs
(what that run's own earlier ops gave it), which tells what the op itself adds to a divergence:
rounding carried in from a lower precision upstream is not the op's (`torchlens.debug.rounding`).
A random op (dropout, attention's dropout) is replayed from the generator states it drew from.

The random generators are forked around the run: a model in training mode draws its dropout masks
from the generators' current state, as the runs being compared did when started from it, and the
user's random stream goes on as if the reference never ran.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from ..core.generators import RandomState
from ..core.naming import op_name
from ..core.structure import check_model
from ..errors import ModelTypeError
from ..measure.memory import call_writes, tensors_of
from ..results import Trace

__all__ = ["Call", "Produced", "Reference", "random_ops", "reference", "reduction_terms"]


class Produced(NamedTuple):
    """An argument of a `Call` that an earlier op of the float64 run produced: the `index`-th
    tensor output of op `ordinal`."""

    ordinal: int
    index: int  # type: ignore[assignment]  # (a field named as tuple's method, which it shadows)


class Call(NamedTuple):
    """One op of the float64 run as it was called: `func` with `args` and `kwargs` in which each
    tensor an earlier op produced is a `Produced` (any other tensor, a parameter, a buffer or an
    input, is held as it was), and its reduction length `terms` (`reduction_terms`)."""

    func: Callable
    args: tuple
    kwargs: dict
    terms: int
    generators: Optional[RandomState] = None  # their states when it was called: a random op draws again as it drew


class Reference:
    """A float64 run of a model (`tl.debug.reference`): `trace`, the eager `Trace` of the float64
    copy; `terms`, each op's reduction length by its ordinal (see `reduction_terms`); `calls`,
    each op's `Call` by its ordinal, which `replay` calls again on another run's inputs."""

    __slots__ = ("trace", "terms", "calls", "_faithful")

    def __init__(self, trace: Trace, terms: Dict[int, int], calls: Optional[Dict[int, Call]] = None):
        self.trace = trace
        self.terms = terms
        self.calls = calls or {}
        self._faithful: Dict[int, bool] = {}  # ordinal -> whether its replay gives back its own output

    def inputs(self, ordinal: int) -> Tuple[Produced, ...]:
        """The ops of the float64 run whose outputs op `ordinal` read (empty when unknown)."""
        call = self.calls.get(ordinal)
        if call is None:
            return ()
        leaves = tree_leaves((call.args, call.kwargs), is_leaf=lambda value: isinstance(value, Produced))
        return tuple(leaf for leaf in leaves if isinstance(leaf, Produced))

    def replay(self, ordinal: int, value_of: Callable[[Produced, torch.Tensor], Optional[torch.Tensor]],
               sources_in: Optional[torch.dtype] = None) -> Optional[tuple]:
        """Op `ordinal` of the float64 run called again in float64, each input an earlier op
        produced given by `value_of(produced, the float64 run's own value)` (None: it cannot be
        given), the parameters, buffers and inputs
        the run's own (rounded through `sources_in` first, when given: a run that held them in a
        lower precision). Its tensor outputs, or None where it cannot be replayed: an input not
        given, an op that fails, or one whose replay on the float64 run's own inputs does not give
        back its own output (a random op; an input written in place after it was made)."""
        if not self._replays_itself(ordinal):
            return None
        return self._call(ordinal, value_of, sources_in)

    def _replays_itself(self, ordinal: int) -> bool:
        known = self._faithful.get(ordinal)
        if known is None:
            own = self.trace.values or {}
            replayed = self._call(ordinal, lambda produced, kept: kept, None)
            kept = own.get(ordinal)
            known = self._faithful[ordinal] = replayed is not None and kept is not None and _same(replayed, kept)
        return known

    def _call(self, ordinal: int, value_of, sources_in) -> Optional[tuple]:
        call = self.calls.get(ordinal)
        if call is None:
            return None
        missing, own = [], self.trace.values or {}
        writes = call_writes(op_name(call.func), call.args, call.kwargs, call.func)

        def given(value):
            if isinstance(value, Produced):
                kept = _output(own, value)
                tensor = value_of(value, kept) if kept is not None else None
                if tensor is None or kept is None:  # (no kept value: none given)
                    missing.append(value)
                    return None
                return _widen_tensor(tensor.detach()).to(kept.device, copy=True)  # where the float64 run ran
            if isinstance(value, torch.Tensor):
                wide = value.detach()
                if sources_in is not None and wide.is_floating_point():
                    return wide.to(sources_in).to(wide.dtype)
                # (a parameter or buffer is copied only for a call that may write it: `inplace=True`,
                # `out=`, an in-place op, a positional flag that may be `inplace`)
                return wide.clone() if writes else wide
            return value

        args, kwargs = tree_map(given, (call.args, call.kwargs), is_leaf=lambda value: isinstance(value, Produced))
        if missing:
            return None
        try:
            with _float64_run(), torch.no_grad():
                if call.generators is not None:
                    call.generators.restore()  # (within the fork: the user's stream is left as it was)
                return tuple(tensor.detach() for tensor in tensors_of(call.func(*args, **kwargs)))
        except Exception:  # an op that cannot run on these inputs is not judged by its replay
            return None

    def __repr__(self) -> str:
        return f"<Reference: float64 trace of {len(self.trace.ops)} ops>"


def _output(values: dict, produced: Produced) -> Optional[torch.Tensor]:
    kept = values.get(produced.ordinal)
    return kept[produced.index] if kept is not None and produced.index < len(kept) else None


def _same(replayed: tuple, kept: tuple) -> bool:
    """Whether a replay gave back the kept outputs, to float64's rounding (a reduction may sum in
    another order the second time)."""
    if len(replayed) != len(kept):
        return False
    for value, own in zip(replayed, kept):
        if value.shape != own.shape or value.dtype != own.dtype:
            return False
        if not (value.is_floating_point() or value.is_complex()):
            if not torch.equal(value, own.to(value.device)):
                return False
            continue
        own = own.to(value.device)
        if bool((value.isnan() != own.isnan()).any()):
            return False
        if not torch.allclose(value, own, rtol=1e-12, atol=0.0, equal_nan=True):
            scale = float(own[own.isfinite()].abs().max()) if bool(own.isfinite().any()) else 0.0
            if float((value - own).abs().nan_to_num(0.0).max()) > 1e-12 * scale:
                return False
    return True


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
    ordinals = _ordinals_of_calls(result, mode.calls)
    return Reference(result, {ordinal: mode.calls[index].terms for index, ordinal in ordinals.items()},
                     _calls_by_ordinal(mode.calls, ordinals))


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
    call, in order (`calls`: its name, reduction length, function and arguments, see `Call`).

    Fused fast paths (`nn.TransformerEncoderLayer`'s, `nn.MultiheadAttention`'s) look for any
    torch-function mode and take their slow path when they find one; the runs being judged took
    the fast path, so the reference must too (`torchlens_keeps_fast_paths`, see `fastpaths`)."""

    torchlens_keeps_fast_paths = True

    def __init__(self):
        super().__init__()
        self.calls: List[_Recorded] = []
        self._made: Dict[int, tuple] = {}  # id(tensor) -> (its weak reference, call index, output index)
        self._generators: Optional[RandomState] = None  # the last state taken, shared while nothing draws

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        called = func  # (the name the capture gives the op: `float`, not the `double` run instead)
        generators = self._states()
        if func in _TO_DOUBLE:
            func = torch.Tensor.double
        elif func not in _BIT_VIEWS:
            args, kwargs = tree_map(_widen_dtype, (args, kwargs))
        result = func(*args, **kwargs)
        try:
            name, terms = op_name(called), reduction_terms(func, args, kwargs, result)
        except Exception:  # a name or a length we cannot tell costs the bound, not the run
            name, terms = "", 1
        named_args, named_kwargs = tree_map(self._named, (args, kwargs))
        self.calls.append(_Recorded(name, terms, func, named_args, named_kwargs, generators))
        self._note_outputs(len(self.calls) - 1, result)
        return result

    def _states(self) -> RandomState:
        """The generators' states now; the object taken last while no op has drawn since (one
        per draw, not per op: a model's ops hold a few states, not thousands)."""
        now, last = RandomState(), self._generators
        if last is not None and torch.equal(now.cpu, last.cpu) and (
                now.cuda is None) == (last.cuda is None) and all(
                torch.equal(x, y) for x, y in zip(now.cuda or (), last.cuda or ())):
            return last
        self._generators = now
        return now

    def _named(self, value):
        """A tensor argument as an earlier call's output (`_Made`), or itself."""
        if isinstance(value, torch.Tensor):
            made = self._made.get(id(value))
            if made is not None and made[0]() is value:
                return _Made(made[1], made[2])
        return value

    def _note_outputs(self, index: int, result) -> None:
        for position, tensor in enumerate(tensors_of(result)):
            try:
                self._made[id(tensor)] = (weakref.ref(tensor), index, position)
            except TypeError:  # a tensor that takes no weak reference is taken for a source
                pass


class _Recorded(NamedTuple):
    name: str
    terms: int
    func: Callable
    args: tuple
    kwargs: dict
    generators: RandomState


class _Made(NamedTuple):
    call: int  # index into the recorded calls
    index: int  # type: ignore[assignment]  # (a field named as tuple's method, which it shadows)


def _ordinals_of_calls(result: Trace, calls: List[_Recorded]) -> Dict[int, int]:
    """Each op of the trace paired with the call the mode saw for it, in order, by name: call
    index -> ordinal. The mode also sees the calls the capture makes for itself (copies of kept
    values), which no op of the trace names: they are passed over."""
    ordinals, position = {}, 0
    for event in result.ops:
        for index in range(position, len(calls)):
            if calls[index].name == event.op:
                ordinals[index] = event.ordinal
                position = index + 1
                break
    return ordinals


def _calls_by_ordinal(calls: List[_Recorded], ordinals: Dict[int, int]) -> Dict[int, Call]:
    """The recorded calls of the trace's ops, their arguments naming the ops that produced them. A
    call reading what no op of the trace produced (a copy the capture made) is left out."""
    out = {}
    for index, ordinal in ordinals.items():
        recorded = calls[index]
        if any(value.call not in ordinals for value in _made_in(recorded)):
            continue
        args, kwargs = tree_map(lambda v: Produced(ordinals[v.call], v.index) if isinstance(v, _Made) else v,
                                (recorded.args, recorded.kwargs), is_leaf=lambda v: isinstance(v, _Made))
        out[ordinal] = Call(recorded.func, args, kwargs, recorded.terms, recorded.generators)
    return out


def _made_in(recorded: _Recorded) -> List[_Made]:
    """The arguments of a recorded call that earlier calls made."""
    leaves = tree_leaves((recorded.args, recorded.kwargs), is_leaf=lambda v: isinstance(v, _Made))
    return [leaf for leaf in leaves if isinstance(leaf, _Made)]


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
