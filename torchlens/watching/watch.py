"""`tl.watch`: a training watch cheap enough to leave on, that replays the step that failed.

How a step is watched (see docs/watch.md):

1. each forward of the model (called with gradients enabled) keeps references to its arguments
   and the random generators' states, and screens its outputs (one sum per output, on the device);
2. each backward into its outputs keeps the gradient it sent in (see `steps`), and the screen of
   the tensor it started from: the loss, even one computed outside the model (see `roots`);
3. at `optimizer.step()` (a step pre-hook, so before any weight changes) the gradients are screened
   too, and the step's screens are read as one number. A finite number is a healthy step and ends
   it; under a process group the ranks agree with one small all-reduce;
4. otherwise the fault is confirmed and the step replayed under tracking (`replay`), or, for a loss
   that went non-finite outside the model, named on its graph; and the watch raises from
   `optimizer.step()`, skips the update, or only reports, as `on_fault=` says;
5. after the update (a step post-hook) the optimizer's parameters are screened and read: the
   step's second read. A non-finite value the update wrote from finite gradients is a fault
   raised from that `optimizer.step()` (see `updates`).

A step ends at `optimizer.step()`, or, when the gradients were reset without one (a step a
`GradScaler` skipped for overflowing gradients, or a `zero_grad` before any step), at the next
forward: told by the gradients' identity and version counter, recorded after each backward. Such a
step is judged by its outputs alone (its gradients were never used), and, given `scaler=`, by the
scale: one that fell below 1 means the gradients overflow unscaled, a fault.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import weakref
from typing import List, Literal, Optional, Protocol, Set, Union

import torch
from torch import nn

from ..errors import NonFiniteError, OptionTypeError, OptionValueError, describe_choices, suggest
from ..guard import internal_error, is_stop
from ..ranks import rank_and_world_size
from ..sinks import checked_sink, open_sink
from ..sites import find_user_site
from ..structure import check_model
from . import roots, updates
from .agreement import agree, first_rank_text, flag
from .checks import Screen, floating_leaves, nonfinite_positions, screen_sums
from .faults import Fault
from .replay import Outcome, replay_step
from .steps import StepRecord, WatchedForward

__all__ = ["Watch", "watch"]

ON_FAULT = ("raise", "skip", "report")
CHECKS = ("grads", "outputs")
DEFAULT_MAX_BYTES = 64 << 20
_graph_task_id = torch._C._current_graph_task_id


def watch(model: nn.Module, optimizer, *, out="torchlens-watch", on_fault: str = "raise", check: str = "grads",
          narrate=True, replays: int = 2, max_bytes: int = DEFAULT_MAX_BYTES, scaler=None,
          compiler="inductor") -> "Watch":
    """Watch every training step of `model` stepped by `optimizer` (one, or a list of them).

    ::

        watch = tl.watch(model, optimizer)          # or: with tl.watch(model, optimizer) as watch:
        for x, y in loader:                         # the training loop, unchanged
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()                        # raises tl.errors.NonFiniteError on a fault,
            optimizer.zero_grad()                   # its `.fault` naming where the value was born
        watch.close()

    A healthy step costs a sum per output, per gradient and per weight and two host reads. On the
    first non-finite output, loss or gradient, before the optimizer changes a weight, the step is
    replayed exactly under tracking (up to `replays` times: a fault no replay reproduces is
    transient; a loss computed outside the model is named on its graph instead), and `on_fault`
    decides: "raise" (from `optimizer.step()`, weights untouched), "skip" (the gradients cleared,
    so the update changes nothing, and training goes on) or "report". An update that writes a
    non-finite value from finite gradients is a fault of its own, raised from the `optimizer.step()`
    that ran it. `check="outputs"` screens the forwards' outputs and losses only. The fault's line goes to `narrate`
    (any narration sink; None for none); its page, trace, repro and inputs to `out`/step-N/.
    `max_bytes` bounds the gradients a step keeps (all its micro-batches) for a loss computed outside the model;
    `scaler` (a `GradScaler`) lets a collapsing scale count as a fault; `compiler` is what
    replays a compiled model whose eager replays find nothing.
    """
    return Watch(model, optimizer, out=out, on_fault=on_fault, check=check, narrate=narrate, replays=replays,
                 max_bytes=max_bytes, scaler=scaler, compiler=compiler)


def _choice(name: str, value, choices) -> str:
    if not isinstance(value, str):
        raise OptionTypeError(f"tl.watch {name}= takes {describe_choices(choices)}, got {value!r}")
    if value not in choices:
        raise OptionValueError(f"tl.watch {name}={value!r}{suggest(value, choices)}: accepted are "
                               f"{describe_choices(choices)}")
    return value


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"tl.watch {name}= takes an integer, got {value!r}")
    if value < minimum:
        raise OptionValueError(f"tl.watch {name}={value}: it must be at least {minimum}")
    return value


def _optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers to hook: one, or several; a wrapper exposing `.optimizer` (accelerate's
    `AcceleratedOptimizer`, Lightning's) is unwrapped to the optimizer whose `step` runs."""
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not items:
        raise OptionValueError("tl.watch needs the optimizer that steps the model (or a list of them); got none")
    found = []
    for item in items:
        inner = item
        while not hasattr(inner, "register_step_pre_hook") and hasattr(inner, "optimizer"):
            inner = inner.optimizer
        while type(inner).__name__ in ("AcceleratedOptimizer", "LightningOptimizer") and hasattr(inner, "optimizer"):
            inner = inner.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise OptionTypeError(f"tl.watch takes a torch.optim.Optimizer (or a list of them) as the optimizer, "
                                  f"got {type(item).__name__}")
        found.append(inner)
    return found


def _eager_module(model: nn.Module):
    """(the module a replay runs, whether `model` is compiled): `torch.compile`'s wrapper and DDP's
    are looked through (a replay runs locally, without DDP's gradient all-reduce)."""
    compiled = False
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model, compiled = model._orig_mod, True
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(
                model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model, compiled


class _Removable(Protocol):
    """What the watch removes when it closes: a torch hook handle, the backward listener, the scaler's hooks."""

    def remove(self) -> None: ...


class _ScalerHooks:
    """`scaler.scale` and `scaler.update` wrapped on the instance: `scaled(loss)` sees each loss
    the scaler scales (the loss itself, even one computed outside the model), `updated()` runs
    once `update` returns. `remove()` puts the originals back (a handle, like the hooks')."""

    def __init__(self, scaler, scaled, updated):
        self.scaler = scaler
        self.wrappers = {"scale": self._wrap(scaler.scale, before=scaled),
                         "update": self._wrap(scaler.update, after=updated)}
        for name, wrapper in self.wrappers.items():
            setattr(scaler, name, wrapper)

    @staticmethod
    def _wrap(original, before=None, after=None):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if before is not None and args:
                before(args[0])
            result = original(*args, **kwargs)
            if after is not None:
                after()
            return result

        return wrapper

    def remove(self) -> None:
        for name, wrapper in self.wrappers.items():
            if self.scaler.__dict__.get(name) is wrapper:
                delattr(self.scaler, name)


class _Confirmed:
    """What of a step that raised an alarm holds non-finite values, element by element: the
    parameters whose gradients do (`grads`, their indices), the forwards whose outputs do (their
    numbers), the losses (`roots.Root`). `loss_first`: a loss is non-finite while every output is
    finite (it went non-finite outside the model, before any backward, unless it read a tensor of
    the model that is not an output: `loss_reads_inside`, which a replay looks into first)."""

    def __init__(self, step: StepRecord, grads: List[int]):
        self.grads = grads
        self.forwards = [f.number for f in step.forwards
                         if f.sums is not None and not bool(torch.isfinite(f.sums).all())]
        self.roots = [root for root in step.roots if root.bad]
        self.loss_first = bool(self.roots) and not self.forwards
        self.loss_reads_inside = self.loss_first and any(root.ops.unscreened for root in self.roots)

    def __bool__(self) -> bool:
        return bool(self.grads or self.forwards or self.roots)


class _Unwatched:
    """Stands for a forward the watch does not keep (no gradient mode: evaluation)."""


_UNWATCHED = _Unwatched()


class Watch:
    """A training watch (`tl.watch`). `faults` lists the `Fault`s caught, `steps` counts the steps
    ended; `close()` (or leaving its `with` block) removes every hook it added."""

    def __init__(self, model: nn.Module, optimizer, *, out="torchlens-watch", on_fault="raise", check="grads",
                 narrate=True, replays=2, max_bytes=DEFAULT_MAX_BYTES, scaler=None, compiler="inductor",
                 step_hook: bool = True, close_on_raise: bool = False):
        check_model(model, "tl.watch")
        self.on_fault = _choice("on_fault", on_fault, ON_FAULT)
        self.check = _choice("check", check, CHECKS)
        self.replays = _count("replays", replays, 1)
        self.max_bytes = _count("max_bytes", max_bytes, 0)
        if not isinstance(out, (str, os.PathLike)):
            raise OptionTypeError(f"tl.watch out= takes a directory path, got {out!r}")
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise OptionTypeError(f"tl.watch scaler= takes a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.out = os.fspath(out)
        self.model = model
        self.optimizers = _optimizers(optimizer)
        self.scaler = scaler
        self.compiler = compiler
        self._sink = open_sink(checked_sink(narrate)) if narrate not in (None, False) else None
        self._eager, self._compiled = _eager_module(model)
        self._modules = list(self._eager.modules())
        self._params = self._watched_parameters()
        names = {id(p): name for name, p in self._eager.named_parameters(remove_duplicate=False)}
        self._names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(self._params)]
        self.faults: List[Fault] = []
        self.steps = 0
        self.false_alarms = 0  # screens that overflowed on finite values (confirmed finite)
        self._step = StepRecord()
        self._open: Union[WatchedForward, _Unwatched, None] = None  # the forward running now
        self._depth = 0  # nested calls of the model inside its own forward
        self._tasks: Set[int] = set()  # graph tasks whose end-of-backward callback is queued
        self._paused = False
        self._collapsed = False
        self._replayer = None  # `tl.compile` of the model, made at the first compiled replay
        self._false_output_alarm = False
        self._thread = threading.get_ident()
        # the parameters after each update (check="grads": outputs, losses, gradients and updates)
        self._updates = updates.UpdateCheck(self._params, self.optimizers) if self.check == "grads" else None
        self._handles: List[_Removable] = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True, always_call=True),
            roots.listen(self._backward_called, self._backward_returned),
        ]
        # a framework's loop cannot go on after the error leaves it: its adapter closes the watch then
        self._close_on_raise = close_on_raise
        self._step_hook = step_hook
        if step_hook:  # (False: the caller calls `check_step()`, see there)
            self._handles += [opt.register_step_pre_hook(self._before_step) for opt in self.optimizers]
        if self._updates is not None:
            self._handles += [opt.register_step_post_hook(self._after_update) for opt in self.optimizers]
        if scaler is not None:
            self._handles.append(_ScalerHooks(scaler, self._scaled, self._after_scaler_update))
        self._closed = False

    def _watched_parameters(self) -> List[torch.Tensor]:
        seen, params = set(), []
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in seen and p.requires_grad:
                        seen.add(id(p))
                        params.append(p)
        return params

    # -- the context manager and closing --------------------------------------------------------

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        self.close()
        return False

    def close(self) -> None:
        """Remove the hooks and let go of the step's references. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._step = StepRecord()
        self._open = None
        if self._sink is not None:
            self._sink.close()

    @property
    def held_bytes(self) -> int:
        """What the current step keeps alive that plain training would have freed (bytes)."""
        return self._step.held_bytes

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        faults = len(self.faults)
        return (f"<Watch {state}: {self.steps} step{'s' if self.steps != 1 else ''}, "
                f"{faults} fault{'s' if faults != 1 else ''}>")

    # -- the hooks --------------------------------------------------------------------------------

    def _ours(self) -> bool:
        return not (self._closed or self._paused) and threading.get_ident() == self._thread

    def _before_forward(self, module, args, kwargs):
        if not self._ours():
            return None
        if self._open is not None:
            self._depth += 1
            return None
        try:
            self._end_reset_step()
            if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
                self._open = _UNWATCHED
                return None
            self._open = WatchedForward(len(self._step.forwards) + 1, args, kwargs,
                                        tuple(m.training for m in self._modules), roots.next_node_number())
        except Exception as exc:
            if is_stop(exc):
                raise
            self._fail("starting a watched forward", exc)
        return None

    def _after_forward(self, module, args, kwargs, output):
        if not self._ours() or self._open is None:
            return None
        if self._depth:
            self._depth -= 1
            return None
        forward, self._open = self._open, None
        if isinstance(forward, _Unwatched):  # (`_UNWATCHED`, the one there is)
            return None
        if sys.exc_info()[1] is not None:  # the forward raised: no step will use it
            return None
        try:
            leaves = forward.screen(output, roots.next_node_number())
            self._step.forwards.append(forward)
            ref = weakref.ref(forward)
            for position, leaf in enumerate(leaves):
                if leaf.requires_grad:
                    leaf.register_hook(functools.partial(self._received, ref, position, leaf.dim() == 0))
        except Exception as exc:
            self._fail("screening a forward's outputs", exc)
        return None

    def _received(self, ref, position: int, is_loss: bool, grad):
        """A backward sent `grad` into output `position` of a watched forward: keep it (see `steps`)."""
        forward = ref()
        if forward is None or self._closed or self._paused or grad is None:
            return None
        try:
            task = _graph_task_id()
            if task not in self._tasks:
                self._tasks.add(task)
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
            if is_loss:
                forward.loss_fed.add(task)
            elif task in forward.loss_fed:
                return None  # it flows from a loss output, whose gradient is kept
            else:
                size = grad.numel() * grad.element_size()
                if self._step.received_bytes + size > self.max_bytes:
                    forward.dropped = (f"the gradient into an output of forward {forward.number} "
                                       f"({size / 2 ** 20:.1f} MiB) is over max_bytes={self.max_bytes}")
                    return None
                forward.received_bytes += size
            forward.received.setdefault(task, {})[position] = grad
        except Exception as exc:
            self._fail("keeping an output's gradient", exc)
        return None

    def _backward_finished(self) -> None:
        """Autograd finished a backward into the model: note how the gradients look now."""
        self._tasks.discard(_graph_task_id())
        step = self._step
        step.backwards += 1
        for index, p in enumerate(self._params):
            if p.grad is not None:
                step.after_backward = (index, weakref.ref(p.grad), p.grad._version)
                return

    def _backward_called(self):
        """`torch.autograd.backward` was called on this thread: a mark to tell, once it returns,
        whether it reached the model (see `_backward_returned`)."""
        return (self._step, self._step.backwards) if self._ours() else None

    def _backward_returned(self, mark, tensors, frame) -> None:
        """A backward from `tensors` returned: when it reached the model, keep their screen (a loss
        computed outside the model is seen nowhere else). Given a scaler, the loss is screened where
        it is scaled instead (the scaled loss may overflow where the loss does not)."""
        if mark is None or self.scaler is not None or not self._ours():
            return
        step, backwards = mark
        if self._step is not step or step.backwards == backwards:
            return  # it did not reach the model (or the step ended meanwhile)
        try:
            step.roots.append(roots.Root(tensors, step.forwards, "backward()", find_user_site(frame)))
        except Exception as exc:
            self._fail("screening the loss a backward started from", exc)

    def _end_reset_step(self) -> None:
        """At a forward: end a step whose gradients were reset without an optimizer step."""
        after = self._step.after_backward
        if after is None:
            return
        index, grad_ref, version = after
        grad = self._params[index].grad
        if grad is not None and grad_ref() is grad and grad._version == version:
            return  # still accumulating: the next micro-batch of the same step
        self._end_skipped_step()

    def _end_skipped_step(self) -> None:
        """End a step no optimizer step took: judged by its outputs (its gradients were never
        applied), and by the scaler's scale."""
        self._end_step(outputs_only=True, skipped=True)

    def _scaled(self, loss) -> None:
        """The scaler is about to scale `loss`: screen it with the step's outputs (a step the
        scaler then skips is a fault when the loss itself was not finite)."""
        leaves = floating_leaves(loss)
        if not self._ours() or not leaves:
            return
        try:
            self._step.roots.append(roots.Root(leaves, self._step.forwards, "scaler.scale",
                                               find_user_site(sys._getframe(1))))
        except Exception as exc:
            self._fail("screening the scaled loss", exc)

    def _after_scaler_update(self) -> None:
        """`scaler.update()` returned: a step the scaler skipped (no optimizer step since its
        backward) ends here, not at the next forward, so that a fault raises from this call."""
        step = self._step
        if self._ours() and step.forwards and step.backwards:
            self._end_skipped_step()

    def _before_step(self, optimizer, args, kwargs):
        if self._updates is not None and self._ours():
            self._updates.before(optimizer)
        self.check_step()
        return None

    def check_step(self) -> None:
        """Judge the step now, as the hook on `optimizer.step()` does (and act on a fault: raise,
        clear the gradients or report). For a loop whose optimizer runs the forward and backward
        inside `step(closure)` (PyTorch Lightning, LBFGS), where that hook runs before them: make
        the watch with `Watch(..., step_hook=False)` and call this after the backward, before the
        update (Lightning's `on_before_optimizer_step`)."""
        if not self._ours():
            return
        if not self._step_hook and self._updates is not None:
            for optimizer in self.optimizers:
                self._updates.before(optimizer)
        if not self._step.forwards:
            return  # nothing since the last step (a second optimizer of the same step)
        self._end_step(outputs_only=self.check == "outputs", skipped=False)

    def _end_step(self, outputs_only: bool, skipped: bool) -> None:
        step, self._step = self._step, StepRecord()
        if self._updates is not None:
            self._updates.bad_grads = set()
        fault = None
        try:
            fault = self._judge(step, outputs_only)
            if fault is None and skipped and self.scaler is not None:
                fault = self._scale_fault(step)
        except Exception as exc:
            if is_stop(exc):
                raise
            self._fail("checking the step", exc)
        self.steps += 1
        if fault is not None:
            self._act(fault, clear=self.on_fault == "skip" and not skipped)

    # -- judging a step -----------------------------------------------------------------------------

    def _judge(self, step: StepRecord, outputs_only: bool) -> Optional[Fault]:
        """The step's screens read as one number; on an alarm, the fault confirmed, then replayed
        or, for a loss that went non-finite outside the model, named on the loss's graph."""
        if not step.forwards:
            return None
        grads = [] if outputs_only else [(i, p) for i, p in enumerate(self._params) if p.grad is not None]
        screen = Screen()
        for forward in step.forwards:
            screen.add(forward.sums)
        for root in step.roots:
            root.screen(screen)
        screen.add(screen_sums([p.grad for _, p in grads if p.grad is not None]))  # (all: `grads` has them)
        if not agree(screen.alarm()):
            return None
        bad = _Confirmed(step, [grads[i][0] for i in nonfinite_positions([p.grad for _, p in grads
                                                                          if p.grad is not None])])
        if self._updates is not None:
            self._updates.bad_grads = set(bad.grads)
        if not agree(flag(bad)):
            self.false_alarms += 1
            return None
        rank, world = rank_and_world_size()
        fault = Fault(self.steps, self._what(bad, step), rank if world > 1 else None)
        fault.micro_batches = len(step.forwards)
        inside = agree(flag(bad.forwards or bad.loss_reads_inside))
        if inside or not agree(flag(bad.loss_first)):
            self._replay(fault, step, gradients=bool(bad.grads or bad.roots),
                         prefer=None if bad.forwards or bad.loss_reads_inside else "backward")
            # (every rank asks, whatever its own replay found: the question is a collective)
            if agree(flag(bad.loss_first and fault.reproduced is not True)):
                mine = bad.loss_first and fault.reproduced is not True
                self._blame_loss(fault, bad.roots[0] if mine else None, replayed=True)
            elif fault.reproduced is False and not bad.grads and self._false_output_alarm:
                self.false_alarms += 1  # the outputs' sums overflowed; the exact replay saw finite outputs
                return None
        else:  # the loss went non-finite first, outside the model: nothing in the model to replay
            self._blame_loss(fault, bad.roots[0] if bad.loss_first else None, replayed=False)
        fault.notes += self._updates.notes(self._names) if self._updates is not None else []
        directory = os.path.join(self.out, f"rank-{rank}" if world > 1 else "", f"step-{fault.step}")
        fault.write(directory, step.forwards)
        return fault

    def _blame_loss(self, fault: Fault, root: Optional[roots.Root], replayed: bool) -> None:
        """The fault is the loss's (`root`; on another rank when None): named on its autograd graph.
        `replayed`: the model was replayed first (the loss read a tensor of it no screen saw)."""
        birth_rank, finding = first_rank_text(root.finding() if root is not None else None)
        fault.finding, fault.phase, fault.reproduced = finding, "loss", None
        fault.why = ("the model's replay found nothing there, and the loop's loss is not replayed" if replayed else
                     "not replayed: the loop computes the loss, outside the model, and a replay runs the model alone")
        if root is not None:
            fault.micro_batch = root.after
        if fault.rank is not None:
            fault.birth_rank = birth_rank

    def _what(self, bad: "_Confirmed", step: StepRecord) -> str:
        parts = [bad.roots[0].what()] if bad.loss_first else []
        if bad.forwards:
            n = len(step.forwards)
            which = (f"forward {bad.forwards[0]} of {n}" if len(bad.forwards) == 1 and n > 1
                     else f"{len(bad.forwards)} of {n} forwards" if n > 1 else "the forward")
            parts.append(f"non-finite outputs in {which}")
        if bad.grads:
            named = ", ".join(self._names[i] for i in bad.grads[:3]) + (", ..." if len(bad.grads) > 3 else "")
            parts.append(f"non-finite gradients in {len(bad.grads)} of {len(self._params)} parameters ({named})")
        if not parts:
            parts.append("non-finite values on another rank")
        return " and ".join(parts)

    def _scale_fault(self, step: StepRecord) -> Optional[Fault]:
        """A step the scaler skipped: a fault only when the scale fell below 1 (once, until it recovers)."""
        if not step.forwards:
            return None
        scale = float(self.scaler.get_scale())
        if scale >= 1.0:
            self._collapsed = False
            return None
        if self._collapsed:
            return None
        self._collapsed = True
        rank, world = rank_and_world_size()
        fault = Fault(self.steps, f"the GradScaler's scale collapsed to {scale:g}: the gradients overflow even "
                                  f"unscaled", rank if world > 1 else None)
        fault.micro_batches = len(step.forwards)
        self._replay(fault, step, gradients=True, prefer="backward")
        directory = os.path.join(self.out, f"rank-{rank}" if world > 1 else "", f"step-{fault.step}")
        fault.write(directory, step.forwards)
        return fault

    def _replay(self, fault: Fault, step: StepRecord, gradients: bool, prefer: Optional[str] = None) -> None:
        """Replay the step (eagerly, then compiled for a compiled model) until a replay reproduces it."""
        self._false_output_alarm = False
        self._paused = True
        outcome: Optional[Outcome] = None
        try:
            for attempt in range(1, self.replays + 1):
                outcome = replay_step(self._eager, step.forwards, self._params, self._modules, attempt,
                                      prefer=prefer)
                if self._reproduced(fault, outcome, attempt):
                    return
            if self._compiled and rank_and_world_size()[1] == 1:
                compiled = self._compiled_replayer()
                outcome = replay_step(self._eager, step.forwards, self._params, self._modules, self.replays + 1,
                                      compiled=compiled, prefer=prefer)
                if self._reproduced(fault, outcome, self.replays + 1):
                    return
            assert outcome is not None  # (replays >= 1: the loop replayed)
            fault.replays = outcome.attempt
            fault.notes = list(outcome.notes)
            if gradients and any(f.dropped for f in step.forwards):
                fault.why = next(f.dropped for f in step.forwards if f.dropped)
            elif gradients and not any(f.received for f in step.forwards):
                fault.why = "no backward reached the model's outputs, so the gradients were not replayed"
            elif any(f.changed_inputs() for f in step.forwards):
                fault.why = "the step's inputs were changed in place after its forward, so the replay is not the step"
            else:  # (outputs that differ from the step's are what a transient fault looks like)
                fault.reproduced = False
                self._false_output_alarm = not gradients and outcome.nonfinite_outputs == 0 and outcome.exact
        except Exception as exc:
            if is_stop(exc):
                raise
            fault.why = f"the replay raised {type(exc).__name__}: {exc}"
        finally:
            self._paused = False

    def _reproduced(self, fault: Fault, outcome, attempt: int) -> bool:
        """Whether `outcome` reproduced the fault: under a process group, on any rank (the ranks
        agree through `tl.debug.across_ranks`, which also names the rank of birth)."""
        if rank_and_world_size()[1] > 1 and outcome.recorder is not None:
            from ..debug.across_ranks import across_ranks

            report = across_ranks(outcome.recorder)
            reproduced = agree(flag(outcome.reproduced)) or report.first_rank is not None
            if not reproduced:
                return False
            fault.take(outcome, self.replays)
            fault.birth_rank = report.first_rank
            born_elsewhere = report.first_rank is not None and report.first_rank != rank_and_world_size()[0]
            if report.finding and (outcome.finding is None or born_elsewhere):
                # the birth, not what reached this rank (FSDP2's reduce-scatter runs in the replay
                # too, so a rank replays the values another rank sent it)
                if fault.finding is not None:
                    fault.notes.insert(0, f"on this rank: {fault.finding}")
                fault.finding, fault.phase, fault.micro_batch = report.finding, None, None
        else:
            if not outcome.reproduced:
                return False
            fault.take(outcome, self.replays if not outcome.compiled else self.replays + 1)
        fault.reproduced, fault.replay = True, attempt
        return True

    def _compiled_replayer(self):
        if self._replayer is None:
            from ..api import compile as tl_compile

            self._replayer = tl_compile(self._eager, on_nonfinite="track", backward=True, compiler=self.compiler)
        return self._replayer

    # -- what an update wrote ----------------------------------------------------------------------

    def _after_update(self, optimizer, args, kwargs):
        """`optimizer`'s update has run: screen the parameters it holds (one sum each, one read)."""
        if not self._ours():
            return None
        fault = None
        try:
            fault = self._judge_update(optimizer)
        except Exception as exc:
            if is_stop(exc):
                raise
            self._fail("checking what an update wrote", exc)
        if fault is not None:
            self._act(fault, clear=False)
        return None

    def _judge_update(self, optimizer) -> Optional[Fault]:
        """A fault when the update wrote a non-finite value (see `updates`); under a process group,
        the ranks agree, and a rank that wrote nothing names the rank that did."""
        check = self._updates
        assert check is not None  # (its hook is registered only with the update check)
        indices, sums = check.screen(optimizer)
        if not agree(None if sums is None else ~torch.isfinite(sums.sum())):
            check.settle(optimizer)
            return None
        written = check.written(optimizer, indices)
        step = max(self.steps - 1, 0)  # (the step judged before this update)
        check.hold(written, updates.origins(written, step, optimizer))
        check.settle(optimizer)
        news = [w for w in written if w.born]
        if not agree(flag(news)):
            # (the rest: non-finite gradients applied, which the step's own check saw, or values
            # something else wrote before the update, which a forward reads as a source)
            if not written:
                self.false_alarms += 1
            return None
        what, finding = (updates.describe(news, self._names, optimizer, len(check.indices[id(optimizer)]))
                         if news else (None, None))
        rank, world = rank_and_world_size()
        birth_rank, finding = first_rank_text(finding)
        fault = Fault(step, what or "non-finite values written by an update on another rank",
                      rank if world > 1 else None)
        fault.finding, fault.phase, fault.birth_rank = finding, "update", birth_rank if world > 1 else None
        fault.why = "an update is measured where it ran, not replayed"
        return fault

    # -- acting on a fault ----------------------------------------------------------------------------

    def _act(self, fault: Fault, clear: bool) -> None:
        if fault.phase == "update" and self.on_fault == "skip":
            fault.notes.append("the update had run: on_fault='skip' cannot take it back")
        self.faults.append(fault)
        line = f"!! watch: {fault}"
        if self._sink is not None:
            try:
                self._sink.write(line)
            except Exception as exc:
                internal_error("writing the watch's line", exc)
        if clear:  # the update then changes nothing: no parameter has a gradient to apply
            for p in self._params:
                p.grad = None
        if self.on_fault == "raise":
            error = NonFiniteError(f"torchlens watch: {fault}")
            # (an attribute the watch gives the error it raises: `errors`, below `watching`, cannot name Fault)
            error.fault = fault  # type: ignore[attr-defined]
            if self._close_on_raise:
                self.close()
            raise error

    def _fail(self, what: str, exc: Exception) -> None:
        """An internal failure: said once, and the watch closed (a watch that cannot watch claims nothing)."""
        internal_error(f"the training watch ({what})", exc)
        self.close()
