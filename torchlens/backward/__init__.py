"""Backward narration: the gradient half of a training step, each node tied to its forward op.

A forward narrated with `backward=True` notes the autograd node each op's output got
(`GradientRoots`). When the forward ends, `BackwardWatch` walks the graph from those nodes: each
node made while the forward ran is tied to the op that made it — autograd numbers nodes as it makes
them (`_sequence_nr`), so the nodes an op made are the new ones its output's node reaches — and
each leaf's `AccumulateGrad` to the leaf's name (`blocks.0.fc.weight`). A pre-hook and a hook go on
each node, and a hook on each output tensor for the gradient that reaches it from outside (the
loss). Nothing is hooked for a forward that built no graph (`no_grad`, `inference_mode`).

The hooks report to the entry point's `BackwardNarration` (one per `Recorder` or compiled model).
One *run* is one execution of autograd's engine (`loss.backward()`, `torch.autograd.grad`): its
nodes are numbered `~1, ~2, ...` in the order they ran, narrated under `-- backward of pass N`,
measured, judged and logged as forward ops are (`Meter.observe`, `tracking.Verdicts`,
`EventLog.append`), and closed by the engine's final callback with a footer.
Runs are kept by autograd's graph task (a backward may run inside another, or on another thread).
A run whose final callback never comes failed: the next pass this thread begins outside a
backward, or the end of the `Recorder` block, ends it with the partial trace, the attempted node
being the one whose pre-hook ran without its hook.

Nothing changes a gradient: the hooks return None, read metadata, and measure with the meter
(detached reductions) exactly as forward ops are measured.

Modules: `graph` (what a forward fed autograd, and the hooks on its nodes), `verdicts` (where the
first non-finite gradient was born), `runs` (each backward run: its lines, statistics, ending).
"""

from .graph import GradientRoots, running_backward
from .narration import BackwardNarration, BackwardStopped, end_unseen_runs_everywhere

__all__ = ["BackwardNarration", "BackwardStopped", "GradientRoots", "running_backward", "end_unseen_runs_everywhere"]
