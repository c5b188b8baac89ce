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

from ..core.guard import internal_error, is_stop
from ..core.sites import find_user_site
from ..core.structure import check_model
from ..errors import NonFiniteError, OptionTypeError, OptionValueError, SpikeError
from ..narration.grammar import plural
from ..narration.sinks import checked_sink, open_sink
from ..options import check_choice
from ..torch_internals.engine import graph_task_id, queue_final_callback
from . import options, roots, updates
from .checks import floating_leaves
from .explain import explain, recorded
from .faults import Fault
from .judging import StepJudge
from .replay import Replays
from .spikes import DEFAULT_RULE, Spike, SpikeCheck, SpikeRule
from .steps import StepRecord, WatchedForward
from .updates import Weights

__all__ = ["Watch", "watch"]



def watch(model: nn.Module, optimizer, *, out="torchlens-watch", on_fault: str = "raise", check: str = "grads",
          narrate=True, replays: int = 2, max_bytes: int = options.DEFAULT_MAX_BYTES, scaler=None,
          compiler="inductor", on_spike: Optional[str] = "report", spike: SpikeRule = DEFAULT_RULE) -> "Watch":
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

    A finite loss or gradients' norm far above its recent level (`spike`, a `SpikeRule`) is a
    spike: replayed before the update, on its own batch and on the last calm step's, it is called
    the batch's (with the first module out of range) or the weights' (with what changed them
    since), or transient; `on_spike` decides as `on_fault` does ("raise": `tl.errors.SpikeError`), None to not
    judge spikes. Its line goes to `narrate`, its batch, page and traces to `out`/step-N/.
    """
    return Watch(model, optimizer, out=out, on_fault=on_fault, check=check, narrate=narrate, replays=replays,
                 max_bytes=max_bytes, scaler=scaler, compiler=compiler, on_spike=on_spike, spike=spike)


class _Removable(Protocol):
    """What the watch removes when it closes: a torch hook handle, the backward listener, the scaler's hooks."""

    def remove(self) -> None: ...


class _Unwatched:
    """Stands for a forward the watch does not keep (no gradient mode: evaluation)."""


_UNWATCHED = _Unwatched()


class Watch:
    """A training watch (`tl.watch`). `faults` lists the `Fault`s caught, `steps` counts the steps
    ended; `close()` (or leaving its `with` block) removes every hook it added."""

    def __init__(self, model: nn.Module, optimizer, *, out="torchlens-watch", on_fault="raise", check="grads",
                 narrate=True, replays=2, max_bytes=options.DEFAULT_MAX_BYTES, scaler=None, compiler="inductor",
                 on_spike: Optional[str] = "report", spike: SpikeRule = DEFAULT_RULE, step_hook: bool = True,
                 close_on_raise: bool = False):
        check_model(model, "tl.watch")
        self.on_fault = check_choice("tl.watch on_fault", on_fault, options.ON_FAULT, takes="")
        self.on_spike = (None if on_spike is None
                         else check_choice("tl.watch on_spike", on_spike, options.ON_FAULT, takes="None or "))
        if not isinstance(spike, SpikeRule):
            raise OptionTypeError(f"tl.watch spike= takes a tl.watching.SpikeRule(window=, warmup=, rtol=, atol=, "
                                  f"spread=, grad_rtol=, factor=), got {type(spike).__name__}")
        if self.on_spike is None and spike is not DEFAULT_RULE:
            raise OptionValueError("tl.watch spike= was given with on_spike=None, which judges no spike: pass "
                                   "on_spike='report', 'skip' or 'raise' with it, or leave spike= out")
        self.check = check_choice("tl.watch check", check, options.CHECKS, takes="")
        self.replays = options.check_count("replays", replays, 1)
        self.max_bytes = options.check_count("max_bytes", max_bytes, 0)
        if not isinstance(out, (str, os.PathLike)):
            raise OptionTypeError(f"tl.watch out= takes a directory path, got {out!r}")
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise OptionTypeError(f"tl.watch scaler= takes a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.out = os.fspath(out)
        self.scaler = scaler
        self.model = model
        self.optimizers = options.optimizers(optimizer)
        self.compiler = compiler
        self._sink = open_sink(checked_sink(narrate)) if narrate not in (None, False) else None
        eager, compiled = options.eager_module(model)
        self._modules = list(eager.modules())
        self._params, names = options.watched_parameters(self.optimizers, eager)
        self.faults: List[Fault] = []
        self.spikes: List[Spike] = []
        self.steps = 0
        self._spike_check = SpikeCheck(spike) if self.on_spike is not None else None
        self._names = names
        self._previous: Optional[StepRecord] = None  # the last calm step, replayed against a spike
        self._step = StepRecord()
        self._open: Union[WatchedForward, _Unwatched, None] = None  # the forward running now
        self._depth = 0  # nested calls of the model inside its own forward
        self._tasks: Set[int] = set()  # graph tasks whose end-of-backward callback is queued
        self._thread = threading.get_ident()
        # the parameters after each update (check="grads": outputs, losses, gradients and updates)
        self._updates = updates.UpdateCheck(self._params, self.optimizers) if self.check == "grads" else None
        self._replays = Replays(eager, compiled, self._params, self._modules, self.replays, compiler)
        self._judge = StepJudge(self._params, names, self._updates, self._replays, self.out, scaler)
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
            self._handles.append(roots.ScalerHooks(scaler, self._scaled, self._after_scaler_update))
        self._closed = False

    @property
    def false_alarms(self) -> int:
        """Screens that overflowed on finite values (confirmed finite)."""
        return self._judge.false_alarms

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
        self._previous = None
        self._open = None
        if self._sink is not None:
            self._sink.close()

    @property
    def held_bytes(self) -> int:
        """What the watch keeps alive that plain training would have freed (bytes): the current
        step's references, and, judging spikes, the previous step's, its batch counted whole."""
        previous = self._previous
        return self._step.held_bytes + (previous.held_bytes + previous.batch_bytes if previous is not None else 0)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<Watch {state}: {plural(self.steps, 'step')}, {plural(len(self.faults), 'fault')}, "
                f"{plural(len(self.spikes), 'spike')}>")

    # -- the hooks: what the step keeps, and where it ends --------------------------------------

    def _ours(self) -> bool:
        return not (self._closed or self._replays.running) and threading.get_ident() == self._thread

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
            leaves = forward.screen(output, roots.next_node_number(), samples=self._spike_check is not None)
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
        if forward is None or self._closed or self._replays.running or grad is None:
            return None
        try:
            task = graph_task_id()
            if task not in self._tasks:
                self._tasks.add(task)
                queue_final_callback(self._backward_finished)
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
        self._tasks.discard(graph_task_id())
        self._step.backward_finished(self._params)

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
        if self._step.grads_reset(self._params):
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
            self._updates.judged_grads(())
        fault = None
        try:
            fault = self._judge.step_fault(step, self.steps, outputs_only)
            if fault is None and skipped and self.scaler is not None:
                fault = self._judge.scale_fault(step, self.steps)
        except Exception as exc:
            if is_stop(exc):
                raise
            self._fail("checking the step", exc)
        number, self.steps = self.steps, self.steps + 1
        step.number = number
        if fault is not None:
            self._act(fault, clear=self.on_fault == "skip" and not skipped)
            return
        if self._spike_check is None or skipped:
            return
        try:
            spike = self._judge_spike(step, number)
        except Exception as exc:
            if is_stop(exc):
                raise
            self._fail("checking the step for a spike", exc)
            return
        if spike is not None:
            self._act_on_spike(spike)
        elif self._spike_check.calm:
            self._previous = step
            if self._updates is not None:
                self._updates.mark_healthy()

    def _judge_spike(self, step: StepRecord, number: int) -> Optional[Spike]:
        """Step `number` (healthy) is a spike when its read says so; it is then explained by replay."""
        check = self._spike_check
        assert check is not None  # (called only when spikes are judged)
        read = self._judge.read
        step.grad_norm = read.grad_norm if read is not None else None
        signal = check.judge(read)
        if signal is None:
            return None
        spike = Spike(number, signal, self._judge.rank, check.rule.window)
        updates = self._updates
        self._replays.running = True
        try:
            explain(spike, step, self._previous, self._replays.eager, self._params, self._modules, check.rule,
                    (lambda: updates.since_healthy(self._names)) if updates is not None
                    else (lambda: Weights(None, [], [])), compiled=self._replays.compiled)
            recordings = recorded(spike, self._replays.eager, step, self._previous, self._params, self._modules)
        except Exception as exc:
            if is_stop(exc):
                raise
            spike.why = f"the replay raised {type(exc).__name__}: {exc}"
            recordings = []
        finally:
            self._replays.running = False
        spike.write(self._judge.directory(number), step.forwards, recordings)
        return spike

    def _after_update(self, optimizer, args, kwargs):
        """`optimizer`'s update has run: screen the parameters it holds (one sum each, one read)."""
        if not self._ours():
            return None
        fault = None
        try:
            fault = self._judge.update_fault(optimizer, self.steps)
        except Exception as exc:
            if is_stop(exc):
                raise
            self._fail("checking what an update wrote", exc)
        if fault is not None:
            self._act(fault, clear=False)
        return None

    # -- acting on a fault or a spike ---------------------------------------------------------------

    def _act(self, fault: Fault, clear: bool) -> None:
        if fault.phase == "update" and self.on_fault == "skip":
            fault.notes.append("the update had run: on_fault='skip' cannot take it back")
        self.faults.append(fault)
        # (an attribute the watch gives the error it raises: `errors`, below `watching`, cannot name Fault)
        self._decide(str(fault), clear, NonFiniteError, "fault", fault if self.on_fault == "raise" else None)

    def _act_on_spike(self, spike: Spike) -> None:
        self.spikes.append(spike)
        self._decide(str(spike), self.on_spike == "skip", SpikeError, "spike",
                     spike if self.on_spike == "raise" else None)

    def _decide(self, text: str, clear: bool, error_type, name: str, raised) -> None:
        """Write the line, clear the gradients (`clear`: the update then changes nothing, no
        parameter having a gradient to apply), and raise `error_type` with `raised` as its
        attribute `name` when there is one to raise."""
        if self._sink is not None:
            try:
                self._sink.write(f"!! watch: {text}")
            except Exception as exc:
                internal_error("writing the watch's line", exc)
        if clear:
            for p in self._params:
                p.grad = None
        if raised is not None:
            error = error_type(f"torchlens watch: {text}")
            setattr(error, name, raised)
            if self._close_on_raise:
                self.close()
            raise error

    def _fail(self, what: str, exc: Exception) -> None:
        """An internal failure: said once, and the watch closed (a watch that cannot watch claims nothing)."""
        internal_error(f"the training watch ({what})", exc)
        self.close()
