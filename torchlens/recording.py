"""Recordings and the `Recorder` context manager (`tl.recording.Recorder`)."""

from .eager.recorder import Recorder
from .results import PartialTrace, Recording, Trace, Transcript

__all__ = ["Recorder", "Recording", "Trace", "PartialTrace", "Transcript"]
