"""Measuring op outputs eagerly, at the rung and tracking mode a run asked for.

What to compute for each tensor, and how, comes from `torchlens.measure.recipes` (the ladder the
compiled path shares, and the recipes read while the tensor is at hand); this module decides *when*
it is read, and shares statistics between views of the same elements. Values on the CPU are read
as each op completes: there is no device to wait for, and with the tensor at hand the cheap
recipes apply ("screen" for tracking, "sums" for exact statistics; each measured again from the
tensor in the rare case it cannot vouch for itself). An accelerator's vectors are read together
once per forward, unless the op's line is printed now (or `on_nonfinite="raise"` must decide at
once), so metadata-free runs keep the one-read-per-forward discipline.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from ..events import Stats, StatsGroup
from .memory import elements_identity
from .recipes import (
    Recipe,
    integers,
    not_applicable,
    recipe,
    screen_vector,
    screened,
    screened_together,
    summed,
    summed_together,
)
from .stats import (
    SAMPLE_SIZE,
    applicable,
    as_float,
    cheap_vector,
    count_vector,
    fill,
    finite_vector,
    is_dtensor,
    is_wrapped,
    measures,
    plain_values,
    sample_indices,
    unmeasured,
    value_kind,
    vector_dtype,
)

__all__ = ["READ_NOW", "Meter", "Pending"]

# Devices whose values are read as each op completes (no device to wait for). Everything else is
# read once per forward. Tests empty it to check the deferred discipline without an accelerator.
READ_NOW = {"cpu"}


class Pending(NamedTuple):
    """A statistics vector still on the device, and the recipe that reads it into a `Stats`."""

    stats: Stats
    vector: torch.Tensor
    recipe: Recipe


class _Known(NamedTuple):
    """Statistics taken this forward, kept by the elements they cover (`memory.elements_identity`)."""

    base: weakref.ref  # the tensor the key's identity stands for while it lives
    stats: Stats
    read_now: bool  # whether they were read as the op completed (else with the rest of the pass)


class Meter:
    """Measures the values of one forward or backward run, following the rung and the tracking mode.

    `observe` is the one entry for a value (an op's output, a backward node's gradients): a `Stats`
    complete when read now, otherwise filled in by `flush()` at the end, one transfer per device.
    """

    def __init__(self, rung: str, tracking: bool, dtensors: str = "local", raising: bool = False,
                 judging: bool = False):
        self.rung = rung
        self.tracking = tracking
        self.raising = raising  # `on_nonfinite="raise"`: it decides at each value
        self.judging = judging  # tracking judges each value as it is recorded
        self._whole_dtensors = dtensors == "global"  # (`dtensor_stats=`: see `_measure_whole`)
        self.pending: List[Pending] = []
        # Statistics already taken this forward, by the elements they cover (views share them). A
        # sample depends on the layout, so only exact statistics and counts are shared.
        self._known: Dict[tuple, _Known] = {}
        self._sharing = rung != "sampled"
        # A CPU forward measures nearly every op the same way: one screen (tracking without
        # statistics) or one "sums" recipe (exact statistics); `_measure_plain` takes that case in
        # few calls (see `measure`).
        self._plain = "screen" if tracking and rung in ("off", "reuse") else "sums" if rung == "exact" else None

    @classmethod
    def of(cls, settings, judging: bool) -> Optional["Meter"]:
        """The meter `settings` ask for (None when they measure nothing)."""
        tracking = settings.on_nonfinite is not None
        meter = cls(settings.value_stats, tracking, settings.dtensor_stats, settings.on_nonfinite == "raise",
                    tracking and judging)
        return meter if meter.active else None

    @property
    def active(self) -> bool:
        return measures(self.rung, self.tracking)

    @property
    def screens(self) -> bool:
        """Whether a plain float tensor's measurement is tracking's screen alone (no statistics):
        then a finite value's `Stats` says nothing but "finite"."""
        return self._plain == "screen"

    def observe(self, value, printed: bool = False):
        """The statistics of `value` (a tensor; a sequence: a `StatsGroup`), read now when `raise` must
        decide at it, when `printed` (its line prints now; or it will not stay as it is), or when
        tracking judges it now as its device is read at once (`on_host`); else with the rest, in one
        read (an accelerator's way). Never raises: "n/a" when it cannot measure."""
        if value.__class__ is _TENSOR:  # (the common case, once an op: `on_host` and `measure_output` inline)
            return self.measure(value, self.raising or printed or (self.judging and value.device.type in READ_NOW))
        return self.measure_output(value, self.raising or printed or (self.judging and self.on_host(value)))

    @staticmethod
    def on_host(value) -> bool:
        """Whether `value` (a tensor; a sequence: its first) has no device to wait for (`READ_NOW`)."""
        if value.__class__ is not _TENSOR and isinstance(value, (tuple, list)):
            for item in value:  # (a node's gradients, once a node: a loop, not a generator)
                if isinstance(item, torch.Tensor):
                    return item.device.type in READ_NOW
            return False
        return isinstance(value, torch.Tensor) and value.device.type in READ_NOW

    def measure_output(self, out, live: bool):
        """Stats of an output (a tensor, or a StatsGroup for several), read now if `live`: what
        `observe` measures with, and the compiled path's outputs returned by a graph."""
        if isinstance(out, torch.Tensor):
            return self.measure(out, live)
        return StatsGroup([self.measure(t, live) for t in out if isinstance(t, torch.Tensor)])

    def measure(self, tensor: torch.Tensor, live: bool) -> Stats:
        """Never raises: whatever cannot be measured says so ("n/a") and the capture goes on."""
        try:
            if tensor.__class__ is not _TENSOR and is_dtensor(tensor):
                if self._whole_dtensors:
                    return self._measure_whole(tensor)
                local = tensor._local_tensor  # type: ignore[attr-defined]  # a DTensor's shard: private to torch
                return _of_local_shard(self.measure(local, live))
            if self._is_plain(tensor):
                return self._measure_plain(tensor)
            identity = elements_identity(tensor) if self._sharing else None
            known = self._shared(identity, live) if identity is not None else None
            if known is not None:
                return known
            values = plain_values(tensor)
            now = live or values.device.type in READ_NOW
            stats = self._measure(values, now)
            if identity is not None:
                self._known[identity[1]] = _Known(weakref.ref(identity[0]), stats, now)
            return stats
        except Exception as exc:
            return Stats("na", tensor.numel(), self.rung != "off",
                         note=f"{type(exc).__name__} measuring {tensor.dtype}")

    def measures_collectively(self, tensors) -> bool:
        """Whether measuring these tensors takes a collective (`dtensor_stats="global"` and a DTensor
        among them): then every rank must measure them, whatever its own values say."""
        return self._whole_dtensors and any(tensor.__class__ is not _TENSOR and is_dtensor(tensor)
                                            for tensor in tensors)

    def _measure_whole(self, tensor) -> Stats:
        """A DTensor's statistics over its whole value (`dtensor_stats="global"`): a replicated one
        is whole on every rank; any other is gathered (or its partial values summed) first, one
        collective, which every rank runs as it measures the same op."""
        if all(placement.is_replicate() for placement in tensor.placements):
            whole = tensor._local_tensor
        else:
            with torch.no_grad():
                whole = tensor.full_tensor()
        stats = self._measure(plain_values(whole), True)
        if stats.kind == "na" or stats.note:
            return stats
        stats.note = "(global)"
        return stats

    def _measure(self, tensor: torch.Tensor, now: bool) -> Stats:
        reason = applicable(tensor)
        if reason is not None:
            return not_applicable(reason, self.rung).stats(tensor.numel())
        numel = tensor.numel()
        kind = value_kind(tensor.dtype)
        sampled = kind == "float" and self.rung == "sampled" and numel > SAMPLE_SIZE
        chosen = recipe(kind, self.rung, immediate=now, sampled=sampled)
        stats = chosen.stats(numel)
        if not chosen.measures:
            return stats
        dtype = vector_dtype(tensor.device)
        if chosen.layout == "small-int":
            return integers(stats, tensor, dtype, self.tracking)
        if kind != "float":  # bools and integers: the tensor itself
            return self._start(stats, chosen.build(tensor, dtype, numel, tensor.dim(), tensor.dtype), chosen, now)
        f = as_float(tensor, tensor.dtype)
        if sampled:
            return self._sampled(stats, f, numel, now)
        if chosen.layout == "screen":
            return screened(stats, f, self.tracking)
        if chosen.layout == "sums":
            return summed(stats, f, dtype, numel, self.tracking, f.device.type in READ_NOW)
        return self._start(stats, chosen.build(f, dtype, numel, f.dim()), chosen, now)

    # -- read now: the tensor is at hand ------------------------------------------------------------

    def measure_all(self, tensors: Sequence[torch.Tensor]) -> List[Stats]:
        """`measure(tensor, False)` of each tensor (a compiled graph's returned outputs, all at hand):
        the same values, with the common case's reductions (`_is_plain`) read to the host in one
        transfer, not one a tensor (`recipes.screened_together`, `recipes.summed_together`)."""
        results: List[Stats] = []
        waiting: List[tuple] = []  # (stats, tensor) to read together
        keys: List[Optional[tuple]] = []  # the `_known` key of each waiting pair
        for tensor in tensors:
            if tensor.__class__ is not _TENSOR or not self._is_plain(tensor):
                results.append(self.measure(tensor, False))
                continue
            identity = elements_identity(tensor, plain=True)
            known = self._shared(identity, True) if identity is not None else None
            if known is None:
                known = self._plain_stats(tensor.numel())
                if known.kind != "na":
                    waiting.append((known, tensor.detach()))
                    keys.append(None if identity is None else identity[1])
                if identity is not None:  # (filled below: a view later in the list shares it)
                    self._known[identity[1]] = _Known(weakref.ref(identity[0]), known, True)
            results.append(known)
        if waiting:
            self._read_together(waiting, keys)
        return results

    def _read_together(self, waiting: List[tuple], keys: List[Optional[tuple]]) -> None:
        """Fill the waiting (stats, tensor) pairs. Never raises: if reading them together fails,
        each is measured alone, and one that fails again says "n/a" and is not kept for views
        to share (as `measure` would leave it)."""
        try:
            if self._plain == "screen":
                screened_together(waiting, self.tracking)
            else:
                summed_together(waiting, self.tracking)
            return
        except Exception:
            pass
        for (stats, tensor), key in zip(waiting, keys):
            try:
                if self._plain == "screen":
                    screened(stats, tensor, self.tracking)
                else:
                    summed(stats, tensor, vector_dtype(tensor.device), stats.numel, self.tracking, True)
            except Exception as exc:
                unmeasured(stats, f"{type(exc).__name__} measuring {tensor.dtype}")
                if key is not None:
                    self._known.pop(key, None)

    def _is_plain(self, tensor: torch.Tensor) -> bool:
        """The common case on the CPU, measured without the ladder's lookups: a plain float32 or
        float64 tensor, screened or summed as it is (what `_measure` would decide for it)."""
        return (self._plain is not None and tensor.dtype in _REDUCED_AS_IS and tensor.device.type in READ_NOW
                and tensor.layout is torch.strided and not tensor.is_nested and not is_wrapped(tensor))

    def _plain_stats(self, numel: int) -> Stats:
        """The `Stats` a plain tensor's measurement fills ("n/a" when it is empty: nothing to read)."""
        if numel == 0:
            return not_applicable("empty", self.rung).stats(0)
        return Stats("counts", numel, self.rung == "reuse") if self._plain == "screen" else Stats("exact", numel)

    def _measure_plain(self, tensor: torch.Tensor) -> Stats:
        """`measure` for the common case (`_is_plain`); statistics shared between views of the same
        elements (`memory.elements_identity`)."""
        identity = elements_identity(tensor, plain=True)
        known = self._shared(identity, True) if identity is not None else None
        if known is not None:
            return known
        stats = self._plain_stats(tensor.numel())
        if stats.kind != "na" and self._plain == "screen":
            screened(stats, tensor.detach(), self.tracking)
        elif stats.kind != "na":
            summed(stats, tensor.detach(), vector_dtype(tensor.device), stats.numel, self.tracking, True)
        if identity is not None:
            self._known[identity[1]] = _Known(weakref.ref(identity[0]), stats, True)
        return stats

    def forget(self, tensors) -> None:
        """Statistics taken of these tensors' memory no longer stand: something wrote it without
        bumping its version counter (a `torch.distributed` collective)."""
        bases = {id(tensor._base if tensor._base is not None else tensor) for tensor in tensors}
        for key in [key for key in self._known if key[0] in bases]:  # (the identity's first part)
            del self._known[key]

    def known(self, tensor: torch.Tensor) -> Optional[Stats]:
        """The statistics this forward already took of `tensor`'s elements, without reading
        anything (None where it took none, or measured it on a path that keeps no record)."""
        try:
            identity = elements_identity(tensor) if self._sharing else None
        except Exception:
            return None
        return self._shared(identity, False) if identity is not None else None

    def _shared(self, identity, live: bool):
        """The statistics already taken of the same elements (`memory.elements_identity`), if they
        still stand for them (the same base alive) and were read at once when this one must be (`live`)."""
        known = self._known.get(identity[1])
        if known is not None and known.base() is identity[0] and (known.read_now or not live):
            return known.stats
        return None

    def _sampled(self, stats: Stats, f: torch.Tensor, numel: int, now: bool) -> Stats:
        """A seeded sample's statistics; with tracking, the whole tensor's counts (screened when read
        now, counted from the start when read later)."""
        dtype = vector_dtype(f.device)
        sample = torch.take(f, sample_indices(numel, f.device))
        stats.sampled = sample.numel()
        if not now:
            counts = [count_vector(f, dtype)] if self.tracking else []
            vector = torch.cat([finite_vector(sample, dtype, 1)] + counts)
            self.pending.append(Pending(stats, vector, recipe("float", "sampled", sampled=True)))
            return stats
        head = cheap_vector(sample, dtype, sample.numel())
        values = (torch.cat([head, screen_vector(f, dtype)]) if self.tracking else head).tolist()
        if all(map(math.isfinite, values[:4])):
            fill(stats, values[:4], "sampled-moments", False)
        else:
            fill(stats, finite_vector(sample, dtype, 1).tolist(), "sampled", False)
        if self.tracking:
            if math.isfinite(values[4]):
                stats.nan = stats.posinf = stats.neginf = 0
            else:
                stats.nan, stats.posinf, stats.neginf = (int(v) for v in count_vector(f, dtype).tolist())
        return stats

    # -- read later: once per forward, per device -----------------------------------------------

    def _start(self, stats: Stats, vector: torch.Tensor, recipe_: Recipe, now: bool) -> Stats:
        if not now:
            self.pending.append(Pending(stats, vector, recipe_))
            return stats
        recipe_.read(stats, vector.tolist(), self.tracking)
        return stats

    def flush(self) -> None:
        """Read every pending vector: one transfer per device for the whole forward."""
        devices = {item.vector.device for item in self.pending}
        for device in devices:
            self.read_along(torch.zeros(0, dtype=vector_dtype(device), device=device))

    def read_along(self, vector: torch.Tensor) -> List[float]:
        """Read `vector` to the host, and in the same transfer every pending vector on its device.

        The compiled path reads each graph's statistics this way, so the ops measured between
        graphs cost no transfer of their own.
        """
        mine = [item for item in self.pending if item.vector.device == vector.device]
        self.pending = [item for item in self.pending if item.vector.device != vector.device]
        try:
            parts = [vector.reshape(-1)] + [item.vector.to(vector.dtype).reshape(-1) for item in mine]
            values = torch.cat(parts).tolist()
        except Exception:  # one vector that cannot be read must not take the others with it
            return self._read_one_by_one(vector, mine)
        start = vector.numel()
        for item in mine:
            size = item.vector.numel()
            item.recipe.read(item.stats, values[start:start + size], self.tracking)
            start += size
        return values[:vector.numel()]

    def _read_one_by_one(self, vector: torch.Tensor, items: List[Pending]) -> List[float]:
        """The slow path of `read_along`: each vector on its own; one that fails says why."""
        for item in items:
            try:
                values = item.vector.reshape(-1).tolist()
                item.recipe.read(item.stats, values, self.tracking)
            except Exception as exc:
                unmeasured(item.stats, f"{type(exc).__name__} reading its statistics")
        return vector.reshape(-1).tolist()


def _of_local_shard(stats: Stats) -> Stats:
    """A DTensor's statistics are its local shard's, and say so (a copy: the shard's own may be
    shared with a view of it)."""
    if stats.kind == "na" or stats.note:
        return stats
    shown = copy.copy(stats)
    shown.note = "(local shard)"
    return shown


_TENSOR = torch.Tensor


# Float dtypes reduced as they are (`torchlens.measure.stats.as_float` keeps them; narrower ones are
# reduced in float32, whose range their values cannot overflow).
_REDUCED_AS_IS = frozenset((torch.float32, torch.float64))
