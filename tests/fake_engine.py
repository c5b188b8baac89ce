"""A stand-in for a distributed engine's own code, for tests that need one in a single process.

FSDP2 keeps each layer's unsharded parameters in a flat buffer whose storage it frees after the
forward and gets back before the next (`resize_`), holding whatever bytes were there, then views
it and copies the gathered values into the views. `EngineMemory` does the same, with bytes of
0xFF (a NaN in float32, every time). The `engine_code` fixture of a test makes torchlens tell the
ops called from this file as FSDP2's, as it tells FSDP2's own under a process group.
"""

from __future__ import annotations

import torch

ENGINE_FILE = "tests/fake_engine.py"


class EngineMemory:
    def __init__(self, numel: int):
        self.flat = torch.zeros(numel)

    def give_back(self) -> None:
        storage = self.flat.untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)
        storage.resize_(size)
        storage.fill_(0xFF)

    def view(self, *shape) -> torch.Tensor:
        return self.flat.view(*shape)

    def unshard(self, x) -> torch.Tensor:
        """The memory back, a view of its stale bytes, the values copied in, a view of them."""
        self.give_back()
        view = self.flat.view(2, 4)  # stale bytes: nothing wrote them yet
        torch.mul(x, 1.0, out=view)  # now every byte of it is written
        return self.flat.view(8)
