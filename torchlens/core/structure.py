"""The model's structure as narration sees it: module scopes, named inputs, named outputs."""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..errors import ModelTypeError

__all__ = ["check_model", "check_selection", "forward_signature", "model_tensors", "module_of", "named_arguments",
           "named_outputs", "tensor_names"]

MAX_NESTING = 8


def named_tensors(obj, label: str, out: List[Tuple[str, torch.Tensor]], nesting: int = 0) -> None:
    """Collect the tensors inside `obj` (tensor, tuple/list, dict, dataclass) with readable labels:
    `batch[0]`, `batch['ids']`, `batch.ids`, as the user would write them to reach the tensor."""
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
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            named_tensors(getattr(obj, field.name, None), f"{label}.{field.name}", out, nesting + 1)


_signatures: Dict[Any, inspect.Signature] = {}


def signature_of(fn) -> inspect.Signature:
    """`inspect.signature(fn)`, memoised per underlying function (it costs tens of µs)."""
    key = getattr(fn, "__func__", fn)
    try:
        return _signatures[key]
    except (KeyError, TypeError):
        signature = inspect.signature(fn)
        try:
            _signatures[key] = signature
        except TypeError:
            pass
        return signature


def forward_signature(module: nn.Module) -> inspect.Signature:
    return signature_of(module.forward)


def named_arguments(fn, args: tuple, kwargs: dict) -> List[Tuple[str, torch.Tensor]]:
    """The tensors among a call's arguments, named after `fn`'s parameters (`x`, `input_ids`, `batch[0]`)."""
    wrapped = getattr(fn, "__wrapped__", None)
    if isinstance(wrapped, nn.Module):  # dynamo calls a torch.nn module through a wrapper function
        fn = wrapped
    if isinstance(fn, nn.Module):
        fn = getattr(fn, "_orig_mod", fn).forward  # a compiled module: named by the wrapped forward
    elif isinstance(getattr(fn, "__self__", None), nn.Module) and getattr(fn, "__name__", "") in (
        "__call__", "_wrapped_call_impl", "_call_impl"):
        fn = getattr(fn.__self__, "_orig_mod", fn.__self__).forward  # a module's call: name by forward
    positional, varargs = _parameter_names(fn)
    out: List[Tuple[str, torch.Tensor]] = []
    for i, arg in enumerate(args):
        if i < len(positional):
            label = positional[i]
        elif varargs:
            label = f"{varargs}[{i - len(positional)}]"
        else:
            label = f"args[{i}]"
        named_tensors(arg, label, out)
    for key, arg in kwargs.items():
        named_tensors(arg, key, out)
    return out


_parameters: Dict[Any, Tuple[Tuple[str, ...], str]] = {}


def _parameter_names(fn) -> Tuple[Tuple[str, ...], str]:
    """Names of `fn`'s positional parameters and of its `*args` parameter (memoised): what
    `Signature.bind` would map positional arguments to, at a fraction of its cost."""
    key = getattr(fn, "__func__", fn)
    try:
        return _parameters[key]
    except (KeyError, TypeError):
        pass
    try:
        parameters = signature_of(fn).parameters.values()
    except (TypeError, ValueError):
        names: Tuple[Tuple[str, ...], str] = ((), "")
    else:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = tuple(p.name for p in parameters if p.kind in kinds)
        varargs = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL), "")
        names = (positional, varargs)
    try:
        _parameters[key] = names
    except TypeError:
        pass
    return names


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


def tensor_names(model) -> dict:
    """id -> dotted name of the model's parameters and buffers (`blocks.1.fc.weight`): how
    non-finite tracking names a tensor no op produced."""
    if not isinstance(model, nn.Module):
        return {}
    names: Dict[int, str] = {}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        names.setdefault(id(tensor), name)
    return names


def model_tensors(model) -> Iterator[torch.Tensor]:
    """The tensors a model holds: its parameters and buffers, and the plain tensor attributes of its
    modules (a mask or a table kept without registering it). Memory the user's program set: views
    of it are measured (see `torchlens.measure.unwritten`)."""
    if not isinstance(model, nn.Module):
        return
    for module in model.modules():
        yield from (tensor for tensor in module._parameters.values() if tensor is not None)
        yield from (tensor for tensor in module._buffers.values() if tensor is not None)
        attributes = module.__dict__
        for name in _tensor_attributes(module):
            value = attributes.get(name)
            if isinstance(value, torch.Tensor):
                yield value


_TENSOR_ATTRIBUTES: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _tensor_attributes(module: nn.Module) -> tuple:
    """The names of a module's plain tensor attributes, found once per module (a module's
    attributes are many; an attribute made later is missed, and views of it are then not measured)."""
    names = _TENSOR_ATTRIBUTES.get(module)
    if names is None:
        names = _TENSOR_ATTRIBUTES[module] = tuple(
            name for name, value in module.__dict__.items() if isinstance(value, torch.Tensor))
    return names


def module_of(fn) -> Optional[nn.Module]:
    """The module a callable belongs to: a module, its bound call (or forward), or what
    `torch.compile(module)` wrapped (`OptimizedModule` stands for its `_orig_mod`); else None."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return getattr(owner, "_orig_mod", owner)
    return fn if isinstance(fn, nn.Module) else None
