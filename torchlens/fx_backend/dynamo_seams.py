"""Where the compiled path relies on dynamo's runtime structures (its wrapper, its mode stack).

The backend contract (`backend(gm, example_inputs)`) tells a backend nothing about forward passes,
the module being compiled, or the code dynamo runs eagerly between graphs. Narrating a whole forward
needs all three, and torch offers no public hook for them, so this module reads them from dynamo's
own structures. Each function degrades gracefully — returning None or False — when torch changes,
and its docstring says what is lost then.

- A compiled callable (an `OptimizedModule` or a function returned by `torch.compile`) runs through
  the `compile_wrapper` closure of a `_TorchDynamoContext`, which calls each of the context's
  `enter_exit_hooks` before the call and each returned cleanup after it (also when the call raises).
  That is the forward boundary: a hook appended there begins and ends a narrated forward.
- The torch function mode stack is cleared while dynamo traces a frame and restored afterwards; the
  restored stack, and the stack the frame's guards expect, are two lists dynamo keeps.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..core.naming import USER_SPELLING, node_name
from ..core.sites import still_running
from ..torch_internals.seams import degraded

__all__ = ["CompiledCall", "adopt_mode_for_this_compile", "call_outcome", "context_of_compiled", "current_call",
           "hook_calls", "raised_while_tracing", "record_user_spellings", "traced_frame_resumed", "traced_node",
           "when_call_ends"]

_WRAPPER_NAME = "compile_wrapper"


class CompiledCall(NamedTuple):
    """A call of a `torch.compile` wrapper in progress: the forward boundary of a compiled model.

    Read from the wrapper's frame (`compile_wrapper`'s locals): the callable it runs and this
    call's arguments. A compiled forward begins when the wrapper calls its context's enter hooks
    (`hook_calls`) and ends when it runs the cleanups they returned — or, for the call during
    which the backend first saw the model, the cleanup added by `when_call_ends`.
    """

    frame: Any
    fn: Optional[Callable]
    args: tuple
    kwargs: dict

    @property
    def context(self):
        """The dynamo context whose wrapper runs this call (it holds the enter hooks)."""
        return self.frame.f_locals.get("self")

    def running(self) -> bool:
        """Whether this call is still on the stack (false once the wrapper returned or raised)."""
        return still_running(self.frame)


def current_call() -> Optional[CompiledCall]:
    """The innermost `torch.compile` wrapper call on this thread's stack, or None."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == _WRAPPER_NAME and "cleanups" in frame.f_code.co_varnames:
            local = frame.f_locals
            return CompiledCall(frame, local.get("fn"), tuple(local.get("args", ())), dict(local.get("kwargs", {})))
        frame = frame.f_back
    return None


def hook_calls(ctx, hook: Callable[[], Callable[[], None]]) -> bool:
    """Have `hook()` called before every call of the compiled callable `ctx` wraps; the cleanup it
    returns is called after the call, also when it raises. False if `ctx` has no such hooks."""
    hooks = getattr(ctx, "enter_exit_hooks", None)
    if not isinstance(hooks, list):
        return False
    if hook not in hooks:
        hooks.append(hook)
    return True


def when_call_ends(call: CompiledCall, cleanup: Callable[[], object]) -> bool:
    """Run `cleanup` when `call` returns or raises.

    Used once, for the call during which the backend first sees a model compiled with the string
    backend: its own enter hooks were evaluated before the backend existed. Without it that first
    forward is closed when the next one begins.
    """
    cleanups = call.frame.f_locals.get("cleanups")
    if not isinstance(cleanups, list):
        return False
    cleanups.append(cleanup)
    return True


def call_outcome():
    """Called from a cleanup: (whether the wrapper call succeeded, the value it returns, the
    exception it raised).

    Read from the wrapper's own locals, not from `sys.exc_info()`: a cleanup runs in a `finally`,
    where `exc_info` also reports an exception the *caller* is handling (a compiled model called
    inside an `except` block). Without the frame: judged by `exc_info` after all.
    """
    call = current_call()
    raised = sys.exc_info()[1]
    if call is None:
        return raised is None, None, raised
    succeeded = bool(call.frame.f_locals.get("call_succeeded", False))
    if succeeded:
        return True, call.frame.f_locals.get("result"), None
    return False, None, raised or RuntimeError("the compiled call failed")


def raised_while_tracing(exc: BaseException) -> bool:
    """Whether an op failed while dynamo traced the forward: a `TorchRuntimeError` (an op failed
    on fake tensors), or an error of the op's own type that dynamo passed on (an `IndexError` for
    an int index past a dimension). Dynamo marks every exception that leaves its trace or its
    compile with the user's frame; its own kinds (a graph break under `fullgraph=True`, a backend
    that failed, an assertion of its own) are no op's failure, and an eager re-run would not find one."""
    if isinstance(exc, torch._dynamo.exc.TorchRuntimeError):
        return True
    own = (torch._dynamo.exc.TorchDynamoException, AssertionError)
    return hasattr(exc, "innermost_user_frame_summary") and not isinstance(exc, own)


def traced_frame_resumed(exc: BaseException) -> bool:
    """Whether dynamo raised `exc` while tracing a *resume function*: the rest of a frame after a
    graph break, whose code before the break has already run. Read from the user frames dynamo
    attaches (`real_stack`), else from the code object its compile was given. False when neither
    can be read: the caller then assumes nothing ran before."""
    try:
        from torch._dynamo.resume_execution import TORCH_DYNAMO_RESUME_IN_PREFIX as prefix
    except ImportError as missing:
        degraded("traced node", missing)
        return False
    stack = getattr(exc, "real_stack", None) or ()
    if any(getattr(frame, "name", "").startswith(prefix) for frame in stack):
        return True
    code = _traceback_local(exc, "_compile", "code")
    return getattr(code, "co_name", "").startswith(prefix)


def traced_node(exc: BaseException) -> Optional[torch.fx.Node]:
    """The FX node dynamo was running on fake tensors when it raised `exc` while tracing (its
    target, its inputs' fake values, its `nn_module_stack` and `stack_trace`), read from the frame
    of dynamo's `get_fake_value` in the traceback; None if there is none (torch changed, or the
    error came from elsewhere in the trace)."""
    node = _traceback_local(exc, "get_fake_value", "node")
    return node if isinstance(node, torch.fx.Node) else None


def _traceback_local(exc: BaseException, function: str, name: str):
    """Local `name` of the innermost frame of `function` in `exc`'s traceback (or its cause's)."""
    found = None
    for error in (exc, exc.__cause__, exc.__context__):
        tb = getattr(error, "__traceback__", None)
        while tb is not None:
            if tb.tb_frame.f_code.co_name == function:
                found = tb.tb_frame.f_locals.get(name, found)
            tb = tb.tb_next
        if found is not None:
            return found
    return None


def context_of_compiled(compiled) -> Optional[Any]:
    """The dynamo context behind what `torch.compile` returned (module or function)."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is not None:
        return ctx
    code = getattr(compiled, "__code__", None)
    if code is None or code.co_name != _WRAPPER_NAME or "self" not in code.co_freevars:
        return None
    return compiled.__closure__[code.co_freevars.index("self")].cell_contents


def adopt_mode_for_this_compile(mode) -> bool:
    """Make `mode` part of the frame being compiled, as if it had been active when tracing began.

    Dynamo restores the mode stack it saved when it started tracing, and guards the compiled frame
    on that stack. Adding `mode` to both means the rest of the current call runs with `mode` active
    (so code between graphs is captured from the very first call) and later calls, which enter
    with `mode` already pushed, reuse this compilation instead of recompiling. If this fails, the
    first call's graph-break gaps go unnarrated and the next call recompiles once.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.torch_function import torch_function_mode_stack_state_mgr

        tx = InstructionTranslator.current_tx()
        expected = tx.output.torch_function_mode_stack
        restored = torch_function_mode_stack_state_mgr.stack
        if not isinstance(expected, list) or not isinstance(restored, list):
            degraded("adopt mode", "dynamo's saved mode stacks are not lists")
            return False
        expected.append(mode)
        restored.append(mode)
        return True
    except Exception as exc:
        degraded("adopt mode", exc)
        return False


_spellings_recorded = False


def record_user_spellings() -> None:
    """Mark the nodes dynamo writes for a tensor method or attribute as another call with what the
    user wrote: `x.new_tensor(d)` is traced as `torch.tensor(d, dtype=..., device=...)`, `x.data`
    as `torch._C._autograd._get_data_attr(x)`. The plan then names the op as eager narration
    does (`new_tensor`, `data`). Installed once, when the backend is first looked up or used;
    where torch's tracer is shaped otherwise, each hook that does not fit is left out and such ops
    keep the name of the call dynamo wrote.
    """
    global _spellings_recorded
    if _spellings_recorded:
        return
    _spellings_recorded = True
    try:
        from torch._dynamo.variables.tensor import TensorVariable
    except Exception as exc:
        degraded("user spellings", exc)
        return
    wrapped = _wrap(TensorVariable, "call_method", lambda name: node_name(name, (), "call_method"))
    # the attribute hook's name differs between torch versions
    hooks = [_wrap(TensorVariable, hook, lambda name: name) for hook in ("var_getattr", "tp_getattro_impl")]
    if not (wrapped and any(hooks)):
        degraded("user spellings", "TensorVariable has no call_method or no attribute hook")


def _wrap(owner, method: str, spelling) -> bool:
    """Wrap `owner.method(self, tx, name, ...)` to mark the node its result stands for; whether
    `owner` has such a method."""
    original = owner.__dict__.get(method)
    if not callable(original):
        return False

    def marking(self, tx, name, *args, **kwargs):
        before = _last_node(tx)
        result = original(self, tx, name, *args, **kwargs)
        if isinstance(name, str):
            _mark(tx, before, result, spelling(name))
        return result

    setattr(owner, method, marking)
    return True


def _last_node(tx):
    try:
        return tx.output.graph._root.prev
    except Exception:
        return None


def _mark(tx, before, result, spelled: str) -> None:
    """Tag the node `result` stands for, if this call created it under another name."""
    try:
        node = result.as_proxy().node if hasattr(result, "as_proxy") else None
        if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
            return
        if USER_SPELLING in node.meta or node_name(node.target, node.args, node.op) == spelled:
            return
        walker = tx.output.graph._root.prev
        while walker is not before and walker is not tx.output.graph._root:
            if walker is node:  # created by this very call
                node.meta[USER_SPELLING] = spelled
                return
            walker = walker.prev
    except Exception:  # never let naming disturb a trace
        return
