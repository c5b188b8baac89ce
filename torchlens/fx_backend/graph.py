"""What the backend returns to dynamo for each graph: the compiled graph, narrated around its calls.

- fused (default): the graph is compiled by the inner compiler untouched; after each call the plan's
  ops are recorded and narrated in one go. Outputs are exactly the inner compiler's.
- live: the graph runs op by op (eagerly) with a narration node after each op, so every line is in
  the sink as soon as its op completes — what survives a hard crash inside compiled code.

Nothing here may break the user's model: if planning or instrumenting a graph fails, the graph is
compiled as dynamo captured it and runs without narration (with one warning); if narrating a call
fails, the call's result is returned all the same.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional

from torch import fx

from ..core.guard import contain, guarded, internal_error
from ..measure.stats import measures
from ..torch_internals.mode_stack import own_work
from .active import active_pass
from .compiled_pass import CompiledPass
from .config import inner_compile
from .failures import graph_failed
from .plan import GraphPlan, build_plan
from .replay import untouched_copy
from .runtime import CompiledRuntime
from .stats_pass import StatsLayout, add_stats_output, module_outputs
from .values_pass import add_value_outputs, split_values

__all__ = ["compile_graph"]


class CompiledGraph:
    """Callable dynamo runs in place of one captured graph."""

    def __init__(self, runtime: CompiledRuntime, plan: GraphPlan, live: bool, replay_copy: fx.GraphModule):
        self.runtime = runtime
        self.plan = plan
        self.fn: Callable = None  # type: ignore[assignment]  # set once the graph is compiled
        self.live = live
        self.replay_copy = replay_copy  # the graph as dynamo captured it, to locate a failure
        # live mode: the instrumented graph, whose frame locates a failure
        self.live_module: Optional[fx.GraphModule] = None
        self.stats: Optional[StatsLayout] = None  # with statistics: what the graph's extra outputs hold
        self.kept_counts: Optional[List[int]] = None  # when keeping values: how many extra outputs each plan op has

    def __call__(self, *args):
        if self.runtime.stop_pending is not None:
            stop = self.runtime.pending_stop()
            if stop is not None:
                raise stop
        run = active_pass()
        if run is None:
            return self._call_alone(args)
        return self._call(run, args, sys._getframe(1))

    def _call(self, run: CompiledPass, args, caller):
        recount = self.stats.recount if self.stats is not None else None
        if recount is not None and recount.fn is not None:  # a screened call was counted again:
            self.fn, self.stats = recount.fn, recount.layout  # measured after the call from now on
        prepared = self._prepare(run, args, caller)
        # Inside an eager capture's forward, a graph computing statistics or kept copies runs
        # unseen by that capture: those are not the model's ops (with inductor none are seen).
        hidden = run.nested and (self.stats is not None or self.kept_counts is not None)
        with run.graph_running():  # the capture of code between graphs steps aside for all of this
            try:
                with own_work(hidden):
                    out = self.fn(*args)
            except Exception as exc:
                if prepared is not None:
                    graph_failed(run, self, args, prepared, exc)
                raise
            out, vector, kept = self._split_outputs(out)
            run.pipeline.returned(out)  # (code after the graph may view what it returned)
            if prepared is not None and self.live:
                with run.own_work():
                    run.end_live(self, out)
            if prepared is not None and not self.live:
                # (a stop: on_nonfinite="raise" found the first non-finite op of this graph)
                with guarded("narrating a compiled graph", run.session.mark_incomplete), run.own_work():
                    first = len(run.session.events)
                    run.add_plan(self.plan, args, prepared, vector, self.stats, kept, out)
                    run.graph_fed_autograd(first, out)
        return out

    def _prepare(self, run: CompiledPass, args, caller):
        """The module this call runs in (None if it cannot be told: the call is then not narrated)."""
        try:
            run.graph_calls += 1
            scope = run.scope_of_call(self.plan, caller)
            if self.live:
                run.start_live(self, args, scope)
            return scope
        except Exception as exc:
            contain(exc, "preparing to narrate a compiled graph", run.session.mark_incomplete,
                    "an internal error narrating a compiled graph")
            return None

    def _split_outputs(self, out):
        """The graph's own outputs, what its statistics outputs hold, and its kept values (per plan op)."""
        vector = kept = None
        if self.stats is not None:
            out, vector = self.stats.split(out)
        if self.kept_counts is not None:
            count = sum(self.kept_counts)
            flat, out = (out[len(out) - count:], out[:len(out) - count])
            kept = split_values(flat, self.kept_counts)
        return out, vector, kept

    def _call_alone(self, args):
        """A graph called outside any narrated forward (no wrapper hook): a run of its own."""
        run = self.runtime.start(None, push_mode=False)
        if run is None:
            return self.fn(*args)
        try:
            out = self._call(run, args, sys._getframe(2))
        except BaseException as exc:
            run.end(False, exc=exc)
            raise
        run.end(True)
        return out

    def emit(self, index: int, value) -> None:
        """Called by the graph right after its `index`-th op completed, with its output (live mode)."""
        run = active_pass()
        if run is None:
            return
        try:  # (once per op: inline, not a `guarded` block)
            with run.own_work():
                run.emit_live(self, index, value)
        except Exception as exc:
            contain(exc, "narrating a compiled op", run.session.mark_incomplete)


def instrument_live(gm: fx.GraphModule, plan: GraphPlan, emit: Callable[[int, object], None]) -> fx.GraphModule:
    """Insert `emit(i, output)` after the node of each plan op."""
    by_name = {node.name: node for node in gm.graph.nodes}
    for op in plan.ops:
        node = by_name[op.node]
        with gm.graph.inserting_after(node):
            gm.graph.call_function(emit, (op.index, by_name[op.value]))  # `y` after `y[i] = v`
    gm.recompile()
    return gm


def compile_graph(runtime: CompiledRuntime, gm: fx.GraphModule, example_inputs, mode: Optional[str] = None):
    """The backend's work for one graph: plan it, instrument it, compile it, wrap it.

    Errors of the compiler underneath are the user's and propagate; errors of torchlens's own
    planning fall back to compiling the untouched graph without narration.
    """
    pristine = untouched_copy(gm)
    try:
        # The frame being compiled is called by frames still on the stack: their modules are its scope.
        plan = build_plan(gm, runtime.scopes, runtime.scopes.scope_of_stack(sys._getframe(1)))
        graph = CompiledGraph(runtime, plan, runtime.config.live, replay_copy=pristine)
        target = _instrument(runtime, graph, gm, mode)
    except Exception as exc:
        internal_error("planning a compiled graph (it runs without narration)", exc)
        return _unnarrated(inner_compile(runtime.config.compiler, untouched_copy(pristine), example_inputs, mode))
    if graph.live:
        graph.fn = target
    else:
        graph.fn = inner_compile(runtime.config.compiler, target, example_inputs, mode)
    return graph


def _unnarrated(fn):
    """A graph torchlens could not plan: it runs as compiled, and the run it is part of knows that
    its ops are missing, so no verdict claims them."""
    def call(*args):
        run = active_pass()
        if run is not None:
            run.session.mark_incomplete("a compiled graph that ran without narration")
        return fn(*args)

    return call


def _instrument(runtime: CompiledRuntime, graph: CompiledGraph, gm: fx.GraphModule, mode: Optional[str]):
    """Add what the options ask for to `gm`: narration calls (live), kept values, statistics
    (tracking alone may screen the graph, counting a call again with the same compiler: `recount`)."""
    config, plan = runtime.config, graph.plan
    settings = config.settings
    if graph.live:
        graph.live_module = instrument_live(gm, plan, graph.emit)
        return graph.live_module.forward
    if settings.keep_values:
        graph.kept_counts = add_value_outputs(gm, plan)
    tracking = settings.on_nonfinite is not None
    if measures(settings.value_stats, tracking):
        only = module_outputs(plan) if config.stats_on == "module_outputs" else None
        screens = tracking and settings.value_stats in ("off", "reuse") and not settings.keep_values

        def recompile(variant: fx.GraphModule, example_inputs):
            return inner_compile(config.compiler, variant, example_inputs, mode)

        graph.stats = add_stats_output(gm, plan, settings.value_stats, only, recompile if screens else None)
    return gm
