"""Op names for torch-level calls, in the vocabulary both substrates share.

The eager substrate sees callables (`torch.relu`, `Tensor.__add__`, the getter of `Tensor.T`); the
compiled substrate sees FX targets (`torch.relu`, `operator.add`, the method name "view"). Both are
reduced to the same short names (`relu`, `add`, `view`, `T`) so eager and compiled transcripts
line up op for op.
"""

from __future__ import annotations

_BINARY = {
    "add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "matmul",
    "and", "or", "xor", "lshift", "rshift",
}

# Spellings that differ between the eager callable and the FX target of the same op.
_SAME_OP = {"truediv": "div"}

_names = {}


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
    name = getattr(func, "__name__", None)
    if name is None:
        name = type(func).__name__
    if name == "__get__":  # a tensor attribute such as .T or .real, read through its descriptor
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    if getattr(func, "__module__", None) in ("_operator", "operator") and name[:1] == "i" and name[1:] in _BINARY:
        name = f"__{name}__"  # operator.iadd, as dynamo records `x += y`, is eager's `add_`
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
