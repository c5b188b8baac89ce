"""An eager capture of a whole model: its ops through the capture mode, its module calls through
the shared global module hooks (the `>` and `<` lines), and the compiled graphs and TorchScript
calls it meets inside them, each narrated as one op.

`capture.py` holds what sees ops (the mode and `OpReporter`, which the compiled substrate's gap
capture uses too); this module adds what only a forward captured eagerly has: its modules.
"""

from __future__ import annotations

import threading
from typing import Dict, List

import torch
from torch.utils.hooks import RemovableHandle

from ..core.compiled_regions import install_for_dynamo
from ..core.guard import guarded
from ..core.pipeline import Pipeline
from ..core.scopes import ScopeTable, is_compile_wrapper
from ..core.sites import find_user_site
from ..core.structure import named_outputs
from ..events import TensorMeta
from ..measure.provenance import tensor_arguments
from ..torch_internals.fastpaths import keep_fast_paths, release_fast_paths
from ..torch_internals.mode_stack import own_work, remove_mode
from .capture import (
    CaptureMode,
    OpReporter,
    captures_in_thread,
    count_capture,
    exclude_from_dynamo,
    input_metas,
    unwinding,
)
from .module_hooks import add_capture, remove_capture

__all__ = ["EagerCapture"]

_get_ident = threading.get_ident
_is_compiling = torch.compiler.is_compiling
_own_work = torch._C.DisableTorchFunction  # torch calls made inside reach no mode, no subclass
_ScriptModule = torch.jit.ScriptModule


class _Released:
    """What a released `CaptureMode` reports to: nothing (every call passes through)."""

    suspended = off = True


_RELEASED = _Released()


class EagerCapture(OpReporter):
    """Installs the mode and module hooks for one forward and reports to its `Pipeline`."""

    reports_graph_calls = True

    def __init__(self, pipeline: Pipeline, scopes: ScopeTable, nested: bool = False):
        super().__init__(pipeline)
        self.scopes = scopes
        self.thread = _get_ident()
        self._mode = CaptureMode(self)
        self._counted = False
        self.nested = nested  # another capture was active when this forward began (see `ForwardPass`)
        self.lean = not (self.nested or self.sites or self.engines) and pipeline.lean
        self.scripted = 0  # TorchScript calls narrated as one op each
        self.graph_calls = 0  # compiled graph calls narrated as one op each (see `compiled_regions`)
        # id(module) -> handles of the closing hooks of its calls in progress (see `_pre_hook`)
        self._closers: Dict[int, List[RemovableHandle]] = {}
        self._wrapped: Dict[int, int] = {}  # id(module) -> calls in progress through its torch.compile wrapper
        self._folded: Dict[int, int] = {}  # id(module) -> calls in progress that share their caller's scope

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        count_capture(1)
        self._counted = True
        keep_fast_paths()
        install_for_dynamo()  # a compiled region inside this forward traces as if we were absent
        add_capture(self)  # module enter/exit through the shared global hooks (`module_hooks`)
        self._mode.__enter__()

    def stop(self) -> None:
        """Remove the hooks and the mode. Safe to call twice, and after a start cut short."""
        remove_capture(self)
        self._wrapped = {}
        closers, self._closers = self._closers, {}
        for pending in closers.values():  # calls a KeyboardInterrupt cut short, say
            for handle in pending:
                handle.remove()
        remove_mode(self._mode)  # a no-op when the mode is not on the stack
        if self._counted:
            self._counted = False
            count_capture(-1)
            release_fast_paths()

    def release(self) -> None:
        """The pass is over: the mode lets go of this capture. The two refer to each other, and
        without this the pass's whole pipeline (its session, meter, tracker: a few hundred objects)
        would wait for the garbage collector, surviving into its older generations on the way;
        released, it is freed as the pass ends. A mode still held somewhere (a copy of the mode
        stack) passes every call through."""
        self.stop()
        # (a stand-in, not an OpReporter: its `suspended` and `off` pass every call by before a report)
        self._mode.capture = _RELEASED  # type: ignore[assignment]

    # -- module hooks ---------------------------------------------------------------------------

    def _pre_hook(self, module, args):
        if self.suspended or self.off:
            return None
        if self._wrapped and id(module) in self._wrapped:
            return None  # already entered, by the compiled wrapper that called it
        if is_compile_wrapper(module):
            module = self._through_wrapper(module, +1)
        elif module._forward_hooks:
            self._close_after_users_hooks(module)
        if self.nested or captures_in_thread() > 1:
            with _own_work():
                self._entered(module)
        else:
            self._entered(module)
        return None

    def _close_after_users_hooks(self, module) -> None:
        """The module has forward hooks of its own (a probe, a steering hook): torch runs them
        after the global hooks, so the ops they run would land in the parent module. One rule for
        both substrates (dynamo traces them inside the module): the module's call closes after its
        own hooks, by a one-shot hook of ours placed after them."""
        handle = module.register_forward_hook(self._closing_hook, always_call=True)
        self._closers.setdefault(id(module), []).append(handle)

    def _closing_hook(self, module, args, output):
        if _get_ident() != self.thread:
            return None  # another thread's call of the same module: not ours to close
        handles = self._closers.get(id(module))
        if handles:
            handles.pop().remove()
            if not handles:
                del self._closers[id(module)]
        if not (_is_compiling() or self.suspended or self.off):
            self._close(module, unwinding(), args, output)
        return None

    def _post_hook(self, module, args, output, unwound: bool):
        if self.suspended or self.off or id(module) in self._closers:
            return None  # (a module with hooks of its own is closed by `_closing_hook`)
        if is_compile_wrapper(module):
            module = self._through_wrapper(module, -1)
        elif self._wrapped and id(module) in self._wrapped:
            return None  # closed by the compiled wrapper that called it
        self._close(module, unwound, args, output)
        return None

    def _through_wrapper(self, wrapper, step: int):
        """What `torch.compile(module)` returned is called: its call is narrated as the wrapped
        module's (whose own hooks may not fire: dynamo traces them for torch.nn modules), and the
        wrapped module's hooks, if they fire, are skipped until the wrapper's call ends."""
        inner = wrapper._orig_mod
        count = self._wrapped.get(id(inner), 0) + step
        if count > 0:
            self._wrapped[id(inner)] = count
        else:
            self._wrapped.pop(id(inner), None)
        return inner

    def _close(self, module, unwinding: bool, args, output) -> None:
        if self.nested or captures_in_thread() > 1:
            with _own_work():
                self._exited(module, unwinding, args, output)
        else:
            self._exited(module, unwinding, args, output)

    def _entered(self, module) -> None:
        self.suspended += 1  # a sink may call torch: that is not the model's op
        try:
            session = self.session
            scope = self.scopes.module_scope(module, session.scope)
            if scope is session.scope and scope.parent is not None:  # one scope with its caller (`module_scope`)
                self._folded[id(module)] = self._folded.get(id(module), 0) + 1
            elif scope.parent is not None:  # the root's own call is the whole pass, not a module line
                session.enter(scope)
        except Exception as exc:
            self.turn_off(exc, "recording a module enter")
        finally:
            self.suspended -= 1

    def _exited(self, module, unwinding: bool, args=(), output=None) -> None:
        self.suspended += 1
        try:
            session = self.session
            if not unwinding and isinstance(module, _ScriptModule) and self._opaque_call("scripted", args, output):
                self.scripted += 1
            folded = self._folded.get(id(module))
            if folded:  # its call opened no scope of its own: its caller's closes
                self._folded[id(module)] = folded - 1
                return
            scope = session.open_scope(self.scopes.paths_of(module))
            if scope is not None:
                session.exit(scope, unwinding)
        except Exception as exc:  # (a stop: on_nonfinite="raise" at the scripted call's outputs)
            self.turn_off(exc, "recording a module exit")
        finally:
            self.suspended -= 1

    def _opaque_call(self, name: str, args, output, written=(), site=None) -> bool:
        """A call whose insides the mode cannot see (a TorchScript module: `scripted`; a compiled
        graph: `compiled`) is narrated as one op with its outputs, measured like any op's, in its
        module; a call that returns no tensor shows the inputs it wrote, if any. Whether it had any.
        Such a call has no schema: it wrote into its arguments if their version counters say so
        (`written`) or it returned one of them."""
        tensors = tuple(tensor for _, tensor in named_outputs(output)) or tuple(written)
        if not tensors:
            return False
        value = tensors[0] if len(tensors) == 1 else tensors
        wrote = bool(written) or any(tensor is arg for tensor in tensors for arg in args)
        self.record_op(name, TensorMeta.all_of(tensors), site, value, args, wrote=wrote)
        return True

    # -- compiled graphs run inside the forward (see `compiled_regions`) --------------------------

    def graph_called(self, args, output, caller, written=()) -> None:
        """A compiled graph ran as one opaque call: one `compiled` op with its outputs (a graph that
        returns nothing but writes its inputs in place shows the tensors it wrote)."""
        if _get_ident() != self.thread:
            return
        self.suspended += 1
        try:
            with own_work(True):  # a compiled run's gap capture may be active: keep our work from it
                site = find_user_site(caller) if self.sites else None
                if self._opaque_call("compiled", args, output, written, site):
                    self.graph_calls += 1
        except Exception as exc:  # (a stop: on_nonfinite="raise" at the graph's outputs)
            self.turn_off(exc, "recording a compiled graph call")
        finally:
            self.suspended -= 1

    def graph_failed(self, args, exc, caller) -> None:
        """A compiled graph raised: the attempted op is the graph call."""
        if _get_ident() != self.thread:
            return
        with guarded("describing the failed compiled graph call"), own_work(True):
            # (a compiled run's gap capture may be active: keep our work from it)
            self.session.op_failed("compiled", input_metas(args, {}), find_user_site(caller), exc,
                                   tensors=tensor_arguments(args, {}))


exclude_from_dynamo(EagerCapture._pre_hook, EagerCapture._post_hook, EagerCapture._closing_hook)
