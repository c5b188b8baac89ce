"""What `tl.watch` takes, checked: its choices and counts, the optimizers it hooks (wrappers looked
through), the parameters they step, and the module a replay runs."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from ..errors import OptionTypeError, OptionValueError

__all__ = ["CHECKS", "DEFAULT_MAX_BYTES", "ON_FAULT", "check_count", "eager_module", "optimizers", "watched_parameters"]

ON_FAULT = ("raise", "skip", "report")
CHECKS = ("grads", "outputs")
DEFAULT_MAX_BYTES = 64 << 20


def check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"tl.watch {name}= takes an integer, got {value!r}")
    if value < minimum:
        raise OptionValueError(f"tl.watch {name}={value}: it must be at least {minimum}")
    return value


def optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers to hook: one, or several; a wrapper exposing `.optimizer` (accelerate's
    `AcceleratedOptimizer`, Lightning's) is unwrapped to the optimizer whose `step` runs."""
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not items:
        raise OptionValueError("tl.watch needs the optimizer that steps the model (or a list of them); got none")
    found = []
    for item in items:
        inner = item
        while not hasattr(inner, "register_step_pre_hook") and hasattr(inner, "optimizer"):
            inner = inner.optimizer
        while type(inner).__name__ in ("AcceleratedOptimizer", "LightningOptimizer") and hasattr(inner, "optimizer"):
            inner = inner.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise OptionTypeError(f"tl.watch takes a torch.optim.Optimizer (or a list of them) as the optimizer, "
                                  f"got {type(item).__name__}")
        found.append(inner)
    return found


def eager_module(model: nn.Module):
    """(the module a replay runs, whether `model` is compiled): `torch.compile`'s wrapper and DDP's
    are looked through (a replay runs locally, without DDP's gradient all-reduce)."""
    compiled = False
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model, compiled = model._orig_mod, True
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(
                model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model, compiled


def watched_parameters(optimizers: List[torch.optim.Optimizer], model: nn.Module) -> Tuple[List[torch.Tensor],
                                                                                           List[str]]:
    """The parameters the optimizers step that take gradients, each once, and their names in `model`."""
    seen, params = set(), []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    params.append(p)
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    return params, [names.get(id(p), f"parameter {i}") for i, p in enumerate(params)]
