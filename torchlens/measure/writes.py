"""Which torch calls write into their arguments: one rule, read from torch, for every substrate.

Eager capture (which argument an op wrote, for tracking's provenance), the compiled plan (what a
graph node wrote into), the statistics pass (whether a value may change before it is read), the
failure replay (whether a graph changes its inputs), the collectives (whether a call overwrote an
asynchronous collective's output) and the one-op repro all ask it here (`torchlens.measure.memory` lists
it with the other facts about memory).

The rule is derived, not listed by hand:

- **operator schemas**: an `aten` operator writes an argument when one of its overloads marks a
  positional tensor argument (or the elements of a tensor list, `_foreach_add_`) as written
  (`Tensor(a!) self`). Keyword-only writes are the `out=` variants, told by the call's own `out=`;
  writes of a list or dict as a container (`aten::append`, `aten::sort.int`) are not tensor writes.
  A compiled graph's operator targets (custom ops included) are read from their own schema;
- **Python's in-place operators**, from the `operator` module (`iadd` is how dynamo records
  `x += y`; `__iadd__` how the eager capture sees it), and indexed assignment (`__setitem__`,
  dynamo's `setitem`);
- **the call's own flags**: `inplace=True` (`F.relu(x, inplace=True)`), `out=`, and normalisation
  in training, which updates the running statistics it is given (`F.batch_norm(..., training=True)`).

`call_writes` answers for a call, `node_writes` for a graph node (by the same rule, on its target
and arguments), and both say which arguments are written, not only whether one is: a write's
provenance, a statistics copy and a replay's caveat each follow the memory actually written.

A few calls write and return nothing (indexed assignment, `_foreach_add_`,
`_amp_foreach_non_finite_check_and_unscale_`): `written_tensor` says which tensor they wrote, so
that the capture narrates them as an op on it rather than blaming the next op that reads it.
"""

from __future__ import annotations

import inspect
import operator
import types
from typing import Dict, Optional, Tuple

import torch

__all__ = ["call_writes", "may_return_an_alias", "node_writes", "target_name", "writes_without_returning",
           "written_tensor"]

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
        # name -> (position, name) of the positional tensor arguments its overloads write
        self.writers: Dict[str, Tuple[Tuple[int, str], ...]] = {}
        self.aten: set = set()  # every aten operator's name
        self.aliasing: set = set()  # those of which an overload may return (a view of) an argument
        # names of which an overload writes a tensor and returns nothing (an `out=` variant's counts:
        # it is all the call made), in any namespace; indexed assignment has no schema of its own
        self.without_returning: set = set(_INDEXED_ASSIGNMENT)
        for schema in torch._C._jit_get_all_schemas():
            namespace, name = schema.name.split("::", 1)
            if namespace == "aten":
                self.aten.add(name)
                places = {(position, argument.name) for position, argument in enumerate(schema.arguments)
                          if _writes_tensor(argument)}
                if places:
                    self.writers[name] = tuple(sorted(places | set(self.writers.get(name, ()))))
                if _returns_an_argument(schema):
                    self.aliasing.add(name)
            if not schema.returns and any(_writes_tensor(argument, keyword=True) for argument in schema.arguments):
                self.without_returning.add(name)
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


def call_writes(name: str, args=(), kwargs=None, func=None) -> tuple:
    """The arguments a call writes into, as it was given them (a tensor, a list of tensors, an
    `out=` tuple); () for a call that writes none, so the answer is also the yes or no. `name` is
    the call's as `naming.op_name` or a graph node's `target_name` gives it; `func`, when known,
    the callable itself: an operator's own schema then says which arguments (a custom op's
    `mutates_args`), and a Python function's signature names its flags passed positionally (a
    graph records `F.relu(x, True)` as the user wrote it; torch hands a function mode
    `inplace=True`). By the rule above, and by the flags: `inplace=True` writes the input, `out=`
    its tensors, normalisation in training (`training=True`, `use_input_stats=True`) the running
    statistics it is given."""
    places = None if isinstance(func, _OPERATORS) else _BY_NAME.get(name)  # (most calls: known by name)
    if places is None:
        places = _places(name, func)
    flags = _flag_positions(func) if func.__class__ is types.FunctionType else _NO_FLAGS
    if not (places or kwargs or flags):
        return ()  # (most calls)
    kwargs = kwargs or {}
    named = _named(flags, args, kwargs)
    written = [_argument(args, kwargs, place) for place in places]
    if named.get("inplace") is True:
        written.append(args[0] if args else named.get("input"))
    written.append(kwargs.get("out"))
    if named.get("training") is True or named.get("use_input_stats") is True:
        written.extend((named.get("running_mean"), named.get("running_var")))
    unique: list = []
    for value in written:
        if value is not None and not any(value is seen for seen in unique):
            unique.append(value)
    return tuple(unique)


def _places(name: str, func) -> Tuple[Tuple[int, str], ...]:
    """(position, name) of the arguments a call of this name (or this operator) writes, whatever
    its flags: by the operator's own schema, else by the name's aten overloads, else Python's
    in-place operators and indexed assignment, which write their first argument."""
    if isinstance(func, _OPERATORS):
        places = _BY_OPERATOR.get(func)
        if places is None:
            places = _BY_OPERATOR[func] = _schema_places(func)
        return places
    places = _BY_NAME.get(name)
    if places is None:  # (asked once an op: the answer per name is kept)
        table = _read()
        places = table.writers.get(name) or (((0, "self"),) if name in table.python else ())
        _BY_NAME[name] = places
    return places


_OPERATORS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_BY_NAME: Dict[str, Tuple[Tuple[int, str], ...]] = {}
_BY_OPERATOR: Dict[object, Tuple[Tuple[int, str], ...]] = {}


def _schema_places(target) -> Tuple[Tuple[int, str], ...]:
    """(position, name) of the positional tensor arguments an operator's overloads write."""
    overloads = [target] if isinstance(target, torch._ops.OpOverload) else [
        getattr(target, name) for name in target.overloads()]
    return tuple(sorted({(position, argument.name) for overload in overloads
                         for position, argument in enumerate(overload._schema.arguments)
                         if _writes_tensor(argument)}))


def _argument(args, kwargs, place: Tuple[int, str]):
    """A call's argument at a schema's (position, name); None where it was not given. torch's
    Python bindings also take a schema's `self` as `input`."""
    position, name = place
    if position < len(args):
        return args[position]
    return kwargs.get(name, kwargs.get("input") if name == "self" else None)


_FLAGS = ("inplace", "training", "use_input_stats")  # the flags that make a Python function write
_READ_BY_NAME = _FLAGS + ("input", "running_mean", "running_var")  # what the rule reads by name
_POSITIONS: Dict[object, Dict[str, int]] = {}
_NO_FLAGS: Dict[str, int] = {}


def _flag_positions(func) -> Dict[str, int]:
    """For a Python function with a write flag among its positional parameters, the positions of
    the parameters the rule reads by name; {} for any other callable (its flags, if any, can only
    be keywords). Read from its signature once."""
    if not isinstance(func, types.FunctionType):
        return {}
    positions = _POSITIONS.get(func)
    if positions is None:
        try:
            parameters = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        positional = {parameter.name: index for index, parameter in enumerate(parameters)
                      if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
        flagged = any(flag in positional for flag in _FLAGS)
        positions = _POSITIONS[func] = {name: positional[name] for name in _READ_BY_NAME
                                        if flagged and name in positional}
    return positions


def _named(positions: Dict[str, int], args, kwargs) -> dict:
    """A call's arguments the rule reads by name: its keywords, and those of `positions` it was
    given positionally (a graph records `F.relu(x, True)` as the user wrote it)."""
    if not positions or not args:
        return kwargs
    named = dict(kwargs)
    named.update((name, args[position]) for name, position in positions.items() if position < len(args))
    return named


def target_name(node) -> str:
    """A graph node's target by name: `add_`, `iadd`, `setitem`, a method's name."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def node_writes(node) -> tuple:
    """The arguments (graph nodes, or lists of them) a graph node writes into: `call_writes` of
    its target and arguments; () for a node that is not a call of a function or method (an opaque
    module call, `call_module`, is its caller's to judge)."""
    if node.op not in ("call_function", "call_method"):
        return ()
    return call_writes(target_name(node), node.args, node.kwargs, node.target)


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
    """The tensor (or tuple of tensors) a nothing-returning call of `name` wrote (`call_writes`),
    or None: what the capture shows as the call's output."""
    if not writes_without_returning(name):
        return None
    for value in call_writes(name, args, kwargs):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return tuple(value)
    return None
