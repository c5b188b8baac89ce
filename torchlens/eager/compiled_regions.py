"""What a capture makes of compiled code that runs inside it.

**Dynamo traces user code as if no capture were running.** A capture's `TorchFunctionMode` sits on
the torch function mode stack for the whole narrated forward, because code that runs eagerly inside
a compiled region (between graphs, in frames dynamo skips) must be captured. But dynamo starts every
trace from that stack: left alone, it would trace the mode's `__torch_function__` around every op,
and the graph would record what the mode called (`torch.floor_divide` for `x // 2`, `torch.rsub`
for `1 - x`) instead of what the user wrote (`operator.floordiv`, `operator.sub`); dynamo's errors
and graph-break messages would point into torchlens. So the capture modes are taken out of the
stack dynamo traces with (its symbolic stack) and kept in the stack its guards expect (the mode is
there at run time, so the compiled frame is reused). If the traced code changes the stack itself
(enters or leaves a mode), dynamo writes back the stack it traced; the capture modes are put back
at their places in it. Graphs are then the ones plain `torch.compile` makes.

**An eager capture shows each compiled graph call as one op, `compiled`,** with the graph's outputs
(and their statistics when asked), in the module that made the call. What runs inside a graph is
whatever the compiler made of it (inductor's kernels, `addmm` for a `linear` and its `relu`), not
the user's ops, so none of it is narrated as such; code dynamo runs eagerly between graphs is
narrated as usual. A graph traced while an eager capture was active is wrapped to report its calls
(dynamo's guards on the mode stack mean such a graph only ever runs under a capture). To see the
ops inside, compile with `backend="torchlens"` or `tl.compile`, whose own narration shows them.

Installed once, the first time a capture starts after dynamo was imported (a compiled region cannot
run before that); it does nothing to traces without capture modes. If torch's internals moved, it
installs nothing: dynamo then traces the modes as before (correct graphs, torch-level op names) and
an eager capture sees the graphs' kernels.
"""

from __future__ import annotations

import sys
import threading

from ..mode_stack import capture_modes, is_capture, with_captures_kept

_lock = threading.Lock()
_installed = False


def _reports_graph_calls(mode) -> bool:
    return is_capture(mode) and getattr(getattr(mode, "capture", None), "reports_graph_calls", False)


def install_for_dynamo() -> None:
    """Install both rules if dynamo is loaded and they are not installed yet (cheap after the first)."""
    global _installed
    if _installed or "torch._dynamo.output_graph" not in sys.modules:
        return
    with _lock:
        if _installed:
            return
        _installed = True
        modules = sys.modules
        for install in (_install_filter, _install_graph_reports):
            try:
                install(modules["torch._dynamo.variables.torch_function"], modules["torch._dynamo.utils"],
                        modules["torch._dynamo.output_graph"])
            except Exception:  # another torch's internals: this rule is not applied
                pass


def _install_filter(torch_function, utils, _output_graph) -> None:
    state = torch_function.SymbolicTorchFunctionState
    original_init = state.__init__
    original_set = utils.set_torch_function_mode_stack

    def init_without_captures(self, py_stack, *args, **kwargs):
        original_init(self, py_stack, *args, **kwargs)
        modes = list(py_stack)
        if any(is_capture(mode) for mode in modes) and len(modes) == len(self.mode_stack):
            kept = [var for var, mode in zip(list(self.mode_stack), modes) if not is_capture(mode)]
            self.mode_stack.clear()
            self.mode_stack.extend(kept)

    def set_keeping_captures(stack):
        original_set(with_captures_kept(stack))

    state.__init__ = init_without_captures
    utils.set_torch_function_mode_stack = set_keeping_captures


def _install_graph_reports(_torch_function, _utils, output_graph) -> None:
    graph_class = output_graph.OutputGraph
    original = graph_class.call_user_compiler

    def call_user_compiler(self, gm, example_inputs):
        compiled = original(self, gm, example_inputs)
        stack = getattr(self, "torch_function_mode_stack", None) or ()
        if any(_reports_graph_calls(mode) for mode in stack):
            return reporting_graph_calls(compiled)
        return compiled

    graph_class.call_user_compiler = call_user_compiler


def reporting_graph_calls(compiled):
    """`compiled` (a graph's compiled callable), reporting each of its calls to the eager captures
    active on the calling thread as one op."""

    def graph_call(*args, **kwargs):
        captures = [mode.capture for mode in capture_modes()
                    if _reports_graph_calls(mode) and not mode.capture.paused]
        if not captures:
            return compiled(*args, **kwargs)
        caller = sys._getframe(1)
        for capture in captures:
            capture.paused = True  # the graph's own torch calls are the compiler's, not the user's ops
        try:
            out = compiled(*args, **kwargs)
        except BaseException as exc:
            for capture in captures:
                capture.paused = False
                capture.graph_failed(args, exc, caller)
            raise
        for capture in captures:
            capture.paused = False
            capture.graph_called(args, out, caller)
        return out

    return graph_call
