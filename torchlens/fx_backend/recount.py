"""Counting a screened graph call again, when its screen was not all finite.

A graph screened for tracking (`stats_pass`) returns, per measured output, a value that is finite
only if all its elements are: that tells a finite call, not how many NaN or infinities an op held,
nor which kinds. A call it does not show finite is run again
on the same inputs by the graph that returns its outputs to measure (the after-call way), compiled
by the same compiler when it is first needed, and measured as that way measures. Only graphs that
neither write into their inputs nor draw random numbers are screened, so the second run computes
what the first did. From then on that graph runs in the screened one's place (`CompiledGraph`): a
graph that held a non-finite value once is likely to again, and each such call would run twice.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx

from ..torch_internals.node_meta import example_value, fake_twins, plain_fake
from .replay import DrawWatch, untouched_copy

__all__ = ["Recount", "draws_random_numbers"]


class Recount:
    """The after-call variant of one screened graph (`gm`, with its `layout`), compiled by
    `compile(gm, example_inputs)` (on a copy: a compiler may rewrite the graph it is given) on its
    first run, under the grad mode of the call that needed it: the mode the graph was compiled for,
    which dynamo guards. `fn` is set once a run succeeded: it may then take the screened graph's
    place. `failure` says why it could not be compiled or run (it is not tried again)."""

    def __init__(self, gm: fx.GraphModule, layout, compile: Callable):
        self.gm = gm
        self.layout = layout  # a `stats_pass.StatsLayout` measured after the call
        self._compile = compile
        self._compiled: Optional[Callable] = None
        self.fn: Optional[Callable] = None
        self.failure: Optional[str] = None

    def outputs(self, args) -> Optional[tuple]:
        """The outputs to measure of a run of the variant on `args` (the screened call's inputs,
        which it did not write into; the model's own outputs of that run are dropped), or None
        when it cannot be compiled or run (`failure`)."""
        if self.failure is not None:
            return None
        try:
            if self._compiled is None:
                self._compiled = self._compile(untouched_copy(self.gm), list(args))
            with torch.no_grad():
                out = self._compiled(*args)
        except Exception as exc:
            self.failure = f"{type(exc).__name__} counting again"
            return None
        self.fn = self._compiled
        return self.layout.split(out)[1]


def draws_random_numbers(gm: fx.GraphModule) -> bool:
    """Whether a run of the graph draws random numbers (torch's rule: `replay.draws_random`), told by
    running it on fake tensors shaped as dynamo recorded its inputs, in a fake mode of its own (so
    nothing of dynamo's shape environment changes); True when that cannot be told (a size only known
    symbolically, a tensor subclass, an op whose output size depends on values)."""
    recorded = [example_value(node) for node in gm.graph.nodes if node.op == "placeholder"]
    if not all(map(plain_fake, recorded)):
        return True
    watch = DrawWatch()
    try:
        fake_mode, args = fake_twins(recorded)
        with fake_mode, torch.no_grad(), watch:
            fx.Interpreter(gm).run(*args)
    except Exception:
        return True
    return watch.drew
