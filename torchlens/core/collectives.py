"""`torch.distributed` collectives as ops: which call is one, what it writes, its group, whether it
is still in flight when it returns.

torch routes each c10d collective (`dist.all_reduce`, `dist.all_gather_single`, ...) through
`handle_torch_function`, so the capture's mode sees it, as it sees the functional collectives
(`torch.ops._c10d_functional.*`, what DTensor and compiled graphs use). Neither returns the tensor
it fills in the way an op does: a c10d collective writes into its arguments and returns nothing (or,
with `async_op=True`, a `Work` to wait on); a functional one returns a tensor whose values arrive
only at its `wait_tensor`. `COLLECTIVES` says, per c10d function, which argument holds what it writes;
tests/test_collectives.py checks it names every c10d function torch dispatches this way.

An asynchronous collective's output holds no values until it is waited on, which torchlens cannot
see (a `Work.wait()`, a stream wait): it is measured when the first op reads it (`Pipeline`), and
views of it before that are not read (`torchlens.measure.unwritten`).
"""

from __future__ import annotations

import inspect
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ..measure.memory import call_writes, held_tensors, may_return_an_alias, storage_keys, storage_ref, tensors_of
from ..measure.provenance import tensor_arguments
from ..torch_internals.seams import degraded

__all__ = ["C10D_MODULE", "COLLECTIVES", "Collective", "collective_call", "graph_label", "in_memory_of",
           "is_functional_collective", "is_wait", "memory_refs", "reads_memory", "shares_memory", "wait_for"]

C10D_MODULE = "torch.distributed.distributed_c10d"
FUNCTIONAL_NAMESPACE = "_c10d_functional"


class _Entry(NamedTuple):
    shown: str  # the name its line shows
    outputs: str  # the parameter holding the tensors the line shows
    writes: bool  # whether the call writes them (a `send` only reads its tensor)
    always_async: bool = False  # `isend` / `irecv` return a `Work` whatever they are told


# c10d function name -> how it is narrated
COLLECTIVES: Dict[str, _Entry] = {
    "all_reduce": _Entry("all_reduce", "tensor", True),
    "all_reduce_coalesced": _Entry("all_reduce_coalesced", "tensors", True),
    "broadcast": _Entry("broadcast", "tensor", True),
    "reduce": _Entry("reduce", "tensor", True),
    "all_gather": _Entry("all_gather", "tensor_list", True),
    "all_gather_single": _Entry("all_gather_single", "output_tensor", True),  # `all_gather_into_tensor`
    "all_gather_coalesced": _Entry("all_gather_coalesced", "output_tensor_lists", True),
    "gather": _Entry("gather", "gather_list", True),
    "scatter": _Entry("scatter", "tensor", True),
    "reduce_scatter": _Entry("reduce_scatter", "output", True),
    "reduce_scatter_single": _Entry("reduce_scatter_single", "output", True),  # `reduce_scatter_tensor`
    "all_to_all_single": _Entry("all_to_all_single", "output", True),
    "all_to_all": _Entry("all_to_all", "output_tensor_list", True),
    "send": _Entry("send", "tensor", False),
    "recv": _Entry("recv", "tensor", True),
    "isend": _Entry("isend", "tensor", False, always_async=True),
    "irecv": _Entry("irecv", "tensor", True, always_async=True),
}


class Collective(NamedTuple):
    """One collective call: the name it is shown by, the tensors it wrote (or sent), whether it
    wrote them, the size of its group, and whether its values were still in flight on return."""

    name: str
    tensors: Tuple[torch.Tensor, ...]
    writes: bool
    group_size: Optional[int]
    in_flight: bool
    functional: bool = False  # `torch.ops._c10d_functional.*`: its values arrive at `wait_tensor`

    @property
    def group(self) -> str:
        """`group of 2`: the group it ran in, as a finding names it."""
        return f"group of {self.group_size}" if self.group_size is not None else "group"

    @property
    def label(self) -> str:
        """`group of 2, async`: what the op's line says after its module."""
        return self.group + (", async" if self.in_flight else "")

    @property
    def value(self):
        """The op's output as the pipeline takes it: one tensor, or a tuple of them."""
        return self.tensors[0] if len(self.tensors) == 1 else self.tensors


_SIGNATURES: Dict[object, inspect.Signature] = {}


def collective_call(func, args, kwargs, out) -> Optional[Collective]:
    """The collective a call was (c10d or functional), or None for any other call. `out` is what it
    returned. Never raises: a call it cannot read is not a collective to it."""
    try:
        if getattr(func, "__module__", None) == C10D_MODULE:
            return _c10d(func, args, kwargs, out)
        if is_functional_collective(func):
            return _functional(func, args, kwargs, out)
    except Exception:
        return None
    return None


def is_wait(func) -> bool:
    """Whether `func` waits for a functional collective's values: `wait_tensor`, or the autograd
    wrapper funcol puts around its output (an `AsyncCollectiveTensor`, which waits before any op
    reads it, measuring included)."""
    name = getattr(func, "__name__", "")
    return _namespace(func) == FUNCTIONAL_NAMESPACE and ("wait_tensor" in name or "_wrap_tensor_autograd" in name)


def wait_for(collective: "Collective") -> None:
    """Make a functional collective's values arrive before they are measured: what its
    `AsyncCollectiveTensor` does before any op reads it, a little earlier (c10d's own collectives
    need nothing: an op reads their output only after the code waited on them)."""
    if collective.functional:
        wait = torch.ops._c10d_functional.wait_tensor
        for tensor in collective.tensors:
            wait(tensor)


def reads_memory(name: str, func, args, kwargs, tensors, out=None) -> Optional[str]:
    """How a call that returned `out` used the memory of `tensors` (an asynchronous collective's
    output): "read" when it read it (torch reads only what has arrived: it was waited on),
    "written" when it wrote all it will use of it without reading it (what it held is then gone),
    None when it did not touch it or only viewed it."""
    keys = {key for tensor in tensors for key in storage_keys(tensor)}
    touched = [argument for argument in tensor_arguments(args, kwargs) if keys.intersection(storage_keys(argument))]
    if not touched:
        return None
    if is_wait(func):
        return "read"
    if name.endswith("_like"):  # `zeros_like(y)`, `empty_like(y)`: its shape and dtype, not its values
        return None
    if getattr(func, "__module__", None) == C10D_MODULE:  # another collective: it sends what it reads
        collective = collective_call(func, args, kwargs, None)
        sent = collective.tensors if collective is not None and collective.writes else ()
        overwrites = collective is not None and collective.name not in _READ_BEFORE_WRITTEN
        return "written" if overwrites and any(t is w for t in touched for w in sent) else "read"
    written = tensors_of(call_writes(name, args, kwargs, func))
    if any(tensor is argument for tensor in written for argument in touched):
        # `y.copy_(...)`, `out=y` never read what `y` held; `y.div_(2)` reads it, then writes
        overwrites = (kwargs.get("out") is not None) or name in _OVERWRITING_IN_PLACE
        return "written" if overwrites else "read"
    if may_return_an_alias(name) and any(keys.intersection(storage_keys(tensor)) for tensor in tensors_of(out)):
        return None  # a view of it (`view`, `to` of its own dtype): nothing read
    return "read"  # (`to`, `contiguous`, `reshape` that copied it read it)


# in-place ops whose result does not depend on what their tensor held (no schema says so)
_OVERWRITING_IN_PLACE = frozenset(("copy_", "fill_", "zero_", "set_", "normal_", "uniform_", "bernoulli_",
                                   "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"))
# c10d collectives that reduce or send the tensor they write into: they read it first
_READ_BEFORE_WRITTEN = frozenset(("all_reduce", "all_reduce_coalesced", "reduce", "broadcast"))


def shares_memory(tensor, tensors) -> bool:
    """Whether `tensor` views the memory of one of `tensors` (a collective's output)."""
    keys = {key for other in tensors for key in storage_keys(other)}
    return any(key in keys for key in storage_keys(tensor))


def memory_refs(tensors) -> list:
    """Weak references to the storages `tensors` hold their values in (they keep nothing alive)."""
    refs = (storage_ref(held) for tensor in tensors for held in held_tensors(tensor))
    return [ref for ref in refs if ref is not None]


def in_memory_of(tensor, refs) -> bool:
    """Whether `tensor` views memory one of `refs` (`memory_refs`) still stands for."""
    keys = {ref.cdata for ref in refs if not ref.expired()}
    return bool(keys) and any(key in keys for key in storage_keys(tensor))


def is_functional_collective(func) -> bool:
    """Whether `func` (a graph node's target too) is a functional collective (`_c10d_functional.all_reduce`)."""
    try:
        return _namespace(func) == FUNCTIONAL_NAMESPACE and _takes_a_group(func)
    except Exception:
        return False


def _takes_a_group(func) -> bool:
    """Whether a functional op is a collective: its schema names a group (`str group_name`);
    `wait_tensor` and the autograd wrapper do not."""
    if isinstance(func, torch._ops.OpOverload):
        overloads = [func]
    else:
        overloads = [getattr(func, name) for name in func.overloads()]
    return any(argument.name == "group_name" for overload in overloads for argument in overload._schema.arguments)


def _namespace(func) -> Optional[str]:
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.split("::")[0]
    return None


def _c10d(func, args, kwargs, out) -> Optional[Collective]:
    entry = COLLECTIVES.get(func.__name__)
    if entry is None:
        return None
    signature = _SIGNATURES.get(func)
    if signature is None:
        signature = _SIGNATURES[func] = inspect.signature(func)
    bound = signature.bind(*args, **kwargs).arguments
    tensors = tuple(tensors_of(bound.get(entry.outputs)))
    if not tensors and entry.outputs == "gather_list":  # not the destination: it only sent
        tensors, writes = tuple(tensors_of(bound.get("tensor"))), False
    else:
        writes = entry.writes
    if not tensors:
        return None
    in_flight = entry.always_async or bool(bound.get("async_op")) and out is not None
    return Collective(entry.shown, tensors, writes, _group_size(bound.get("group")), in_flight)


def _functional(func, args, kwargs, out) -> Optional[Collective]:
    tensors = tuple(tensors_of(out))
    if not tensors:
        return None
    name = getattr(func, "__name__", "collective").split(".")[0]
    return Collective(name, tensors, False, _functional_group_size(func, args, kwargs), True, functional=True)


def graph_label(target, args, kwargs) -> Optional[Collective]:
    """The functional collective a compiled graph's node is, without tensors (its line says its
    `label` after its module, `group of 2, async`: its values arrive at the graph's `wait_tensor`),
    None for other nodes."""
    if not is_functional_collective(target):
        return None
    try:
        size = _functional_group_size(target, args, kwargs)
    except Exception:
        size = None
    return Collective("", (), False, size, True, functional=True)


def _functional_group_size(func, args, kwargs) -> Optional[int]:
    """The size of the group a functional collective names by its `group_name` argument."""
    overload = func if isinstance(func, torch._ops.OpOverload) else getattr(func, func.overloads()[0])
    positions = [i for i, argument in enumerate(overload._schema.arguments) if argument.name == "group_name"]
    group = kwargs.get("group_name") if kwargs else None
    if group is None and positions and positions[0] < len(args):
        group = args[positions[0]]
    return _group_size_by_name(group) if isinstance(group, str) else None


def _group_size(group) -> Optional[int]:
    try:
        import torch.distributed as dist

        return dist.get_world_size(group)
    except Exception:  # no default group (a call that will fail in torch itself), a group torn down
        return None


def _group_size_by_name(name: Optional[str]) -> Optional[int]:
    if name is None:
        return None
    try:
        from torch.distributed import distributed_c10d
    except ImportError:
        return None
    resolve = getattr(distributed_c10d, "_resolve_process_group", None)
    if resolve is None:
        degraded("process group by name", "torch.distributed.distributed_c10d has no _resolve_process_group")
        return None
    try:
        return resolve(name).size()
    except Exception:  # a group torn down
        return None
