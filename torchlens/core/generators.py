"""The default random generators' states, taken and put back.

What needs a run again exactly as it ran (a training watch's replay of a faulty step, a bisection's
compiled tries set beside one eager run) starts each run from the generator states the original
started from: dropout masks and random initialisations then reproduce bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["RandomState"]


class RandomState:
    """The default generators' states: the CPU one and each initialised CUDA device's."""

    __slots__ = ("cpu", "cuda")

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)

    @property
    def nbytes(self) -> int:
        return self.cpu.numel() + sum(s.numel() for s in (self.cuda or ()))
