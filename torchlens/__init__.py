"""torchlens: narrate a PyTorch forward pass, eagerly or inside `torch.compile`.

    import torchlens as tl
    recording = tl.record(model, x, narrate=True)

See the README and docs/ for the guide.
"""

from . import errors, options, recording
from .api import record, trace
from .events import Event, EventKind, TensorMeta
from .recording import PartialTrace, Recording, Trace
from .selectors import in_module

__all__ = [
    "record",
    "trace",
    "in_module",
    "options",
    "recording",
    "errors",
    "Recording",
    "Trace",
    "PartialTrace",
    "Event",
    "EventKind",
    "TensorMeta",
]
__version__ = "0.1.0"
