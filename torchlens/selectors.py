"""Selectors: which events are narrated.

A selector is a predicate over an `Event`. `tl.in_module("transformer.h.3")` keeps that module's
subtree: its own enter/exit lines (the context) and every op inside it. Selectors compose with
`|`, `&` and `~`, and any plain callable `event -> bool` can stand in for one (it is wrapped).

Selection changes what is printed, never what is recorded: ordinals stay global, so a selected
line's `#N` is the same as in the full transcript.
"""

from __future__ import annotations

from typing import Callable, Iterable

from .errors import OptionTypeError, OptionValueError, UnknownModuleError, suggest
from .events import Event

__all__ = ["InModule", "Predicate", "Selector", "as_selector", "in_module"]


class Selector:
    """Base class: subclasses implement `__call__(event) -> bool`."""

    def __call__(self, event: Event) -> bool:
        raise NotImplementedError

    def module_paths(self) -> Iterable[str]:
        """Module paths this selector names, checked against the model before the run."""
        return ()

    def check_paths(self, known: Iterable[str], missing: str = "the model has no module at that path") -> None:
        """Raise `UnknownModuleError` for a named module that is not among `known`; `missing` says
        where it was looked for (a model's modules, or the modules one recorded forward called)."""
        known = set(known)
        for path in self.module_paths():
            if path not in known:
                raise UnknownModuleError(
                    f"in_module({path!r}): {missing}{suggest(path, known)}{_children_hint(path, known)}"
                )

    def __or__(self, other) -> "Selector":
        return _AnyOf(self, as_selector(other, _COMBINED))

    def __ror__(self, other) -> "Selector":
        return _AnyOf(as_selector(other, _COMBINED), self)

    def __and__(self, other) -> "Selector":
        return _AllOf(self, as_selector(other, _COMBINED))

    def __rand__(self, other) -> "Selector":
        return _AllOf(as_selector(other, _COMBINED), self)

    def __invert__(self) -> "Selector":
        return _Not(self)

    def _identity(self) -> tuple:
        """What makes two selectors the same selection: so that `NarrationOptions` built twice from
        the same arguments compare equal (the default is the object itself)."""
        return (id(self),)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._identity() == self._identity()

    def __hash__(self) -> int:
        return hash((type(self), self._identity()))


class InModule(Selector):
    """Events inside any of the given module paths (the modules' own enter/exit lines included)."""

    def __init__(self, *paths: str):
        if not paths:
            raise OptionValueError("in_module() needs at least one module path, e.g. in_module('encoder.layer.3')")
        for path in paths:
            if not isinstance(path, str):
                raise OptionTypeError(f"in_module() takes module paths as strings, got {type(path).__name__}")
            if not path:
                raise OptionValueError("in_module(''): the root is selected by default; pass a submodule path")
        self.paths = tuple(paths)
        self._prefixes = tuple(p + "." for p in paths)

    def __call__(self, event: Event) -> bool:
        path = event.scope.path
        return path in self.paths or path.startswith(self._prefixes)

    def module_paths(self):
        return self.paths

    def _identity(self) -> tuple:
        return self.paths

    def __repr__(self) -> str:
        return "in_module(" + ", ".join(repr(p) for p in self.paths) + ")"


class Predicate(Selector):
    """Wraps a plain `event -> bool` callable so it composes with other selectors."""

    def __init__(self, fn: Callable[[Event], bool]):
        self.fn = fn

    def __call__(self, event: Event) -> bool:
        return bool(self.fn(event))

    def _identity(self) -> tuple:
        return (id(self.fn),)  # the same function; callables need not be hashable

    def __repr__(self) -> str:
        return f"Predicate({getattr(self.fn, '__name__', self.fn)!r})"


class _AnyOf(Selector):
    def __init__(self, *parts: Selector):
        self.parts = parts

    def __call__(self, event: Event) -> bool:
        return any(part(event) for part in self.parts)

    def module_paths(self):
        return [p for part in self.parts for p in part.module_paths()]

    def _identity(self) -> tuple:
        return self.parts

    def __repr__(self) -> str:
        return "(" + " | ".join(map(repr, self.parts)) + ")"


class _AllOf(_AnyOf):
    def __call__(self, event: Event) -> bool:
        return all(part(event) for part in self.parts)

    def __repr__(self) -> str:
        return "(" + " & ".join(map(repr, self.parts)) + ")"


class _Not(Selector):
    def __init__(self, inner: Selector):
        self.inner = inner

    def __call__(self, event: Event) -> bool:
        return not self.inner(event)

    def module_paths(self):
        return self.inner.module_paths()

    def _identity(self) -> tuple:
        return (self.inner,)

    def __repr__(self) -> str:
        return f"~{self.inner!r}"


def _children_hint(path: str, known) -> str:
    """'; modules under 'a.b': a.b.c, a.b.d' for the deepest ancestor of `path` that exists (or that
    it has none: the message always says what could have been named)."""
    parent = path
    while parent:
        parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        if parent in known:
            break
    prefix = parent + "." if parent else ""
    children = sorted(p for p in known if p.startswith(prefix) and p and "." not in p[len(prefix):])
    if not children:
        return f"; {repr(parent) if parent else 'the model'} has no submodules"
    shown = ", ".join(children[:8]) + (", ..." if len(children) > 8 else "")
    return f"; modules under {repr(parent) if parent else 'the root'}: {shown}"


def in_module(*paths: str) -> Selector:
    """Narrate only these modules' subtrees: `tl.in_module("transformer.h.3")`.

    Paths are dotted names as in `model.named_modules()`; an unknown path is an error at the start
    of the run that names the nearest existing paths.
    """
    return InModule(*paths)


_COMBINED = "combining selectors with | or &"


def as_selector(obj, argument: str = "select=") -> Selector:
    """`obj` as a `Selector` (a plain callable is wrapped); `argument` names what the user passed it
    as, for the error when it is neither."""
    if isinstance(obj, Selector):
        return obj
    if callable(obj):
        return Predicate(obj)
    raise OptionTypeError(
        f"{argument} takes a selector such as tl.in_module('...') or a callable event -> bool, got {type(obj).__name__}"
    )
