"""A spike explained by replay, before the update: the batch or the weights, and where.

Two replays on the weights the spiking step saw (the optimizer has not run), each with every
module's output and output gradient measured (`Probe`: their RMS, one read at the end):

1. **the spiking step itself.** If its outputs do not come out as the step's did, the spike did
   not reproduce: **transient** (a nondeterministic kernel, a race, the hardware), and its batch
   is saved. Not for a compiled step, whose eager replay does not repeat the compiler's random
   draws: there a difference is said, not judged;
2. **the previous calm step's batch** (the last step well within the rule's margins: one just
   under them may be the start of the trouble). The watch kept its references (arguments,
   generators' states, the gradients sent into its outputs), as it keeps the current step's. If
   these weights give that batch the outputs it had when it ran (each output's RMS within the
   rule's `factor`, a loss the model returns included, and a sample of its values within their
   own size of the step's: a sign flipped is not what it had), and, for a spike of the gradients
   alone, gradients that differ from the spiking batch's somewhere, the verdict is **the batch**,
   and the first module, in the order the values were computed, whose output (for a gradients'
   spike: whose gradient) on the spiking batch is out of that factor of the healthy batch's is
   named, with both RMS. Otherwise **the weights**: what changed them since that step is said as
   far as it was seen (parameters written outside the optimizer, else the updates that ran), with
   the parameters whose elements moved most (from the update check's screens, sums of squares
   taken after every update, and one screen now: nothing is copied).

A replay that cannot be the step (a batch changed in place since its forward, a backward not
kept) is said, not used. The step's gradients' norm is the one `optimizer.step()` saw (after any
clipping or unscaling, which a replay does not repeat): replays are compared with replays.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..core.guard import is_stop
from ..narration.grammar import plural
from ..narration.ranks import rank_and_world_size
from .agreement import agree, flag, values_by_rank
from .checks import floating_leaves, sample, screen_squares
from .replay import run_forwards, user_state_kept
from .spikes import Spike, SpikeRule, figure, local_loss
from .steps import StepRecord
from .updates import Weights

__all__ = ["Magnitudes", "Probe", "explain", "record_step", "recorded"]

# how close a replayed output's RMS must be to the step's to be the step's (a compiled step is
# replayed eagerly: its outputs differ by rounding, far below any spike)
_SAME = 1e-3


class Magnitudes(NamedTuple):
    """Per-module RMS in one replay: `outputs` [(module, RMS)] in the order the modules returned,
    `gradients` [(module, RMS)] in the order their output gradients arrived. A module called more
    than once is named once per call (`blocks.0 (call 2)`)."""

    outputs: List[Tuple[str, float]]
    gradients: List[Tuple[str, float]]
    types: Dict[str, str]  # module -> its class's name


class Probe:
    """Forward hooks on every module of `model` while open: each call's floating outputs' sum of
    squares (and their gradients', as they arrive), kept on the device until `magnitudes()`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._outputs: List[Tuple[str, torch.Tensor, int]] = []
        self._grads: Dict[str, List] = {}  # module -> [squares, numel], in arrival order
        self._calls: collections.Counter = collections.Counter()
        self._types: Dict[str, str] = {}
        self._handles: list = []

    def __enter__(self) -> "Probe":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(functools.partial(self._returned, name or "(model)")))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _returned(self, name: str, module, args, output) -> None:
        leaves = floating_leaves(output)
        if not leaves:
            return
        self._calls[name] += 1
        key = name if self._calls[name] == 1 else f"{name} (call {self._calls[name]})"
        self._types[key] = type(module).__name__
        squares = screen_squares(leaves)
        assert squares is not None  # (there are leaves)
        self._outputs.append((key, squares.sum(), sum(leaf.numel() for leaf in leaves)))
        for leaf in leaves:
            if leaf.requires_grad:
                leaf.register_hook(functools.partial(self._gradient, key))

    def _gradient(self, key: str, grad: torch.Tensor) -> None:
        squares = screen_squares([grad])
        assert squares is not None  # (one tensor)
        entry = self._grads.setdefault(key, [torch.zeros((), device=squares.device), 0])
        entry[0] = entry[0] + squares[0]
        entry[1] += grad.numel()

    def magnitudes(self) -> Magnitudes:
        """The RMS of each module's outputs and gradients (one host read)."""
        parts = [s for _, s, _ in self._outputs] + [entry[0] for entry in self._grads.values()]
        values = torch.stack([p.to(parts[0].device).float() for p in parts]).tolist() if parts else []
        rms = _rms(values, [n for _, _, n in self._outputs] + [entry[1] for entry in self._grads.values()])
        count = len(self._outputs)
        return Magnitudes([(key, r) for (key, _, _), r in zip(self._outputs, rms[:count])],
                          list(zip(self._grads, rms[count:])), dict(self._types))


class _Replayed(NamedTuple):
    """One probed replay: the magnitudes, each forward's outputs' RMS and samples, the gradients' norm."""

    magnitudes: Magnitudes
    outputs: List[List[Tuple[float, bool]]]  # per forward: (RMS, whether it is a one-number loss)
    samples: List[List[torch.Tensor]]  # per forward: `checks.sample` of each output
    grad_norm: Optional[float]


def _replay(model: nn.Module, step: StepRecord, params: List[torch.Tensor], modules: List[nn.Module]) -> _Replayed:
    outputs: List[List[Tuple[float, bool]]] = []
    samples: List[List[torch.Tensor]] = []
    with user_state_kept(model, params, modules), Probe(model) as probe:
        kept = []
        for leaves in run_forwards(model, step.forwards, modules):
            kept.append((screen_squares(leaves), [(leaf.numel(), leaf.dim() == 0) for leaf in leaves]))
            samples.append([sample(leaf) for leaf in leaves])
        grads = [p.grad for p in params if p.grad is not None]
        squares = screen_squares(grads)
        norm = math.sqrt(float(squares.sum())) if squares is not None else None
    for squares, shapes in kept:
        values = squares.tolist() if squares is not None else []
        outputs.append(list(zip(_rms(values, [n for n, _ in shapes]), [loss for _, loss in shapes])))
    return _Replayed(probe.magnitudes(), outputs, samples, norm)


def _as_run(step: StepRecord) -> List[List[float]]:
    """Each forward's outputs' RMS as the step computed them (from its screens: one read)."""
    return [_rms(forward.squares.tolist() if forward.squares is not None else [], forward.sizes)
            for forward in step.forwards]


def _rms(squares: List[float], sizes) -> List[float]:
    """Root mean squares from sums of squares and element counts (0 for an empty tensor)."""
    return [math.sqrt(v / n) if n else 0.0 for v, n in zip(squares, sizes)]


def _outputs_text(rms: float, is_loss: bool, which: str = "") -> str:
    return f"the loss it returns {figure(rms)}" if is_loss else f"{which}output RMS {figure(rms)}"


def _first_apart(replayed: List[List[Tuple[float, bool]]], reference: List[List[float]],
                 close: Callable[[float, float], bool]) -> Optional[Tuple[float, bool, float, str]]:
    """The first output of `replayed` that is not `close` to `reference`'s: (its RMS, whether a
    loss, the reference's RMS, which output it is in words when there are several); None when
    all are."""
    for index, (outputs, ref) in enumerate(zip(replayed, reference), 1):
        for position, ((rms, is_loss), expected) in enumerate(zip(outputs, ref), 1):
            if not close(rms, expected):
                which = f"output {position} of {len(outputs)}'s " if len(outputs) > 1 else ""
                which += f"(forward {index} of {len(replayed)}) " if len(replayed) > 1 else ""
                return rms, is_loss, expected, which
    return None


def _moved(replayed: List[List[torch.Tensor]], step: StepRecord) -> Optional[float]:
    """How far the replayed outputs' samples are from the step's own, relative to the step's
    (the largest over its outputs: 2 for a sign flipped); None when the step kept none."""
    worst = None
    for samples, forward in zip(replayed, step.forwards):
        if forward.samples is None:
            return None
        for got, kept in zip(samples, forward.samples):
            if got.shape != kept.shape:
                continue
            size = float(torch.linalg.vector_norm(kept))
            apart = float(torch.linalg.vector_norm(got.to(kept.device) - kept))
            distance = apart / size if size > 0 else (0.0 if apart == 0 else math.inf)
            if worst is None or not distance <= worst:  # (NaN included)
                worst = distance
    return worst


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= _SAME * max(abs(a), abs(b)) or (math.isnan(a) and math.isnan(b))


def _within(factor: float) -> Callable[[float, float], bool]:
    def close(a: float, b: float) -> bool:
        if a == b:
            return True
        if not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b <= 0:
            return False
        return max(a / b, b / a) <= factor

    return close


def explain(spike: Spike, step: StepRecord, previous: Optional[StepRecord], model: nn.Module,
            params: List[torch.Tensor], modules: List[nn.Module], rule: SpikeRule,
            weights: Callable[[], Weights], compiled: bool = False) -> None:
    """Replay `step` and `previous` (see the module) and tell `spike` what they found; `compiled`:
    the step ran compiled, and the replays run eagerly. Under a process group every rank asks each
    question the others ask, in the same order (the replays are collectives under FSDP2),
    whatever its own answers."""
    world = rank_and_world_size()[1]
    if world > 1 and "loss" in spike.which:
        losses = values_by_rank(local_loss(step.roots))
        if any(v is not None for v in losses):
            spike.batch_rank = max((v, r) for r, v in enumerate(losses) if v is not None)[1]
    if _stopped(spike, _changed(step, "the spiking step's")):
        return
    spiked, failed = _attempt(lambda: _replay(model, step, params, modules))
    if _stopped(spike, failed):
        return
    assert spiked is not None  # (it did not fail)
    spike.magnitudes = (spiked.magnitudes, None)
    _transient(spike, spiked, step, compiled)
    if _stopped(spike, _cannot_compare(previous)):
        return
    assert previous is not None  # (`_cannot_compare` says so otherwise)
    healthy, failed = _attempt(lambda: _replay(model, previous, params, modules))
    if _stopped(spike, failed):
        return
    assert healthy is not None  # (it did not fail)
    spike.magnitudes = (spiked.magnitudes, healthy.magnitudes)
    if spike.verdict == "transient":
        return
    gradients = spike.which == "gradients"
    if gradients:
        if not (_backward_replayed(step) and _backward_replayed(previous)):
            spike.why = ("the backward was not replayed in full (the gradient into the outputs was not kept: "
                         "max_bytes, or no backward reached them), so the gradients were not measured")
            return
        # (in one process: under a process group the replay's gradients are this rank's, not reduced)
        if (world == 1 and spiked.grad_norm is not None and spike.grad_norm is not None
                and not _same(spiked.grad_norm, spike.grad_norm)):
            spike.notes.append(f"the step's gradients' norm is the one optimizer.step() saw (clipped or unscaled); "
                               f"its replay's is {figure(spiked.grad_norm)}")
    if not _weights(spike, spiked, healthy, previous, rule, weights):
        spike.verdict = "batch"
        first = healthy.outputs[0][0] if healthy.outputs and healthy.outputs[0] else None
        ran = _as_run(previous)
        spike.evidence = (f"the same weights give step {previous.number}'s batch what it had"
                          + (f" ({_outputs_text(first[0], first[1])} against {figure(ran[0][0])})" if first else ""))
        _where(spike, spiked.magnitudes, healthy.magnitudes, rule.factor, gradients)


def _attempt(replay):
    """(the replay's result, None) or (None, why it raised)."""
    try:
        return replay(), None
    except Exception as exc:
        if is_stop(exc):
            raise
        return None, f"the replay raised {type(exc).__name__}: {exc}"


def _stopped(spike: Spike, why: Optional[str]) -> bool:
    """Whether the explanation stops here, on every rank (one agrees: `why` on any rank)."""
    if not agree(flag(why)):
        return False
    if spike.verdict is None:
        spike.why = why or "the replay could not go on on another rank"
    return True


def _changed(step: StepRecord, whose: str) -> Optional[str]:
    changed = sum(f.changed_inputs() for f in step.forwards)
    if changed:
        return (f"{whose} batch was changed in place after its forward ({plural(changed, 'input tensor')}): "
                f"a replay would not be that step")
    return None


def _backward_replayed(step: StepRecord) -> bool:
    return all(f.received and not f.dropped for f in step.forwards)


def _transient(spike: Spike, spiked: _Replayed, step: StepRecord, compiled: bool) -> None:
    """Call `spike` transient when its replay does not give the step's outputs again (the ranks
    agree: a rank whose own replay matched says on which rank it did not). Not for a compiled
    step: its eager replay does not repeat the compiler's random draws (dropout's masks), so a
    difference there is not evidence of a transient."""
    apart = _first_apart(spiked.outputs, _as_run(step), _same)
    if compiled:
        if apart is not None:
            rms, is_loss, expected, which = apart
            spike.notes.append(f"replayed eagerly, the compiled step gives {_outputs_text(rms, is_loss, which)} "
                               f"against its {figure(expected)} (the compiler's random draws and rounding): "
                               f"whether the spike is transient is not told")
        return
    if apart is not None:
        rms, is_loss, expected, which = apart
        spike.verdict = "transient"
        spike.evidence = (f"its replay gives {_outputs_text(rms, is_loss, which)} against the step's "
                          f"{figure(expected)} "
                          f"(a nondeterministic kernel, a race or the hardware)")
    if rank_and_world_size()[1] > 1:
        ranks = [r for r, v in enumerate(values_by_rank(1.0 if apart is not None else None)) if v is not None]
        if ranks and apart is None:
            spike.verdict = "transient"
            spike.evidence = f"the replay on rank {ranks[0]} does not give that rank's outputs again"


def _weights(spike: Spike, spiked: _Replayed, healthy: _Replayed, previous: StepRecord, rule: SpikeRule,
             weights) -> bool:
    """Whether the weights made `spike`: they do not give the previous step's batch what it had
    (each output's RMS within the rule's factor, and its samples within their own size of the
    step's), or, for a spike of the gradients alone, they give that batch gradients as large as
    the spiking batch's (no module's out of range). If so, `spike` is told, with what changed the
    weights since, as far as it was seen."""
    off = _first_apart(healthy.outputs, _as_run(previous), _within(rule.factor))
    moved = _moved(healthy.samples, previous)
    alike = spike.which == "gradients" and _first_out(spiked.magnitudes.gradients,
                                                      healthy.magnitudes.gradients, rule.factor) is None
    if off is None and (moved is None or moved <= 1.0) and not alike:
        known = weights()
        if known.outside:
            spike.notes.append(f"written outside the optimizer since step {previous.number}: "
                               f"{_names(known.outside)}; its outputs are as they were")
        return False
    spike.verdict = "weights"
    if off is not None:
        rms, is_loss, expected, which = off
        spike.evidence = (f"the same weights give step {previous.number}'s batch {_outputs_text(rms, is_loss, which)} "
                          f"against {figure(expected)} when it ran")
    elif moved is not None and moved > 1.0:
        spike.evidence = (f"the same weights give step {previous.number}'s batch outputs that moved by "
                          f"{figure(moved)} times their size since it ran")
    else:
        spike.evidence = (f"the same weights give step {previous.number}'s batch gradients like the spiking "
                          f"batch's (every module's within {figure(rule.factor)}x)")
    known = weights()
    spike.parameters = known.changed
    if known.outside:
        spike.evidence += f": written outside the optimizer since that step: {_names(known.outside)}"
    elif known.span is not None:
        first, last = known.span
        # (what ran, not what caused: a write no counter or screen sees, a sign flipped through
        # `.data`, would look the same)
        spike.evidence += (f": since then, the update of step {first}, and no other write seen" if first == last
                           else f": since then, the updates of steps {first}-{last}, and no other write seen")
    else:
        spike.notes.append("no update was screened since that step: the parameters that changed are not known")
    return True


def _names(names: List[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def record_step(model: nn.Module, step: StepRecord, params: List[torch.Tensor], modules: List[nn.Module]):
    """`step` replayed under `Recorder(backward=True, value_stats="exact")`, narrated nowhere: the
    `Recording` of each of its forwards (its micro-batches), for their saved traces."""
    from ..options import NarrationOptions
    from ..recording import Recorder

    quiet = NarrationOptions(sink=_discard, sites=True)
    with user_state_kept(model, params, modules):
        with Recorder(model, narrate=quiet, backward=True, value_stats="exact") as recorder:
            for _ in run_forwards(model, step.forwards, modules):
                pass
    return list(recorder.recordings)


def recorded(spike: Spike, model: nn.Module, step: StepRecord, previous: Optional[StepRecord],
             params: List[torch.Tensor], modules: List[nn.Module]) -> list:
    """[(name, `Recording`)]: the spiking step and the previous one replayed under `record_step`,
    for their saved traces ("spike", "healthy"; "spike-2" for a step's second micro-batch); each
    only where its probed replay ran (which the ranks agreed on), and none after a rank failed to
    record (they record together)."""
    replayed = spike.magnitudes or (None, None)
    found = []
    for name, ran, which in (("spike", replayed[0], step), ("healthy", replayed[1], previous)):
        if ran is None or which is None:
            break
        recordings, failed = _attempt(lambda: record_step(model, which, params, modules))  # noqa: B023
        if agree(flag(failed)):
            spike.notes.append(f"the {name} replay's trace was not recorded: {failed or 'it failed on another rank'}")
            break
        found += [(name if i == 1 else f"{name}-{i}", recording) for i, recording in enumerate(recordings or [], 1)]
    return found


def _discard(line: str) -> None:
    """The traces' sink: their lines are rendered again from the recordings when asked for."""


def _cannot_compare(previous: Optional[StepRecord]) -> Optional[str]:
    """Why the previous step cannot be replayed, or None."""
    if previous is None or not previous.forwards:
        return "no healthy step before it was kept to compare with"
    return _changed(previous, f"step {previous.number}'s")


def _first_out(values: List[Tuple[str, float]], reference: List[Tuple[str, float]],
               factor: float) -> Optional[Tuple[str, float, float]]:
    """The first module of `values` whose RMS is out of `factor` of `reference`'s: (module, RMS,
    reference RMS); None when none is."""
    known, close = dict(reference), _within(factor)
    for module, rms in values:
        if module in known and not close(rms, known[module]):
            return module, rms, known[module]
    return None


def _where(spike: Spike, spiked: Magnitudes, healthy: Magnitudes, factor: float, gradients: bool) -> None:
    """Name the first module, in the order computed, whose RMS on the spiking batch is out of
    `factor` of the healthy batch's (outputs; for a gradients' spike, gradients)."""
    measured = "gradient" if gradients else "output"
    found = _first_out(spiked.gradients if gradients else spiked.outputs,
                       healthy.gradients if gradients else healthy.outputs, factor)
    if found is not None:
        spike.module, spike.value, spike.healthy = found
        spike.measured, spike.module_type = measured, spiked.types.get(found[0])
        return
    spike.notes.append(f"no module's {measured} left the range the previous batch gives: what spiked comes from "
                       f"what the batch gives the loss besides the modules' inputs (its labels, say)")
