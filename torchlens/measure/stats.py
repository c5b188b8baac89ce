"""Value statistics and non-finite tracking: what an op's output holds, at a cost the user chooses.

The rungs of `value_stats=`:

- "off": nothing is read. Metadata only.
- "reuse": print what non-finite tracking (`on_nonfinite=`) computed anyway: `| finite` or
  `| nan=3 +inf=1`. No extra reads.
- "sampled": statistics of a bounded, seeded sample of the elements, marked `~=` and with the sample
  size; a sample never claims the tensor is finite.
- "exact": min, max, mean and standard deviation over every element, with non-finite counts. When
  non-finite values are present, min/max/mean/sd are those of the finite elements. An integer
  tensor's min and max are its integers exactly, at any width (`int_vector`).

Everything is computed on the tensor's device as a small vector. This module holds the tensor-level
pieces: which tensors can be measured, the vectors, and how a read vector fills a `Stats`. Which
vector a tensor gets is `torchlens.measure.recipes` (shared by both substrates); when it is read is
`torchlens.measure.meter` (eager) and `fx_backend.stats_pass` (compiled graphs).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..events import Stats

__all__ = ["FEW_INTEGERS", "INT_COUNT", "INT_VECTOR_SIZE", "SAMPLE_SIZE", "applicable", "as_float", "cheap_vector",
           "count_vector", "exact_below", "few_int_values", "fill", "finite_vector", "int_vector", "is_dtensor",
           "is_wrapped", "lean_count_vector", "measures", "plain_values", "sample_indices", "shareable",
           "small_int_vector", "unmeasured", "unwrapped", "value_kind", "vector_dtype"]

SAMPLE_SIZE = 4096
_SAMPLE_SEED = 0

_inf = float("inf")
is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrapped = torch._C._functorch.get_unwrapped


# -- what to compute ---------------------------------------------------------------------------

_INTEGERS = {dtype for dtype in (getattr(torch, name, None) for name in (
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")) if dtype is not None}


def measures(rung: str, tracking: bool) -> bool:
    """Whether a run computes any statistics at all."""
    return tracking or rung in ("sampled", "exact")


def value_kind(dtype: torch.dtype) -> Optional[str]:
    """"float" (every floating and complex dtype, half to float8), "int", "bool", or None for
    dtypes whose values cannot be reduced (quantized, packed sub-byte types)."""
    if dtype == torch.bool:
        return "bool"
    if dtype in _INTEGERS:
        return "int"
    if (dtype.is_floating_point or dtype.is_complex) and "_x" not in str(dtype):  # not a packed float4 pair
        return "float"
    return None


def applicable(tensor: torch.Tensor) -> Optional[str]:
    """Why statistics cannot be computed for this tensor (meta, empty, sparse, an unsupported
    dtype), or None when they can."""
    if tensor.device.type == "meta":
        return "meta"
    if tensor.layout != torch.strided:
        return str(tensor.layout).replace("torch.", "")
    if value_kind(tensor.dtype) is None:
        return str(tensor.dtype).replace("torch.", "")
    if tensor.numel() == 0:
        return "empty"
    return None


def plain_values(tensor: torch.Tensor) -> torch.Tensor:
    """The ordinary tensor holding `tensor`'s values, to reduce from outside any transform.

    Inside `torch.func.vmap` / `grad` / `jvp` an op's output is a wrapper (a batched or
    gradient-tracking tensor) whose values cannot be read from outside the transform; the tensor
    it wraps holds them (for vmap: every example of the batch, so the statistics cover the batch).
    A nested tensor (`nn.TransformerEncoder`'s fast path) is measured over its components.
    """
    tensor = unwrapped(tensor)
    if tensor.is_nested:  # its components only (a jagged tensor's buffer may hold more)
        return torch.cat([part.reshape(-1) for part in tensor.unbind()])
    return tensor


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a functorch transform's wrapper (vmap, grad, jvp) holds, a DTensor's local shard
    (its values on this rank: reading the global tensor would be a collective), or `tensor` itself."""
    while is_wrapped(tensor):
        tensor = _unwrapped(tensor)
    if tensor.__class__ is not torch.Tensor and is_dtensor(tensor):
        return unwrapped(tensor._local_tensor)  # type: ignore[attr-defined]  # a DTensor's shard: private to torch
    return tensor


def is_dtensor(tensor) -> bool:
    """Whether `tensor` is a `torch.distributed.tensor.DTensor` (told without importing it)."""
    return hasattr(tensor, "placements") and hasattr(tensor, "_local_tensor")


def shareable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has the version counter and plain layout statistics sharing relies on
    (inference tensors have no version counter; wrapped and nested tensors no plain storage)."""
    return not (torch.is_inference(tensor) or tensor.is_nested or is_wrapped(tensor))


def as_float(tensor, dtype: torch.dtype):
    """The values to reduce, in float32 (float64 kept); complex tensors by magnitude.

    `dtype` is the tensor's dtype, passed separately so this also builds graph nodes from FX proxies.
    """
    tensor = tensor.detach()
    if dtype.is_complex:
        magnitude = tensor.abs()
        return magnitude if dtype == torch.complex128 else magnitude.float()
    if dtype == torch.float64:
        return tensor
    return tensor.float()


def vector_dtype(device) -> torch.dtype:
    """Statistics vectors are float64 (exact counts past 2**24), float32 where float64 is missing."""
    return torch.float32 if device.type == "mps" else torch.float64


def cheap_vector(f, dtype: torch.dtype, numel: int):
    """[min, max, mean, sd] over every element: no masking, and only the sd depends on another
    result. Only trusted when all four come back finite (else the tensor is re-measured, or its
    counts are shown instead). Asks nothing of `f`, so it traces into FX graphs as it runs eagerly.

    (`var_mean` reads the tensor once, but eagerly on CPU its Welford update costs 2-5x the second
    pass; in an inductor graph the two forms cost about the same.)"""
    mn, mx = torch.aminmax(f)
    mean = f.mean()
    sd = torch.linalg.vector_norm(f - mean) / math.sqrt(max(numel - 1, 1))
    return torch.stack([mn, mx, mean, sd]).to(dtype)


def count_vector(f, dtype: torch.dtype):
    """[nan, +inf, -inf] counts."""
    return torch.stack([torch.isnan(f).sum(), torch.isposinf(f).sum(), torch.isneginf(f).sum()]).to(dtype)


_PACK = float(1 << 17)  # packed counts: 17 bits each, exact in a float64 sum below 2**17 elements
_FLOAT32_EXACT = 1 << 24  # counts summed in float32 are exact below 2**24 elements


def lean_count_vector(f, dtype: torch.dtype, numel: int):
    """`count_vector` for a compiled graph, where every reduction is a loop of its own and int64
    sums are not vectorized (measured with inductor on CPU, per tensor of 4k / 1.6M elements:
    packed 9 / 1900 us, float32 sums 15 / 850 us, int64 sums 22 / 4300 us).

    Small tensors (static `numel` below 2**17) add 1 (NaN), 2**17 (+inf) or 2**34 (-inf) per element
    into one float64 sum, split again in the graph; larger ones take three float32 sums, and only
    past 2**24 elements, where float32 would round, three int64 sums. Every path is exact.
    """
    if numel < _PACK and dtype == torch.float64:
        code = torch.isnan(f).to(dtype) + torch.isposinf(f).to(dtype) * _PACK + torch.isneginf(f).to(dtype) * _PACK**2
        total = code.sum()
        neginf = torch.floor(total / _PACK**2)
        rest = total - neginf * _PACK**2
        posinf = torch.floor(rest / _PACK)
        return torch.stack([rest - posinf * _PACK, posinf, neginf])
    if numel < _FLOAT32_EXACT:
        counts = [mask(f).sum(dtype=torch.float32) for mask in (torch.isnan, torch.isposinf, torch.isneginf)]
        return torch.stack(counts).to(dtype)
    return count_vector(f, dtype)


def finite_vector(f, dtype: torch.dtype, ndim: int):
    """[min, max, shift, sum, sum of squares, finite count, nan, +inf, -inf] over the finite elements.

    Every reduction is independent of the others — the moments are taken about a shift (the first
    element, when finite) instead of about the mean, which would need a second pass — so a compiler
    fuses them all into one pass over the tensor. Written with plain torch calls and no reads: it
    runs on tensors and traces into FX graphs alike (hence `ndim` is passed in, not asked of `f`).
    `moments()` turns it into mean and sd.
    """
    finite = torch.isfinite(f)
    first = f[(0,) * ndim]
    shift = torch.where(torch.isfinite(first), first, 0)
    deviation = torch.where(finite, f - shift, 0)
    values = [
        torch.where(finite, f, _inf).amin(),
        torch.where(finite, f, -_inf).amax(),
        shift,
        deviation.sum(dtype=dtype),
        (deviation * deviation).sum(dtype=dtype),
        finite.sum(),
    ]
    return torch.cat([torch.stack([v.to(dtype) for v in values]), count_vector(f, dtype)])


# -- integers ----------------------------------------------------------------------------------
#
# A statistics vector is float64 (float32 on MPS): an int64 past 2**53 (a token id hashed, a
# timestamp in nanoseconds) would be rounded in it. So the vector carries an integer as four 16-bit
# limbs, each exact in either float, and the host puts them together again. Mean and sd are taken
# from deviations about one element of the tensor, each computed exactly in integers and rounded
# once to the vector's float: a spread of a few units among values near 2**62 is kept (converting
# the values themselves to float64 first would make them all equal, and their sd 0).

_UINT64 = getattr(torch, "uint64", None)
_WIDE = {dtype for dtype in (torch.int64, _UINT64) if dtype is not None}  # where a difference may overflow
_INT64_MIN = -(1 << 63)
_LIMB_BITS = 16
_LIMB = (1 << _LIMB_BITS) - 1
_LIMBS = 4  # per 64-bit integer
_ENDS = 3  # min, max and the shift the deviations are taken about
_SUMS = _ENDS * _LIMBS  # where the sums of deviations start
INT_VECTOR_SIZE = _SUMS + 3
INT_COUNT = _SUMS + 2  # the element count (a padded vector's one more)


def int_vector(values, dtype: torch.dtype, vector: torch.dtype, ndim: int, padded: bool = False):
    """[min, max, shift (each as four limbs), sum of deviations, sum of their squares, count] of an
    integer tensor, every dtype from int8 to uint64; `fill` puts it together as exact integers and
    the moments about the shift.

    Plain torch calls on `values` and no reads, so it traces into FX graphs as it runs eagerly (hence
    `dtype` and `ndim` are passed in). The 64-bit dtypes are reduced as int64 in their own order
    (uint64 with its top bit flipped), which every backend reduces; the narrower ones are widened to
    int64, exactly. `padded`: a dynamic size that may be zero (its statistics then say "empty");
    one copy of the first element is appended, which changes neither the extremes nor the sums, and
    the count says how many elements there are (one more, taken off when read)."""
    ordered = values.detach()
    if dtype == _UINT64:
        ordered = ordered.view(torch.int64) ^ _INT64_MIN
    elif dtype != torch.int64:
        ordered = ordered.to(torch.int64)
    if padded:
        flat = ordered.reshape(-1)
        ordered = torch.cat([flat, torch.cat([flat, flat.new_zeros(1)])[:1]])
        ndim = 1
    shift = ordered[(0,) * ndim]
    mn, mx = torch.aminmax(ordered)
    ends = torch.stack([mn, mx, shift])
    if dtype == _UINT64:
        ends = ends ^ _INT64_MIN  # back to the unsigned values' bits
    limbs = [(ends >> (_LIMB_BITS * i)) & _LIMB for i in range(_LIMBS - 1)]
    top = ends >> (_LIMB_BITS * (_LIMBS - 1))
    limbs.append(top & _LIMB if dtype == _UINT64 else top)  # the top limb carries the sign
    deviation = _deviation(ordered, shift, dtype in _WIDE, vector)
    sums = torch.stack([deviation.sum(), (deviation * deviation).sum(), torch.ones_like(deviation).sum()])
    return torch.cat([torch.stack(limbs, dim=1).reshape(-1).to(vector), sums])


def _deviation(ordered, shift, wide: bool, vector: torch.dtype):
    """`ordered - shift`, exact in int64 and rounded once to `vector`'s float. Two 64-bit values may
    be further apart than int64 holds: their high and low 32 bits are subtracted apart, each
    exactly, and put together in the float."""
    if not wide:
        return (ordered - shift).to(vector)
    high = (ordered >> 32) - (shift >> 32)
    low = (ordered & 0xFFFFFFFF) - (shift & 0xFFFFFFFF)
    return high.to(vector) * float(1 << 32) + low.to(vector)


FEW_INTEGERS = 256  # an integer tensor this small is summed in Python, faster than a reduction's calls
_EXACT_FLOAT64 = 1 << 53  # integers below this magnitude, and sums of them, are exact in float64


def few_int_values(tensor: torch.Tensor) -> Optional[list]:
    """`small_int_vector(tensor.to(torch.float64)).tolist()` of a CPU integer tensor of at most
    `FEW_INTEGERS` elements, in Python's integers: a token id's or a position's tensor costs a read
    instead of eight torch calls. The same floats, bit for bit, whenever the float64 reductions
    could not round (every value, every partial sum of the deviations or of their squares below
    2**53, whatever the order of summation); None when they could (then the vector is computed)."""
    items = tensor.reshape(-1).tolist()
    shift, low, high = items[0], min(items), max(items)
    deviations = [item - shift for item in items]
    squares = sum(deviation * deviation for deviation in deviations)
    # (|d| <= d*d for an integer d: squares below 2**53 bound every partial sum of the deviations too)
    if squares >= _EXACT_FLOAT64 or max(-low, high) >= _EXACT_FLOAT64:
        return None
    return [float(low), float(high), float(shift), float(sum(deviations)), float(squares)]


def small_int_vector(f):
    """[min, max, shift, sum of deviations, sum of their squares] of integers converted to the
    vector's float `f`: what an integer tensor read at once costs, in few calls. Exact while every
    value is (`exact_below`: the caller checks min and max, and measures an `int_vector` when not)."""
    flat = f.reshape(-1)
    shift = flat[0]
    deviation = flat - shift
    mn, mx = torch.aminmax(flat)
    return torch.stack([mn, mx, shift, deviation.sum(), torch.dot(deviation, deviation)])


def exact_below(vector: torch.dtype) -> int:
    """Integers below this magnitude are exact in the float of a statistics vector."""
    return 1 << (53 if vector == torch.float64 else 24)


def _integer(limbs: Sequence[float]) -> int:
    """An integer from its four limbs (the top one signed for a signed dtype)."""
    return sum(int(limb) << (_LIMB_BITS * i) for i, limb in enumerate(limbs))


def _fill_int(stats: Stats, values: Sequence[float]) -> None:
    total, squares, count = values[_SUMS:_SUMS + 3]
    if count < 1:
        return  # (a padded vector of an empty tensor: nothing was measured)
    mn, mx, shift = (_integer(values[_LIMBS * i:_LIMBS * (i + 1)]) for i in range(_ENDS))
    _integer_moments(stats, mn, mx, shift, total, squares, count)


def _integer_moments(stats: Stats, mn: int, mx: int, shift: int, total: float, squares: float, count) -> None:
    """Exact min and max, and mean and sd from the sums of deviations about `shift`."""
    mean_deviation = total / count
    variance = max(squares - total * mean_deviation, 0.0) / max(count - 1, 1)
    stats.min, stats.max = mn, mx
    stats.mean, stats.sd = shift + mean_deviation, math.sqrt(variance)


def moments(values: Sequence[float]) -> Tuple[Optional[float], Optional[float], Optional[float], Optional[float]]:
    """(min, max, mean, sd) from the first six entries of a `finite_vector`."""
    mn, mx, shift, total, squares, count = values[:6]
    if count < 1:
        return None, None, None, None
    mean_deviation = total / count
    variance = max(squares - total * mean_deviation, 0.0) / max(count - 1, 1)
    return mn, mx, shift + mean_deviation, math.sqrt(variance)


_sample_indices: Dict[Tuple[int, str], torch.Tensor] = {}


def sample_indices(numel: int, device) -> torch.Tensor:
    """The seeded positions a sample reads: the same for every tensor of this size, so runs agree."""
    key = (numel, str(device))
    indices = _sample_indices.get(key)
    if indices is None:
        generator = torch.Generator().manual_seed(_SAMPLE_SEED)
        indices = torch.randint(0, numel, (SAMPLE_SIZE,), generator=generator).to(device)
        if len(_sample_indices) > 256:
            _sample_indices.clear()
        _sample_indices[key] = indices
    return indices


def unmeasured(stats: Stats, why: str) -> None:
    """Turn `stats` into "not measured" (the footer counts it), keeping whether it was shown."""
    stats.kind = "na"
    stats.note = why
    stats.min = stats.max = stats.mean = stats.sd = None
    stats.nan = stats.posinf = stats.neginf = None


def fill(stats: Stats, values: Sequence[float], layout: str, tracking: bool) -> None:
    """Store a read vector in `stats`; `layout` says what the vector holds:

    "bool" [true count], "counts" [nan, +inf, -inf], "moments" (a `cheap_vector`, all finite),
    "moments+counts" (a `cheap_vector`, trusted only if the counts that follow are zero),
    "finite" (a `finite_vector`), "int" (an `int_vector`), "small-int" (a `small_int_vector`),
    "sampled" / "sampled-moments" (a `finite_vector` / `cheap_vector` of the sample, then the
    tensor's counts when tracking).
    """
    _fill(stats, values, layout, tracking)
    _drop_overflowed(stats)


def _drop_overflowed(stats: Stats) -> None:
    """A moment that overflowed the arithmetic of its reduction (a fused graph's float32 sums of
    values near 3e38, an sd past float64's range) is not a measurement: it is dropped and named,
    and never printed as `inf`."""
    lost = [name for name in ("min", "max", "mean", "sd")
            if getattr(stats, name) is not None and not math.isfinite(getattr(stats, name))]
    for name in lost:
        setattr(stats, name, None)
    if lost:
        stats.note = f"({'/'.join(lost)} overflowed)"


def _fill(stats: Stats, values: Sequence[float], layout: str, tracking: bool) -> None:
    if layout == "bool":
        stats.true = int(values[0])
        return
    if layout == "counts":
        stats.nan, stats.posinf, stats.neginf = (int(v) for v in values)
        return
    if layout == "int":  # integers are always finite: no counts
        _fill_int(stats, values)
        return
    if layout == "small-int":  # (a `small_int_vector` whose min and max were exact)
        mn, mx, shift = (int(value) for value in values[:3])
        _integer_moments(stats, mn, mx, shift, values[3], values[4], stats.numel)
        return
    if layout == "moments":
        stats.min, stats.max, stats.mean, stats.sd = values[:4]
        stats.nan = stats.posinf = stats.neginf = 0
        return
    if layout == "moments+counts":
        stats.nan, stats.posinf, stats.neginf = (int(v) for v in values[4:7])
        if not stats.nonfinite:
            stats.min, stats.max, stats.mean, stats.sd = values[:4]
        return
    if layout == "sampled-moments":  # a finite sample, then the tensor's counts when tracking
        stats.min, stats.max, stats.mean, stats.sd = values[:4]
        if tracking and len(values) >= 7:
            stats.nan, stats.posinf, stats.neginf = (int(v) for v in values[4:7])
        return
    stats.min, stats.max, stats.mean, stats.sd = moments(values)
    counts = [int(v) for v in values[6:9]]
    if layout == "finite":
        stats.nan, stats.posinf, stats.neginf = counts
    elif layout == "sampled":
        if sum(counts):
            stats.note = "(non-finite values in the sample)"
        if tracking and len(values) >= 12:
            stats.nan, stats.posinf, stats.neginf = (int(v) for v in values[9:12])
