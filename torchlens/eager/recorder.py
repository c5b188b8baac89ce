"""`Recorder`: narrate every forward of a model inside a `with` block.

The decorator idiom of line tracers (`with snoop():`) maps onto this: each call of the model while
the block is open is one pass, recorded and narrated with a pass number.
"""

from __future__ import annotations

import sys
import threading
import collections
from typing import Deque, Optional

from torch import nn

from ..narrator import Narrator
from ..results import Recording
from ..errors import OptionValueError, RecorderStateError
from ..options import Settings, make_settings
from ..session import internal_error
from .capture import unwinding
from .runner import EagerRun
from .structure import check_model, check_selection


class Recorder:
    """Context manager: every forward of `model` called inside is one recorded, narrated pass.

    ::

        with tl.recording.Recorder(model, narrate="run.log") as rec:
            model(x)
            model(y)
        rec.recordings[1].narrate(last=10)

    `recordings` holds one `Recording` per pass (a `PartialTrace` for a pass that failed), each with
    its forward's output: over a long loop pass `keep=N` to keep only the last N (the pass numbers
    go on counting).
    """

    def __init__(self, model: nn.Module, *, narrate=None, value_stats: str = "off", on_nonfinite=None,
                 keep: Optional[int] = None):
        check_model(model, "Recorder")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise OptionValueError(f"Recorder(keep=...) takes a number of passes >= 1, or None for all; got {keep!r}")
        self.model = model
        self.settings: Settings = make_settings(narrate, value_stats, on_nonfinite)
        check_selection(self.settings, [name for name, _ in model.named_modules()])
        self.recordings: Deque[Recording] = collections.deque(maxlen=keep)
        self.passes = 0
        self._narrator: Optional[Narrator] = None
        self._handles = []
        self._run: Optional[EagerRun] = None
        self._thread = None

    def __enter__(self) -> "Recorder":
        if self._handles:
            raise RecorderStateError("this Recorder is already active: leave its `with` block before entering it again")
        if self.settings.narration is not None:
            self._narrator = Narrator(self.settings.narration)
        self._thread = threading.get_ident()
        self._handles = [
            self.model.register_forward_pre_hook(self._begin, with_kwargs=True),
            self.model.register_forward_hook(self._end, with_kwargs=True, always_call=True),
        ]
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        run, self._run = self._run, None
        if run is not None:  # a pass cut short by something forward hooks do not see (KeyboardInterrupt)
            try:
                if exc is not None:
                    self._keep(run.abort(exc))
            except Exception as inner:
                internal_error("ending an interrupted pass", inner)
            finally:
                run.close()
        if self._narrator is not None:
            self._narrator.close()
            self._narrator = None
        return False

    def _keep(self, recording) -> None:
        if recording is not None:
            self.recordings.append(recording)

    def _begin(self, module, args, kwargs):
        if self._run is not None or threading.get_ident() != self._thread:
            return None  # a nested call of the model inside its own forward is part of the pass
        try:
            self.passes += 1
            self._run = EagerRun(self.model, self.settings, self._narrator, header=f"pass {self.passes}")
            self._run.begin(args, kwargs)
        except Exception as exc:
            if self._run is not None:
                self._run.close()
            self._run = None
            if getattr(exc, "torchlens_stop", False):
                raise
            internal_error("starting a pass", exc)
        return None

    def _end(self, module, args, kwargs, output):
        run = self._run
        if run is None or threading.get_ident() != self._thread:
            return None
        self._run = None
        try:
            self._keep(run.abort(sys.exc_info()[1]) if unwinding() else run.end(output))
        except Exception as exc:
            internal_error("ending a pass", exc)
        finally:
            run.close()
        return None
