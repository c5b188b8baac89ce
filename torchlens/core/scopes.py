"""Module scopes: which module call an event belongs to, and what that module is called."""

from __future__ import annotations

import re
import types
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ..events import Scope

__all__ = ["ScopeTable", "is_compile_wrapper", "outside_names", "without_compile_wrappers"]


class ScopeTable:
    """Names module calls: `Scope`s with absolute paths, parented by the module that *called* them.

    A scope's parent is the module whose forward called it, not the module that owns it as an
    attribute: `blocks.0`'s parent is the root, because the `blocks` ModuleList is never called.
    Scopes are interned per (calling scope, module), so events of one call share one object.

    Three sources name calls: module hooks (eager: `module_scope(module, caller)`), the Python stack
    (code dynamo runs between graphs: `scope_of_stack(frame)`), and FX node metadata (compiled
    graphs: `fx_backend.module_stack` reads it at compile time, `resolve(frame_scope, ...)` per call).
    """

    def __init__(self, root: Optional[torch.nn.Module]):
        self.root_scope = Scope("", type(_module_of(root)).__name__ if root is not None else "<compiled>", None)
        self._root = weakref.ref(root) if root is not None else None  # a table never keeps a model alive
        self._names: Dict[int, str] = {}
        self._refs: Dict[int, weakref.ref] = {}
        self._interned: Dict[Tuple, Scope] = {}
        self._calls: Dict[Tuple[int, int], Tuple[Scope, weakref.ref]] = {}
        self._unknown: Dict[int, weakref.ref] = {}  # modules not in the root when it was last read
        self._fingerprint: Optional[list] = None  # the module tree's shape when the names were last read
        self.refresh()

    @property
    def root(self) -> Optional[torch.nn.Module]:
        """The model this table names (None once it is collected, or for a compiled function)."""
        return self._root() if self._root is not None else None

    @classmethod
    def for_model(cls, root: torch.nn.Module) -> "ScopeTable":
        """The table of `root`, kept between captures of the same model (building it walks every
        module; a repeated forward then finds each call's scope with one lookup)."""
        table = _tables.get(root)
        if table is None:
            table = _tables[root] = cls(root)
        elif table._fingerprint != tree_fingerprint(root):
            table.refresh()  # the model changed since: modules swapped, added, removed or renamed
        return table

    def refresh(self) -> None:
        """(Re)read the module names from the root: when a capture starts, and when a module turns
        up that the table has not seen, in case the model was changed since.

        The tables are built aside and swapped in, never cleared in place: a capture in another
        thread may be reading them (the same model narrated twice at once) and must see either
        the old names or the new ones, never an empty table.
        """
        root = self._root() if self._root is not None else None
        if root is None:
            return
        fingerprint = tree_fingerprint(root)
        names, refs = {}, {}
        for name, module in root.named_modules():
            name = without_compile_wrappers(name)  # a compiled module is named as the module it wraps
            if id(module) not in names:
                names[id(module)] = name
                refs[id(module)] = weakref.ref(module)
        self._names, self._refs = names, refs
        self._fingerprint = fingerprint  # after the swap: a reader matching it finds the new names
        # Names may have moved: calls of the model's modules are named afresh (the interned scopes
        # stay valid); calls of modules that are not part of it (created on the fly, or another
        # model run inside this forward) keep theirs, or a call open now could not be closed.
        self._calls = {key: call for key, call in list(self._calls.items()) if key[0] not in names}
        self._unknown = {}

    def knows(self, module) -> bool:
        """Whether `module` is the root or one of its submodules."""
        ref = self._refs.get(id(module))
        return ref is not None and ref() is module

    @property
    def paths(self):
        """Every module path of the root, "" (the root itself) included."""
        return list(self._names.values())

    def module_scope(self, module, parent: Optional[Scope] = None) -> Scope:
        """The scope of `module` called from `parent` (the root's scope for the root itself).

        A module that is not part of the root (created on the fly, or passed in) is named under its
        caller after what it is (`outside_names`): `attn.<Linear>`, `attn.<apply_rotary_pos_emb>`.
        """
        parent = parent or self.root_scope
        call = self._calls.get((id(module), id(parent)))  # the common case: a call seen before
        if call is not None and call[1]() is module:
            return call[0]
        name = self._name(module)
        if name == "":
            return self.root_scope
        type_name = type(module).__name__
        if name is None:
            label, type_name = outside_names(type(module))
            if parent.path.endswith(label):
                # called by a module of its own class that is not part of the model either: a
                # dispatching wrapper (transformers' kernel-hub `Func` calls a per-model copy,
                # which compiled code calls as a function) is one scope, as dynamo records it
                self._calls[(id(module), id(parent))] = (parent, weakref.ref(module))
                return parent
            name = f"{parent.path}.{label}" if parent.path else label
        scope = self._child(parent, name, name, type_name)
        self._calls[(id(module), id(parent))] = (scope, weakref.ref(module))
        return scope

    def _name(self, module) -> Optional[str]:
        """The module's path under the root (None for a module that is not part of it)."""
        names, refs = self._names, self._refs  # one consistent pair, whatever another thread swaps in
        ref = refs.get(id(module))
        if ref is None or ref() is not module:
            unknown = self._unknown.get(id(module))
            if unknown is not None and unknown() is module:
                return None  # created on the fly, already looked for since the last read
            self.refresh()  # a module the table has not seen: the model may have changed
            names, refs = self._names, self._refs
            ref = refs.get(id(module))
            if ref is None or ref() is not module:
                self._unknown[id(module)] = weakref.ref(module)
                return None
        return names.get(id(module))

    def paths_of(self, module) -> Tuple[str, ...]:
        """The paths `module`'s calls are named by: its path, or for a module that is not part of
        the model one per caller it was called from (`caller.<Type>`: a function wrapper kept in a
        global is called by every layer)."""
        names, refs = self._names, self._refs
        ref = refs.get(id(module))
        if ref is not None and ref() is module:
            return (names[id(module)],) if id(module) in names else ()
        return tuple(scope.path for (module_id, _), (scope, call_ref) in list(self._calls.items())
                     if module_id == id(module) and call_ref() is module)

    def scope_of_traceback(self, tb) -> Scope:
        """The scope of the innermost module of the model whose code the traceback `tb` ran through,
        from its outermost frame in: unlike `scope_of_stack`, it sees frames that no longer link
        to their callers (a finished generator expression) and torch's own module-call frames."""
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        return self._scope_of_frames(frames)

    def scope_of_stack(self, frame) -> Scope:
        """The scope of the innermost module of the model whose code runs on the Python stack
        from `frame` outwards, nested in the scopes of the modules that called it."""
        frames = []
        for _ in range(_MAX_FRAMES):
            if frame is None:
                break
            frames.append(frame)
            frame = frame.f_back
        return self._scope_of_frames(reversed(frames))

    def _scope_of_frames(self, frames) -> Scope:
        """The scope nesting the model's modules whose code runs in `frames` (outermost first):
        a frame of a method of a known module (its `self`) opens that module's call."""
        scope, last = self.root_scope, None
        for frame in frames:
            if "self" in frame.f_code.co_varnames:
                module = _module_of(frame.f_locals.get("self"))
                if module is not None and module is not last and self.knows(module):
                    scope, last = self.module_scope(module, scope), module
        return scope

    def name_of_id(self, module_id: int) -> Optional[str]:
        """The path of the model's module with this `id` (None when the table has no such module)."""
        return self._names.get(module_id)

    def resolve(self, frame_scope: Scope, entries) -> Scope:
        """The scope of an op run in `frame_scope` under these `relative_stack` entries."""
        scope = frame_scope
        prefix = frame_scope.path + "." if frame_scope.path else ""
        for name, relative, call, type_name in entries:
            path = prefix + name if relative else name
            scope = self._child(scope, path, path + call, type_name)
        return scope

    def _child(self, parent: Scope, path: str, key: str, type_name: str) -> Scope:
        chain_key = (id(parent), key, type_name)  # a module swapped for another class: a new scope
        scope = self._interned.get(chain_key)
        if scope is None:  # setdefault: two threads meeting a new call keep one scope for it
            scope = self._interned.setdefault(chain_key, Scope(path, type_name, parent, key))
        return scope


_tables: "weakref.WeakKeyDictionary[torch.nn.Module, ScopeTable]" = weakref.WeakKeyDictionary()


def outside_names(cls: type) -> Tuple[str, str]:
    """(the label in `<...>`, the type shown) of a module class called from inside a model but not
    part of it, as both substrates name its calls (eager from the module, compiled from the class
    dynamo records).

    Most such modules are named after their class (`<Linear>`). A class made inside a function
    (its `__qualname__` holds `<locals>`) is a wrapper a factory made around one function or
    class, which is what the user knows: it is named after the one its `forward` closes over, and
    shown with where that lives. The `kernels` hub (transformers 5) wraps `apply_rotary_pos_emb`
    in such a `Func`: `attn.<apply_rotary_pos_emb>` of type
    `transformers.models.llama.modeling_llama.apply_rotary_pos_emb`, not `attn.<Func>`."""
    known = _outside.get(cls)
    if known is None:
        wrapped = _wrapped_by_factory_class(cls)
        if wrapped is None:
            known = (f"<{cls.__name__}>", cls.__name__)
        else:
            home = getattr(wrapped, "__module__", None) or "?"
            where = f"{home}.{getattr(wrapped, '__qualname__', wrapped.__name__)}"
            known = (f"<{wrapped.__name__}>", where)
        _outside[cls] = known
    return known


def _wrapped_by_factory_class(cls: type):
    """The one function or class the `forward` of a factory-made module class closes over, or None."""
    if "<locals>" not in getattr(cls, "__qualname__", ""):
        return None
    cells = getattr(getattr(cls, "forward", None), "__closure__", None) or ()
    found: List[object] = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, types.FunctionType) or isinstance(value, type) and not issubclass(value, torch.nn.Module):
            found.append(value)
    return found[0] if len(found) == 1 and getattr(found[0], "__name__", None) else None


_outside: "weakref.WeakKeyDictionary[type, Tuple[str, str]]" = weakref.WeakKeyDictionary()

_MAX_FRAMES = 64


def tree_fingerprint(root: torch.nn.Module) -> list:
    """What a model's module names depend on, read ten times faster than `named_modules()`: for
    every module reached, its identity and its children's names and identities, in walk order.
    Equal fingerprints mean `named_modules()` would give the same modules under the same names
    (a module reached twice is listed once, as `named_modules()` does)."""
    out = []
    seen = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        children = module._modules
        out.append((id(module), tuple((name, id(child)) for name, child in children.items())))
        stack.extend(child for child in reversed(children.values()) if child is not None)
    return out


def is_compile_wrapper(module: torch.nn.Module) -> bool:
    """Whether `module` is what `torch.compile(module)` returned (an `OptimizedModule`): it stands
    for the module it wraps, whose own call is the one narrated."""
    return "_orig_mod" in module._modules


def _module_of(obj) -> Optional[torch.nn.Module]:
    if not isinstance(obj, torch.nn.Module):
        return None
    return getattr(obj, "_orig_mod", obj)  # an OptimizedModule stands for the module it wraps


_WRAPPER = re.compile(r"(?:^|\.)_orig_mod(?=\.|$)")  # torch.compile's OptimizedModule attribute


def without_compile_wrappers(path: str) -> str:
    """`block._orig_mod.fc` -> `block.fc`: a module reached through what `torch.compile` returned
    is named as the module itself."""
    return _WRAPPER.sub("", path).strip(".")
