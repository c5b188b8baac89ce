"""Torch calls that write into a tensor and return nothing: which argument they wrote.

Most torch calls return what they produced, and in-place ones return the tensor they changed, so
a capture that narrates what a call returns sees them all. A few write and return `None`:
indexed assignment (`y[:, 0] = v`, `x[mask] = v`: `Tensor.__setitem__`, dynamo's
`operator.setitem`) and the operators whose schemas return nothing while an argument is written
(`_foreach_add_`, `_amp_foreach_non_finite_check_and_unscale_`, ...). Left out, a NaN written by
one of them would be blamed on the next op that reads the tensor. They are narrated as an op whose
output is the tensor they wrote.

The table is read from torch's own operator schemas, not listed by hand, so it follows torch.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

# `Tensor.__setitem__` is the one Python-level writer returning None; it has no schema of its own
# (it dispatches to `index_put_`, `copy_`, `fill_`, which do return their tensor).
_PYTHON_WRITERS = {"__setitem__": ((0, "self"),), "setitem": ((0, "self"),)}

_table: Optional[Dict[str, Tuple[Tuple[int, str], ...]]] = None


def _written_arguments() -> Dict[str, Tuple[Tuple[int, str], ...]]:
    """name -> the (position, name) of the argument each nothing-returning overload writes."""
    table: Dict[str, set] = {}
    for schema in torch._C._jit_get_all_schemas():
        if schema.returns:
            continue
        for position, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                table.setdefault(schema.name.split("::")[-1], set()).add((position, argument.name))
                break
    result = {name: tuple(sorted(places)) for name, places in table.items()}
    result.update(_PYTHON_WRITERS)
    return result


def writes_without_returning(name: str) -> bool:
    """Whether a call of this name (as `naming.op_name` gives it, or the callable's own
    `__name__`) may write a tensor and return nothing."""
    global _table
    if _table is None:
        _table = _written_arguments()
    return name in _table


def written_tensor(name: str, args, kwargs):
    """The tensor (or list of tensors) a nothing-returning call of `name` wrote, or None."""
    if not writes_without_returning(name):
        return None
    for position, argument in _table[name]:
        value = kwargs.get(argument) if argument in kwargs else (args[position] if position < len(args) else None)
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return tuple(value)
    return None
