"""torchlens: narrate a PyTorch forward pass, eagerly or inside `torch.compile`.

    import torchlens as tl
    recording = tl.record(model, x, narrate=True)

See the README and docs/ for the guide.
"""

from . import debug, errors, fx_backend, options, recording
from .fx_backend import registration as _registration  # noqa: F401  (loads fx_backend.registration)
from .api import compile, record, trace
from .events import Event, EventKind, TensorMeta
from .recording import PartialTrace, Recording, Trace
from .selectors import in_module

__all__ = [
    "record",
    "trace",
    "compile",
    "in_module",
    "options",
    "recording",
    "debug",
    "errors",
    "Recording",
    "Trace",
    "PartialTrace",
    "Event",
    "EventKind",
    "TensorMeta",
]
__version__ = "0.1.0"

fx_backend.registration.register_without_entry_point()
