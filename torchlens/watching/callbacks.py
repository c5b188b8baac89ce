"""Thin adapters that put a `tl.watch` on a framework's training loop.

- `TrainerWatch(**watch_keywords)`: a transformers `TrainerCallback`. The watch is made when
  training begins, on the model and the optimizer the `Trainer` built (accelerate's optimizer
  wrapper looked through), and closed when it ends. The `Trainer` steps the optimizer itself, so
  the watch judges each step from `optimizer.step()` as in a plain loop.
- `LightningWatch(**watch_keywords)`: a PyTorch Lightning `Callback`. Lightning runs the forward
  and backward inside `optimizer.step(closure)`, so the watch judges the step from
  `on_before_optimizer_step` (after the backward, before the update; `Watch.check_step`). It
  watches the forwards of the `LightningModule` itself: a `training_step` that calls `self(x)`.
  One that never calls its own forward gives the watch nothing to see, and it says so once.

In both, a loss computed outside the model (a `Trainer`'s `compute_loss`, a `training_step`) is
screened where its backward starts, and each update after it runs (a step post-hook on the torch
optimizer, which both frameworks step), as in a plain loop.

A fault under `on_fault="raise"` leaves `trainer.train()` / `trainer.fit()` as their exception
(`tl.errors.NonFiniteError`, `.fault` attached), the watch closed first (the loop cannot go on).
Neither framework is a dependency: each class is built on first use, from the framework installed
then.
"""

from __future__ import annotations

import functools

from ..errors import warn_safely
from .watch import Watch

__all__ = ["LightningWatch", "TrainerWatch"]


def TrainerWatch(**watch_keywords):  # noqa: N802 (a class to its caller)
    """A transformers `TrainerCallback` that watches the training (`tl.watch` keywords)."""
    return _trainer_class()(**watch_keywords)


def LightningWatch(**watch_keywords):  # noqa: N802 (a class to its caller)
    """A PyTorch Lightning `Callback` that watches the fit (`tl.watch` keywords)."""
    return _lightning_class()(**watch_keywords)


class _Watching:
    """What both adapters share: the `tl.watch` keywords, the `Watch` while it runs, its faults."""

    def __init__(self, **watch_keywords):
        self.keywords = watch_keywords
        self.watch = None

    @property
    def faults(self):
        return self.watch.faults if self.watch is not None else []

    @property
    def spikes(self):
        return self.watch.spikes if self.watch is not None else []


@functools.lru_cache(maxsize=None)
def _trainer_class():
    from transformers import TrainerCallback

    class TorchlensTrainerWatch(_Watching, TrainerCallback):
        """Watches a `Trainer`'s training with `tl.watch`; `watch` is the `Watch` while it runs."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.watch = Watch(model, optimizer, close_on_raise=True, **self.keywords)

        def on_train_end(self, args, state, control, **kwargs):
            if self.watch is not None:
                self.watch.close()

    return TorchlensTrainerWatch


@functools.lru_cache(maxsize=None)
def _lightning_class():
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the older package name
        # (the same class under its older package: to mypy, another type bound to the same name; with
        # neither package installed both read as Any, and the ignore has nothing to silence)
        from pytorch_lightning import Callback  # type: ignore[assignment,unused-ignore]

    class TorchlensLightningWatch(_Watching, Callback):
        """Watches a Lightning fit with `tl.watch`; `watch` is the `Watch` while it runs."""

        _said_blind = False

        def on_fit_start(self, trainer, pl_module):
            self.watch = Watch(pl_module, list(trainer.optimizers), step_hook=False, close_on_raise=True,
                               **self.keywords)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            watch = self.watch
            if watch is None:
                return
            if not watch._step.forwards and not self._said_blind:
                self._said_blind = True
                warn_safely("torchlens LightningWatch: this step ran no forward of the LightningModule itself "
                            "(its training_step does not call self(...)): the watch sees nothing of it")
            watch.check_step()

        def teardown(self, trainer, pl_module, stage):
            if self.watch is not None:
                self.watch.close()

    return TorchlensLightningWatch
