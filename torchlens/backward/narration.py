"""The hooks' entry points into the runs of a watched backward: which run a node belongs to, when
a run ends (autograd's final callback, or a failure seen later), and who narrates it."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Dict, List, Optional

from ..core.guard import contain, internal_error, is_stop
from ..core.session import attach, nonfinite_message
from ..errors import NonFiniteError
from ..findings import Finding
from ..narration.narrator import Narrator
from ..results import Recording
from ..torch_internals.engine import graph_task_id, queue_final_callback
from .graph import BackwardWatch, GradientRoots, NodeRecord
from .run import BackwardRun

__all__ = ["BackwardNarration", "BackwardStopped", "end_unseen_runs_everywhere"]


class BackwardNarration:
    """The backwards of one entry point's passes (`Recorder`, a compiled model): their runs, the
    narrator they write to, and the watches whose hooks are still on a graph."""

    MAX_WATCHES = 8  # graphs kept hooked while no backward has run through them (gradient accumulation)

    def __init__(self, settings, narrator: Optional[Narrator], forward_open: Callable[[], bool] = bool,
                 once: bool = False):
        self.settings = settings
        self.narrator = narrator  # shared with the forwards (a `Recorder`'s); else each run opens its own
        self.thread = threading.get_ident()  # the thread whose forwards the shared narrator narrates
        self.forward_open = forward_open  # whether a forward is being narrated on the shared narrator now
        self.live_run: Optional[BackwardRun] = None  # the run writing to the shared narrator now
        self._pending: list = []  # lines of runs held back until the forward being narrated ends
        # `once`: the graph of one forward (`tl.record`, `tl.trace`), released when its backward ends
        self.once = once
        self.raising = settings.on_nonfinite == "raise"
        # The runs not ended yet, by autograd's graph task: a backward may run inside another (a
        # reentrant checkpoint's), or on another thread while this one runs a forward.
        self.runs: Dict[int, BackwardRun] = {}
        self.watches: List[BackwardWatch] = []
        self.released = 0  # graphs released before any backward ran through them (past MAX_WATCHES)
        self._lock = threading.RLock()  # nodes on different devices run on different threads

    def busy(self, thread: int) -> bool:
        """Whether a run on `thread` must hold its lines back from the shared narrator."""
        return thread != self.thread or self.live_run is not None or self.forward_open()

    def deliver(self, lines) -> None:
        """A held-back run's lines: written now, or, while a forward is being narrated, after it."""
        with self._lock:
            if self.forward_open():
                self._pending.append(lines)
            else:
                narrator = self.narrator
                assert narrator is not None  # (a run holds its lines back only from a shared narrator)
                narrator.write_lines(lines)

    def flush_pending(self) -> None:
        """A forward's narration ended: write the backwards held back while it ran."""
        with self._lock:
            pending, self._pending = self._pending, []
            narrator = self.narrator
            if narrator is None:  # (none shared: no run held its lines back)
                return
            for lines in pending:
                narrator.write_lines(lines)

    # -- the forward side -------------------------------------------------------------------------

    def watch(self, recording: Recording, roots: GradientRoots, outputs, names: dict, root, parameters=(),
              forward_values=None) -> None:
        """Hook the graph a forward just built; graphs whose backward already ran are released
        (and, past `MAX_WATCHES`, the oldest ones). `parameters`: (name, weak reference) of the
        model's, looked at after a backward under a process group (`GradTracker.written_after`);
        `forward_values`: what the forward's ops read or produced that was not finite (tracking)."""
        with self._lock:
            self._release()
            watch = BackwardWatch(self, recording, roots, outputs, names, root, forward_values)
            watch.parameters = parameters
            self.watches.append(watch)
            _OPEN.add(self)

    def _release(self) -> None:
        running = {run.watch for run in self.runs.values()}
        kept = []
        for watch in self.watches:
            if watch in running or watch.runs == 0:
                kept.append(watch)
            else:
                watch.detach()
        while len(kept) >= self.MAX_WATCHES:  # room for the graph being added
            oldest = kept.pop(0)
            oldest.detach()
            self.released += 1
        self.watches = kept

    def end_unseen_runs(self) -> None:
        """A new pass begins outside any backward: the runs this thread began and did not end
        failed unseen (their final callback never came)."""
        with self._lock:
            if graph_task_id() != -1:
                return
            thread = threading.get_ident()
            for run in list(self.runs.values()):
                if run.thread == thread:
                    self._end_failed(run, None)

    def _ended(self) -> None:
        """After a run ended: a one-forward narration lets go of its graph."""
        if self.once:
            for watch in self.watches:
                watch.detach()
            self.watches = []
            _OPEN.discard(self)

    def close(self, exc: Optional[BaseException] = None) -> None:
        """The entry point is done (the `Recorder` block ends): a backward still open failed (with
        `exc`, the exception leaving the block, when there is one); every hook is removed."""
        with self._lock:
            try:
                for run in list(self.runs.values()):
                    self._end_failed(run, exc)
            finally:
                for watch in self.watches:
                    watch.detach()
                self.watches = []
                if self.narrator is not None:
                    self.flush_pending()

    # -- hooks (autograd's engine calls them, possibly on a device's thread) -----------------------

    def node_starting(self, watch: BackwardWatch, record: NodeRecord, grad_outputs) -> None:
        self._in_run(watch, record, BackwardRun.starting, record, grad_outputs)

    def node_done(self, watch: BackwardWatch, record: NodeRecord, grad_inputs, grad_outputs) -> None:
        self._in_run(watch, record, BackwardRun.node_done, watch, record, grad_inputs, grad_outputs)

    def output_grad(self, watch: BackwardWatch, label: str, node, grad) -> None:
        self._in_run(watch, None, BackwardRun.output_grad, watch, label, node, grad)

    def _in_run(self, watch: BackwardWatch, record: Optional[NodeRecord], step, *args) -> None:
        """Hand a hook's report to the run it belongs to (`step` of that run, with `args`), begun
        now if need be; a failure goes to `_hook_failed`."""
        try:
            with self._lock:
                run = self._run_for(watch, record)
                if run is not None:
                    step(run, *args)
        except Exception as exc:
            self._hook_failed(exc)

    def _hook_failed(self, exc: Exception) -> None:
        """A hook raised. A deliberate stop (a kept-values budget) ends the run with its partial
        trace and stops the backward; a failure of torchlens is reported and the run marked
        incomplete, the backward untouched."""
        with self._lock:
            run = self.runs.get(graph_task_id())
            if is_stop(exc) and run is not None:
                self._end_failed(run, exc)
        contain(exc, "narrating a backward node", run.mark_incomplete if run is not None else None,
                "nodes after an internal error were not all narrated")

    def _run_for(self, watch: BackwardWatch, record: Optional[NodeRecord] = None) -> Optional[BackwardRun]:
        """The run the engine's current execution belongs to, begun now if need be. A leaf's node
        (`AccumulateGrad`, which outlives graphs and is shared by them) never begins a run: fired
        alone, it is a backward through a graph no narrated forward built (None)."""
        task = graph_task_id()
        run = self.runs.get(task)
        if run is None:
            if record is not None and record.label is not None:
                return None
            run = self.runs[task] = BackwardRun(self, watch, task)
            queue_final_callback(functools.partial(self._finished, run))
        return run

    def _finished(self, run: BackwardRun) -> None:
        """Autograd's final callback for the run's graph task: it finished. Never raises (it runs
        inside the user's backward)."""
        try:
            if run.waits_for_final_callbacks():  # ends after the callbacks queued since (DDP's, a hook's)
                queue_final_callback(functools.partial(self._finished, run))
                return
            with self._lock:
                if self.runs.get(run.task) is not run:
                    return
                del self.runs[run.task]
                if self.released:  # said by the next backward to end, the one that would reach them
                    graphs = "the graph of 1 earlier pass was" if self.released == 1 else \
                        f"the graphs of {self.released} earlier passes were"
                    run.mark_incomplete(f"{graphs} released before a backward reached them (more than "
                                        f"{self.MAX_WATCHES} waited)")
                    self.released = 0
                run.finish()
                self._ended()
        except Exception as exc:
            internal_error("ending the backward's narration", exc)

    def _end_failed(self, run: BackwardRun, exc: Optional[BaseException]) -> None:
        self.runs.pop(run.task, None)
        known = exc is not None
        failure = exc if exc is not None else BackwardStopped()
        try:
            partial = run.fail(failure, noticed_late=not known)
            if known and getattr(failure, "partial_trace", None) is None:
                attach(failure, partial)
        except Exception as inner:
            internal_error("ending a failed backward", inner)
        self._ended()

    def stop(self, run: BackwardRun, finding: Finding) -> None:
        """`on_nonfinite="raise"`: stop the backward at this finding, with the partial trace."""
        error = NonFiniteError(nonfinite_message(finding))
        self._end_failed(run, error)
        raise error


# Narrations with graphs still hooked: a backward of theirs that failed unseen is ended (its sink
# closed, its partial trace kept) when this thread next begins a forward.
_OPEN: "weakref.WeakSet[BackwardNarration]" = weakref.WeakSet()


def end_unseen_runs_everywhere() -> None:
    """A forward begins: end the runs of this thread that failed unseen, whatever narrated them."""
    if not _OPEN:  # the common case, every forward: nothing is watched
        return
    for narration in list(_OPEN):
        if narration.runs:
            narration.end_unseen_runs()


class BackwardStopped(BaseException):
    """Stands for an exception a backward raised that torchlens did not see (it was caught inside
    the `Recorder` block, or the backward was run after it): the error its partial trace reports."""

    def __str__(self) -> str:
        return "the backward stopped without finishing (an exception raised inside it was not seen by torchlens)"
