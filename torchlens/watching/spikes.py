"""Loss spikes: a finite loss, or gradients' norm, far above its recent level.

The step's one read already brings both numbers (`checks.ScreenRead`: the losses its backwards
started from, and the norm of its gradients, which the sums of squares of the screen give for
nothing more), so judging them costs a comparison on the host. Each is judged against the median
of its last `window` values (a median: one earlier spike in the window does not move it), once
`warmup` steps have been seen. A loss spikes when it exceeds that level by more than `rtol` times
the level's size, by more than `atol` (Lightning's `SpikeDetection` words) and by more than
`spread` times the window's own spread (its median absolute deviation, scaled to a normal's
standard deviation): the losses of small batches are skewed, and a loss three times its median is
ordinary there, while a spike is far outside what the window has seen. The gradients' norm spikes
when it exceeds its level by more than `grad_rtol` times it and `spread` times its spread. Every
finite value enters its window, a spike's too, so that a lasting change of level stops being
called a spike once it is the median. A step well within both margins is `calm`: what a spike's
replay may take as its healthy reference.

What a spike is found to be (the batch, the weights, a transient) is `explain`'s work.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import statistics
from typing import Deque, List, NamedTuple, Optional, Tuple

import torch

from ..errors import OptionTypeError, OptionValueError
from .checks import ScreenRead
from .faults import attempt, save_inputs

__all__ = ["DEFAULT_RULE", "Signal", "Spike", "SpikeCheck", "SpikeRule", "figure", "local_loss"]


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    """When a step's loss or gradients' norm is a spike (`tl.watch(spike=SpikeRule(...))`).

    - `window`: the steps whose median is the level a value is judged against (50);
    - `warmup`: the steps seen before any is judged (50: the first steps' fall is no spike, and
      a window's median and spread need that many values to be steady);
    - `rtol`, `atol`, `spread`: a loss spikes when `loss - level` is over `rtol * |level|`, `atol`
      and `spread` times the window's spread (0.5, 0.0, 10.0: a language model's loss sits near
      the log of its vocabulary, and a model an update wrecked rarely doubles it; the spread
      keeps small batches' skewed losses from tripping it);
    - `grad_rtol`: the gradients' norm spikes when `norm - level` is over `grad_rtol * level` (4.0:
      five times its level) and `spread` times its spread; None to judge the loss alone;
    - `factor`: how far a module's output (or gradient) RMS, or a replayed output's, may be from
      the healthy batch's, either way, and still be in its range (3.0).
    """

    window: int = 50
    warmup: int = 50
    rtol: float = 0.5
    atol: float = 0.0
    spread: float = 10.0
    grad_rtol: Optional[float] = 4.0
    factor: float = 3.0

    def __post_init__(self):
        for name in ("window", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionTypeError(f"SpikeRule {name}= takes an integer, got {value!r}")
            if value < 1:
                raise OptionValueError(f"SpikeRule {name}={value}: it must be at least 1")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)):
            raise OptionTypeError(f"SpikeRule factor= takes a number, got {self.factor!r}")
        if not 1 < self.factor < math.inf:
            raise OptionValueError(f"SpikeRule factor={self.factor}: it must be a finite number over 1")
        for name in ("rtol", "atol", "spread", "grad_rtol"):
            value = getattr(self, name)
            if value is None and name == "grad_rtol":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise OptionTypeError(f"SpikeRule {name}= takes a number, got {value!r}")
            if not value >= 0 or math.isinf(value):
                raise OptionValueError(f"SpikeRule {name}={value}: it must be a finite number, 0 or more")


DEFAULT_RULE = SpikeRule()


class Signal(NamedTuple):
    """What spiked at a step: the loss and its level, the gradients' norm and its level (None
    where not judged), and `which`: "loss", "gradients" or "loss and gradients"."""

    loss: Optional[float]
    loss_level: Optional[float]
    grad_norm: Optional[float]
    grad_level: Optional[float]
    which: str


class _Level:
    """The last `window` finite values of one number, and their median."""

    def __init__(self, window: int):
        self.values: Deque[float] = collections.deque(maxlen=window)
        self.seen = 0

    def median(self) -> Optional[float]:
        return statistics.median(self.values) if self.values else None

    def spread(self, middle: float) -> float:
        """The median absolute deviation from `middle` (the median), as a normal's standard deviation."""
        if len(self.values) < 2:
            return 0.0
        return 1.4826 * statistics.median(abs(v - middle) for v in self.values)

    def add(self, value: Optional[float]) -> None:
        if value is not None and math.isfinite(value):
            self.values.append(value)
            self.seen += 1


class SpikeCheck:
    """The spike rule applied step by step: `judge(read)` gives the step's `Signal` when it spiked."""

    def __init__(self, rule: SpikeRule):
        self.rule = rule
        self.loss = _Level(rule.window)
        self.grads = _Level(rule.window)
        self.calm = False  # whether the step judged last stayed well within its margins

    def judge(self, read: Optional[ScreenRead]) -> Optional[Signal]:
        """Judge a step's read (then add its values to their windows). `calm` says afterwards
        whether the step stayed within half of each margin: a step a spike's replay may take as
        the healthy reference (one just under the margin may be the start of the trouble)."""
        self.calm = False
        if read is None:
            return None
        rule = self.rule
        loss_level, grad_level = self.loss.median(), self.grads.median()
        loss_over = self._over(self.loss, loss_level, read.loss, rule.rtol, rule.atol)
        grad_over = (self._over(self.grads, grad_level, read.grad_norm, rule.grad_rtol, 0.0)
                     if rule.grad_rtol is not None else None)
        self.loss.add(read.loss)
        self.grads.add(read.grad_norm)
        self.calm = all(over is None or over <= 0.5 for over in (loss_over, grad_over))
        loss_spiked, grad_spiked = (over is not None and over > 1.0 for over in (loss_over, grad_over))
        if not (loss_spiked or grad_spiked):
            return None
        which = "loss and gradients" if loss_spiked and grad_spiked else "loss" if loss_spiked else "gradients"
        return Signal(read.loss, loss_level, read.grad_norm, grad_level, which)

    def _over(self, level: _Level, middle: Optional[float], value: Optional[float], rtol: float,
              atol: float) -> Optional[float]:
        """How far `value` is above its level (`middle`, the window's median), as a fraction of the
        margin a spike must pass (over 1: a spike); None when it is not judged (no value, or still
        in the warmup)."""
        if value is None or middle is None or level.seen < self.rule.warmup or math.isnan(value):
            return None
        margin = max(rtol * abs(middle), atol, self.rule.spread * level.spread(middle))
        excess = value - middle
        if margin <= 0:
            return math.inf if excess > 0 else 0.0
        return excess / margin


def figure(value: Optional[float]) -> str:
    """A magnitude as a line shows it: 3 significant digits."""
    if value is None:
        return "?"
    return f"{value:.3g}"


class Spike:
    """One spike the watch caught, and what its replays found.

    - `step`: the training step (counted from 0), `rank`: this process's rank under a process group;
    - `loss`, `loss_level`, `grad_norm`, `grad_level`: the step's values and their levels (the
      medians of their windows); `which`: what spiked ("loss", "gradients", "loss and gradients");
    - `verdict`: "batch" (the same weights give the previous step's batch what it had), "weights"
      (they do not: the updates since, or a write outside the optimizer, changed them),
      "transient" (the replay of the step does not give its outputs again), or None when the
      replays could not tell (`why` says why);
    - `evidence`: the comparison the verdict rests on, in words;
    - `module`, `measured`, `value`, `healthy`, `ratio`: the first module whose output
      (`measured="output"`) or gradient (`"gradient"`), in the order it was computed, left the range
      the previous step's batch gives on the same weights: its RMS on this batch and on that one;
    - `parameters`: for a "weights" verdict, (name, norm before, norm after) of the parameters whose
      elements moved most since the healthy step (the change of their RMS);
    - `batch_rank`: under a process group, the rank whose loss spiked most (its batch);
    - `notes`; `inputs`, `html`, `traces`: paths under `out/step-N/` (the batch, the page, the
      replays' saved traces).
    """

    def __init__(self, step: int, signal: Signal, rank: Optional[int], window: int):
        self.step, self.rank, self.window = step, rank, window
        self.loss, self.loss_level = signal.loss, signal.loss_level
        self.grad_norm, self.grad_level = signal.grad_norm, signal.grad_level
        self.which = signal.which
        self.verdict: Optional[str] = None
        self.why: Optional[str] = None
        self.evidence: Optional[str] = None
        self.module: Optional[str] = None
        self.module_type: Optional[str] = None
        self.measured: Optional[str] = None
        self.value: Optional[float] = None
        self.healthy: Optional[float] = None
        self.parameters: List[Tuple[str, float, float]] = []
        self.batch_rank: Optional[int] = None
        self.notes: List[str] = []
        self.inputs: Optional[str] = None
        self.html: Optional[str] = None
        self.traces: List[str] = []
        # (`explain.Magnitudes` of the spike's batch, of the healthy one or None), for the page
        self.magnitudes: Optional[tuple] = None

    @property
    def ratio(self) -> Optional[float]:
        if self.value is None or self.healthy is None:
            return None
        return self.value / self.healthy if self.healthy else math.inf

    def seen(self) -> str:
        """What the check saw: the values against their levels."""
        parts = []
        if "loss" in self.which:
            parts.append(f"loss {figure(self.loss)} against {figure(self.loss_level)}")
        if "gradients" in self.which:
            parts.append(f"gradients' norm {figure(self.grad_norm)} against {figure(self.grad_level)}")
        return " and ".join(parts) + f" (the median of the last {self.window} steps)"

    def where(self) -> Optional[str]:
        if self.module is None:
            return None
        kind = f" ({self.module_type})" if self.module_type else ""
        return (f"first out of range: {self.module}{kind}: {self.measured} RMS {figure(self.value)} against "
                f"{figure(self.healthy)} (x{figure(self.ratio)})")

    def __str__(self) -> str:
        rank = f"rank {self.rank} " if self.rank is not None else ""
        text = f"{rank}step {self.step}: a {self.which} spike: {self.seen()}"
        if self.verdict == "transient":
            text += f"; transient: {self.evidence}"
        elif self.verdict is not None:
            whose = f" of rank {self.batch_rank}" if self.verdict == "batch" and self.batch_rank not in (
                None, self.rank) else ""
            text += f"; the {self.verdict}{whose}: {self.evidence}"
        else:
            text += f"; not explained: {self.why}"
        if self.where():
            text += f"; {self.where()}"
        if self.parameters:
            text += "; the parameters that moved most since (norm then -> now): " + ", ".join(
                f"{name} {figure(before)} -> {figure(after)}" for name, before, after in self.parameters)
        for note in self.notes:
            text += f"; {note}"
        return text

    def __repr__(self) -> str:
        return f"<Spike step={self.step} {self.which} verdict={self.verdict} module={self.module}>"

    def write(self, directory: str, forwards, recordings) -> None:
        """Leave the batch (`torch.load`), the page and the replays' traces in `directory`; a file
        that cannot be written is said, not raised."""
        from ..view.spike_page import spike_page

        if attempt("making the spike's directory", lambda: _made(directory)) is None:
            return
        inputs = os.path.join(directory, "inputs.pt")
        self.inputs = attempt("saving the spike's batch", lambda: save_inputs(forwards, inputs))
        for name, recording in recordings:
            path = attempt(f"saving the {name} replay",
                            lambda: recording.save(os.path.join(directory, f"{name}.tl")))  # noqa: B023
            if path is not None:
                self.traces.append(path)
        page = os.path.join(directory, "spike.html")
        self.html = attempt("writing the spike's page", lambda: _write_text(page, spike_page(self)))


def _made(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    return directory


def _write_text(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
    return path


def local_loss(roots) -> Optional[float]:
    """This rank's loss of the step (its one-number roots summed; a host read: a spike's question)."""
    values = [root.value for root in roots if root.value is not None]
    return float(torch.stack([v.float().reshape(()) for v in values]).sum()) if values else None
