"""What dynamo writes into the meta of each node of a graph it captures, read in one place.

A backend is handed an `fx.GraphModule` whose nodes dynamo annotated while it traced: the fake
value each node computed (`example_value`; graphs that other tracers made carry `val`), the module
calls it ran inside (`nn_module_stack`) and the user's source lines (`stack_trace`). These keys are
dynamo's, not a contract of torch.fx, so the compiled substrate reads them only through these
functions; the seam table's "node meta" row probes them on the installed torch.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["example_value", "fake_twins", "module_stack", "plain_fake", "stack_trace"]


def example_value(node, or_val: bool = False):
    """The value dynamo traced `node` to (a fake tensor, a SymInt, a tuple of them), None where
    not recorded; `or_val`: also the `val` that graphs from other tracers carry."""
    meta = getattr(node, "meta", None)
    if meta is None:
        return None
    return meta.get("example_value", meta.get("val")) if or_val else meta.get("example_value")


def module_stack(node) -> Optional[dict]:
    """The module calls `node` ran inside, outermost first (dynamo's `nn_module_stack`)."""
    return node.meta.get("nn_module_stack")


def stack_trace(node) -> Optional[str]:
    """The user's source lines `node` came from, as dynamo formats them."""
    return node.meta.get("stack_trace")


def plain_fake(value) -> bool:
    """Whether a recorded value is a plain fake tensor: not a subclass (a DTensor), not a SymInt."""
    return type(value) is FakeTensor


def fake_twins(values) -> Tuple[FakeTensorMode, List[torch.Tensor]]:
    """A fake mode of its own and, in it, fake tensors shaped as these plain fake ones (static
    sizes): to run a graph's ops on its recorded inputs without touching dynamo's fake mode or its
    shape environment."""
    mode = FakeTensorMode()
    with mode:
        return mode, [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in values]
