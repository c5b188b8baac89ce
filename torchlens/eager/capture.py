"""Eager capture: a `TorchFunctionMode` for ops (here) and global module hooks for module context
(`model_capture.EagerCapture`).

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

import contextlib
import sys
import threading
import types

import torch
from torch.overrides import TorchFunctionMode

from ..core.collectives import C10D_MODULE, collective_call
from ..core.compiled_regions import run_by_dynamo
from ..core.engines import distributed, engine_of
from ..core.guard import contain, internal_error, is_stop
from ..core.naming import op_name
from ..core.pipeline import Call, Pipeline
from ..core.session import error_summary
from ..core.sites import find_user_site
from ..events import TensorMeta
from ..measure.provenance import tensor_arguments
from ..measure.writes import written_tensor
from ..repro.kept import KeptCall
from ..torch_internals.seams import degraded
from .module_hooks import HOOKS

__all__ = ["CaptureMode", "OpReporter", "captures_in_thread", "count_capture", "exclude_from_dynamo", "input_metas",
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


def count_capture(delta: int) -> None:
    """An eager capture starts (1) or stops (-1) in this thread: what `captures_in_thread` counts."""
    _threads.captures = captures_in_thread() + delta


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

    @contextlib.contextmanager
    def stepping_aside(self):
        """Report nothing while code below the mode runs whose torch calls are not the model's ops
        (a compiled graph's: its ops are its plan's, or one op of their own)."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

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


exclude_from_dynamo(CaptureMode.__torch_function__, *HOOKS)
