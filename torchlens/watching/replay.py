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
were, and the screens must match bit for bit (NaN equal to NaN); an argument the caller changed in
place after the forward is counted. What does not match is said, never assumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..core.generators import RandomState
from ..core.guard import is_stop
from ..findings import Finding
from ..narration.grammar import plural
from ..narration.ranks import rank_and_world_size
from ..options import NarrationOptions
from ..recording import Recorder
from .agreement import agree, flag
from .checks import floating_leaves, nonfinite_positions, same_screens, screen_squares
from .steps import StepRecord, WatchedForward, autocast_as

__all__ = ["Outcome", "Replays", "replay_step", "run_forwards", "user_state_kept"]


@dataclasses.dataclass(eq=False, slots=True)
class Outcome:
    """What one replay found. `finding` is the first finding in program order (forward before its
    backward, micro-batch by micro-batch), `recording` the pass it is in (a `Recording`, or the
    compiled forward's), `micro_batch` its forward's number in the step, `phase` "forward" or
    "backward"; `notes` say what was not as in the step."""

    attempt: int
    compiled: bool
    finding: Optional[Finding] = None
    recording: Any = None  # (a Recording, or a compiled pass's)
    micro_batch: Optional[int] = None
    phase: Optional[str] = None
    notes: List[str] = dataclasses.field(default_factory=list)
    recordings: list = dataclasses.field(default_factory=list)
    nonfinite_gradients: int = 0  # parameters whose replayed gradient holds a non-finite value
    nonfinite_outputs: int = 0  # replayed forwards with a non-finite output
    exact: bool = True  # every replayed forward's outputs screened bitwise as the step's did
    recorder: Optional[Recorder] = None

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
def user_state_kept(model: nn.Module, params: List[torch.Tensor], modules: List[nn.Module]):
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
        outcome.notes.append(f"{plural(changed, 'input tensor')} changed in place after "
                             f"the step's forward: the replay ran on the changed values")
    inexact = 0
    with user_state_kept(model, params, modules):
        # narrated nowhere, with sites: the recordings render (page, trace) with each op's file:line
        quiet = NarrationOptions(sink=_discard, sites=True)
        recorder = Recorder(model, narrate=quiet, backward=True, on_nonfinite="track") if compiled is None else None
        with (recorder if recorder is not None else contextlib.nullcontext()):
            runner = compiled if compiled is not None else model
            # (the generator first: after its last forward it resumes to run the backwards)
            for leaves, forward in zip(run_forwards(runner, forwards, modules), forwards):
                if compiled is not None:
                    outcome.recordings.append(compiled.torchlens.last_recording)
                if not same_screens(screen_squares(leaves), forward.squares):
                    inexact += 1
                if nonfinite_positions(leaves):
                    outcome.nonfinite_outputs += 1
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
    elif forwards and not any(f.received for f in forwards):
        outcome.notes.append("no backward reached the model's outputs in the step: only the forwards were replayed")
    outcome.find(prefer)
    return outcome


def run_forwards(model, forwards: List[WatchedForward], modules: List[nn.Module]):
    """Run the step's `forwards` again through `model`, each as it began (training flags, random
    generators' states, autocast), on its own argument objects, yielding each one's floating
    outputs; after each, the backwards that finished with it, fed the gradients
    the step's own backwards sent into the outputs. The caller keeps the user's state
    (`user_state_kept`)."""
    plan = _backward_plan(forwards)
    last_forward = {task: max(index for index, _, _ in entries) for task, entries in plan.items()}
    outputs: List[List[torch.Tensor]] = []
    for index, forward in enumerate(forwards):
        for module, training in zip(modules, forward.modes):
            module.training = training
        forward.rng.restore()
        with autocast_as(forward.autocast), torch.enable_grad():
            output = model(*forward.args, **forward.kwargs)
        leaves = floating_leaves(output)
        outputs.append(leaves)
        yield leaves
        for task in [t for t, last in last_forward.items() if last == index]:
            _run_backward(plan[task], outputs)


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


class Replays:
    """How a watch replays a faulty step: eagerly, up to `count` times, until a replay reproduces
    the fault; then, for a compiled model whose eager replays found nothing, once through
    `tl.compile` of it (made at its first use, compiled by `compiler`). `running` while a replay
    runs (the watch's hooks stand aside); `false_output_alarm`: the last replay saw the step's
    outputs finite and exact, so their screen's alarm was an overflow of finite values."""

    def __init__(self, eager: nn.Module, compiled: bool, params: List[torch.Tensor], modules: List[nn.Module],
                 count: int, compiler):
        self.eager, self.compiled, self.params, self.modules = eager, compiled, params, modules
        self.count, self.compiler = count, compiler
        self.running = False
        self.false_output_alarm = False
        self._replayer = None

    def run(self, fault, step: StepRecord, gradients: bool, prefer: Optional[str] = None) -> None:
        """Replay `step` for `fault` (a `faults.Fault`, told what the replays found)."""
        self.false_output_alarm = False
        self.running = True
        outcome: Optional[Outcome] = None
        try:
            for attempt in range(1, self.count + 1):
                outcome = replay_step(self.eager, step.forwards, self.params, self.modules, attempt, prefer=prefer)
                if self._reproduced(fault, outcome):
                    return
            if self.compiled and rank_and_world_size()[1] == 1:
                outcome = replay_step(self.eager, step.forwards, self.params, self.modules, self.count + 1,
                                      compiled=self._compiled_replayer(), prefer=prefer)
                if self._reproduced(fault, outcome):
                    return
            assert outcome is not None  # (count >= 1: the loop replayed)
            why = _not_replayed(step.forwards, gradients)
            fault.not_reproduced(outcome, why)
            # (outputs that differ from the step's are what a transient fault looks like)
            self.false_output_alarm = why is None and not gradients and outcome.nonfinite_outputs == 0 and outcome.exact
        except Exception as exc:
            if is_stop(exc):
                raise
            fault.not_reproduced(None, f"the replay raised {type(exc).__name__}: {exc}")
        finally:
            self.running = False

    def _reproduced(self, fault, outcome: Outcome) -> bool:
        """Whether `outcome` reproduced the fault: under a process group, on any rank (the ranks
        agree through `tl.debug.across_ranks`, which also names the rank of birth)."""
        birth, reproduced = None, outcome.reproduced
        if rank_and_world_size()[1] > 1 and outcome.recorder is not None:
            from ..debug.across_ranks import across_ranks

            birth = across_ranks(outcome.recorder)
            reproduced = agree(flag(outcome.reproduced)) or birth.first_rank is not None
        if reproduced:
            fault.reproduced_by(outcome, outcome.attempt, self.count + (1 if outcome.compiled else 0), birth)
        return reproduced

    def _compiled_replayer(self):
        if self._replayer is None:
            from ..api import compile as tl_compile

            self._replayer = tl_compile(self.eager, on_nonfinite="track", backward=True, compiler=self.compiler)
        return self._replayer


def _not_replayed(forwards: List[WatchedForward], gradients: bool) -> Optional[str]:
    """Why the replays could not tell a transient fault (they did not replay the step), or None."""
    if gradients and any(f.dropped for f in forwards):
        return next(f.dropped for f in forwards if f.dropped)
    if gradients and not any(f.received for f in forwards):
        return "no backward reached the model's outputs, so the gradients were not replayed"
    if any(f.changed_inputs() for f in forwards):
        return "the step's inputs were changed in place after its forward, so the replay is not the step"
    return None
