"""Op names for torch-level calls, in the vocabulary both substrates share.

The eager substrate sees the callable torch dispatches to the capture's mode (`torch.relu`,
`Tensor.__add__`, `Tensor.remainder` for `x % y`, the getter of `Tensor.T`); its name is the op's
name (dunders shortened: `__add__` -> `add`). That is the vocabulary.

The compiled substrate sees FX targets written by dynamo: `operator.floordiv` for `x // y`,
`operator.sub` for `1 - x` (where eager gets `Tensor.__rsub__`), `getattr(x, "T")` for `x.T`, a
method name for `x.view(...)`. Each is named by what eager would be handed for the same Python
expression: which callable torch dispatches for each operator of `Tensor` — plain, reflected (a
Python number on the left) and in-place — is read from torch once, by calling each operator on a
small tensor under a probing mode, never from a hand list. Where dynamo rewrote a method or
attribute into another call (`x.new_tensor(d)` traced as `torch.tensor(d, ...)`, `x.data` as
`_get_data_attr`), the node carries the name the user wrote (see `fx_backend.dynamo_seams`).
"""

from __future__ import annotations

import builtins
import inspect
import operator
import threading
from typing import Any, Dict, Optional

import torch

from ..torch_internals.node_meta import example_value

__all__ = ["USER_SPELLING", "node_name", "op_name"]

_BINARY = {
    "add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "matmul",
    "and", "or", "xor", "lshift", "rshift",
}

# Spellings that differ between the eager callable and the FX target of the same op.
_SAME_OP = {"truediv": "div"}

# Node metadata key under which the compiled path records the method or attribute a user wrote
# when dynamo traced it as a different call.
USER_SPELLING = "torchlens_user_spelling"

_names: Dict[Any, str] = {}


def op_name(func) -> str:
    """The short name of a torch-level callable, cached per callable."""
    try:
        return _names[func]
    except KeyError:
        name = _names[func] = _derive(func)
        return name
    except TypeError:  # an unhashable callable: rare, just derive it
        return _derive(func)


def _derive(func) -> str:
    if isinstance(func, torch._ops.OpOverload) and func._overloadname == "default":
        return func._opname  # `torch.ops.x.y.default` is `y`, as its packet `torch.ops.x.y` is
    name = getattr(func, "__name__", None)
    if name is None:
        name = type(func).__name__
    if name == "__get__":  # a tensor attribute such as .T or .real, read through its descriptor
        owner_name = getattr(getattr(func, "__self__", None), "__name__", None)
        if owner_name is not None:
            name = owner_name
    return dunder_name(name)


def dunder_name(name: str) -> str:
    """`__add__` -> `add`, `__radd__` -> `add`, `__iadd__` -> `add_`, `__truediv__` -> `div`."""
    if not (name.startswith("__") and name.endswith("__")) or len(name) <= 4:
        return _SAME_OP.get(name, name)
    core = name[2:-2]
    if core[0] == "i" and core[1:] in _BINARY:
        return _SAME_OP.get(core[1:], core[1:]) + "_"
    if core[0] == "r" and core[1:] in _BINARY:
        core = core[1:]
    return _SAME_OP.get(core, core)


# -- the compiled substrate's names -------------------------------------------------------------

def node_name(target, args, op: str = "call_function") -> str:
    """The eager name of an FX call: `op` is the node's kind, `args` its arguments as written
    (FX nodes for values computed in the graph)."""
    if op == "call_method":
        return _dunder_eager_name(target) or dunder_name(target)
    if target is builtins.getattr and len(args) >= 2 and isinstance(args[1], str):
        return args[1]  # `x.T`, `x.real`: eager sees the attribute's getter
    dunders = _operator_dunders().get(_key(target))
    if dunders is not None:
        plain, reflected = dunders
        dunder = plain if not args or _is_tensor_arg(args[0]) or reflected is None else reflected
        return _dunder_eager_name(dunder) or dunder_name(dunder)
    return op_name(target)


def _key(target):
    try:
        hash(target)
        return target
    except TypeError:
        return None


def _is_tensor_arg(arg) -> bool:
    if isinstance(arg, torch.Tensor):
        return True
    if getattr(arg, "meta", None) is None:  # not an fx.Node
        return False
    value = example_value(arg, or_val=True)  # what the node computed, recorded by its tracer
    return isinstance(value, torch.Tensor) or value is None


_SKIPPED = {"setitem", "delitem", "contains", "index", "length_hint", "truth", "not_", "is_", "is_not",
            "concat", "iconcat", "countOf", "indexOf", "getitem"}
_lock = threading.Lock()
_dunders_of_operator: Optional[Dict] = None
_dispatched: Dict[str, Optional[str]] = {}


def _operator_dunders() -> Dict:
    """`operator` function -> (the Tensor dunder it calls, the reflected dunder or None)."""
    global _dunders_of_operator
    if _dunders_of_operator is None:
        table = {}
        for name in operator.__all__:
            if name in _SKIPPED:
                continue
            core = name.rstrip("_")
            plain = f"__{core}__"
            if not hasattr(torch.Tensor, plain) and core[:1] == "i" and core[1:] in _BINARY:
                core = core[1:]  # `x @= y` without `Tensor.__imatmul__`: Python runs `x = x @ y`
                plain = f"__{core}__"
            if not hasattr(torch.Tensor, plain):
                continue
            reflected = f"__r{core}__" if hasattr(torch.Tensor, f"__r{core}__") else None
            table[getattr(operator, name)] = (plain, reflected)
        _dunders_of_operator = table
    return _dunders_of_operator


def _dunder_eager_name(dunder: str) -> Optional[str]:
    """The name eager narration gives a Tensor dunder: that of the callable torch dispatches for
    it (`__mod__` -> `remainder`, `__rand__` -> `bitwise_and`), read once by calling it."""
    if not (dunder.startswith("__") and dunder.endswith("__")):
        return None
    try:
        return _dispatched[dunder]
    except KeyError:
        pass
    with _lock:
        if dunder not in _dispatched:
            _dispatched[dunder] = _probe(dunder)
    return _dispatched[dunder]


class _Probe(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.first = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.first is None:
            self.first = func
        return func(*args, **(kwargs or {}))


def _probe(dunder: str) -> Optional[str]:
    method = getattr(torch.Tensor, dunder, None)
    if method is None:
        return None
    unary = _arity(dunder) == 1
    reflected = dunder[2] == "r" and dunder[3:-2] in _BINARY
    for dtype in (torch.float32, torch.int64, torch.bool):
        with torch._C.DisableTorchFunction():  # the probe's own tensors are nobody's ops
            operand = torch.ones(2, 2, dtype=dtype)
            other = (True if dtype == torch.bool else 2) if reflected else torch.ones(2, 2, dtype=dtype)
        probe = _Probe()
        try:
            with torch.no_grad(), probe:
                if unary:
                    method(operand)
                else:
                    method(operand, other)
        except Exception:
            continue
        if probe.first is not None:
            return op_name(probe.first)
    return None


def _arity(dunder: str) -> int:
    function = getattr(operator, dunder[2:-2], None) or getattr(operator, dunder[2:-2] + "_", None)
    if function is None:
        return 2
    try:
        return len(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return 2
