"""Provenance: where the values a tensor holds come from, for non-finite tracking's verdicts.

An op's output comes from the op that produced it, then from every op that wrote into its memory
since (an in-place op, an indexed assignment, a write through a view of the same storage), from
the last write that covered all of it on (`origin_chain`: the rule both substrates use; the
compiled plan applies it at compile time to the fake tensors of a graph, `fx_backend.plan`). A
tensor no tracked op produced is a `Source` (a parameter, a buffer, a constant, an input), named
and measured only when a verdict needs it. Whether a call wrote into its arguments is
`memory.call_writes`'s rule, applied by the capture before it tells `Provenance.produced`; which
memory a tensor is in, and which part of it, `torchlens.measure.memory`'s facts.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..events import Event
from ..findings import NAN, NEGINF, POSINF
from ..findings import bits as _bits
from .memory import covers, memory_span, storage_key, storage_ref, tensors_of, version
from .stats import as_float, is_dtensor, plain_values

__all__ = ["LazyReads", "Provenance", "Source", "carried_kinds", "origin_chain", "passed_in", "tensor_arguments"]


def origin_chain(first, writes, after: int, span) -> tuple:
    """What a value holds comes from `first` (the op that produced it, or a source), then from each
    of `writes` — (ref, position, span written), in order — made after position `after`, from the
    last write that covered all of the value's `span` on (an unknown span is never covered)."""
    refs = [first]
    for ref, position, written in writes:
        if position > after:
            if covers(written, span):
                refs = []  # this write replaced everything the value holds
            refs.append(ref)
    return tuple(refs)


class _Producer(NamedTuple):
    """The op that produced a tensor, kept by the tensor's identity (checked by the weak reference:
    an identity is reused once its tensor is freed)."""

    ref: weakref.ref
    event: Event


class _Write(NamedTuple):
    """An op that wrote into a storage: which, where in the pass it landed, the span it wrote (as
    `origin_chain` takes writes)."""

    event: Event
    position: float
    span: object  # memory.memory_span of what it wrote (None: unknown)


class _Written(NamedTuple):
    """The writes into one storage, while the storage lives (its key may then stand for another)."""

    ref: StorageWeakRef
    writes: List[_Write]


class Provenance:
    """What produced, and what since wrote, the tensors of one forward (by identity and storage)."""

    def __init__(self, names: Callable[[], Dict[int, str]]):
        self._names = names  # id(tensor) -> dotted name, of the model's parameters and buffers
        self._name_table: Optional[Dict[int, str]] = None
        self._producers: Dict[int, _Producer] = {}
        self._writers: Dict[int, _Written] = {}  # by storage key (`memory.storage_key`)
        self.sources: Dict[int, Source] = {}

    def origin_of(self, tensor: torch.Tensor) -> tuple:
        """Where `tensor`'s values come from: the op that produced it (or a Source) and the ops
        that wrote into its memory since, from the last write that covered all of it on."""
        known = self._producers.get(id(tensor))
        producer = known.event if known is not None and known.ref() is tensor else None
        first = producer if producer is not None else self.source(tensor)
        if not self._writers:
            return (first,)
        key = storage_key(tensor)  # (most memory was never written)
        entry = self._writers.get(key) if key is not None else None
        if entry is None or entry.ref.expired():
            return (first,)
        after = -1 if producer is None else producer.ordinal
        later = [write for write in entry.writes if write.position > after and write.event is not producer]
        if not later:  # written only before it was produced (or by its producer: `relu_`)
            return (first,)
        return origin_chain(first, later, after, memory_span(tensor))

    def source(self, tensor: torch.Tensor) -> Source:
        source = self.sources.get(id(tensor))
        if source is None or (source.ref is not None and source.ref() is not tensor):
            if self._name_table is None:
                self._name_table = self._names()
            label = self._name_table.get(id(tensor)) or _label(tensor)
            source = self.sources[id(tensor)] = Source(label, tensor)
        return source

    def sources_of(self, tensors) -> list:
        """The `Source` each tensor is known as so far (None where it is not one yet)."""
        return [self.sources.get(id(tensor)) for tensor in tensors]

    def met_after_writing(self, tensors, known) -> None:
        """`tensors` were written by the op that read them, and those that became sources only
        now (not in `known`, from `sources_of` before) were first met after the write: what they
        hold says nothing of what the op read, so their measurement is void."""
        for tensor, before in zip(tensors, known):
            source = self.sources.get(id(tensor))
            if source is not None and source is not before:
                source.version = _WRITTEN

    def produced(self, event: Event, out, args=(), kwargs=None, position: Optional[float] = None) -> None:
        """Remember that `event` produced the tensors in `out` (one tensor, or a tuple/list).
        `args` and `kwargs` are given for a call that writes into its arguments (`memory.call_writes`):
        an output that is one of them (`x.add_(y)`, `out=buf`, a `_foreach_*_` list) was written
        in place. `position`: where in the pass the write landed, when later than the op's own
        ordinal (an asynchronous collective's values arrive when they are waited on)."""
        for tensor in (out,) if out.__class__ is torch.Tensor else tensors_of(out):
            self._producers[id(tensor)] = _Producer(weakref.ref(tensor), event)
            if tensor.__class__ is not torch.Tensor and is_dtensor(tensor):  # its shard is the op's too
                local = tensor._local_tensor  # type: ignore[attr-defined]  # a DTensor's shard: private to torch
                self._producers[id(local)] = _Producer(weakref.ref(local), event)
            if (args or kwargs) and passed_in(tensor, args, kwargs):
                self._wrote(event, tensor, event.ordinal if position is None else position)

    def _wrote(self, event: Event, tensor: torch.Tensor, position: float) -> None:
        ref = storage_ref(tensor)
        if ref is None:
            return
        entry = self._writers.get(ref.cdata)
        if entry is None or entry.ref.expired():  # new memory (perhaps at a freed one's address)
            entry = self._writers[ref.cdata] = _Written(ref, [])
        entry.writes.append(_Write(event, position, memory_span(tensor)))


class Source:
    """A tensor no tracked op produced: a parameter, a buffer, a constant. Measured only when an
    op holds a non-finite value its other inputs do not explain (a host read, then, and only then)."""

    __slots__ = ("label", "ref", "_kinds", "counts", "reported", "version")

    def __init__(self, label: str, tensor: Optional[torch.Tensor]):
        self.label = label
        self.ref = weakref.ref(tensor) if tensor is not None else None
        self._kinds: Optional[int] = -1  # -1: not measured yet
        self.counts = ""
        self.reported = False  # its finding is made once, at the first op that reads it
        # Measured later than it was read (when a finding needs it): if written in place since
        # (a buffer updated by the forward), what it held when read is unknown.
        self.version = version(tensor)

    def kinds(self) -> Optional[int]:
        if self._kinds == -1:
            self._kinds = self._measure()
        return self._kinds

    @property
    def measured(self) -> bool:
        """Whether `kinds()` was asked for (it measured the tensor then; asking now reads nothing)."""
        return self._kinds != -1

    def _measure(self) -> Optional[int]:
        tensor = self.ref() if self.ref is not None else None
        if tensor is None or version(tensor) != self.version:
            return None
        try:
            values = plain_values(tensor).detach()
            if not (values.dtype.is_floating_point or values.dtype.is_complex):
                return 0
            values = as_float(values, values.dtype)  # complex by magnitude, as the meter measures it
            counts = torch.stack([torch.isnan(values).sum(), torch.isposinf(values).sum(),
                                  torch.isneginf(values).sum()]).tolist()
        except Exception:
            return None
        self.counts = " ".join(f"{name}={count}" for name, count in zip(("nan", "+inf", "-inf"), counts) if count)
        return _bits(*counts)


def carried_kinds(args, kwargs) -> int:
    """Non-finite kinds a call's scalar arguments carry in (`float("-inf")` in `masked_fill`;
    NumPy floats are floats too; a complex scalar by its magnitude, as complex tensors are measured)."""
    kinds = 0
    for value in (*args, *kwargs.values()):
        for item in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(item, complex):
                item = _magnitude(item)
            if isinstance(item, float) and not math.isfinite(item):
                kinds |= NAN if item != item else (POSINF if item > 0 else NEGINF)
    return kinds


def _magnitude(value: complex) -> float:
    """|value| as far as finiteness goes: infinite if a part is, NaN if a part is and none is
    infinite (`abs` raises where the magnitude of finite parts overflows; torch would give inf)."""
    if math.isinf(value.real) or math.isinf(value.imag):
        return math.inf
    return math.nan if math.isnan(value.real) or math.isnan(value.imag) else 0.0


def _label(tensor: torch.Tensor) -> str:
    """How a tensor no narrated op produced is named when it is not a parameter or buffer."""
    try:
        dims = ",".join(str(size) for size in tensor.shape)
    except RuntimeError:  # a nested tensor
        dims = "nested"
    return f"a [{dims}] tensor no narrated op produced"


class LazyReads:
    """What an op read (`Tracker.reads_of`), worked out only if a verdict needs it.

    Most outputs are finite, and a finite output's verdict never asks where its values came from;
    on the CPU the verdict is drawn as the op returns, so the capture asks for the reads only when
    the op is still waiting for its verdict (statistics to be read later) or its output is not
    finite (`resolve`), and drops them otherwise. They must be worked out before the op's own
    outputs are registered (`Tracker.produced`): an op that wrote into its input would otherwise
    be found as the origin of what it read. Unpacks as `(refs, carried)`."""

    __slots__ = ("_tracker", "_args", "_kwargs", "_value")

    def __init__(self, tracker, args, kwargs):  # a `tracking.Tracker`
        self._tracker = tracker
        self._args = args
        self._kwargs = kwargs
        self._value = None

    @property
    def resolved(self) -> Optional[tuple]:
        """`(refs, carried)` once worked out; None while it has not been (nothing is worked out here)."""
        return self._value

    def resolve(self) -> tuple:
        if self._value is None:
            self._value = self._tracker.reads_of(self._args, self._kwargs)
            self._args = self._kwargs = self._tracker = None  # keep no tensor alive by it
        return self._value

    def resolve_written(self, out) -> None:
        """Resolve now, for an op that wrote into one of its own arguments (in place, `out=`). A
        tensor it wrote that no earlier op produced or read is first met here, after the write:
        what it holds now says nothing of what the op read, so its measurement is void (what the
        op read stays unknown, never blamed on the values the op itself wrote)."""
        provenance = self._tracker.provenance
        written = tensors_of(out)
        known = provenance.sources_of(written)
        self.resolve()
        provenance.met_after_writing(written, known)

    def __iter__(self):
        return iter(self.resolve())


_WRITTEN = -1  # a Source's version when it was first met after the op that read it wrote into it


def tensor_arguments(args, kwargs) -> List[torch.Tensor]:
    """The tensors a call was given (`memory.tensors_of` of its arguments), in order."""
    return tensors_of((args, tuple(kwargs.values()))) if kwargs else tensors_of(args)


def passed_in(tensor: torch.Tensor, args, kwargs) -> bool:
    """Whether `tensor` is one of a call's tensor arguments (the call wrote into it)."""
    return any(value is tensor or (isinstance(value, (list, tuple)) and any(item is tensor for item in value))
               for value in ((*args, *kwargs.values()) if kwargs else args))
