"""What to compute for one tensor, and how to read it back: the one statistics ladder.

Both substrates measure through it: the eager meter (`torchlens.measure.meter`) runs a recipe's vector
on the tensor, the compiled path (`fx_backend.stats_pass`) traces the same vector into the graph.
The ladder — not applicable, then the dtype's kind (bool, integer, float), then the rung (exact,
sampled, counts for tracking) — is decided here once; a `Recipe` names what it builds (`layout`),
how long its vector is (`size`), the `Stats` it fills, and whether a dynamic size was padded.

Three recipes exist only where the tensor is still at hand when the vector is read (`immediate`:
on the CPU, where reading needs no device to wait for, or a line printed now), because a result
they cannot vouch for is measured again from the tensor; they run here (`screened`, `summed`,
`integers`), called by the meter, which decided that they are read now:

- "screen": tracking's first look, one sum. A sum of finite values is finite unless it overflows;
  any NaN or infinity makes it NaN or infinite. So a finite sum proves every element finite, and
  only a sum that is not (a real NaN or infinity, or an overflow of finite values) pays for the
  three exact counts.
- "sums": exact statistics as [min, max, sum, sum of squares], three reductions that read the
  tensor once each and write nothing. The moments are taken from them on the host; when the mean
  is large against the spread (where subtracting sums would lose digits) mean and sd are measured
  again about the mean, as a two-pass algorithm does. A min or max that is not finite means
  non-finite values: the tensor is measured again, masking and counting them.
- "small-int": an integer tensor's statistics from its values converted to float64, as few calls as
  "sums" takes; exact while min and max are within float64's exact integers (2**53). Past them the
  tensor is measured again as "int" does, with its integers as integers.

A compiled graph's returned outputs are all at hand after its call: their screens or sums are
taken one tensor after another and read to the host in one transfer (`screened_together`,
`summed_together`), each then read as its own would be.

Deferred vectors (an accelerator's, read once per forward or graph call, when the tensor is gone)
carry their counts from the start ("counts", "moments+counts").
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from ..events import Stats
from .stats import (
    FEW_INTEGERS,
    INT_COUNT,
    INT_VECTOR_SIZE,
    cheap_vector,
    count_vector,
    exact_below,
    few_int_values,
    fill,
    finite_vector,
    int_vector,
    lean_count_vector,
    small_int_vector,
)

__all__ = ["CONDITION_LIMIT", "Recipe", "about_the_mean", "all_finite", "from_sums", "integers", "moments_from_sums",
           "not_applicable", "recipe", "screen_finite", "screen_vector", "screened", "screened_together", "sum_parts",
           "summed", "summed_together", "sums_of"]


class Recipe(NamedTuple):
    """How one tensor is measured: the vector to build and the `Stats` it fills."""

    layout: str  # what the vector holds, as `torchlens.measure.stats.fill` reads it ("" when nothing is computed)
    kind: str  # the `Stats.kind` it produces
    shown: bool  # whether the op line shows it (tracking alone measures without showing)
    size: int = 0  # entries of the vector, or of its head when counts follow (sampled with tracking)
    note: str = ""  # why nothing is measured ("int": tracking only, integers cannot be non-finite)
    padded: bool = False  # a dynamic size that may be zero: one NaN appended, taken off when read
    lean: bool = False  # counts for a compiled graph (`lean_count_vector`), eager's otherwise

    @property
    def measures(self) -> bool:
        return bool(self.layout)

    def stats(self, numel: int) -> Stats:
        return Stats(self.kind, numel, self.shown, note=self.note)

    def build(self, values, dtype: torch.dtype, numel, ndim: int, source: Optional[torch.dtype] = None):
        """The vector for `values` (a tensor, or an FX proxy: nothing here reads a value), in
        `dtype`. A float's `values` are already in the dtype the recipe reduces (see
        `torchlens.measure.stats.as_float`); an integer's are the tensor itself, of dtype `source`."""
        if self.layout in _AT_HAND:
            raise ValueError(f"a {self.layout!r} recipe is measured by the meter, with its tensor at hand")
        if self.layout == "int":
            assert source is not None, "an integer's recipe is built with its tensor's dtype"
            return int_vector(values, source, dtype, ndim, self.padded)
        return _BUILDERS[self.layout](self, values, dtype, numel, ndim)

    def read(self, stats: Stats, values: Sequence[float], tracking: bool) -> None:
        """Fill `stats` from the vector read back (`size` entries)."""
        if self.layout in _AT_HAND:
            raise ValueError(f"a {self.layout!r} vector is read by the meter, with its tensor at hand")
        values = list(values)
        if self.padded:  # the element appended to keep an empty tensor's reductions defined
            values[INT_COUNT if self.layout == "int" else 6] -= 1  # (a float's, a NaN: counted as one)
        fill(stats, values, self.layout, tracking)


_AT_HAND = ("screen", "sums", "small-int")  # recipes the meter measures, with the tensor at hand


def not_applicable(reason: str, rung: str) -> Recipe:
    """Nothing can be measured (meta, sparse, empty, an unreducible dtype): the line says why."""
    return Recipe("", "na", rung != "off", note=reason)


@functools.lru_cache(maxsize=None)  # a few dozen combinations, asked for once per measured tensor
def recipe(kind: str, rung: str, *, numel_known: bool = True, immediate: bool = False,
           in_graph: bool = False, sampled: bool = False) -> Recipe:
    """The recipe for a tensor of value kind `kind` ("float", "int", "bool": `stats.value_kind`).

    `immediate`: the vector is read while the tensor is at hand (eager only), so the cheap
    "screen" and "sums" recipes apply (an accelerator's "sums" is read as the two-pass vector,
    one read: see `torchlens.measure.meter`). `in_graph`: traced into a compiled graph. `sampled`: the
    "sampled" rung applies to this tensor (eager, more elements than a sample holds).
    """
    shown = rung != "off"
    measuring = rung in ("exact", "sampled")
    if kind != "float" and not measuring:  # tracking only: integers and bools are always finite
        return Recipe("", "na", False, note=kind)
    if kind == "bool":
        return Recipe("bool", "bool", shown, 1)
    if kind == "int":  # exact integers (`torchlens.measure.stats.int_vector`; read now, in few calls when it can)
        if immediate:
            return Recipe("small-int", "exact", shown, 5)
        return Recipe("int", "exact", shown, INT_VECTOR_SIZE, padded=not numel_known)
    if not measuring:  # tracking: counts, shown by "reuse"
        if immediate:
            return Recipe("screen", "counts", rung == "reuse", 1)
        return Recipe("counts", "counts", rung == "reuse", 3, lean=in_graph)
    if sampled:
        return Recipe("sampled-moments" if immediate else "sampled", "sampled", shown, 4 if immediate else 9)
    if not numel_known:
        return Recipe("finite", "exact", shown, 9, padded=True)
    if immediate:
        return Recipe("sums", "exact", shown, 4)
    # Read later, when the tensor is gone: its counts come along, and a tensor that turns out to
    # hold non-finite values reports them without min/max/mean/sd (masking every tensor in case it
    # does would cost several times more, on every op).
    return Recipe("moments+counts", "exact", shown, 7, lean=in_graph)


# -- read now: the tensor at hand (the "screen", "sums" and "small-int" recipes) --------------------


def screened(stats: Stats, f: torch.Tensor, tracking: bool) -> Stats:
    """Tracking: one sum proves the tensor finite; only one that is not is counted."""
    if screen_finite(f):
        stats.nan = stats.posinf = stats.neginf = 0
        return stats
    fill(stats, count_vector(f, torch.float64).tolist(), "counts", tracking)
    return stats


def summed(stats: Stats, f: torch.Tensor, dtype: torch.dtype, numel: int, tracking: bool, on_host: bool) -> Stats:
    """Exact statistics, read now. On the CPU from [min, max, sum, sum of squares] (see
    `torchlens.measure.recipes`); on an accelerator, whose every read is a sync, from the two-pass
    vector, read once. A tensor holding non-finite values is measured again, masking them and
    counting them."""
    if on_host:
        f = f.contiguous()  # a transposed or strided view: one copy, cheaper than a second pass
        return from_sums(stats, f, sums_of(f), numel, tracking)
    values = cheap_vector(f, dtype, numel).tolist()
    if math.isfinite(values[0]) and math.isfinite(values[1]):  # no NaN, no infinity
        fill(stats, values, "moments", tracking)  # (a moment past float64's range is dropped)
        return stats
    # non-finite values: min/max/mean/sd of the finite ones, and counts
    fill(stats, finite_vector(f, dtype, f.dim()).tolist(), "finite", tracking)
    return stats


def from_sums(stats: Stats, f: torch.Tensor, values: Sequence[float], numel: int, tracking: bool) -> Stats:
    """Exact statistics from the "sums" vector of `f` (read to the host), measured again from `f`
    in the rare cases the sums cannot give them: finite values whose sums overflowed, a mean large
    against the spread, non-finite values."""
    finite = all(map(math.isfinite, values))
    if finite:
        mn, mx, mean, sd = moments_from_sums(values, numel)
        if sd is not None:  # the common case: nothing more to read
            fill(stats, [mn, mx, mean, sd], "moments", tracking)
            return stats
    f = f.contiguous()  # (read again as `summed` reads it)
    if finite:
        values = _moments(f, values, numel)
    elif all(map(math.isfinite, values[:2])):
        values = _rescaled(f, values[0], values[1], numel)  # finite, but the sums overflowed
    if math.isfinite(values[0]) and math.isfinite(values[1]):  # no NaN, no infinity
        fill(stats, values, "moments", tracking)  # (a moment past float64's range is dropped)
        return stats
    # non-finite values: min/max/mean/sd of the finite ones, and counts
    fill(stats, finite_vector(f, torch.float64, f.dim()).tolist(), "finite", tracking)
    return stats


def summed_together(measured: Sequence[Tuple[Stats, torch.Tensor]], tracking: bool) -> None:
    """`summed` on the CPU for many tensors at once (a compiled graph's returned outputs): the same
    reductions of each, read to the host in one transfer instead of one each, then read as
    `summed` reads them. Each entry is (its `Stats`, a plain float32 or float64 CPU tensor)."""
    parts: list = []
    for _, tensor in measured:
        parts += sum_parts(tensor.contiguous())
    values = torch.stack(parts).tolist() if parts else []  # (float32 parts beside float64 ones widen exactly)
    for i, (stats, tensor) in enumerate(measured):
        from_sums(stats, tensor, values[4 * i:4 * i + 4], stats.numel, tracking)


def screened_together(measured: Sequence[Tuple[Stats, torch.Tensor]], tracking: bool) -> None:
    """`screened` for many CPU tensors at once: their sums read to the host in one transfer."""
    sums = torch.stack([tensor.sum() for _, tensor in measured]).tolist() if measured else []
    for (stats, tensor), total in zip(measured, sums):
        if math.isfinite(total):
            stats.nan = stats.posinf = stats.neginf = 0
        else:
            fill(stats, count_vector(tensor, torch.float64).tolist(), "counts", tracking)


_SUMMED_AS_IS = frozenset((torch.float32, torch.float64))
_SUMMED_IN_FLOAT = frozenset((torch.float16, torch.bfloat16))


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of these CPU tensors is finite, told by one read: the sum of their
    sums. A NaN or an infinity anywhere makes it non-finite, and so may finite values too large for
    it: False then means "not shown finite", to be measured tensor by tensor. A tensor of another
    kind (complex, integer, a subclass), or a failure to read, is not shown finite either."""
    sums = []
    try:
        for tensor in tensors:
            if tensor.__class__ is not torch.Tensor:
                return False
            if tensor.dtype in _SUMMED_AS_IS:
                sums.append(tensor.sum())
            elif tensor.dtype in _SUMMED_IN_FLOAT:
                sums.append(tensor.sum(dtype=torch.float32))
            else:
                return False
        return not sums or math.isfinite(torch.stack(sums).sum().item())
    except Exception:
        return False


def integers(stats: Stats, tensor: torch.Tensor, dtype: torch.dtype, tracking: bool) -> Stats:
    """Exact statistics of integers, read now: from their float copy while that is exact (the
    common case: token ids, positions, counts), else from the integers themselves. A few on the
    CPU are summed in Python (`few_int_values`: the same floats)."""
    values = None
    if dtype == torch.float64 and tensor.numel() <= FEW_INTEGERS and tensor.device.type == "cpu":
        values = few_int_values(tensor)
    if values is None:
        values = small_int_vector(tensor.detach().to(dtype)).tolist()
    bound = exact_below(dtype)
    if -bound < values[0] and values[1] < bound:
        fill(stats, values, "small-int", tracking)
        return stats
    # integers past the float's exact ones: measured again in integers
    fill(stats, int_vector(tensor, tensor.dtype, dtype, tensor.dim()).tolist(), "int", tracking)
    return stats


def _moments(f: torch.Tensor, sums, numel: int) -> list:
    """[min, max, mean, sd] from a "sums" vector, the sd measured about the mean when the
    sums cannot give it (see `torchlens.measure.recipes.CONDITION_LIMIT`)."""
    mn, mx, mean, sd = moments_from_sums(sums, numel)
    if sd is None:
        mean, sd = about_the_mean(f, mean, numel)
    return [mn, mx, mean, sd]


def _rescaled(f: torch.Tensor, mn: float, mx: float, numel: int) -> list:
    """[min, max, mean, sd] of finite values too large for their sums (near the dtype's
    largest): the sums of `f` divided by a power of two (exact, bar values too small to matter
    beside the largest), scaled back on the host, where float64 holds them."""
    exponent = math.ceil(math.log2(max(abs(mn), abs(mx))))
    scaled = f * 2.0 ** -exponent  # a multiplier, not a divisor: 2**128 is past float32's range
    _, _, mean, sd = _moments(scaled, sums_of(scaled), numel)
    return [mn, mx, _ldexp(mean, exponent), _ldexp(sd, exponent)]


def _ldexp(value: float, exponent: int) -> float:
    """`value * 2**exponent`, infinite past float64's range (the statistic is then dropped and
    named, never printed as `inf`: see `torchlens.measure.stats.fill`)."""
    try:
        return math.ldexp(value, exponent)
    except OverflowError:
        return math.copysign(math.inf, value)


# -- the vectors -----------------------------------------------------------------------------------


def screen_vector(f, dtype: torch.dtype):
    """[sum]: finite only if every element is (see the module docstring)."""
    return f.sum()[None].to(dtype)


def screen_finite(f) -> bool:
    """Whether the screen proves every element of `f` finite (False: measure the counts)."""
    return math.isfinite(f.sum().item())


def sums_of(f) -> list:
    """[min, max, sum, sum of squares] of `f` (contiguous, float32 or float64), read to the host:
    what "sums" measures. Few torch calls: on small tensors their fixed cost is what counts."""
    return torch.stack(sum_parts(f)).tolist()  # (float32 parts beside a float64 one widen to it exactly)


def sum_parts(f) -> list:
    """The four 0-d tensors of `sums_of` (not read yet): min, max and sum in `f`'s dtype, and the
    sum of squares (`sum_of_squares`: float64 past a million elements)."""
    mn, mx = torch.aminmax(f)
    flat = f.reshape(-1)
    return [mn, mx, flat.sum(), torch.dot(flat, flat) if flat.numel() < _ROWS_FROM else sum_of_squares(flat)]


_ROW = 4096  # elements per row of a large tensor's sum of squares
_ROWS_FROM = 1 << 20  # below a million elements a dot product's error stays under about 3e-6


def sum_of_squares(flat):
    """Σx² of a 1-d contiguous tensor, in float64. A float32 dot product accumulates along the
    whole tensor (relative error about 1e-4 at 10 million elements); taken as rows of 4096, whose
    norms are summed in float64, it stays near 1e-9, at a fixed cost of a few calls that only pays
    on large tensors."""
    numel = flat.numel()
    if numel < _ROWS_FROM:
        return torch.dot(flat, flat).double()
    whole = numel // _ROW * _ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, _ROW), dim=1).double()
    tail = flat[whole:]
    return torch.dot(rows, rows) + torch.dot(tail, tail).double()


def _counts(recipe: Recipe, f, dtype, numel):
    return lean_count_vector(f, dtype, numel if isinstance(numel, int) else UNKNOWN_NUMEL) if recipe.lean \
        else count_vector(f, dtype)


def _padded(f, dtype):
    """A dynamic size that may be zero: one NaN appended keeps the reductions defined."""
    padded = torch.cat([f.reshape(-1), f.new_full((1,), float("nan"))])
    return finite_vector(padded, dtype, 1)


UNKNOWN_NUMEL = 1 << 62  # a dynamic element count: `lean_count_vector`'s int64 sums, exact at any size

_BUILDERS: "dict[str, Callable]" = {
    "bool": lambda r, f, dtype, numel, ndim: f.sum()[None].to(dtype),
    "finite": lambda r, f, dtype, numel, ndim: _padded(f, dtype) if r.padded else finite_vector(f, dtype, ndim),
    "counts": lambda r, f, dtype, numel, ndim: _counts(r, f, dtype, numel),
    "moments": lambda r, f, dtype, numel, ndim: cheap_vector(f, dtype, numel),
    "moments+counts": lambda r, f, dtype, numel, ndim: torch.cat([cheap_vector(f, dtype, numel),
                                                                  _counts(r, f, dtype, numel)]),
}


# -- reading "sums" --------------------------------------------------------------------------------

# The sd is taken from sums only while the mean is small against the spread: with
# sum of squares / (n * variance) below this, subtracting the sums loses fewer digits than the
# two-pass sd's own rounding; past it the sd is measured about the mean.
CONDITION_LIMIT = 4.0


def moments_from_sums(values: Sequence[float], numel: int):
    """(min, max, mean, sd) from a "sums" vector, or None for the sd when it must be measured
    about the mean (see `CONDITION_LIMIT`). All four entries must be finite."""
    mn, mx, total, squares = values[:4]
    mean = total / numel
    spread = squares - total * mean  # n * variance, computed from the sums
    if spread <= 0 or squares > CONDITION_LIMIT * spread:
        return mn, mx, mean, None
    return mn, mx, mean, math.sqrt(spread / max(numel - 1, 1))


def about_the_mean(f, mean: float, numel: int):
    """(mean, sd) measured again about `mean`, for a tensor whose sums cannot give its sd.

    The shift is `mean` as `f`'s dtype holds it, so `f - shift` is exact for the elements near it;
    the shifted elements' mean is tiny against their spread, so their sums lose nothing, and the
    shift's own rounding is taken out exactly. `f` is contiguous, float32 or float64.
    """
    shift = torch.tensor(mean, dtype=f.dtype).item()
    deviation = (f - shift).reshape(-1)
    total, squares = torch.stack([deviation.sum().double(), sum_of_squares(deviation)]).tolist()
    variance = max(squares - total * total / numel, 0.0) / max(numel - 1, 1)
    return shift + total / numel, math.sqrt(variance)
