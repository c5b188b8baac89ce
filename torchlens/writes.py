"""Which torch calls write into their arguments: one rule, read from torch, for every substrate.

Eager capture (which argument an op wrote, for tracking's provenance), the compiled plan (what a
graph node wrote into), the statistics pass (whether a value may change before it is read), the
failure replay (whether a graph changes its inputs) and the one-op repro all ask it here.

The rule is derived, not listed by hand:

- **operator schemas**: an `aten` operator writes an argument when one of its overloads marks a
  positional tensor argument (or the elements of a tensor list, `_foreach_add_`) as written
  (`Tensor(a!) self`). Keyword-only writes are the `out=` variants, told by the call's own `out=`;
  writes of a list or dict as a container (`aten::append`, `aten::sort.int`) are not tensor writes.
  A compiled graph's operator targets (custom ops included) are read from their own schema;
- **Python's in-place operators**, from the `operator` module (`iadd` is how dynamo records
  `x += y`; `__iadd__` how the eager capture sees it), and indexed assignment (`__setitem__`,
  dynamo's `setitem`);
- **the call's own flags**: `inplace=True` (`F.relu(x, inplace=True)`) and `out=`.

A few calls write and return nothing (indexed assignment, `_foreach_add_`,
`_amp_foreach_non_finite_check_and_unscale_`): `written_tensor` says which tensor they wrote, so
that the capture narrates them as an op on it rather than blaming the next op that reads it.
"""

from __future__ import annotations

import operator
from typing import Dict, Optional, Tuple

import torch

__all__ = ["call_writes", "may_return_an_alias", "node_writes", "target_name", "target_writes", "writes_an_argument",
           "writes_without_returning", "written_tensor"]

# Indexed assignment: `Tensor.__setitem__` (which dispatches to `index_put_`, `copy_`, `fill_`) and
# dynamo's `operator.setitem` write their first argument and have no schema of their own.
_INDEXED_ASSIGNMENT = ("__setitem__", "setitem")


def _python_in_place() -> frozenset:
    """`iadd`, `__iadd__`, ...: Python's in-place operators, as the `operator` module names them."""
    # (`iadd` is the in-place `add`, `ior` of `or_`; `invert` and `index` begin with an i but are not in-place)
    names = {name for name in dir(operator) if name.startswith("i") and hasattr(operator, f"__{name}__")
             and (hasattr(operator, name[1:]) or hasattr(operator, name[1:] + "_"))}
    return frozenset(names | {f"__{name}__" for name in names} | set(_INDEXED_ASSIGNMENT))


class _Table:
    """What torch's schemas say, read once on first use (reading them takes ~50 ms)."""

    def __init__(self):
        self.writers: Dict[str, tuple] = {}  # names of the operators that write a tensor argument
        self.aten: set = set()  # every aten operator's name
        self.aliasing: set = set()  # those of which an overload may return (a view of) an argument
        # name -> the (position, name) of the tensor arguments a nothing-returning overload writes
        self.without_returning: Dict[str, Tuple[Tuple[int, str], ...]] = {}
        for schema in torch._C._jit_get_all_schemas():
            namespace, name = schema.name.split("::", 1)
            if namespace == "aten":
                self.aten.add(name)
                if any(_writes_tensor(argument) for argument in schema.arguments):
                    self.writers[name] = ()
                if _returns_an_argument(schema):
                    self.aliasing.add(name)
            if not schema.returns:  # (any namespace; an `out=` written counts: it is all the call made)
                written = [(position, argument.name) for position, argument in enumerate(schema.arguments)
                           if _writes_tensor(argument, keyword=True)]
                if written:
                    known = set(self.without_returning.get(name, ()))
                    self.without_returning[name] = tuple(sorted(known | set(written)))
        for name in _INDEXED_ASSIGNMENT:
            self.without_returning[name] = ((0, "self"),)
        self.python = _python_in_place()


def _writes_tensor(argument, keyword: bool = False) -> bool:
    """Whether a schema argument is a tensor (or a tensor list's elements) the call writes; a
    keyword-only one (an `out=` variant's) only when `keyword`."""
    alias = argument.alias_info
    if alias is None or not alias.is_write or (argument.kwarg_only and not keyword):
        return False
    kind = argument.type
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    if isinstance(kind, torch.TensorType):
        return True
    # `Tensor(a!)[]` writes the elements; `t[](a!)` (a list method) writes the list itself
    return isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.TensorType) \
        and not alias.before_set


def _returns_an_argument(schema) -> bool:
    """Whether an overload returns memory of a positional argument (not an `out=` variant's)."""
    if any(argument.kwarg_only and argument.alias_info is not None for argument in schema.arguments):
        return False  # `add.out`: what it returns is the `out=` it was given
    return any(result.alias_info is not None for result in schema.returns)


_table: Optional[_Table] = None


def _read() -> _Table:
    global _table
    if _table is None:
        _table = _Table()
    return _table


def writes_an_argument(name: str) -> bool:
    """Whether a call of this name (as `naming.op_name` or a graph node's `target_name` gives it)
    writes into one of its tensor arguments, whatever its flags."""
    table = _read()
    return name in table.writers or name in table.python


def call_writes(name: str, args=(), kwargs=None) -> bool:
    """Whether this call writes into one of its arguments: by its name, or by `inplace=True` or
    `out=` among its keyword arguments."""
    if kwargs and (kwargs.get("inplace") is True or kwargs.get("out") is not None):
        return True
    return writes_an_argument(name)


def target_writes(target) -> bool:
    """Whether an operator (`torch.ops.aten.add_.Tensor`, a custom op, its packet) writes one of
    its tensor arguments, by its own schema; False for anything without one."""
    if isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    elif isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, name) for name in target.overloads()]
    else:
        return False
    return any(_writes_tensor(argument) for overload in overloads for argument in overload._schema.arguments)


def target_name(node) -> str:
    """A graph node's target by name: `add_`, `iadd`, `setitem`, a method's name."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def node_writes(node) -> bool:
    """Whether a graph node (`call_function` or `call_method`) writes into one of its tensor
    arguments: the rule above, by its target's name or schema and its keyword flags."""
    if node.op not in ("call_function", "call_method"):
        return False
    return call_writes(target_name(node), node.args, node.kwargs) or target_writes(node.target)


def may_return_an_alias(name: str) -> bool:
    """Whether a call of this name may return memory of one of its arguments (`view`, `split`,
    `contiguous`, an in-place op), by the aten schemas (`Tensor(a) self -> Tensor(a)`); True for a
    name torch has no aten operator of (`__getitem__`, a custom op): nothing says it does not.
    Python's operator methods are looked up by their operator (`__add__` as `add`)."""
    known = _ALIASING.get(name)
    if known is None:
        table = _read()
        operator_name = name[2:-2] if name.startswith("__") and name.endswith("__") else name
        known = _ALIASING[name] = operator_name in table.aliasing or operator_name not in table.aten
    return known


_ALIASING: Dict[str, bool] = {}  # `may_return_an_alias` by name, as asked (an op's name repeats every forward)


def writes_without_returning(name: str) -> bool:
    """Whether a call of this name may write a tensor and return nothing."""
    return name in _read().without_returning


def written_tensor(name: str, args, kwargs):
    """The tensor (or tuple of tensors) a nothing-returning call of `name` wrote, or None."""
    places = _read().without_returning.get(name)
    if places is None:
        return None
    for position, argument in places:
        value = kwargs.get(argument) if argument in kwargs else (args[position] if position < len(args) else None)
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return tuple(value)
    return None
