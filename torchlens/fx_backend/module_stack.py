"""Reading dynamo's `nn_module_stack` node metadata: which module calls an FX node ran inside.

Dynamo records, on each node, `{key: (path, cls)}` for the modules whose forwards were on the
stack when it traced the node, outermost first. The key is `str(id(module))`, with `@N` for the
N-th re-call of a module within the trace; the path is how the module was reached from the
compiled frame (`L['self'].blocks[0]._modules['attn']`).
"""

from __future__ import annotations

import re
from typing import List, Tuple

from ..core.scopes import ScopeTable, outside_names, without_compile_wrappers

__all__ = ["relative_stack"]

_FRAME_LOCAL = re.compile(r"^([LG]\['[^']*'\]|self)\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_MODULES_ITEM = re.compile(r"\._modules\['([^']+)'\]")


def clean_module_path(path: str) -> str:
    """`L['self'].blocks[0]._modules['attn']` -> `blocks.0.attn`; `G['cm']._orig_mod.proj` (a
    compiled module reached through its wrapper) -> `proj`, as the module itself would be named."""
    path = _FRAME_LOCAL.sub("", str(path))
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    return without_compile_wrappers(path)


def relative_stack(table: ScopeTable, stack, frame_path: str) -> Tuple[Tuple[str, bool, str, str], ...]:
    """A node's `nn_module_stack`, relative to the module whose frame was compiled.

    The id in each key gives the module's absolute name in `table` (the path text is the fallback:
    `L['self'].blocks[0]` -> `blocks.0`); names inside the compiled frame's module are made
    relative to it, because dynamo may run the same graph for another instance of that module
    (`blocks.1` reusing `blocks.0`'s graph). Each entry becomes (name, relative?, call suffix,
    class name), which `ScopeTable.resolve` turns into a scope per call.
    """
    entries: List[Tuple[str, bool, str, str]] = []
    prefix = frame_path + "." if frame_path else ""
    for key, (path, cls) in (stack or {}).items():
        base_key, _, call = str(key).partition("@")
        name = table.name_of_id(int(base_key)) if base_key.isdigit() else None
        if name is None and str(path).startswith("G[") and isinstance(cls, type):
            # a module kept in a global, not part of the model (transformers' kernel-hub wrappers of
            # functions such as `apply_rotary_pos_emb`): named as eager names it (`outside_names`)
            label, type_name = outside_names(cls)
            caller, relative = (entries[-1][0], entries[-1][1]) if entries else ("", True)
            entries.append((f"{caller}.{label}" if caller else label, relative, f"@{call}" if call else "",
                            type_name))
            continue
        if name is None:
            name = clean_module_path(path)
            name = prefix + name if name else frame_path
        if not name or name == frame_path:
            continue  # the compiled frame's own module (or the root seen through a wrapper)
        relative = name.startswith(prefix)
        entries.append((name[len(prefix):] if relative else name, relative, f"@{call}" if call else "",
                        getattr(cls, "__name__", str(cls))))
    return tuple(entries)
