"""Judging a watched step: its screens read as one number; on an alarm, the fault confirmed element
by element, described, and replayed to its birth or, for a loss that went non-finite outside the
model, named on the loss's graph. Also judged: a step a `GradScaler` skipped (by its scale), and
what an optimizer's update wrote. Under a process group each question is asked of every rank
(`agreement`), so that all take the same path and issue the same collectives."""

from __future__ import annotations

import os
from typing import List, Optional

import torch

from ..narration.ranks import rank_and_world_size
from . import roots, updates
from .agreement import agree, first_rank_text, flag, total
from .checks import Screen, ScreenRead, nonfinite_positions, screen_squares, shares
from .faults import Fault
from .replay import Replays
from .steps import StepRecord

__all__ = ["StepJudge"]


class _Confirmed:
    """What of a step that raised an alarm holds non-finite values, element by element: the
    parameters whose gradients do (`grads`, their indices), the forwards whose outputs do (their
    numbers), the losses (`roots.Root`). `loss_first`: a loss is non-finite while every output is
    finite (it went non-finite outside the model, before any backward, unless it read a tensor of
    the model that is not an output: `loss_reads_inside`, which a replay looks into first)."""

    def __init__(self, step: StepRecord, grads: List[int]):
        self.grads = grads
        self.forwards = [f.number for f in step.forwards
                         if f.squares is not None and not bool(torch.isfinite(f.squares).all())]
        self.roots = [root for root in step.roots if root.bad]
        self.loss_first = bool(self.roots) and not self.forwards
        self.loss_reads_inside = self.loss_first and any(root.ops.unscreened for root in self.roots)

    def __bool__(self) -> bool:
        return bool(self.grads or self.forwards or self.roots)


class StepJudge:
    """What judging needs of a watch: its parameters and their names, the update check (None
    with check="outputs"), its replays, the directory faults are written to, and the scaler.
    `false_alarms` counts screens that overflowed on finite values (confirmed finite)."""

    def __init__(self, params: List[torch.Tensor], names: List[str], update_check: Optional[updates.UpdateCheck],
                 replays: Replays, out: str, scaler):
        self.params, self.names, self.updates, self.replays = params, names, update_check, replays
        self.out, self.scaler = out, scaler
        self.false_alarms = 0
        self._collapsed = False  # the scale is below 1, a fault said once until it recovers
        self.read: Optional[ScreenRead] = None  # what the last step's read said (for the spike check)

    def step_fault(self, step: StepRecord, number: int, outputs_only: bool) -> Optional[Fault]:
        """Step `number`'s screens read once (`read`); on an alarm, the fault confirmed, then
        replayed or, for a loss that went non-finite outside the model, named on the loss's graph."""
        self.read = None
        if not step.forwards:
            return None
        grads = [] if outputs_only else [(i, p) for i, p in enumerate(self.params) if p.grad is not None]
        screen = Screen()
        for forward in step.forwards:
            screen.add(forward.squares)
        for root in step.roots:
            root.screen(screen)
        gradients = [p.grad for _, p in grads if p.grad is not None]  # (all: `grads` has them)
        screen.add_grads(screen_squares(gradients, shares(gradients, rank_and_world_size()[1])))
        self.read = screen.read(total)
        if self.read is None or not self.read.alarm:
            return None
        bad = _Confirmed(step, [grads[i][0] for i in nonfinite_positions([p.grad for _, p in grads
                                                                          if p.grad is not None])])
        if self.updates is not None:
            self.updates.judged_grads(bad.grads)
        if not agree(flag(bad)):
            self.false_alarms += 1
            return None
        fault = Fault(number, self._what(bad, step), _this_rank(), micro_batches=len(step.forwards))
        inside = agree(flag(bad.forwards or bad.loss_reads_inside))
        if inside or not agree(flag(bad.loss_first)):
            self.replays.run(fault, step, gradients=bool(bad.grads or bad.roots),
                             prefer=None if bad.forwards or bad.loss_reads_inside else "backward")
            # (every rank asks, whatever its own replay found: the question is a collective)
            if agree(flag(bad.loss_first and fault.reproduced is not True)):
                mine = bad.loss_first and fault.reproduced is not True
                self._blame_loss(fault, bad.roots[0] if mine else None, replayed=True)
            elif fault.reproduced is False and not bad.grads and self.replays.false_output_alarm:
                self.false_alarms += 1  # the outputs' screen overflowed; the exact replay saw finite outputs
                return None
        else:  # the loss went non-finite first, outside the model: nothing in the model to replay
            self._blame_loss(fault, bad.roots[0] if bad.loss_first else None, replayed=False)
        fault.notes += self.updates.notes(self.names) if self.updates is not None else []
        return self._write(fault, step)

    @staticmethod
    def _blame_loss(fault: Fault, root: Optional[roots.Root], replayed: bool) -> None:
        """The fault is the loss's (`root`; on another rank when None): named on its autograd graph."""
        birth_rank, finding = first_rank_text(root.finding() if root is not None else None)
        fault.of_loss(finding, birth_rank, root.after if root is not None else None, replayed)

    def _what(self, bad: _Confirmed, step: StepRecord) -> str:
        parts = [bad.roots[0].what()] if bad.loss_first else []
        if bad.forwards:
            n = len(step.forwards)
            which = (f"forward {bad.forwards[0]} of {n}" if len(bad.forwards) == 1 and n > 1
                     else f"{len(bad.forwards)} of {n} forwards" if n > 1 else "the forward")
            parts.append(f"non-finite outputs in {which}")
        if bad.grads:
            named = ", ".join(self.names[i] for i in bad.grads[:3]) + (", ..." if len(bad.grads) > 3 else "")
            parts.append(f"non-finite gradients in {len(bad.grads)} of {len(self.params)} parameters ({named})")
        if not parts:
            parts.append("non-finite values on another rank")
        return " and ".join(parts)

    def scale_fault(self, step: StepRecord, number: int) -> Optional[Fault]:
        """Step `number`, which the scaler skipped: a fault only when the scale fell below 1 (once,
        until it recovers)."""
        if not step.forwards:
            return None
        scale = float(self.scaler.get_scale())
        if scale >= 1.0:
            self._collapsed = False
            return None
        if self._collapsed:
            return None
        self._collapsed = True
        fault = Fault(number, f"the GradScaler's scale collapsed to {scale:g}: the gradients overflow even "
                              f"unscaled", _this_rank(), micro_batches=len(step.forwards))
        self.replays.run(fault, step, gradients=True, prefer="backward")
        return self._write(fault, step)

    def update_fault(self, optimizer, steps: int) -> Optional[Fault]:
        """A fault when `optimizer`'s update (after `steps` steps) wrote a non-finite value (see
        `updates`); under a process group, the ranks agree, and a rank that wrote nothing names
        the rank that did."""
        check = self.updates
        assert check is not None  # (its hook is registered only with the update check)
        indices, squares = check.screen(optimizer)
        check.screened(optimizer, max(steps - 1, 0), indices, squares)
        if not agree(None if squares is None else ~torch.isfinite(squares.sum())):
            check.checked(optimizer)
            return None
        written = check.written(optimizer, indices)
        step = max(steps - 1, 0)  # (the step judged before this update)
        check.hold(written, updates.origins(written, step, optimizer))
        check.checked(optimizer)
        news = [w for w in written if w.born]
        if not agree(flag(news)):
            # (the rest: non-finite gradients applied, which the step's own check saw, or values
            # something else wrote before the update, which a forward reads as a source)
            if not written:
                self.false_alarms += 1
            return None
        what, finding = (updates.describe(news, self.names, optimizer, len(check.indices[id(optimizer)]))
                         if news else (None, None))
        birth_rank, finding = first_rank_text(finding)
        rank = _this_rank()
        fault = Fault(step, what or "non-finite values written by an update on another rank", rank)
        fault.of_update(finding, birth_rank if rank is not None else None)
        return fault

    def _write(self, fault: Fault, step: StepRecord) -> Fault:
        fault.write(self.directory(fault.step), step.forwards)
        return fault

    def directory(self, step: int) -> str:
        """Where step `step`'s files go: `out`/step-N (under rank-R/ under a process group)."""
        rank, world = rank_and_world_size()
        return os.path.join(self.out, f"rank-{rank}" if world > 1 else "", f"step-{step}")

    @property
    def rank(self) -> Optional[int]:
        """This process's rank under a process group of several, else None."""
        return _this_rank()


def _this_rank() -> Optional[int]:
    """This process's rank under a process group of several, else None (as a `Fault` names it)."""
    rank, world = rank_and_world_size()
    return rank if world > 1 else None
