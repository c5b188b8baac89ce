"""Which ops a distributed engine runs for itself inside the user's modules.

FSDP2 gathers a layer's parameters in the layer's forward pre-hook (`empty`, `all_gather_copy_in`,
the all-gather, views of the unsharded parameters, `split_with_sizes_copy`); DDP and tensor
parallel run ops of their own around the model's too. Narrated as the user's, they bury the model's
lines. An op is an engine's when the code that called it is the engine's (its file lies in the
engine's part of torch); narration folds such ops unless `NarrationOptions(engine_ops=True)`, and
the footer counts them. Told only under an initialised process group (where the engines run), from
the calling frames, each code object judged once.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

__all__ = ["distributed", "engine_of"]

# where in torch each engine's code lives, the most specific first
_ENGINE_FILES = (
    ("torch/distributed/fsdp/_fully_shard/", "FSDP2"),
    ("torch/distributed/fsdp/", "FSDP"),
    ("torch/nn/parallel/distributed.py", "DDP"),
    ("torch/distributed/algorithms/ddp_comm_hooks/", "DDP"),
    ("torch/distributed/tensor/parallel/", "tensor parallel"),
    ("torch/distributed/tensor/", "DTensor"),
)

_TORCH = object()  # a code object of torch's own, no engine's: the engine is further out, if any
_TORCH_DIR = os.path.dirname(torch.__file__).replace("\\", "/") + "/"
_MODULES_DIR = _TORCH_DIR + "nn/modules/"
_BY_CODE: Dict[object, object] = {}


def engine_of(frame) -> Optional[str]:
    """The engine whose code ran the op `frame` called, or None when it was somebody else's: the
    frames out from it are followed through torch's own (a custom op's dispatch, an autograd
    Function's `apply`) to the first that is an engine's or not torch's."""
    while frame is not None:
        verdict = _verdict(frame.f_code)
        if verdict is not _TORCH:
            return verdict
        frame = frame.f_back
    return None


def _verdict(code):
    try:
        return _BY_CODE[code]
    except KeyError:
        filename = code.co_filename.replace("\\", "/")
        verdict: object = next((name for part, name in _ENGINE_FILES if part in filename), None)
        if verdict is None and filename.startswith(_TORCH_DIR) and not filename.startswith(_MODULES_DIR):
            verdict = _TORCH  # (torch's own modules, `nn.Linear`, are the model's code: no engine's)
        if len(_BY_CODE) < 65536:
            _BY_CODE[code] = verdict
        return verdict


def distributed() -> bool:
    """Whether a process group is initialised (engines run only then)."""
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False
