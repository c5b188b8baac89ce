"""Every place torchlens relies on torch's private internals, as one table.

torch offers no public hook for much of what narration needs: where a compiled forward begins and
ends, the code dynamo runs between graphs, a graph traced as if no capture were running, the
autograd task a backward hook runs in. Each such dependency is a `Seam`: what of torch it patches
or reads, the function of ours that does it, and what a user loses where it does not apply. A torch
upgrade that moves one of them must show up as a warning that says what is lost, never as a
silently wrong transcript:

- `check()` probes every seam on the installed torch (tests/test_torch_seams.py fails when one
  stopped applying, so an upgrade is caught in CI, not by a user);
- at run time, the code that uses a seam calls `degraded(name, why)` when it finds torch otherwise
  shaped; that warns once per seam (a `NarrationWarning`) and the feature degrades as its row says.

The code that patches or reads each seam stays beside the feature it serves (named in `where`);
this module imports nothing of dynamo until `check()` runs, so `import torchlens` stays cheap.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Callable, Dict, NamedTuple, Optional

import torch

from ..errors import warn_safely

__all__ = ["SEAMS", "Seam", "check", "degraded"]


class Seam(NamedTuple):
    name: str
    relies_on: str  # what of torch is patched or read
    where: str  # the torchlens code that does it
    lost: str  # what a user loses where it does not apply
    probe: Callable[[], Optional[str]]  # None where it applies on the installed torch, else why not


def _missing(owner, *names) -> Optional[str]:
    absent = [name for name in names if not hasattr(owner, name)]
    return f"{getattr(owner, '__name__', owner)} has no {', '.join(absent)}" if absent else None


def _probe_mode_filter():
    from torch._dynamo import utils
    from torch._dynamo.variables import torch_function

    return (_missing(torch_function, "SymbolicTorchFunctionState")
            or _missing(utils, "set_torch_function_mode_stack"))


def _probe_graph_reports():
    from torch._dynamo import output_graph

    return _missing(output_graph.OutputGraph, "call_user_compiler")


def _probe_transformed_code():
    from torch._dynamo import utils

    table = getattr(utils, "orig_code_map", None)
    if isinstance(getattr(table, "values", None), dict):
        return None
    return "torch._dynamo.utils.orig_code_map is not a table"


def _probe_compile_wrapper():
    from torch._dynamo import eval_frame

    context = eval_frame._TorchDynamoContext
    wrapper = _nested_code(context.__call__.__code__, "compile_wrapper")
    if wrapper is None:
        return "_TorchDynamoContext.__call__ defines no compile_wrapper"
    names = set(wrapper.co_varnames) | set(wrapper.co_freevars)
    absent = {"self", "fn", "args", "kwargs", "cleanups", "call_succeeded", "result"} - names
    if absent:
        return f"compile_wrapper has no {', '.join(sorted(absent))}"
    if "enter_exit_hooks" not in context.__init__.__code__.co_names:
        return "_TorchDynamoContext keeps no enter_exit_hooks"
    return None


def _nested_code(code, name):
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found = const if const.co_name == name else _nested_code(const, name)
            if found is not None:
                return found
    return None


def _probe_adopt_mode():
    from torch._dynamo import output_graph, symbolic_convert
    from torch._dynamo.variables import torch_function

    manager = getattr(torch_function, "torch_function_mode_stack_state_mgr", None)
    fields = getattr(getattr(output_graph, "OutputGraphGuardsState", None), "__dataclass_fields__", {})
    return (_missing(symbolic_convert.InstructionTranslator, "current_tx")
            or (None if isinstance(getattr(manager, "stack", None), list) else "no torch function mode stack manager")
            or (None if "torch_function_mode_stack" in fields else "OutputGraph keeps no torch_function_mode_stack"))


def _probe_spellings():
    from torch._dynamo.variables.tensor import TensorVariable

    if "call_method" not in TensorVariable.__dict__:
        return "TensorVariable has no call_method"
    if not any(name in TensorVariable.__dict__ for name in ("var_getattr", "tp_getattro_impl")):
        return "TensorVariable has no attribute hook"
    return None


@functools.lru_cache(maxsize=None)  # (dynamo caches the frame: compiled again, it would not call the backend)
def _probe_graph_nodes() -> tuple:
    """The call nodes of a graph dynamo captured from a module calling a submodule."""
    from torch import nn

    graphs = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def forward(self, x):
            return self.inner(x).relu()

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(Probe(), backend=backend, fullgraph=True)(torch.ones(1, 2))
    return tuple(node for gm in graphs for node in gm.graph.nodes if node.op == "call_function")


def _probe_node_meta():
    from . import node_meta

    nodes = _probe_graph_nodes()
    if not nodes or not all(isinstance(node_meta.example_value(node), torch.Tensor) for node in nodes):
        return "a captured graph's nodes carry no example_value"
    if not all(node_meta.plain_fake(node_meta.example_value(node)) for node in nodes):
        return "a captured graph's example values are not FakeTensor (tracked graphs are not screened)"
    if not any("inner" in str(node_meta.module_stack(node) or {}) for node in nodes):
        return "a captured graph's nodes carry no nn_module_stack naming their module"
    if not any(__file__.rsplit(".", 1)[0] in (node_meta.stack_trace(node) or "") for node in nodes):
        return "a captured graph's nodes carry no stack_trace of the user's lines"
    return None

def _probe_fast_path_handlers():
    from torch._dynamo.variables import torch as torch_variables

    return _missing(torch_variables.TorchInGraphFunctionVariable, "_get_handlers")


def _probe_frame_strategy():
    from torch._C._dynamo import eval_frame

    return _missing(eval_frame, "_FrameAction", "_FrameExecStrategy", "set_code_exec_strategy")


def _probe_disable_flag():
    import inspect

    from torch._dynamo.variables import functions

    if "_torchdynamo_disable" in inspect.getsource(functions):
        return None
    return "dynamo no longer reads _torchdynamo_disable"


def _probe_raised_while_tracing():
    from torch._dynamo import exc

    return _missing(exc, "TorchRuntimeError", "TorchDynamoException")


def _probe_backward_entry():
    """`Tensor.backward` still calls `torch.autograd.backward` as the module's attribute, at the call."""
    original, called = torch.autograd.backward, []

    def listening(*args, **kwargs):
        called.append(True)
        return original(*args, **kwargs)

    torch.autograd.backward = listening
    try:
        torch.ones((), requires_grad=True).mul(2).backward()
    finally:
        torch.autograd.backward = original
    return None if called else "Tensor.backward no longer calls torch.autograd.backward"


def _probe_sequence_numbers():
    missing = _missing(torch._C._autograd, "_get_sequence_nr")
    if missing:
        return missing
    before = torch._C._autograd._get_sequence_nr()
    node = torch.ones(1, requires_grad=True).mul(2).grad_fn
    if (node is None or not hasattr(node, "_sequence_nr")
            or not before <= node._sequence_nr() < torch._C._autograd._get_sequence_nr()):
        return "a node's _sequence_nr() no longer falls between the counter's values around its making"
    return None


def _probe_hook_handles():
    from collections import OrderedDict

    from torch.utils.hooks import RemovableHandle

    # (the kind of table torch keeps hooks in: a plain dict has no weak reference)
    table: OrderedDict[int, object] = OrderedDict()
    handle = RemovableHandle(table)
    table[handle.id] = print
    if handle.hooks_dict_ref() is not table or handle.extra_dict_ref:
        return "RemovableHandle no longer keeps its hook table as hooks_dict_ref and its key as id"
    return None


def _probe_resolve_process_group():
    import torch.distributed as dist

    if not dist.is_available():
        return None  # no collectives to narrate
    from torch.distributed import distributed_c10d

    return _missing(distributed_c10d, "_resolve_process_group")


def _probe_traced_node():
    import inspect

    from torch._dynamo import convert_frame, exc, resume_execution, utils

    missing = _missing(resume_execution, "TORCH_DYNAMO_RESUME_IN_PREFIX") or _missing(utils, "get_fake_value")
    if missing:
        return missing
    if "node" not in inspect.signature(utils.get_fake_value).parameters:
        return "get_fake_value takes no `node`"
    if "real_stack" not in inspect.signature(exc.TorchRuntimeError).parameters:
        return "TorchRuntimeError keeps no real_stack"
    if "code" not in inspect.signature(convert_frame._compile).parameters:
        return "convert_frame._compile takes no `code`"
    return None


def _probe_shared_hook_keys():
    module = torch.nn.modules.module

    def hook(*args):
        return None

    handle = module.register_module_forward_hook(hook, always_call=True)
    try:
        if module._global_forward_hooks.get(handle.id) is not hook:
            return "_global_forward_hooks is not keyed by the handle's id"
        if handle.id not in module._global_forward_hooks_always_called:
            return "always_call is not kept in _global_forward_hooks_always_called"
    finally:
        handle.remove()
    return None


def _probe_global_hook_check():
    import inspect

    from torch._dynamo import eval_frame

    module = torch.nn.modules.module
    missing = _missing(module, "_has_any_global_hook", "_global_forward_hooks", "_global_forward_pre_hooks")
    if missing:
        return missing
    if "_has_any_global_hook" not in inspect.getsource(eval_frame.OptimizedModule.__call__):
        return "OptimizedModule.__call__ no longer asks _has_any_global_hook"
    return None


def _probe_version_counters():
    tensor = torch.zeros(1)
    before = tensor._version
    tensor.add_(1)
    return None if tensor._version == before + 1 else "an in-place write no longer bumps Tensor._version"


def _probe_dtensor_shards():
    import torch.distributed as dist

    if not dist.is_available():
        return None  # no DTensors to measure
    from torch.distributed.tensor import DTensor

    return None if "_local_tensor" in getattr(DTensor, "__slots__", ()) else "DTensor keeps no _local_tensor"


def _probe_view_bases():
    base = torch.zeros(2)
    return None if base[:1]._base is base else "a view's _base is not the tensor it views"


def _probe_storage_identity():
    from torch.multiprocessing.reductions import StorageWeakRef

    storage = torch.zeros(1).untyped_storage()
    if not isinstance(getattr(storage, "_cdata", None), int):
        return "an untyped storage has no integer _cdata"
    if StorageWeakRef(storage).cdata != storage._cdata:
        return "StorageWeakRef.cdata is not the storage's _cdata"
    return None


def _probe_pytree():
    from torch.utils import _pytree

    return _missing(_pytree, "tree_map", "tree_leaves", "tree_flatten")


def _probe_wrapper_subclasses():
    from torch.utils import _python_dispatch

    return _missing(_python_dispatch, "is_traceable_wrapper_subclass", "TorchDispatchMode")


def _probe_operator_objects():
    op = torch.ops.aten.add.Tensor
    if not isinstance(op, torch._ops.OpOverload) or not isinstance(torch.ops.aten.add, torch._ops.OpOverloadPacket):
        return "torch.ops.aten.add.Tensor is no OpOverload, or its packet no OpOverloadPacket"
    return None if (op._opname, op._overloadname, op._schema.name) == ("add", "Tensor", "aten::add") \
        else "an OpOverload's _opname, _overloadname or _schema moved"


def _probe_functional_wait():
    import torch.distributed as dist

    if not dist.is_available():
        return None
    return _missing(torch.ops._c10d_functional, "wait_tensor")


def _probe_functorch_wrappers():
    from torch._C import _functorch

    return _missing(_functorch, "is_functorch_wrapped_tensor", "get_unwrapped")


def _probe_module_own_hooks():
    module = torch.nn.Linear(1, 1)
    handle = module.register_forward_hook(lambda *args: None)
    try:
        return None if len(module._forward_hooks) == 1 else "a module's forward hooks are not in its _forward_hooks"
    finally:
        handle.remove()


def _probe_compile_entry_points():
    import torch._dynamo
    from torch._dynamo.backends import registry
    from torch._inductor import compile_fx, list_mode_options

    return (_missing(torch._dynamo, "reset", "register_backend", "list_backends", "lookup_backend")
            or _missing(registry, "_BACKENDS") or _missing(compile_fx, "compile_fx")
            or (None if callable(list_mode_options) else "torch._inductor.list_mode_options is not callable"))


def _probe_shape_printer():
    from torch.utils._sympy.printers import PythonPrinter

    return None if callable(getattr(PythonPrinter, "doprint", None)) else "PythonPrinter has no doprint"


def _probe_compiler_bisector():
    import inspect

    from torch._inductor import compiler_bisector

    missing = (_missing(compiler_bisector, "BACKENDS", "ConfigChange")
               or _missing(compiler_bisector.CompilerBisector, "do_bisect", "get_backend", "get_config_change"))
    if missing:
        return missing
    if "get_backend" not in compiler_bisector.CompilerBisector.__dict__:
        return "CompilerBisector.get_backend is not its own classmethod"
    if "CompilerBisector.get_backend()" not in inspect.getsource(torch.compile):
        return "torch.compile no longer reads the bisector's backend"
    return None


SEAMS = (
    Seam("mode filter", "dynamo's SymbolicTorchFunctionState.__init__ and utils.set_torch_function_mode_stack",
         "core.compiled_regions._install_filter",
         "dynamo traces the capture's mode: compiled graphs under a capture record torch-level names "
         "(floor_divide for //) and dynamo's errors point into torchlens", _probe_mode_filter),
    Seam("graph reports", "dynamo's OutputGraph.call_user_compiler",
         "core.compiled_regions._install_graph_reports",
         "an eager capture shows a compiled graph's kernels instead of one `compiled` op", _probe_graph_reports),
    Seam("transformed code", "dynamo's utils.orig_code_map", "core.compiled_regions.run_by_dynamo",
         "dynamo's own calls between graphs (floats wrapped into tensors) are narrated as the user's ops",
         _probe_transformed_code),
    Seam("compile wrapper", "the locals of _TorchDynamoContext's compile_wrapper and its enter_exit_hooks",
         "fx_backend.dynamo_seams.current_call, hook_calls, when_call_ends, call_outcome",
         "a compiled model's forwards are not narrated as passes: each graph call is a pass of its own, "
         "code between graphs is not narrated", _probe_compile_wrapper),
    Seam("adopt mode", "InstructionTranslator.current_tx and dynamo's saved torch function mode stacks "
         "(torch_function_mode_stack_state_mgr)",
         "fx_backend.dynamo_seams.adopt_mode_for_this_compile",
         "a string-backend model's first call does not narrate code between graphs, and recompiles once",
         _probe_adopt_mode),
    Seam("user spellings", "dynamo's TensorVariable.call_method and attribute hook (patched)",
         "fx_backend.dynamo_seams.record_user_spellings",
         "compiled ops keep the name of the call dynamo wrote (tensor for x.new_tensor, _get_data_attr for .data)",
         _probe_spellings),
    Seam("node meta", "dynamo's node.meta keys: example_value (val from other tracers), nn_module_stack, stack_trace; "
         "example values as torch._subclasses.fake_tensor's FakeTensor, and a FakeTensorMode of our own",
         "torch_internals.node_meta",
         "compiled ops lose their shapes, modules and user sites (lines, statistics and writes go wrong); tracked "
         "graphs are no longer screened", _probe_node_meta),
    Seam("fast-path handlers", "dynamo's TorchInGraphFunctionVariable._get_handlers",
         "torch_internals.fastpaths._same_to_dynamo",
         "a model compiled while a capture runs breaks its graph at every fast-path check", _probe_fast_path_handlers),
    Seam("frame strategy", "torch._C._dynamo.eval_frame.set_code_exec_strategy, with "
         "_FrameExecStrategy(_FrameAction.SKIP, ...)", "eager.capture.exclude_from_dynamo",
         "dynamo may compile the capture's hooks as frames of their own, which then go silent between graphs",
         _probe_frame_strategy),
    Seam("disable flag", "the _torchdynamo_disable attribute dynamo reads", "eager.capture.outside_dynamo",
         "a tl.record inside a compiled forward is traced by dynamo instead of capturing eagerly", _probe_disable_flag),
    Seam("dynamo errors", "torch._dynamo.exc.TorchRuntimeError and TorchDynamoException",
         "fx_backend.dynamo_seams.raised_while_tracing",
         "a compiled forward that failed while dynamo traced it is not located by an eager re-run",
         _probe_raised_while_tracing),
    Seam("has_torch_function", "torch.overrides.has_torch_function (replaced while a capture runs)",
         "torch_internals.fastpaths",
         "nn.MultiheadAttention and nn.TransformerEncoder run their slow path under capture (other results)",
         lambda: _missing(torch.overrides, "has_torch_function")),
    Seam("operator schemas", "torch._C._jit_get_all_schemas", "measure.writes",
         "which calls write their arguments cannot be told: writes are not followed",
         lambda: _missing(torch._C, "_jit_get_all_schemas")),
    Seam("graph task", "torch._C._current_graph_task_id and the engine's queue_callback",
         "torch_internals.engine",
         "backward narration cannot tell one backward from another, nor when one ends",
         lambda: (_missing(torch._C, "_current_graph_task_id")
                  or _missing(torch.autograd.Variable._execution_engine, "queue_callback"))),
    Seam("backward entry", "torch.autograd.backward, which Tensor.backward looks up at each call (wrapped while "
         "a watch is open)", "watching.roots.listen",
         "tl.watch does not see the loss a backward starts from: a NaN loss computed outside the model whose "
         "gradients are finite is no fault", _probe_backward_entry),
    Seam("autograd sequence numbers", "torch._C._autograd._get_sequence_nr, Node._sequence_nr and a custom "
         "Function node's _forward_cls", "watching.roots.loss_ops, watching.steps, backward.graph",
         "a watch fault for a loss computed outside the model does not list the loss's ops", _probe_sequence_numbers),
    Seam("hook handles", "torch.utils.hooks.RemovableHandle's hooks_dict_ref and id", "backward.graph.Hooks",
         "nothing shown: each backward hook's handle is kept, more objects for the garbage collector per step",
         _probe_hook_handles),
    Seam("disable torch function", "torch._C.DisableTorchFunction",
         "eager.capture, eager.model_capture, torch_internals.mode_stack, core.naming",
         "a capture's own work would reach another capture's transcript",
         lambda: _missing(torch._C, "DisableTorchFunction")),
    Seam("process group by name", "torch.distributed.distributed_c10d._resolve_process_group", "core.collectives",
         "a functional collective's line does not say the size of its group", _probe_resolve_process_group),
    Seam("traced node", "torch._dynamo: resume functions' name prefix (TORCH_DYNAMO_RESUME_IN_PREFIX), "
         "TorchRuntimeError.real_stack, the `node` "
         "local of utils.get_fake_value and the `code` local of convert_frame._compile in a tracing error's traceback",
         "fx_backend.dynamo_seams.traced_frame_resumed, traced_node",
         "a tracing error after a graph break is not located (the forward is not run again, and the tail says so)",
         _probe_traced_node),
    Seam("global hook check", "torch.nn.modules.module._has_any_global_hook, read by OptimizedModule.__call__ "
         "to warn that global hooks fire an extra time", "eager.module_hooks",
         "every call of a torch.compile'd module under a capture warns that hooks fire an extra time",
         _probe_global_hook_check),
    Seam("shared hook keys", "torch.nn.modules.module._global_forward_pre_hooks, _global_forward_hooks and "
         "_global_forward_hooks_always_called: dicts keyed by the RemovableHandle's id, which dynamo guards on",
         "eager.module_hooks._register",
         "a compiled submodule under an eager capture compiles again at every capture, up to dynamo's recompile "
         "limit", _probe_shared_hook_keys),
    Seam("version counters", "Tensor._version, the counter every in-place write bumps (an inference tensor has "
         "none)", "measure.memory",
         "what was written since it was measured or kept cannot be told: statistics and kept values may be stale",
         _probe_version_counters),
    Seam("DTensor shards", "DTensor._local_tensor, the shard this rank holds",
         "events, measure.meter, measure.provenance, measure.stats",
         "a DTensor's lines show no local shape, its shard is not measured nor followed by tracking",
         _probe_dtensor_shards),
    Seam("view bases", "Tensor._base, the tensor a view views", "measure.memory, measure.meter, watching.roots",
         "a view's statistics are not shared with its base's (measured again), a loss viewing a larger tensor is "
         "kept whole", _probe_view_bases),
    Seam("storage identity", "an untyped storage's _cdata (StorageWeakRef.cdata)", "measure.memory",
         "writes through another view of the same memory are not followed", _probe_storage_identity),
    Seam("pytree", "torch.utils._pytree: tree_map, tree_leaves, tree_flatten", "debug.reference, repro.kept, "
         "results, watching.checks, watching.steps",
         "nested outputs and arguments (dicts, ModelOutputs) are not opened", _probe_pytree),
    Seam("wrapper subclasses", "torch.utils._python_dispatch: is_traceable_wrapper_subclass, TorchDispatchMode",
         "measure.memory, measure.integer_values, fx_backend.replay",
         "a wrapper subclass (an asynchronous collective's tensor) is read as plain values; a compiled graph's "
         "failure is not located", _probe_wrapper_subclasses),
    Seam("operator objects", "torch._ops.OpOverload and OpOverloadPacket, their _schema, _opname and "
         "_overloadname",
         "core.naming, measure.writes, core.collectives, debug.reference, eager.capture, fx_backend.replay",
         "aten operators called directly are named by their Python repr, and their writes are not read from "
         "their schema", _probe_operator_objects),
    Seam("functional wait", "torch.ops._c10d_functional.wait_tensor", "core.collectives",
         "a functional collective's wait is not the moment its values land: it is measured at its call",
         _probe_functional_wait),
    Seam("function mode stack", "torch.overrides._get_current_function_mode_stack and torch._C's "
         "_len_torch_function_stack, _get_function_stack_at, _pop_torch_function_stack, "
         "_push_on_torch_function_stack", "torch_internals.mode_stack",
         "a capture's mode cannot be lifted from under another's: nested captures and compiled graphs inside "
         "captures narrate each other's work",
         lambda: (_missing(torch.overrides, "_get_current_function_mode_stack")
                  or _missing(torch._C, "_len_torch_function_stack", "_get_function_stack_at",
                              "_pop_torch_function_stack", "_push_on_torch_function_stack"))),
    Seam("functorch wrappers", "torch._C._functorch: is_functorch_wrapped_tensor, get_unwrapped", "measure.stats",
         "values inside torch.func transforms (vmap, grad) are not measured: their lines say n/a",
         _probe_functorch_wrappers),
    Seam("module call frames", "nn.Module._call_impl.__code__, the frame a module call runs in",
         "eager.module_hooks, eager.capture",
         "a module whose forward raised is closed as if it had returned (its exit line is not marked)",
         lambda: None if isinstance(getattr(torch.nn.Module._call_impl, "__code__", None), types.CodeType)
         else "nn.Module._call_impl is not a Python function"),
    Seam("module's own hooks", "Module._forward_hooks, the forward hooks a module holds",
         "eager.model_capture",
         "ops a module's own forward hooks run land in its parent module", _probe_module_own_hooks),
    Seam("compile entry points", "torch._dynamo: reset, register_backend, list_backends, lookup_backend, the "
         "backend registry's _BACKENDS; torch._inductor: compile_fx.compile_fx, list_mode_options, config.patch",
         "options, fx_backend.config, fx_backend.entry, fx_backend.registration, debug.bisect",
         "tl.compile cannot check compiler= and mode=, or compile with inductor underneath",
         _probe_compile_entry_points),
    Seam("shape printer", "torch.utils._sympy.printers.PythonPrinter", "fx_backend.shapes",
         "dynamic shapes are shown symbolically, not resolved to the sizes a call had", _probe_shape_printer),
    Seam("compiler bisector", "torch._inductor.compiler_bisector.CompilerBisector (do_bisect, get_backend read by "
         "torch.compile, get_config_change), ConfigChange and its BACKENDS", "debug.bisect",
         "tl.debug.bisect cannot bisect a compiled divergence; it says so", _probe_compiler_bisector),
)

_by_name: Dict[str, Seam] = {seam.name: seam for seam in SEAMS}
_warned: set = set()
_lock = threading.Lock()


def check() -> Dict[str, Optional[str]]:
    """Each seam's name -> None where it applies on the installed torch, else why not."""
    result = {}
    for seam in SEAMS:
        try:
            result[seam.name] = seam.probe()
        except Exception as exc:  # (an import that failed is the answer)
            result[seam.name] = f"{type(exc).__name__}: {exc}"
    return result


def degraded(name: str, why) -> None:
    """The code using seam `name` found torch otherwise shaped (`why`: a reason or an exception):
    say once, in this process, what the user loses."""
    if name in _warned:  # (the common case once said: no lock)
        return
    seam = _by_name[name]
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    reason = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else str(why)
    warn_safely(f"torchlens: torch {torch.__version__} is not shaped as this torchlens expects at {seam.relies_on} "
                f"({reason}); so {seam.lost}", stacklevel=3)
