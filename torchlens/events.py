"""The one event model both substrates produce.

A forward pass becomes a sequence of `Event`s: the forward's tensor inputs ("input source"), each
torch-level operation that produced a tensor, module enter/exit transitions, and the forward's tensor
outputs. Everything downstream (selection, the line grammar, sinks, crash tails, compare) reads only
these records, so the eager substrate and the compiled one are narrated by the same code.

Records are plain slotted classes rather than dataclasses: the eager substrate builds one per
captured op, and construction cost is on the hot path.
"""

from __future__ import annotations

import enum
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .narration.stats_text import stats_text

__all__ = ["ENTER", "EXIT", "GRAD", "INPUT", "NODE", "OP", "OUTPUT", "Attempt", "BackwardAttempt", "BackwardEvent",
           "Event", "EventKind", "Scope", "ShardedMeta", "Stats", "StatsGroup", "TensorMeta"]


class EventKind(str, enum.Enum):
    INPUT = "input"
    OP = "op"
    ENTER = "enter"
    EXIT = "exit"
    OUTPUT = "output"
    NODE = "node"  # a backward node ran (an autograd function, or a gradient accumulated into a leaf)
    GRAD = "grad"  # the gradient of a forward output arrived from outside the forward (the loss)


INPUT = EventKind.INPUT
OP = EventKind.OP
ENTER = EventKind.ENTER
EXIT = EventKind.EXIT
OUTPUT = EventKind.OUTPUT
NODE = EventKind.NODE
GRAD = EventKind.GRAD


class Scope:
    """A module's place in the hierarchy: its dotted path, class name, depth and parent.

    The root module has path "" and depth 0. Depth counts module *calls*: `blocks.0.attn` called by
    `blocks.0` called by the root has depth 2, since the container `blocks` is never called itself;
    a module that lives elsewhere in the tree but is called from inside `blocks.0` nests under it.
    Scopes are interned per capture, so two events in the same module call share one `Scope`.

    `key` tells module *calls* apart: it is the path, with `@N` added for the N-th re-entry of a
    module within one compiled graph (`proj(proj(x))`), so two consecutive calls of the same module
    are narrated as two enter/exit pairs.
    """

    __slots__ = ("path", "type_name", "depth", "parent", "key", "lines")

    path: str
    type_name: str
    depth: int
    parent: Optional["Scope"]
    key: str
    lines: Optional[Tuple[str, str]]

    def __init__(self, path: str, type_name: str, parent: Optional["Scope"], key: Optional[str] = None):
        self.path = path
        self.type_name = type_name
        self.parent = parent  # the enclosing module that was *called* (a ModuleList never is)
        self.depth = 0 if parent is None else parent.depth + 1
        self.key = path if key is None else key
        self.lines = None  # its (enter, exit) lines once rendered: they depend only on the fields above

    def chain(self) -> Tuple["Scope", ...]:
        """The scopes from the root's first child down to this one (the root itself excluded)."""
        out = []
        scope: Optional[Scope] = self
        while scope is not None and scope.parent is not None:
            out.append(scope)
            scope = scope.parent
        return tuple(reversed(out))

    def __repr__(self) -> str:
        return f"Scope({self.path!r}, {self.type_name})"


class TensorMeta(tuple):
    """What narration shows of a tensor without reading its payload: (shape, dtype, device).

    `shape` holds ints, or strings for symbolic sizes when a compiled graph is narrated with
    `symbolic_shapes=True`. `dtype` and `device` are the torch objects themselves; the grammar
    abbreviates them. A tuple, so that hashing and comparing it (rendering memoises on it) is fast.
    """

    __slots__ = ()

    def __new__(cls, shape, dtype, device):
        return tuple.__new__(cls, (shape, dtype, device))

    def __getnewargs__(self):  # copy and pickle build it from its three fields, like the constructor
        return tuple(self)

    @classmethod
    def of(cls, tensor) -> "TensorMeta":
        return cls.single(tensor)[0]

    @classmethod
    def single(cls, tensor) -> Tuple["TensorMeta"]:
        """`(TensorMeta.of(tensor),)`: the outputs of an op that returned one tensor.

        Interned: a forward repeats a few shapes many times, and a training loop repeats them every
        step, so ops of the same shape share one description (and one tuple of it). Events then
        hold no object of their own for it, and a long run's steps leave that many fewer objects
        for the garbage collector to move into its older generations."""
        if tensor.__class__ is not _TENSOR and hasattr(tensor, "placements") and hasattr(tensor, "_local_tensor"):
            return (ShardedMeta.of(tensor),)  # a DTensor
        key = (tensor.shape, tensor.dtype, tensor.device)
        try:
            return _SINGLES[key]
        except KeyError:
            if len(_SINGLES) >= _INTERN_LIMIT:  # shapes that change all run long (generation): start again
                _SINGLES.clear()
            single = _SINGLES[key] = (tuple.__new__(cls, key),)
            return single
        except TypeError:  # a symbolic size cannot be hashed: described, not interned
            return (tuple.__new__(cls, key),)

    @classmethod
    def all_of(cls, tensors) -> Tuple["TensorMeta", ...]:
        """The descriptions of a sequence of tensors (interned, see `single`)."""
        if len(tensors) == 1:
            return cls.single(tensors[0])
        return cls.interned(tuple(cls.of(tensor) for tensor in tensors))

    @staticmethod
    def interned(metas: Tuple["TensorMeta", ...]) -> Tuple["TensorMeta", ...]:
        """`metas` (a multi-output op's), or an equal tuple already held (see `single`)."""
        try:
            if len(_MANY) >= _INTERN_LIMIT:
                _MANY.clear()
            return _MANY.setdefault(metas, metas)
        except TypeError:
            return metas

    @classmethod
    def ragged(cls, tensor) -> "TensorMeta":
        """A tensor whose sizes are not all fixed (a nested tensor): ragged sizes shown as `*`."""
        shape: List[Union[int, str]] = []
        for dim in range(tensor.dim()):
            try:
                shape.append(int(tensor.size(dim)))
            except RuntimeError:
                shape.append("*")
        return tuple.__new__(cls, (tuple(shape), tensor.dtype, tensor.device))

    @property
    def shape(self):
        return self[0]

    @property
    def dtype(self):
        return self[1]

    @property
    def device(self):
        return self[2]

    def __repr__(self) -> str:
        return f"TensorMeta({list(self[0])}, {self[1]}, {self[2]})"


class ShardedMeta(TensorMeta):
    """A DTensor's `TensorMeta`: its global (shape, dtype, device), then how it is laid out over its
    mesh (`Shard(1)`, `Replicate()`, `Partial(sum)`) and the shape of this rank's local tensor."""

    __slots__ = ()

    def __new__(cls, shape, dtype, device, placements: str = "", local_shape=()):
        return tuple.__new__(cls, (shape, dtype, device, placements, local_shape))

    def __getnewargs__(self):
        return tuple(self)

    @classmethod
    def of(cls, tensor) -> "ShardedMeta":
        placements = ",".join(_placement_text(p) for p in tensor.placements)
        local = tensor._local_tensor
        return tuple.__new__(cls, (tensor.shape, tensor.dtype, tensor.device, placements, tuple(local.shape)))

    @property
    def placements(self) -> str:
        return self[3]

    @property
    def local_shape(self):
        return self[4]

    def __repr__(self) -> str:
        return f"ShardedMeta({list(self[0])}, {self[1]}, {self[2]}, {self[3]}, local {list(self[4])})"


def _placement_text(placement) -> str:
    """`Shard(1)`, `Replicate()`, `Partial(sum)`: as torch writes them, without its `dim=`."""
    return repr(placement).replace("dim=", "")


_TENSOR = torch.Tensor
_SINGLES: dict = {}  # (shape, dtype, device) -> (TensorMeta,)
_MANY: dict = {}  # tuple of TensorMeta -> itself
_INTERN_LIMIT = 1 << 14


class Event:
    """One captured moment of a forward pass.

    - `kind`: one of `EventKind`.
    - `ordinal`: for input sources and ops, the 1-based position in the forward (the `#N` of the
      line); module and output events carry the ordinal of the last op before them.
    - `op`: the operation's name (`linear`, `relu`, `add`, ...); "input" / "output" for sources and
      results; the module's class name for enter/exit.
    - `scope`: the module the op ran in (for enter/exit, the module entered or left).
    - `outputs`: `TensorMeta` of each tensor the op produced.
    - `site`: the user's `file:line` that issued the op, when sites were asked for.
    - `stats`: value statistics (see `torchlens.measure.stats`), when asked for.
    - `label`: the argument name of an input source or the position of an output (`x`, `out[0]`).
    - `reads`, `finding`: what non-finite tracking knows of the op (`torchlens.measure.tracking`).
    - `engine`: "FSDP2", "DDP", ... for an op a distributed engine ran for itself (`torchlens.core.engines`).
    """

    __slots__ = ("kind", "ordinal", "op", "scope", "outputs", "site", "stats", "label", "reads", "finding", "engine")

    def __init__(self, kind, ordinal, op, scope, outputs=(), site=None, stats=None, label=None):
        self.kind = kind
        self.ordinal = ordinal
        self.op = op
        self.scope = scope
        self.outputs = outputs
        self.site = site
        self.stats = stats
        self.label = label
        self.reads = None  # with non-finite tracking: what the op read (see `torchlens.measure.tracking`)
        self.finding = None  # with non-finite tracking: the tracker's verdict at this op, if any
        self.engine = None  # the distributed engine that ran the op for itself (`torchlens.core.engines`), if any

    def with_stats(self, stats) -> "Event":
        """This op's event again, with other statistics: a compiled graph called again in the same
        situation records the same ops, with its own values' statistics (and no verdict: there is
        no tracking where events are restated)."""
        event = Event(self.kind, self.ordinal, self.op, self.scope, self.outputs, self.site, stats, self.label)
        event.engine = self.engine
        return event

    @property
    def module(self) -> str:
        """Dotted path of the module the event belongs to ("" for the root)."""
        return self.scope.path

    @property
    def depth(self) -> int:
        """Module depth: 0 for the root, 1 for its children, ..."""
        return self.scope.depth

    @property
    def is_op(self) -> bool:
        """True for events narrated as `#` lines (input sources and ops)."""
        return self.kind is OP or self.kind is INPUT

    def __repr__(self) -> str:
        where = f" @{self.scope.path}" if self.scope.path else ""
        return f"Event({self.kind.value} #{self.ordinal} {self.op}{where})"


class BackwardEvent(Event):
    """A moment of a backward through a narrated forward's graph (`NODE` or `GRAD`).

    `ordinal` counts the backward's nodes (the `~N` of the line); `op` is the autograd node's name
    (`AddmmBackward0`, `AccumulateGrad`); `scope` and `site` are those of the forward op it
    differentiates, which `forward` names (`#5 linear @fc2`); `outputs` are the gradients the node
    produced (for `AccumulateGrad` and `GRAD`, the gradient received); `label` is the leaf's name
    (`fc2.weight`) or the forward output's (`out`).
    """

    __slots__ = ("forward",)

    def __init__(self, kind, ordinal, op, scope, outputs=(), site=None, stats=None, label=None, forward=None):
        super().__init__(kind, ordinal, op, scope, outputs, site, stats, label)
        self.forward = forward


class Stats:
    """What was measured of one tensor, and how: evidence-qualified statistics.

    `kind` is "exact", "sampled", "counts" (non-finite tracking only), "bool" or "na" (not
    applicable: meta, empty, or non-numeric tensors; `note` says why). `shown` is False when only
    tracking asked for it: the op line then shows nothing, but the first non-finite op is still
    found. Counts are None when not measured (a sample never measures them).
    """

    __slots__ = ("kind", "numel", "min", "max", "mean", "sd", "nan", "posinf", "neginf", "true", "sampled",
                 "note", "shown")

    kind: str
    numel: int
    min: Optional[float]  # an int's, for an integer tensor: exact
    max: Optional[float]
    mean: Optional[float]
    sd: Optional[float]
    nan: Optional[int]
    posinf: Optional[int]
    neginf: Optional[int]
    true: Optional[int]
    sampled: int
    note: str
    shown: bool

    def __init__(self, kind: str, numel: int = 0, shown: bool = True, note: str = ""):
        self.kind = kind
        self.numel = numel
        self.min = self.max = self.mean = self.sd = None
        self.nan = self.posinf = self.neginf = None
        self.true = None  # bool tensors: how many elements are True
        self.sampled = 0
        self.note = note
        self.shown = shown

    @property
    def nonfinite(self) -> bool:
        return bool(self.nan or self.posinf or self.neginf)

    def __str__(self) -> str:
        """The statistics segment of the op's line (`min=0 max=2 mean=1 sd=1 finite`)."""
        return stats_text(self)

    def __repr__(self) -> str:
        return f"Stats({str(self) or self.kind})"


class StatsGroup:
    """Statistics of a multi-output op: one `Stats` per tensor output."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Stats]):
        self.parts = tuple(parts)

    @property
    def nonfinite(self) -> bool:
        return any(part.nonfinite for part in self.parts)

    @property
    def shown(self) -> bool:
        return any(part.shown for part in self.parts)

    def __str__(self) -> str:
        return stats_text(self)

    def __repr__(self) -> str:
        return f"StatsGroup({', '.join(map(repr, self.parts))})"


class Attempt:
    """The call that was in flight when a forward failed: it raised, so it has no outputs.

    `inputs` describes its tensor arguments; `ordinal` is the number it would have had.
    `op` is None when no torch call was in flight (the error came from Python code between ops).
    `notes` say how the call was located and what that method cannot promise (a replay's caveats).
    `inputs` is None when the call was located without seeing its arguments. `call` keeps the
    function and the arguments themselves when the eager capture saw the call raise (a
    `torchlens.repro.kept.KeptCall`, which `PartialTrace.repro` replays); None otherwise.
    `values`, one per input, says what an integer input held (`torchlens.measure.integer_values.Values`:
    its smallest and largest value, or why they were not read; None for any other input), read once
    the forward had failed; None when no input is an integer tensor whose values were sought.
    """

    __slots__ = ("op", "ordinal", "scope", "site", "inputs", "notes", "call", "values")

    def __init__(self, op, ordinal, scope, site, inputs, notes=(), call=None, values=None):
        self.op = op
        self.ordinal = ordinal
        self.scope = scope
        self.site = site
        self.inputs = inputs
        self.notes = tuple(notes)
        self.call = call  # the function and arguments it was called with, for `.repro()` (eager only)
        self.values = None if values is None else tuple(values)

    @property
    def module(self) -> str:
        return self.scope.path

    @property
    def on_cuda(self) -> bool:
        return any(meta.device.type == "cuda" for meta in self.inputs or ())

    def __repr__(self) -> str:
        return f"Attempt({self.op} #{self.ordinal} @{self.scope.path})"


class BackwardAttempt(Attempt):
    """The backward node that was running when a backward failed; `forward` names its forward op
    (`#5 linear @fc2`) and `inputs` describes the gradients it received."""

    __slots__ = ("forward",)

    def __init__(self, op, ordinal, scope, site, inputs, forward, notes=()):
        super().__init__(op, ordinal, scope, site, inputs, notes)
        self.forward = forward

    def __repr__(self) -> str:
        return f"BackwardAttempt({self.op} ~{self.ordinal} <- {self.forward})"
