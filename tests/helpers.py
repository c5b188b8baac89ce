"""Test helpers: leftover-state probes, a host-sync counter, transcript parsing."""

from __future__ import annotations

import contextlib
import re

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_module = torch.nn.modules.module
_HAS_ANY_GLOBAL_HOOK = _module._has_any_global_hook  # (read before torchlens is imported)


def leftover_state():
    """Everything capture could leave behind in torch (and torchlens's own per-thread state), as
    comparable values."""
    import sys

    from torchlens.eager.capture import captures_in_thread
    from torchlens.eager.module_hooks import routed

    active = sys.modules.get("torchlens.fx_backend.active")
    return (
        captures_in_thread(),
        routed(),
        # the hooks captures share are registered only while one runs: none may stay
        len(_module._global_forward_pre_hooks),
        len(_module._global_forward_hooks),
        len(_module._global_forward_hooks_always_called),
        len(_module._global_backward_hooks),
        _module._has_any_global_hook is _HAS_ANY_GLOBAL_HOOK,  # torch's own check given back
        len(torch.overrides._get_current_function_mode_stack()),
        torch._C._len_torch_dispatch_stack(),
        active is not None and active.active_pass() is not None,
        torch.overrides.has_torch_function is torch._C._has_torch_function,  # fast paths given back
    )


def module_hook_counts(model):
    return [
        (name, len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
        for name, m in model.named_modules()
    ]


_SYNC_FUNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__array__"}
_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
_COPY_OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNC_FUNCS:
            self.counts.append(("function", name))
        return func(*args, **(kwargs or {}))


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            self.counts.append(("dispatch", str(func)))
        elif func in _COPY_OPS:
            out = func(*args, **kwargs)
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0] if func is torch.ops.aten.copy_.default else out
            if isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and dst.device.type == "cpu":
                self.counts.append(("dispatch", "device-to-host copy"))
            return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs():
    """Count host syncs made inside the block: scalar reads (`item`, `tolist`, `bool(t)`,
    `aten._local_scalar_dense`) and device-to-host copies. Yields the list of what was seen.

    Enter it *before* the capture under test, so the capture's own calls pass through it.
    """
    counts = []
    with _DispatchCounter(counts), _FunctionCounter(counts):
        yield counts


OP_LINE = re.compile(r"^(?P<indent> *)#(?P<ordinal>\d+)\s+(?P<op>\S+)\s+(?P<rest>.*)$")
ENTER_LINE = re.compile(r"^(?P<indent> *)> (?P<path>\S+) \((?P<type>\w+)\)$")
EXIT_LINE = re.compile(r"^(?P<indent> *)< (?P<path>\S+)")


def op_lines(text: str):
    return [line for line in text.splitlines() if line.lstrip().startswith("#")]


def ordinals(text: str):
    return [int(OP_LINE.match(line).group("ordinal")) for line in op_lines(text)]


def check_nesting(text: str):
    """Assert that `>`/`<` lines balance and that indentation follows the depth of module calls:
    two spaces per module open around the line. Returns the deepest nesting seen."""
    stack = []
    deepest = 0
    for line in text.splitlines():
        if m := ENTER_LINE.match(line):
            assert len(m.group("indent")) == 2 * len(stack), line
            stack.append(m.group("path"))
            deepest = max(deepest, len(stack))
        elif m := EXIT_LINE.match(line):
            assert stack and stack[-1] == m.group("path"), f"unbalanced exit: {line!r} with open {stack}"
            stack.pop()
            assert len(m.group("indent")) == 2 * len(stack), line
        elif m := OP_LINE.match(line):
            at = re.search(r"  @(\S+)", line)
            assert len(m.group("indent")) == 2 * len(stack), line
            if stack:
                assert at and (at.group(1) == stack[-1]), f"op {line!r} outside its module {stack[-1]}"
    assert not stack, f"modules never closed: {stack}"
    return deepest
