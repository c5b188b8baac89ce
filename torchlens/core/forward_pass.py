"""One forward pass, from its inputs to its `Recording`: the lifecycle both substrates share.

Words used across the package: a *pass* is one forward of a model; `ForwardPass` (here) is its
lifecycle — it owns the `Session` (the pass's event log), the `Narrator` it feeds (unless a
`Recorder` shares one across passes) and the `Pipeline` every value the substrate sees goes
through (measured, judged, logged, kept: `torchlens.core.pipeline`); a `Recording` (or, on failure, a
`PartialTrace`) is what the pass leaves the user.

A substrate adds only how ops are seen: `eager.runner.EagerPass` is a `ForwardPass` plus module
hooks and the capture mode; `fx_backend.compiled_pass.CompiledPass` is a `ForwardPass` plus compiled
graphs' plans and the capture of code between graphs. Both go through the same four steps:

    begin(inputs)   the forward's input tensors, named by `inputs()` as (label, tensor) pairs
    finish(output)  the outputs and the footer: the `Recording`
    fail(exc)       the partial trace and the failure block, attached to the user's exception
    close()         release the sink this pass opened (idempotent; runs after either ending)
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch

from ..backward import BackwardNarration, GradientRoots, end_unseen_runs_everywhere
from ..errors import NonFiniteError
from ..events import Scope, TensorMeta
from ..measure.meter import Meter
from ..narration.narrator import Narrator
from ..narration.ranks import world_size
from ..options import Settings
from ..results import PartialTrace, Recording
from ..torch_internals.mode_stack import own_work, under_a_capture
from .guard import guarded, internal_error
from .pipeline import Pipeline
from .session import Session
from .structure import model_tensors, named_outputs, tensor_names
from .values import ValueKeeper

__all__ = ["ForwardPass"]


class ForwardPass:
    """One forward's session, narrator, meter and value keeper, begun and ended in one way.

    `narrator`: a narrator shared by several passes (a `Recorder`'s), left open at `close()`;
    without it the pass opens its own sink when narration is on and closes it at `close()` (a
    path's `{rank}` is filled in then, so a process group set up between two forwards is seen).
    `nested` says whether another capture's mode was active when the pass was made: the pass's own
    torch calls (`own_work()`) must then stay out of that capture's transcript.
    """

    def __init__(self, settings: Settings, root: Scope, model, header: Optional[str] = None,
                 narrator: Optional[Narrator] = None, backward: Optional[BackwardNarration] = None):
        self.settings = settings
        self.nested = under_a_capture()
        end_unseen_runs_everywhere()  # a backward of an earlier forward that failed unseen: ended now
        # id -> name of the model's parameters and buffers, read when a finding or a backward needs it
        self.tensor_names: Callable[[], dict] = lambda: tensor_names(model)
        # (name, weak reference) of the model's parameters: where a collective may write gradients
        self._parameters = lambda: tuple((name, weakref.ref(p)) for name, p in
                                         (model.named_parameters() if isinstance(model, torch.nn.Module) else ()))
        # `backward`: where this forward's backward is narrated (`backward=True`); the nodes its ops
        # feed autograd are noted in `roots` (none when the forward builds no graph)
        self.backward = backward
        self.roots = GradientRoots() if backward is not None and torch.is_grad_enabled() else None
        self._owned_narrator = None
        if narrator is None and settings.narration is not None:
            narrator = self._owned_narrator = Narrator(settings.narration)
        self.narrator = narrator
        try:
            self.session = Session(settings, root, narrator, header)
            values = self.session.values  # (a dict exactly when `settings.keep_values`)
            self.keeper = (ValueKeeper(values, settings.keep_on_cpu, settings.max_bytes)
                           if values is not None else None)
            # (tracking while narrating reads a CPU op's statistics at once: its `!!` line follows it)
            meter = Meter.of(settings, judging=narrator is not None)
            self.pipeline = Pipeline(self.session, meter, self.tensor_names, self.keeper, self.roots,
                                     held=lambda: model_tensors(model))
        except BaseException:
            self.close()  # the sink it opened
            raise

    def own_work(self):
        """Context for this pass's own torch calls: invisible to a capture it runs inside."""
        return own_work(self.nested)

    def begin(self, inputs: Callable[[], Iterable[Tuple[str, torch.Tensor]]]) -> None:
        """Record the forward's input tensors, named by `inputs()` (naming them may run user code:
        a key's `repr`, a dataclass field). A deliberate stop (`on_nonfinite="raise"` on a NaN
        input, a trace budget the inputs exceed) propagates; any other failure here is torchlens's
        own, reported, and the forward goes on with its recording marked incomplete."""
        pipeline = self.pipeline
        with self.own_work(), guarded("recording the forward's inputs", self.session.mark_incomplete,
                                      "an internal error recording the inputs"):
            for label, tensor in inputs():
                pipeline.input(label, TensorMeta.single(tensor), tensor)

    def finish(self, output, notes: Callable[[], Sequence[str]] = tuple) -> Recording:
        """The recording of the forward that returned `output`, with `notes()` on how it ran (footer).

        A failure of torchlens here must not turn the user's successful forward into an error: it
        is reported and a bare recording of the events so far is returned.
        """
        session = self.session
        with self.own_work():
            try:
                outputs = named_outputs(output)
                for label, tensor in outputs:
                    self.pipeline.output(label, TensorMeta.single(tensor), tensor)
                session.footer_extra.extend(notes())
                session.move_to(session.root)
                recording = session.finish(output, self.pipeline.settle())
            except Exception as exc:
                internal_error("finishing the recording", exc)
                return Recording(session.events, output, self.settings)
            self._watch_backward(recording, outputs)
            return recording

    def _watch_backward(self, recording: Recording, outputs) -> None:
        """Hook the graph this forward built, so that its backward is narrated (`backward=True`)."""
        roots, backward = self.roots, self.backward  # (roots are noted only with a backward to narrate)
        if roots is None or backward is None or not (roots.items or any(t.requires_grad for _, t in outputs)):
            return
        self.roots = self.pipeline.roots = None
        with guarded("hooking the backward"):
            backward.watch(recording, roots, outputs, self.tensor_names(), self.session.root,
                                self._parameters() if world_size() > 1 else (), self.pipeline.forward_values)

    def fail(self, exc: BaseException) -> Optional[PartialTrace]:
        """The partial trace of a forward that raised `exc`, attached to it. Never raises: a problem
        here is a warning, and the user's exception goes on."""
        session = self.session
        with self.own_work():
            try:
                # (before `settle`, which forgets the collectives still in flight: their memory is not read)
                attempt = None if isinstance(exc, NonFiniteError) else session.attempt_for(exc, self.pipeline.unread)
                return session.fail(exc, attempt, self.pipeline.settle())
            except Exception as inner:
                internal_error("building the partial trace", inner)
                return None

    def close(self) -> None:
        """Close the sink this pass opened (not a shared one). Safe to call twice."""
        narrator, self._owned_narrator = self._owned_narrator, None
        if narrator is not None:
            narrator.close()
