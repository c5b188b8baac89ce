"""A `Fault`: the step a watch caught, what its replay found, and what it left on disk."""

from __future__ import annotations

import os
from typing import List, Optional

import torch

from ..errors import ReproError, warn_safely
from ..narration.grammar import plural
from .replay import Outcome

__all__ = ["Fault", "MEASURED", "attempt", "save_inputs"]

# the phases a fault is named in without a replay: a loss the loop computed outside the model (on
# its autograd graph), and an optimizer's update (the parameters it wrote, read after it ran)
MEASURED = ("loss", "update")


class Fault:
    """One faulty step.

    - `step`: the training step, counted from 0 (each `optimizer.step()`, and each step a
      `GradScaler` skipped); `rank`: this process's rank under a process group, else None.
    - `what`: what the cheap check saw ("non-finite gradients in 2 parameters (fc.weight, fc.bias)",
      "non-finite outputs in forward 2 of 4").
    - `reproduced`: True when a replay found it again, False when no replay did (a **transient**
      fault: a nondeterministic kernel, a race, the hardware; the step's inputs are saved),
      None when the replays could not tell, or none ran (`why` says why, e.g. the backward was not
      replayed; a loss or an update fault is measured where it happened).
    - `phase`: "forward" or "backward" (where a replay found it), "loss" (a loss computed outside
      the model, named on its autograd graph) or "update" (what an optimizer's update wrote).
    - `replay`: which replay reproduced it (1-based), `replays`: how many ran.
    - `finding`: the first finding's text (where the value was born), `birth_rank`: under a
      process group, the rank it was born on (`tl.debug.across_ranks` over the replays).
    - `html`, `trace`, `repro`, `inputs`: paths of the replay's page, its saved trace, the one-op
      repro directory (a forward birth only), the step's inputs; None where there is none.
    - `recording`: the replayed pass that holds the finding (a `Recording`), in memory.
    """

    def __init__(self, step: int, what: str, rank: Optional[int] = None, micro_batches: int = 0):
        self.step = step
        self.what = what
        self.rank = rank
        self.reproduced: Optional[bool] = None
        self.why: Optional[str] = None
        self.replay: Optional[int] = None
        self.replays = 0
        self.finding: Optional[str] = None
        self.micro_batch: Optional[int] = None
        self.micro_batches = micro_batches
        self.phase: Optional[str] = None
        self.compiled_only = False
        self.birth_rank: Optional[int] = None
        self.notes: List[str] = []
        self.recording = None
        self.html: Optional[str] = None
        self.trace: Optional[str] = None
        self.repro: Optional[str] = None
        self.inputs: Optional[str] = None

    def reproduced_by(self, outcome: Outcome, attempt: int, replays: int, birth=None) -> None:
        """Replay `attempt` reproduced the fault: take what it found. `birth`, under a process group:
        `tl.debug.across_ranks` over the replays, which names the rank the value was born on."""
        self.reproduced, self.replay, self.replays = True, attempt, replays
        self.notes = list(outcome.notes)
        if outcome.finding is not None:
            self.finding = outcome.finding.text + _location(outcome.finding.event, outcome.finding.text)
            self.recording, self.micro_batch, self.phase = outcome.recording, outcome.micro_batch, outcome.phase
        elif outcome.nonfinite_gradients:
            self.finding = (f"non-finite gradients in {outcome.nonfinite_gradients} parameters, "
                            f"with no finding in what was narrated")
        self.compiled_only = outcome.compiled and outcome.reproduced
        if birth is None:
            return
        self.birth_rank = birth.first_rank
        born_elsewhere = birth.first_rank is not None and birth.first_rank != self.rank
        if birth.finding and (outcome.finding is None or born_elsewhere):
            # the birth, not what reached this rank (FSDP2's reduce-scatter runs in the replay
            # too, so a rank replays the values another rank sent it)
            if self.finding is not None:
                self.notes.insert(0, f"on this rank: {self.finding}")
            self.finding, self.phase, self.micro_batch = birth.finding, None, None

    def not_reproduced(self, outcome: Optional[Outcome], why: Optional[str]) -> None:
        """No replay reproduced the fault (`outcome`: the last one's): transient, or, given `why`,
        the replays could not tell (they did not replay the step, or raised)."""
        if outcome is not None:
            self.replays, self.notes = outcome.attempt, list(outcome.notes)
        if why is None:
            self.reproduced = False
        else:
            self.why = why

    def of_loss(self, finding: Optional[str], birth_rank: Optional[int], micro_batch: Optional[int],
                replayed: bool) -> None:
        """The fault is the loss's, named on its autograd graph (`finding`, on rank `birth_rank`;
        `micro_batch` where this rank's loss went non-finite). `replayed`: the model was replayed
        first (the loss read a tensor of it no screen saw)."""
        self.finding, self.phase, self.reproduced = finding, "loss", None
        self.why = ("the model's replay found nothing there, and the loop's loss is not replayed" if replayed else
                    "not replayed: the loop computes the loss, outside the model, and a replay runs the model alone")
        if micro_batch is not None:
            self.micro_batch = micro_batch
        if self.rank is not None:
            self.birth_rank = birth_rank

    def of_update(self, finding: Optional[str], birth_rank: Optional[int]) -> None:
        """The fault is what an optimizer's update wrote (`finding`, on rank `birth_rank`)."""
        self.finding, self.phase, self.birth_rank = finding, "update", birth_rank
        self.why = "an update is measured where it ran, not replayed"

    def __str__(self) -> str:
        rank = f"rank {self.rank} " if self.rank is not None else ""
        head = f"{rank}step {self.step}: {self.what}"
        if self.phase in MEASURED:  # found where it happened, without a replay
            text = f"{head}; {self._where('not named', 'on rank')}"
            text += f"; {self.why}" if self.phase == "loss" and self.why else ""
        elif self.reproduced:
            how = " (compiled, after the eager replays found nothing)" if self.compiled_only else ""
            text = (f"{head}; {self._where('non-finite values', 'born on rank')}; reproduced in replay "
                    f"{self.replay} of {self.replays}{how}")
        elif self.reproduced is False:
            text = (f"{head}; transient: not reproduced in {plural(self.replays, 'replay')} "
                    f"(a nondeterministic kernel, a race or the hardware)")
        else:
            text = f"{head}; not replayed to its birth: {self.why}"
        for note in self.notes:
            text += f"; {note}"
        return text

    def _where(self, unnamed: str, born: str) -> str:
        """Where the value was born: the finding, its micro-batch, and the rank it was born on."""
        where = self.finding or unnamed
        if self.micro_batch is not None and self.micro_batches > 1:
            where += f", in the {self.phase} of micro-batch {self.micro_batch} of {self.micro_batches}"
        if self.birth_rank is not None and self.birth_rank != self.rank:
            where = f"{born} {self.birth_rank}: {where}"
        return where

    def __repr__(self) -> str:
        return f"<Fault step={self.step} phase={self.phase} reproduced={self.reproduced}: {self.finding}>"

    def write(self, directory: str, forwards) -> None:
        """Leave the replay's page, its trace, the one-op repro and the step's inputs in `directory`.
        A file that cannot be written is said, not raised: the fault itself is the news."""
        os.makedirs(directory, exist_ok=True)
        self.inputs = attempt("saving the step's inputs",
                              lambda: save_inputs(forwards, os.path.join(directory, "inputs.pt")))
        if self.recording is None:
            return
        self.html = attempt("writing the replay's page",
                            lambda: self.recording.to_html(os.path.join(directory, "replay.html")))
        self.trace = attempt("saving the replay", lambda: self.recording.save(os.path.join(directory, "replay.tl")))
        if self.phase == "forward":
            try:
                self.repro = os.path.dirname(self.recording.repro(os.path.join(directory, "repro")))
            except ReproError:
                self.repro = None


def _location(event, text: str) -> str:
    """` @module file:line` of the op (or the forward op of the backward node) a finding is at;
    the module only where the finding's `text` does not name it already."""
    if event is None:
        return ""
    scope = getattr(event, "scope", None)
    path = getattr(scope, "path", "") if scope is not None else ""
    named = path and f"@{path}" in text.split()
    parts = ([f"@{path}"] if path and not named else []) + ([event.site] if getattr(event, "site", None) else [])
    return (" " + " ".join(parts)) if parts else ""


def save_inputs(forwards, path: str) -> str:
    torch.save([{"args": f.args, "kwargs": f.kwargs, "rng_cpu": f.rng.cpu, "rng_cuda": f.rng.cuda}
                for f in forwards], path)
    return path


def attempt(what: str, write):
    try:
        return write()
    except Exception as exc:
        warn_safely(f"torchlens watch: {what} failed ({type(exc).__name__}: {exc})")
        return None
