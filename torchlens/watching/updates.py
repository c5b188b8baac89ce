"""What an optimizer's update wrote: non-finite values in a parameter that was finite before it.

AdamW with `eps=0` writes 0/0 into every element whose gradient has been zero since the start (an
embedding row no batch used); a float16 Adam whose `eps` rounds to 0 does the same; a learning-rate
spike or a weight-decay bug overflows a weight. The gradients are finite, so the step's screen,
taken before the update, sees nothing, and the next step would find the NaN in a weight as a
source, a step late. So after each update the watch screens the parameters the optimizer holds
(one sum each, read once), and on an alarm tells, for each parameter that holds a non-finite value
now, how it was before the update and how its gradient was (`UpdateCheck.written`).

"Before the update" costs no second pass over the weights: every parameter is screened after each
update, and its version counter (which every in-place write bumps, the optimizer's included) tells
whether anything wrote it since. Only a parameter something else wrote since the last check is
summed again before the update (`UpdateCheck.before`, read only on an alarm); the first check is
made with the watch, outside any step. A write
through `.data` does not bump the counter: a value written that way between two steps is not seen
before the update (docs/watch.md says so).
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from ..measure.memory import version
from .checks import local, nonfinite_positions, screen_squares

__all__ = ["UpdateCheck", "Weights", "Written", "describe", "origins"]


class Written(NamedTuple):
    """A parameter that holds non-finite values after an update."""

    index: int  # type: ignore[assignment]  # in the watch's parameters (a field named as tuple's method)
    nan: int
    inf: int
    before: str  # "finite", "non-finite" (before the update) or "unknown" (not checked before it)
    grad: str  # "finite", "non-finite" or "none"

    @property
    def born(self) -> bool:
        """Whether the update itself made the value: finite before, from a finite (or no) gradient."""
        return self.before == "finite" and self.grad != "non-finite"


class Weights(NamedTuple):
    """What the update check knows of the weights since the last healthy step: the updates since
    ((first, last) step, or None), the parameters that moved most ((name, norm then, norm now)),
    and those written since by something other than the optimizer."""

    span: Optional[Tuple[int, int]]
    changed: List[Tuple[str, float, float]]
    outside: List[str]


class UpdateCheck:
    """The update screen of a watch's parameters, optimizer by optimizer (see the module)."""

    def __init__(self, params: Sequence[torch.Tensor], optimizers):
        self.params = list(params)
        position = {id(p): i for i, p in enumerate(self.params)}
        self.indices: Dict[int, List[int]] = {}
        taken = set()
        for opt in optimizers:
            mine = [position[id(p)] for group in opt.param_groups for p in group["params"] if id(p) in position]
            self.indices[id(opt)] = [i for i in dict.fromkeys(mine) if i not in taken]
            taken.update(mine)
        self.held: Dict[int, str] = {}  # index -> what wrote the non-finite values it holds, as known
        # the parameters whose gradients the step's own check found non-finite (the optimizer may
        # change a gradient in place: what it held before the update is what counts)
        self.bad_grads: set = set()
        self._before: Dict[int, Tuple[List[int], Optional[torch.Tensor]]] = {}
        # the first check, when the watch is made (not in a step): one sum each, one read
        self.versions: List[Optional[int]] = [version(p) for p in self.params]  # as of the last check
        squares = screen_squares(self.params)
        if squares is not None and not bool(torch.isfinite(squares.sum())):
            self.held.update((i, "") for i in nonfinite_positions(self.params))
        # per optimizer, the screen after its last update (the first: the watch's own check), and the
        # one of the weights the last healthy step ran on (`mark_healthy`), each as (the step whose
        # update it followed, None for the watch's check; the parameters; their sums of squares)
        self.last: Dict[int, Tuple[Optional[int], List[int], torch.Tensor]] = {}
        self.healthy: Dict[int, Tuple[Optional[int], List[int], torch.Tensor]] = {}
        # the parameters written by something other than an update since the last healthy step:
        # their version counters moved between two checks, or (seen at a spike) their sums of
        # squares no longer match the last update's screen (a write through `.data`)
        self.outside: Set[int] = set()
        for opt, indices in self.indices.items():
            if squares is not None and indices:
                self.last[opt] = (None, indices, squares[indices])

    def judged_grads(self, bad: Sequence[int]) -> None:
        """The step's own check found the gradients of parameters `bad` non-finite (none: a new step)."""
        self.bad_grads = set(bad)

    def before(self, optimizer) -> None:
        """Before `optimizer`'s update: screen each of its parameters written since the last check."""
        changed = [i for i in self.indices.get(id(optimizer), ()) if self.versions[i] != version(self.params[i])]
        for i in changed:
            self.held.pop(i, None)  # (learned again from this screen)
        self.outside.update(changed)
        self._before[id(optimizer)] = (changed, screen_squares([self.params[i] for i in changed]))

    def screen(self, optimizer) -> Tuple[List[int], Optional[torch.Tensor]]:
        """After `optimizer`'s update: (the parameters screened, their sums of squares), leaving out
        those known to hold non-finite values already."""
        indices = [i for i in self.indices.get(id(optimizer), ()) if i not in self.held]
        return indices, screen_squares([self.params[i] for i in indices])

    def screened(self, optimizer, step: int, indices: List[int], squares: Optional[torch.Tensor]) -> None:
        """Keep the screen taken after `optimizer`'s update of step `step` (for `since_healthy`)."""
        if squares is not None:
            self.last[id(optimizer)] = (step, indices, squares)

    def mark_healthy(self) -> None:
        """A healthy step ran on the weights as last screened: what `since_healthy` compares with."""
        self.healthy = dict(self.last)
        self.outside.clear()

    def since_healthy(self, names: Sequence[str], count: int = 3) -> Weights:
        """What changed the weights since the last healthy step ran on them (a host read: a
        spike's question): the updates since ((first, last) step, or None), the `count` parameters
        whose elements moved most on average (the change of their RMS: a near-zero bias that grew
        500-fold moved less than a weight that doubled) as (name, norm then, norm now), the norms now
        screened afresh, and those written since by something other than the optimizer: their version
        counters moved, or their sums of squares differ from the last update's screen (a write
        through `.data`, which moves no counter)."""
        found: List[Tuple[float, str, float, float]] = []
        self.outside.update(i for i, p in enumerate(self.params) if self.versions[i] != version(p))
        span: Optional[Tuple[int, int]] = None
        for key, (step, indices, after) in self.last.items():
            if key not in self.healthy:
                continue
            since, before_indices, before = self.healthy[key]
            now = screen_squares([self.params[i] for i in indices])
            assert now is not None  # (indices is not empty: a screen was kept)
            now_values, after_values = now.tolist(), after.tolist()
            self.outside.update(i for k, i in enumerate(indices) if now_values[k] != after_values[k])
            if step is not None and after is not before:
                first = 0 if since is None else since + 1
                span = (first, step) if span is None else (min(span[0], first), max(span[1], step))
            position = {i: k for k, i in enumerate(before_indices)}
            old = before.tolist()
            for k, i in enumerate(indices):
                if i in position:
                    a, b = math.sqrt(old[position[i]]), math.sqrt(now_values[k])
                    moved = abs(b - a) / math.sqrt(max(local(self.params[i]).numel(), 1))  # (its RMS's change)
                    if moved > 0:
                        found.append((moved, names[i], a, b))
        found.sort(key=lambda item: -item[0])
        changed = [(name, a, b) for _, name, a, b in found[:count]]
        return Weights(span, changed, [names[i] for i in sorted(self.outside)])

    def checked(self, optimizer) -> None:
        """The check of this update is done: note each parameter's version counter."""
        for i in self.indices.get(id(optimizer), ()):
            self.versions[i] = version(self.params[i])
        self._before.pop(id(optimizer), None)

    def written(self, optimizer, indices: List[int]) -> List[Written]:
        """The screened parameters that hold non-finite values now (exact: an alarm's answer)."""
        bad = [indices[k] for k in nonfinite_positions([self.params[i] for i in indices])]
        changed, sums = self._before.get(id(optimizer), (None, None))
        found = []
        for i in bad:
            p = local(self.params[i].detach())
            with torch.no_grad():
                nan, inf = int(torch.isnan(p).sum()), int(torch.isinf(p).sum())
            grad = "non-finite" if i in self.bad_grads else _grad_state(self.params[i])
            found.append(Written(i, nan, inf, self._state_before(i, changed, sums), grad))
        return found

    def _state_before(self, i: int, changed: Optional[List[int]], sums: Optional[torch.Tensor]) -> str:
        if changed is None:  # (no check ran before this update: `check_step` was not called)
            return "unknown"
        if i in changed:
            assert sums is not None  # (the parameters in `changed` were screened: their sums exist)
            # (a sum that overflowed on finite values reads as non-finite: the update is then not
            # blamed, a fault missed rather than one claimed without being measured)
            return "finite" if bool(torch.isfinite(sums[changed.index(i)])) else "non-finite"
        return "finite"  # finite at the last check, and not written since (its version counter)

    def hold(self, written: Sequence[Written], origin: Dict[int, str]) -> None:
        """Note the parameters that hold non-finite values now, with what wrote them where known."""
        for w in written:
            self.held[w.index] = origin.get(w.index, "")

    def notes(self, names: Sequence[str]) -> List[str]:
        """For a later fault: the parameters that still hold what an update wrote into them."""
        return [f"{names[i]} holds the non-finite values {origin}" for i, origin in self.held.items() if origin]


def _grad_state(param: torch.Tensor) -> str:
    if param.grad is None:
        return "none"
    return "non-finite" if nonfinite_positions([param.grad]) else "finite"


def describe(written: Sequence[Written], names: Sequence[str], optimizer, count: int) -> Tuple[str, str]:
    """(what the check saw, the finding) of an update that wrote non-finite values (`written`, each
    `born`)."""
    shown = ", ".join(names[w.index] for w in written[:3]) + (", ..." if len(written) > 3 else "")
    what = (f"non-finite values in {len(written)} of {count} parameters after the {type(optimizer).__name__} "
            f"update ({shown})")
    return what, f"{_values(written, names)} written by that update, {_gradients(written)}"


def origins(written: Sequence[Written], step: int, optimizer) -> Dict[int, str]:
    """What a later fault says of each parameter an update made non-finite."""
    return {w.index: f"step {step}'s {type(optimizer).__name__} update wrote ({_gradients([w])})"
            for w in written if w.born}


def _values(written: Sequence[Written], names: Sequence[str]) -> str:
    totals = (("NaN", sum(w.nan for w in written)), ("inf", sum(w.inf for w in written)))
    kinds = " and ".join(kind for kind, n in totals if n)
    return f"{kinds} in " + ", ".join(f"{names[w.index]} ({_counts(w)})" for w in written)


def _counts(w: Written) -> str:
    return ", ".join(part for part in (f"nan={w.nan}" if w.nan else "", f"inf={w.inf}" if w.inf else "") if part)


def _gradients(written: Sequence[Written]) -> str:
    states = {w.grad for w in written}
    if states == {"finite"}:
        return "from finite gradients"
    return "with no gradient" if states == {"none"} else "from finite gradients or none"
