"""What the backend returns to dynamo for each graph: the compiled graph, narrated around its calls.

- fused (default): the graph is compiled by the inner compiler untouched; after each call the plan's
  ops are recorded and narrated in one go. Outputs are exactly the inner compiler's.
- live: the graph runs op by op (eagerly) with a narration node after each op, so every line is in
  the sink as soon as its op completes — what survives a hard crash inside compiled code.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from torch import fx

from ..session import internal_error
from .config import inner_compile
from .plan import GraphPlan, build_plan
from .replay import untouched_copy
from .stats_pass import add_stats_output, module_outputs, wants_stats
from .values_pass import add_value_outputs, split_values
from .runtime import CompiledRun, CompiledRuntime, active_run


class CompiledGraph:
    """Callable dynamo runs in place of one captured graph."""

    def __init__(self, runtime: CompiledRuntime, plan: GraphPlan, fn: Callable, live: bool,
                 replay_copy: fx.GraphModule):
        self.runtime = runtime
        self.plan = plan
        self.fn = fn
        self.live = live
        self.replay_copy = replay_copy  # the graph as dynamo captured it, to locate a failure
        self.slots = None  # with statistics: what the graph's extra output holds, per plan op
        self.kept_counts = None  # when keeping values: how many extra outputs each plan op has
        self._live_run: Optional[CompiledRun] = None
        self._live_shapes = None
        self._live_frame = None

    def __call__(self, *args):
        run = active_run()
        if run is None:
            return self._call_alone(args)
        return self._call(run, args, sys._getframe(1))

    def _call(self, run: CompiledRun, args, caller):
        run.graph_calls += 1
        frame_scope = run.frame_scope(self.plan, caller)
        if self.live:
            self._start_live(run, args, frame_scope)
        with run.graph_running():  # the capture of code between graphs steps aside for all of this
            try:
                out = self.fn(*args)
            except Exception as exc:
                run.graph_failed(self, args, frame_scope, exc)
                raise
            out, vector, kept = self._split_outputs(out)
            if not self.live:
                try:
                    run.add_plan(self.plan, args, frame_scope, vector, self.slots, kept)
                except Exception as exc:
                    if getattr(exc, "torchlens_stop", False):
                        raise  # on_nonfinite="raise" found the first non-finite op of this graph
                    internal_error("narrating a compiled graph", exc)
        return out

    def _split_outputs(self, out):
        """The graph's own outputs, its statistics vector and its kept values (per plan op)."""
        vector = kept = None
        if self.slots is not None:
            vector, out = out[-1], out[:-1]
        if self.kept_counts is not None:
            count = sum(self.kept_counts)
            flat, out = (out[len(out) - count:], out[:len(out) - count])
            kept = split_values(flat, self.kept_counts)
        return out, vector, kept

    def _call_alone(self, args):
        """A graph called outside any narrated forward (no wrapper hook): a run of its own."""
        run = self.runtime.begin(None, (), {}, push_mode=False)
        if run is None:
            return self.fn(*args)
        try:
            out = self._call(run, args, sys._getframe(2))
        except BaseException as exc:
            run.fail(exc)
            run.close()
            raise
        run.finish(None)
        run.close()
        return out

    # -- live mode ------------------------------------------------------------------------------

    def _start_live(self, run: CompiledRun, args, frame_scope) -> None:
        self._live_run = run
        plan = self.plan
        self._live_shapes = plan.resolver.resolve(args) if plan.resolver is not None else None
        self._live_frame = frame_scope

    def emit(self, index: int, value) -> None:
        """Called by the graph right after its `index`-th op completed, with its output (live mode)."""
        run = self._live_run
        if run is None:
            return
        try:
            run.add_plan_ops(self.plan, self._live_frame, self._live_shapes, index, index + 1, values=[value])
        except Exception as exc:
            if getattr(exc, "torchlens_stop", False):
                raise
            internal_error("narrating a compiled op", exc)


def instrument_live(gm: fx.GraphModule, plan: GraphPlan, emit: Callable[[int, object], None]) -> fx.GraphModule:
    """Insert `emit(i, output)` after the node of each plan op."""
    by_name = {node.name: node for node in gm.graph.nodes}
    for op in plan.ops:
        node = by_name[op.node]
        with gm.graph.inserting_after(node):
            gm.graph.call_function(emit, (op.index, node))
    gm.recompile()
    return gm


def compile_graph(runtime: CompiledRuntime, gm: fx.GraphModule, example_inputs, mode: Optional[str] = None) -> CompiledGraph:
    """The backend's work for one graph: plan it, compile it, wrap it."""
    # The frame being compiled is called by frames still on the stack: their modules are its scope.
    plan = build_plan(gm, runtime.scopes, runtime.scopes.scope_of_stack(sys._getframe(1)))
    config = runtime.config
    settings = config.settings
    graph = CompiledGraph(runtime, plan, fn=None, live=config.live, replay_copy=untouched_copy(gm))  # type: ignore[arg-type]
    if config.live:
        graph.fn = instrument_live(gm, plan, graph.emit).forward
        return graph
    if settings.keep_values:
        graph.kept_counts = add_value_outputs(gm, plan)
    tracking = settings.on_nonfinite is not None
    if wants_stats(settings.value_stats, tracking):
        only = module_outputs(plan) if config.stats_on == "module_outputs" else None
        graph.slots = add_stats_output(gm, plan, settings.value_stats, tracking, only)
    graph.fn = inner_compile(config.compiler, gm, example_inputs, mode)
    return graph
