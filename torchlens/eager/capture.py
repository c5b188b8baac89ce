"""Eager capture: a `TorchFunctionMode` for ops and global module hooks for module context.

The mode sees every torch-level call (the granularity of a dynamo graph: `linear`, not
`t`/`addmm`); the hooks report module enter/exit. Both only ever read metadata (shape, dtype,
device) unless value statistics or kept values were asked for, so metadata narration reads no
tensor payload and makes no device sync by construction.

Captures nest: a `tl.record` (or a `Recorder` pass) may run inside a forward that is itself being
narrated, in the same thread. Both see the inner model's ops, each in its own transcript. What a
capture computes for itself (statistics, kept copies, a sink that calls torch) must not reach the
other as the model's ops, so a capture's own work runs with torch functions' dispatch turned off
whenever another capture is active in the thread (only then: it costs half a microsecond).

Two rules keep this safe around `torch.compile`:

- The mode and the hooks return at once when `torch.compiler.is_compiling()`: when dynamo traces
  through them it sees only the original call, so compiled graphs are unchanged.
- Their code objects are excluded from dynamo's frame evaluation (at import): otherwise dynamo
  would compile them as frames of their own, where `is_compiling()` is true, and they would go
  silent in code that runs eagerly between compiled graphs.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Dict, List

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..core.collectives import C10D_MODULE, collective_call
from ..core.compiled_regions import install_for_dynamo, run_by_dynamo
from ..core.engines import distributed, engine_of
from ..core.guard import contain, guarded, internal_error, is_stop
from ..core.naming import op_name
from ..core.pipeline import Call, Pipeline
from ..core.scopes import ScopeTable, is_compile_wrapper
from ..core.session import error_summary
from ..core.sites import find_user_site
from ..core.structure import named_outputs
from ..events import TensorMeta
from ..measure.provenance import tensor_arguments
from ..measure.writes import written_tensor
from ..repro.kept import KeptCall
from ..torch_internals.fastpaths import keep_fast_paths, release_fast_paths
from ..torch_internals.mode_stack import own_work, remove_mode
from ..torch_internals.seams import degraded
from .module_hooks import HOOKS, add_capture, remove_capture

__all__ = ["CaptureMode", "EagerCapture", "OpReporter", "captures_in_thread", "exclude_from_dynamo", "input_metas",
           "output_metas", "outside_dynamo", "unwinding"]

_Tensor = torch.Tensor
_Size = torch.Size
_OPERATORS = (torch._ops.OpOverloadPacket, torch._ops.OpOverload)  # `torch.ops.*` calls
_is_compiling = torch.compiler.is_compiling
_get_ident = threading.get_ident
_CALL_IMPL = torch.nn.Module._call_impl.__code__
_own_work = torch._C.DisableTorchFunction  # torch calls made inside reach no mode, no subclass
_threads = threading.local()  # .captures: eager captures active in this thread


def captures_in_thread() -> int:
    return getattr(_threads, "captures", 0)


def unwinding() -> bool:
    """Called from a forward hook: is the module's forward propagating an exception?

    `Module._call_impl` runs `always_call` hooks from its `except` block only when the forward
    raised; on success they run from its inner helper. So the hook's caller tells which it is.
    """
    return sys._getframe(2).f_code is _CALL_IMPL


class CaptureMode(TorchFunctionMode):
    """Reports each torch-level call that returns tensors to the active capture."""

    torchlens_capture = True  # how `fastpaths` tells the capture's modes from anybody else's

    def __init__(self, capture: "OpReporter"):
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = _NO_KWARGS
        capture = self.capture
        if capture.suspended or capture.off or _is_compiling():
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            with _own_work():
                capture.op_raised(func, args, kwargs, exc)
            raise
        kind = type(out)
        if kind is _Tensor and capture.lean and capture.plain_op_done(func, out):
            return out  # the common case, in as few calls as possible
        if kind is _Tensor or (kind is not _Size and isinstance(out, (tuple, list, _Tensor))):
            produced = out  # sizes, dtypes, bools: not ops, and frequent
        elif out is None and (produced := written_tensor(getattr(func, "__name__", ""), args, kwargs)) is not None:
            pass  # `y[i] = v` and the few other calls that write a tensor and return nothing
        elif getattr(func, "__module__", None) == C10D_MODULE:  # a collective: None, a `Work`, a rank
            if capture.nested:
                with _own_work():
                    capture.collective_done(func, args, kwargs, out)
            else:
                capture.collective_done(func, args, kwargs, out)
            return out
        else:
            return out
        if capture.nested:  # an outer capture is below this mode: keep our work from it
            with _own_work():
                capture.op_done(func, produced, args, kwargs)
        else:
            capture.op_done(func, produced, args, kwargs)
        return out


_meta = TensorMeta.of
_single = TensorMeta.single
_interned = TensorMeta.interned
# shared by every call without keyword arguments: read-only
_NO_KWARGS: types.MappingProxyType[str, object] = types.MappingProxyType({})


def output_metas(out):
    """TensorMeta of each tensor an op returned, or None when it returned no tensor."""
    try:
        if type(out) is _Tensor or isinstance(out, _Tensor):
            return _single(out)
        if isinstance(out, (tuple, list)):  # named tuples too: torch.max(x, dim) gives values and indices
            metas = tuple(_meta(t) for t in out if isinstance(t, _Tensor))
            return _interned(metas) if metas else None
    except RuntimeError:  # a tensor without plain sizes (nested): free on the common path
        tensors = (out,) if isinstance(out, _Tensor) else [t for t in out if isinstance(t, _Tensor)]
        return tuple(TensorMeta.ragged(t) for t in tensors) or None
    return None


def input_metas(args, kwargs):
    """TensorMeta of the tensor arguments of a call (one level into lists and tuples)."""
    return tuple(_any_meta(tensor) for tensor in tensor_arguments(args, kwargs))


def _any_meta(tensor) -> TensorMeta:
    try:
        return TensorMeta.of(tensor)
    except RuntimeError:  # a nested tensor has no plain sizes
        return TensorMeta.ragged(tensor)


class OpReporter:
    """What `CaptureMode` reports each torch call to: records it as an op through the pass's
    `Pipeline` (or, metadata only, straight into its session).

    Subclasses decide which module an op belongs to: eager capture knows it from module hooks
    (the session's current scope), the compiled path's gap capture reads it from the stack.
    """

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.session = pipeline.session
        self.sites = self.session.settings.sites
        # Two reasons to stay silent: `suspended` (a count) while torchlens's own work or a compiled
        # graph runs, resumed after it; `off` for the rest of the forward, after a failure of our own.
        self.suspended = 0
        self.off = False
        self.ops = 0  # ops recorded through `record_op` (what the gap capture counts for the footer)
        self.nested = False  # another capture's mode is below ours in this thread
        self.lean = False  # whether ops may take `plain_op_done` (set by a capture that allows it)
        # under a process group, which ops an engine (FSDP2, DDP, ...) ran for itself (`engines`)
        self.engines = distributed()

    follows_stack = False  # whether `locate` needs the caller's frame (not eager: hooks say it)
    reports_graph_calls = False  # whether compiled graph calls inside its forward are its ops

    def locate(self, frame) -> None:
        """Bring the session's open module to the one the call at `frame` runs in."""

    def op_done(self, func, out, args=(), kwargs=None, collective=None, frame=None) -> None:
        metas = output_metas(out)
        if metas is None:
            return
        try:
            if frame is None:
                frame = sys._getframe(2)  # 0: here, 1: the mode, 2: the code that called the op
            if run_by_dynamo(frame):
                return  # dynamo's own work between graphs (a float wrapped for a graph): not the user's op
            if self.follows_stack:
                self.locate(frame)
            site = find_user_site(frame) if self.sites else None
            if collective is None and func.__class__ in _OPERATORS:  # (a functional collective?)
                collective = collective_call(func, args, kwargs, out)
            engine = engine_of(frame) if self.engines else None
            if collective is not None:
                self.pipeline.op(collective.name, metas, site, out, collective=collective,
                                 call=Call(func, args, kwargs, collective.writes), engine=engine)
                self.ops += 1
                return
            self.record_op(op_name(func), metas, site, out, args, kwargs, func, engine=engine)
        except Exception as exc:
            self.recording_failed(exc)

    def collective_done(self, func, args, kwargs, out) -> None:
        """A `torch.distributed` collective returned: an op on the tensors it wrote (or sent)."""
        collective = collective_call(func, args, kwargs, out)
        if collective is not None:  # (0: here, 1: the mode, 2: torch's dispatch of the call)
            self.op_done(func, collective.value, args, kwargs, collective, sys._getframe(2))

    def recording_failed(self, exc: Exception) -> None:
        """An op could not be recorded: a deliberate stop (`on_nonfinite="raise"`, a trace budget)
        ends the run; a failure of torchlens turns the capture off for the rest of the forward,
        with a warning and a footer that says the recording is incomplete."""
        self.turn_off(exc, "recording an op")

    def turn_off(self, exc: Exception, what: str) -> None:
        """`guard.contain`, and the capture stays off for the rest of the forward (a stop propagates)."""
        if not is_stop(exc):
            self.off = True
        contain(exc, what, self.session.mark_incomplete)

    def plain_op_done(self, func, out) -> bool:
        """`op_done` for the common case, in few calls: an op that returned one tensor, in a capture
        that records metadata only (`lean`: no statistics, tracking, kept values, sites or nesting).
        False when the general path must record it (a nested tensor has no plain sizes)."""
        try:
            metas = _single(out)
        except RuntimeError:
            return False
        try:
            if run_by_dynamo(sys._getframe(2)):  # 0: here, 1: the mode, 2: the code that called the op
                return True
            self.session.add_op(op_name(func), metas)
        except Exception as exc:
            self.recording_failed(exc)
        return True

    def record_op(self, name: str, metas, site, out, args, kwargs=None, func=None, wrote=None,
                  engine=None) -> None:
        """Add an op through the pipeline: its output measured, judged with what it read, kept.
        Whether the call wrote into its arguments is `writes.call_writes`'s rule unless the caller
        knows (`wrote`); `engine`: the distributed engine that ran it for itself."""
        self.pipeline.op(name, metas, site, out, call=Call(func, args, kwargs, wrote), engine=engine)
        self.ops += 1

    def op_raised(self, func, args, kwargs, exc) -> None:
        try:
            frame = sys._getframe(2)
            self.locate(frame)
            site = find_user_site(frame)  # a failure is rare: always worth its site
            self.session.op_failed(op_name(func), input_metas(args, kwargs), site, exc,
                                   call=KeptCall(func, args, kwargs, error=error_summary(exc)),
                                   tensors=tensor_arguments(args, kwargs))
        except Exception as inner:
            internal_error("describing the failed op", inner)


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
        _threads.captures = captures_in_thread() + 1
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
            _threads.captures = captures_in_thread() - 1
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


_ScriptModule = torch.jit.ScriptModule


def exclude_from_dynamo(*functions) -> None:
    """Never let dynamo compile these functions, nor anything they call.

    They run inside compiled regions (between graphs, or around a compiled submodule) and must run
    as plain Python; compiled as frames of their own they would see `is_compiling()` as true and
    do nothing. The strategy lives in torch's C extension, so this costs eager users no import.
    """
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError as exc:  # a torch without per-code strategies: nothing to exclude from
        degraded("frame strategy", exc)
        return
    strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    for fn in functions:
        set_code_exec_strategy(fn.__code__, strategy)


def outside_dynamo(fn):
    """Make `fn` run as plain Python when it is called inside a region `torch.compile` traces.

    Its `_torchdynamo_disable` flag makes dynamo break the graph at the call instead of inlining
    it, and its frame and everything under it are excluded from compilation, so a `tl.record`
    inside a compiled forward captures its model eagerly, as it would outside (what
    `torch.compiler.disable` does, without a wrapper frame and without importing dynamo).
    """
    fn._torchdynamo_disable = True
    exclude_from_dynamo(fn)
    return fn


exclude_from_dynamo(CaptureMode.__torch_function__, EagerCapture._pre_hook, EagerCapture._post_hook,
                    EagerCapture._closing_hook, *HOOKS)
