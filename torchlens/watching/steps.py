"""What a healthy step keeps so that a faulty one can be replayed exactly: references, not copies.

For each forward of the step (each micro-batch, under gradient accumulation): its arguments (held,
with their version counters, to tell later whether the caller changed them in place), the random
generators' states when it began (the CPU generator's and every initialised CUDA device's: small
host tensors), the autocast and training modes it ran under, the screen of its outputs, and the
gradient its backward sent into its outputs. That gradient is how the replay runs the backward
without knowing the loss: a loss the model returns (a 0-dim output, transformers' `.loss`) gets
a scalar, kept always; the gradient into the other outputs (a loss computed outside the model) is
kept within the watch's byte bound, and not kept at all when a loss output received one (it then
flows from that loss, and the replay recomputes it).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_leaves

from ..core.generators import RandomState
from ..measure.memory import version
from .checks import floating_leaves, sample, screen_squares

__all__ = ["GradsSeen", "StepRecord", "WatchedForward", "autocast_as", "autocast_state", "tensor_versions"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> Tuple[Tuple[str, bool, torch.dtype], ...]:
    """(device type, enabled, dtype) of autocast for the CPU and CUDA, as the forward saw it."""
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in _AUTOCAST_DEVICES)


@contextlib.contextmanager
def autocast_as(state):
    """Run under the autocast `state` recorded (enabled or not, per device type)."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if device == "cuda" and not torch.cuda.is_available():
                if enabled:
                    raise RuntimeError("the step ran under CUDA autocast, and CUDA is not available")
                continue
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


def tensor_versions(value) -> Tuple[Tuple[torch.Tensor, Optional[int]], ...]:
    """(tensor, version counter) of each tensor in `value` (a forward's arguments)."""
    return tuple((leaf, version(leaf)) for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


class WatchedForward:
    """One forward of a step, as the replay needs it (see the module's docstring)."""

    __slots__ = ("number", "args", "kwargs", "versions", "rng", "autocast", "modes", "squares", "sizes", "samples",
                 "received", "received_bytes", "dropped", "loss_fed", "nodes", "output_nodes", "_first", "__weakref__")

    def __init__(self, number: int, args, kwargs, modes: Tuple[bool, ...], first_node: Optional[int]):
        self.number = number  # 1-based, within the step
        # the sequence numbers of the autograd nodes it made, [first, last), once it has returned,
        # and those of its screened outputs' nodes (what a loss computed from them reads)
        self.nodes: Optional[Tuple[int, int]] = None
        self.output_nodes: frozenset = frozenset()
        self._first = first_node
        self.args = args
        self.kwargs = kwargs
        self.versions = tensor_versions((args, kwargs))
        self.rng = RandomState()
        self.autocast = autocast_state()
        self.modes = modes
        self.squares: Optional[torch.Tensor] = None  # the outputs' screen (their sums of squares)
        # judging spikes: the outputs' element counts (with `squares`, their RMS) and a few of
        # their values (`checks.sample`)
        self.sizes: Tuple[int, ...] = ()
        self.samples: Optional[List[torch.Tensor]] = None
        # graph task id -> {output position: the gradient it received} (a dict: insertion is run order)
        self.received: Dict[int, Dict[int, torch.Tensor]] = {}
        self.received_bytes = 0
        self.dropped: Optional[str] = None  # why an output's gradient was not kept
        self.loss_fed: set = set()  # graph tasks in which a loss output received its gradient

    def changed_inputs(self) -> int:
        """How many of its argument tensors were modified in place after it ran."""
        return sum(1 for tensor, seen in self.versions if version(tensor) != seen)

    def screen(self, output, next_node: Optional[int], samples: bool = False) -> List[torch.Tensor]:
        """Screen its outputs, now it has returned (`next_node`: autograd's next sequence number);
        with `samples`, keep a few of their values (what a spike's replay compares)."""
        leaves = floating_leaves(output)
        if self._first is not None and next_node is not None:
            try:
                self.output_nodes = frozenset(leaf.grad_fn._sequence_nr() for leaf in leaves
                                              if leaf.grad_fn is not None)
                self.nodes = (self._first, next_node)
            except Exception:  # (torch no longer numbers its nodes so: the loss's ops go unnamed)
                self.nodes = None
        self.squares = screen_squares(leaves)
        if samples:
            self.sizes = tuple(leaf.numel() for leaf in leaves)
            self.samples = [sample(leaf) for leaf in leaves]
        return leaves


class GradsSeen(NamedTuple):
    """How a step's gradients looked after its last backward: the first parameter with a gradient,
    a weak reference to that gradient, and the gradient's version counter."""

    param: int
    grad: weakref.ref
    version: Optional[int]


class StepRecord:
    """The forwards since the step began, and how the step's gradients looked after its last
    backward (to tell, at the next forward, that they were reset without an optimizer step: a step
    a GradScaler skipped, or a `zero_grad` before a step was taken)."""

    __slots__ = ("forwards", "after_backward", "backwards", "roots", "number", "grad_norm")

    def __init__(self):
        self.number: Optional[int] = None  # the training step it was, once judged
        self.grad_norm: Optional[float] = None  # its gradients' norm, as its read said
        self.forwards: List[WatchedForward] = []
        self.roots: list = []  # `roots.Root`: what each backward into the model started from
        self.after_backward: Optional[GradsSeen] = None
        self.backwards = 0

    def backward_finished(self, params: Sequence[torch.Tensor]) -> None:
        """A backward into the model finished: note how the gradients of `params` look now."""
        self.backwards += 1
        for index, grad in enumerate(p.grad for p in params):
            if grad is not None:
                self.after_backward = GradsSeen(index, weakref.ref(grad), version(grad))
                return

    def grads_reset(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether the gradients were reset without an optimizer step since the step's last backward
        (False before any backward, and while they still accumulate: the next micro-batch)."""
        seen = self.after_backward
        if seen is None:
            return False
        grad = params[seen.param].grad
        return not (grad is not None and version(grad) == seen.version and seen.grad() is grad)

    @property
    def received_bytes(self) -> int:
        """The bytes of the gradients into the outputs the step keeps, all its forwards together
        (what the watch's `max_bytes` bounds)."""
        return sum(f.received_bytes for f in self.forwards)

    @property
    def batch_bytes(self) -> int:
        """The bytes of the tensors among its forwards' arguments (its batch)."""
        return sum(t.numel() * t.element_size() for f in self.forwards for t, _ in f.versions)

    @property
    def held_bytes(self) -> int:
        """The bytes this step keeps alive that plain training would have freed: the gradients
        into the outputs, and the generators' states (kept whatever the bound: a replay needs them)."""
        return sum(f.received_bytes + f.rng.nbytes for f in self.forwards)
