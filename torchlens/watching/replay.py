"""Replaying a faulty step exactly, under tracking, before the optimizer changes anything.

The replay runs the step's forwards again on the weights the step saw (the optimizer has not
touched them), each from the random generators' states and under the autocast and training modes
it began with, on the same argument objects, and after each one the backwards that finished with
it, fed the gradients the step's own backwards sent into the outputs. It runs under
`Recorder(backward=True, on_nonfinite="track")`, so the first finding names the forward op or the
backward node where the value was born. Around it everything the user's run owns is put back as
it was: the parameters' gradients (set aside, not copied), the generators' states, the buffers
(a forward in training mode updates BatchNorm's running statistics again; they are copied before
and written back after) and the modules' training flags.

The replay shows it was exact where it can: each forward's outputs are screened as the step's
were, and the sums must match bit for bit (NaN equal to NaN); an argument the caller changed in
place after the forward is counted. What does not match is said, never assumed.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..findings import Finding
from ..generators import RandomState
from ..options import NarrationOptions
from ..recording import Recorder
from .checks import floating_leaves, nonfinite_positions, same_sums, screen_sums
from .steps import WatchedForward, autocast_as

__all__ = ["Outcome", "replay_step"]


class Outcome:
    """What one replay found. `finding` is the first finding in program order (forward before its
    backward, micro-batch by micro-batch), `recording` the pass it is in (a `Recording`, or the
    compiled forward's), `micro_batch` its forward's number in the step, `phase` "forward" or
    "backward"; `notes` say what was not as in the step."""

    __slots__ = ("attempt", "compiled", "finding", "recording", "micro_batch", "phase", "notes", "recordings",
                 "nonfinite_gradients", "nonfinite_outputs", "exact", "recorder")

    def __init__(self, attempt: int, compiled: bool):
        self.attempt = attempt
        self.compiled = compiled
        self.finding: Optional[Finding] = None
        self.recording = None
        self.micro_batch: Optional[int] = None
        self.phase: Optional[str] = None
        self.notes: List[str] = []
        self.recordings: list = []
        self.nonfinite_gradients = 0  # parameters whose replayed gradient holds a non-finite value
        self.nonfinite_outputs = 0  # replayed forwards with a non-finite output
        self.exact = True  # every replayed forward's outputs screened bitwise as the step's did
        self.recorder: Optional[Recorder] = None

    @property
    def reproduced(self) -> bool:
        return self.finding is not None or self.nonfinite_gradients > 0 or self.nonfinite_outputs > 0

    def find(self, prefer: Optional[str] = None) -> None:
        """The first finding of phase `prefer` ("backward" for a fault in the gradients alone: a
        NaN the forward made and masked is not what reached them), else the first of any. A
        backward finding that is a forward value's consequence (`Finding.consequence`) gives way
        to that forward's own finding: the value to chase is the forward's."""
        found = []
        for number, recording in enumerate(self.recordings, 1):
            phases = [("forward", getattr(recording, "findings", ()))]
            phases += [("backward", backward.findings) for backward in getattr(recording, "backward", ())]
            found += [(phase, number, recording, findings[0]) for phase, findings in phases if findings]
        chosen = next((item for item in found if item[0] == prefer), found[0] if found else None)
        if chosen is not None and chosen[0] == "backward" and chosen[3].consequence:
            chosen = next((item for item in found if item[0] == "forward" and item[2] is chosen[2]), chosen)
        if chosen is not None:
            self.phase, self.micro_batch, self.recording, self.finding = chosen


def _backward_plan(forwards: List[WatchedForward]) -> Dict[int, List[Tuple[int, int, torch.Tensor]]]:
    """graph task -> [(forward index, output position, gradient received)], in the order the
    step's backwards ran; each task runs in the replay once the last forward it reached has run."""
    plan: Dict[int, List[Tuple[int, int, torch.Tensor]]] = {}
    for index, forward in enumerate(forwards):
        for task, grads in forward.received.items():
            plan.setdefault(task, []).extend((index, position, grad) for position, grad in grads.items())
    return dict(sorted(plan.items(), key=lambda item: item[0]))


@contextlib.contextmanager
def _user_state_kept(model: nn.Module, params: List[torch.Tensor], modules: List[nn.Module]):
    """Set the gradients aside for the replay's own; afterwards put back the gradients, the
    generators' states, the buffers' values and the training flags."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    rng = RandomState()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [m.training for m in modules]
    try:
        yield
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        rng.restore()
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        for module, training in zip(modules, modes):
            module.training = training


def replay_step(model: nn.Module, forwards: List[WatchedForward], params: List[torch.Tensor],
                modules: List[nn.Module], attempt: int, compiled=None, prefer: Optional[str] = None) -> Outcome:
    """Replay the step's `forwards` (and their backwards) on `model` (the eager module), or,
    given `compiled` (`tl.compile` of it, tracking), through it. `prefer`: see `Outcome.find`."""
    outcome = Outcome(attempt, compiled is not None)
    changed = sum(f.changed_inputs() for f in forwards)
    if changed:
        outcome.notes.append(f"{changed} input tensor{'s' if changed != 1 else ''} changed in place after "
                             f"the step's forward: the replay ran on the changed values")
    plan = _backward_plan(forwards)
    last_forward = {task: max(index for index, _, _ in entries) for task, entries in plan.items()}
    inexact = 0
    with _user_state_kept(model, params, modules):
        # narrated nowhere, with sites: the recordings render (page, trace) with each op's file:line
        quiet = NarrationOptions(sink=_discard, sites=True)
        recorder = Recorder(model, narrate=quiet, backward=True, on_nonfinite="track") if compiled is None else None
        with (recorder if recorder is not None else contextlib.nullcontext()):
            outputs: List[List[torch.Tensor]] = []
            for index, forward in enumerate(forwards):
                for module, training in zip(modules, forward.modes):
                    module.training = training
                forward.rng.restore()
                with autocast_as(forward.autocast), torch.enable_grad():
                    output = (compiled if compiled is not None else model)(*forward.args, **forward.kwargs)
                if compiled is not None:
                    outcome.recordings.append(compiled.torchlens.last_recording)
                leaves = floating_leaves(output)
                outputs.append(leaves)
                if not same_sums(screen_sums(leaves), forward.sums):
                    inexact += 1
                if nonfinite_positions(leaves):
                    outcome.nonfinite_outputs += 1
                for task in [t for t, last in last_forward.items() if last == index]:
                    _run_backward(plan[task], outputs)
        if recorder is not None:
            outcome.recordings, outcome.recorder = list(recorder.recordings), recorder
        grads = [p.grad for p in params if p.grad is not None]
        outcome.nonfinite_gradients = len(nonfinite_positions(grads))
    outcome.exact = not inexact and not changed
    if inexact:
        outcome.notes.append(f"the outputs of {inexact} of {len(forwards)} replayed forwards differ from the "
                             f"step's (a nondeterministic kernel, or state the replay does not restore)")
    missing = [f.dropped for f in forwards if f.dropped]
    if missing:
        outcome.notes.append(f"the backward was not replayed in full: {missing[0]}")
    elif forwards and not plan:
        outcome.notes.append("no backward reached the model's outputs in the step: only the forwards were replayed")
    outcome.find(prefer)
    return outcome


def _discard(line: str) -> None:
    """The replay's sink: its lines are rendered again from the recordings when asked for."""


def _run_backward(entries, outputs: List[List[torch.Tensor]]) -> None:
    tensors, grads = [], []
    for index, position, grad in entries:
        leaves = outputs[index]
        if position < len(leaves) and leaves[position].requires_grad:
            tensors.append(leaves[position])
            grads.append(grad)
    if tensors:
        torch.autograd.backward(tensors, grads, retain_graph=True)
