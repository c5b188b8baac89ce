"""`compiled.torchlens`: what a model compiled by `tl.compile` offers about its narration.

The runtime behind a compiled model holds its sink, dynamo hooks and per-graph plans; none of that
is the user's to touch. The handle shows what is: the latest forward's recording and how many
forwards were narrated. A copied or saved compiled model carries no handle (its copy's is None).
"""

from __future__ import annotations

from typing import Optional

from ..results import Recording

__all__ = ["CompiledNarration"]


class CompiledNarration:
    """The narration of a model compiled with `tl.compile`, attached to it as `.torchlens`.

    `last_recording`: the most recent forward's `Recording` (None before the first; only the last
    is kept, and no longer than the model). `forwards`: how many forwards have been narrated.
    """

    __slots__ = ("_runtime",)

    def __init__(self, runtime):
        self._runtime = runtime

    @property
    def last_recording(self) -> Optional[Recording]:
        return self._runtime.last_recording

    @property
    def forwards(self) -> int:
        return self._runtime.passes

    def __reduce__(self):
        """A copied or saved compiled model carries no narration state (see `CompiledRuntime`)."""
        return (_no_handle, ())

    def __repr__(self) -> str:
        last = self.last_recording
        return f"CompiledNarration(forwards={self.forwards}, last_recording={'None' if last is None else 'Recording'})"


def _no_handle():
    return None
