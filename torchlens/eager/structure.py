"""The model's structure as narration sees it: module scopes, named inputs, named outputs."""

from __future__ import annotations

import inspect
from typing import Dict, List, Tuple

import torch
from torch import nn

from ..errors import ModelTypeError
from ..events import Scope

MAX_NESTING = 8


class ScopeTable:
    """Maps module objects to `Scope`s named by their path under the root module.

    Built from `named_modules()` once per capture. A module reached during the forward that is not
    a registered submodule (created on the fly, or passed in) gets a scope named after its class
    under the module that called it.
    """

    def __init__(self, root: nn.Module):
        self.root = Scope("", type(root).__name__, None)
        self._by_id: Dict[int, Scope] = {id(root): self.root}
        by_path = {"": self.root}
        for path, module in root.named_modules():
            if path:
                parent = by_path[path.rsplit(".", 1)[0] if "." in path else ""]
                by_path[path] = self._by_id[id(module)] = Scope(path, type(module).__name__, parent)
        self.paths = list(by_path)
        self._keep_alive = root  # ids stay valid while the root (and so its children) lives

    def scope_of(self, module: nn.Module, caller: Scope) -> Scope:
        scope = self._by_id.get(id(module))
        if scope is None:
            name = f"<{type(module).__name__}>"
            path = f"{caller.path}.{name}" if caller.path else name
            scope = self._by_id[id(module)] = Scope(path, type(module).__name__, caller)
        return scope


def named_tensors(obj, label: str, out: List[Tuple[str, torch.Tensor]], nesting: int = 0) -> None:
    """Collect the tensors inside `obj` (tensor, tuple/list, dict) with readable labels."""
    if isinstance(obj, torch.Tensor):
        out.append((label, obj))
    elif nesting >= MAX_NESTING:
        return
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            named_tensors(item, f"{label}[{i}]", out, nesting + 1)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            named_tensors(item, f"{label}[{key!r}]", out, nesting + 1)


_signatures = {}


def forward_signature(module: nn.Module) -> inspect.Signature:
    """`inspect.signature(module.forward)`, memoised per forward function (it costs tens of µs)."""
    forward = module.forward
    key = getattr(forward, "__func__", forward)
    try:
        return _signatures[key]
    except (KeyError, TypeError):
        signature = inspect.signature(forward)
        try:
            _signatures[key] = signature
        except TypeError:
            pass
        return signature


def named_inputs(module: nn.Module, args: tuple, kwargs: dict) -> List[Tuple[str, torch.Tensor]]:
    """The forward's tensor arguments, named after its parameters (`x`, `input_ids`, `batch[0]`)."""
    out: List[Tuple[str, torch.Tensor]] = []
    try:
        signature = forward_signature(module)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        for i, arg in enumerate(args):
            named_tensors(arg, f"args[{i}]", out)
        for key, arg in kwargs.items():
            named_tensors(arg, key, out)
        return out
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            for key, item in value.items():
                named_tensors(item, key, out)
        else:
            named_tensors(value, name, out)
    return out


def named_outputs(output) -> List[Tuple[str, torch.Tensor]]:
    out: List[Tuple[str, torch.Tensor]] = []
    named_tensors(output, "out", out)
    return out


def check_model(model, entry: str) -> nn.Module:
    """The model argument must be an `nn.Module`; say how to fix it when it is not."""
    if isinstance(model, nn.Module):
        return model
    hint = ""
    if callable(model):
        hint = " To narrate a plain function, wrap it in a module whose forward calls it."
    raise ModelTypeError(f"{entry} takes an nn.Module as the model, got {type(model).__name__}.{hint}")


def check_selection(settings, paths) -> None:
    """A selector naming a module path the model lacks is an error before the run starts."""
    narration = settings.narration
    if narration is not None and narration.select is not None:
        narration.select.check_paths(paths)
