"""torchlens: narrate a PyTorch forward pass, eagerly or inside `torch.compile`.

    import torchlens as tl
    recording = tl.record(model, x, narrate=True)

See the README and docs/ for the guide.
"""

from . import debug, errors, options, recording, watching
from .api import compile, load, record, trace  # noqa: F401  (compile: public, left out of __all__ below)
from .events import Attempt, Event, EventKind, Scope, Stats, StatsGroup, TensorMeta
from .findings import Finding, FindingKind
from .fx_backend.registration import register_without_entry_point as _register
from .recording import PartialTrace, Recording, Trace
from .selectors import in_module
from .watching import Fault, Watch, watch

# `compile` is left out of __all__ so that `from torchlens import *` does not shadow the builtin.
__all__ = [
    "record",
    "trace",
    "load",
    "watch",
    "Watch",
    "Fault",
    "in_module",
    "options",
    "recording",
    "debug",
    "watching",
    "errors",
    "Recording",
    "Trace",
    "PartialTrace",
    "Event",
    "EventKind",
    "Finding",
    "FindingKind",
    "TensorMeta",
    "Scope",
    "Attempt",
    "Stats",
    "StatsGroup",
]
__version__ = "0.1.0"

_register()  # from a source checkout, where no installed entry point names the backend


def __dir__():
    """The public API, not the implementation: importing torchlens imports its internal modules,
    which Python would otherwise list as attributes of the package (`dir(tl)` showed some 60)."""
    return sorted([*__all__, "compile", "__version__"])
