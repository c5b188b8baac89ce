"""Keeping op outputs for `tl.trace`: detached copies, optionally on the CPU, within a budget."""

from __future__ import annotations

import torch

from ..errors import TraceBudgetError
from ..events import BackwardEvent
from ..narration.grammar import op_ref

__all__ = ["DEFAULT_MAX_BYTES", "ValueKeeper"]

DEFAULT_MAX_BYTES = 2 * 1024**3


def _fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


class ValueKeeper:
    """Observer that copies each op's tensor outputs into `values[ordinal]`.

    Copies, not references: a later in-place op (`relu_`, `add_`) would otherwise change what was
    kept. The copy is detached, so it holds no autograd graph.
    """

    def __init__(self, values: dict, keep_on_cpu: bool = False, max_bytes=DEFAULT_MAX_BYTES):
        self.values = values
        self.keep_on_cpu = keep_on_cpu
        self.max_bytes = max_bytes
        self.total = 0

    def __call__(self, event, out) -> None:
        tensors = (out,) if isinstance(out, torch.Tensor) else tuple(t for t in out if isinstance(t, torch.Tensor))
        size = sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")
        if self.max_bytes is not None and self.total + size > self.max_bytes:
            where = (f"~{event.ordinal} {event.op} (a backward node)" if isinstance(event, BackwardEvent)
                     else op_ref(event.ordinal, event.op, event.scope.path))
            raise TraceBudgetError(
                f"tl.trace stopped at {where}: keeping its output would make "
                f"{_fmt_bytes(self.total + size)} of kept values, over max_bytes={self.max_bytes} "
                f"({_fmt_bytes(self.max_bytes)}). Pass a larger max_bytes= (None for no limit), "
                f"keep_on_cpu=True to keep them in host memory, or use tl.record, which keeps no values."
            )
        self.total += size
        self.values[event.ordinal] = tuple(self._copy(t) for t in tensors)

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self.keep_on_cpu and tensor.device.type != "cpu":
            return tensor.to("cpu", copy=True)
        return tensor.clone()
