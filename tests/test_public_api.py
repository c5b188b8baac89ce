"""The public API stays small and explicit: every public module says what it exports."""

import ast
import importlib
import inspect
import pathlib
import pkgutil

import pytest
import torch
from torch import nn

import torchlens as tl

PUBLIC_MODULES = ["torchlens", "torchlens.options", "torchlens.errors", "torchlens.recording", "torchlens.debug"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_module_declares_what_it_exports(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name} has no __all__"
    missing = [item for item in exported if not hasattr(module, item)]
    assert missing == []


def test_star_imports_bring_no_implementation_details():
    namespace = {}
    exec("from torchlens.options import *", namespace)
    assert "os" not in namespace and "make_settings" not in namespace and "NarrationOptions" in namespace
    namespace = {}
    exec("from torchlens.errors import *", namespace)
    assert "suggest" not in namespace and "warnings" not in namespace and "NonFiniteError" in namespace


def test_dir_of_the_package_shows_its_api_not_its_implementation_modules():
    """A newcomer's `dir(tl)` listed every internal module (`grammar`, `meter`, `pipeline`, ...)
    beside the dozen names they need."""
    shown = set(dir(tl))
    assert {"record", "trace", "compile", "load", "watch", "in_module", "options", "recording", "debug",
            "errors", "Recording", "Trace", "PartialTrace", "Finding", "Watch", "Fault"} <= shown
    assert tl.Watch is tl.watching.Watch and tl.recording.Recorder and tl.options.NarrationOptions
    assert not shown & {"grammar", "meter", "pipeline", "session", "narrator", "fx_backend", "eager", "api"}
    assert all(hasattr(tl, name) for name in shown)
    assert tl.narration.grammar is importlib.import_module("torchlens.narration.grammar")  # still reachable for who needs it


def test_compile_is_public_but_not_star_exported():
    assert callable(tl.compile) and "compile" not in tl.__all__


def test_a_compiled_model_offers_its_narration_not_its_runtime():
    import copy

    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    compiled = tl.compile(model, compiler="eager")
    torch._dynamo.reset()
    try:
        assert compiled.torchlens.last_recording is None and compiled.torchlens.forwards == 0
        compiled(torch.randn(2, 3))
        compiled(torch.randn(2, 3))
    finally:
        torch._dynamo.reset()
    handle = compiled.torchlens
    assert handle.forwards == 2 and isinstance(handle.last_recording, tl.Recording)
    assert repr(handle) == "CompiledNarration(forwards=2, last_recording=Recording)"
    assert not hasattr(handle, "config") and not hasattr(handle, "scopes")  # no runtime internals
    with pytest.raises(AttributeError):
        handle.last_recording = None
    assert getattr(copy.deepcopy(compiled), "torchlens", None) is None  # a copy carries no narration state


def test_every_entry_point_takes_exactly_the_keywords_of_the_one_keyword_table():
    """`tl.record`, `tl.trace`, `Recorder` and `tl.compile` take the keywords the table in
    `torchlens.options` lists for them, no more and no fewer, so a keyword added to one entry
    point without the table (and its check) fails here."""
    import inspect

    from torchlens.options import COMPILE, RECORD, RECORDER, TRACE, keywords_of

    def named_keywords(fn, skip=()):
        parameters = inspect.signature(fn).parameters.values()
        return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in skip}

    assert named_keywords(tl.record) == set(keywords_of(RECORD))
    assert named_keywords(tl.trace, skip=("compiled",)) == set(keywords_of(TRACE))
    assert named_keywords(tl.recording.Recorder.__init__) == set(keywords_of(RECORDER))
    assert named_keywords(tl.compile) == set(keywords_of(COMPILE))
    from torchlens.fx_backend.config import OPTION_KEYS

    assert set(OPTION_KEYS) == set(keywords_of(COMPILE))  # the string backend's options= keys


@pytest.mark.parametrize("keyword,bad", [("value_stats", "exakt"), ("on_nonfinite", "trak"), ("narrate", 3.5)])
def test_a_shared_keyword_is_checked_alike_by_every_entry_point(keyword, bad):
    model = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    messages = set()
    for call in (lambda: tl.record(model, x, **{keyword: bad}),
                 lambda: tl.trace(model, x, **{keyword: bad}),
                 lambda: tl.recording.Recorder(model, **{keyword: bad}),
                 lambda: tl.compile(model, **{keyword: bad})):
        with pytest.raises((tl.errors.OptionTypeError, tl.errors.OptionValueError)) as info:
            call()
        messages.add(str(info.value))
    assert len(messages) == 1, messages


# Modules whose `__all__` is the user's `from ... import *` surface, kept free of the helpers the
# package shares internally (`test_star_imports_bring_no_implementation_details`): other torchlens
# modules may import names from them that their `__all__` leaves out.
USER_API_MODULES = {"torchlens.options", "torchlens.errors"}


def _all_modules() -> dict:
    """Every module of the package, imported: name -> module."""
    modules = {"torchlens": tl}
    for info in pkgutil.walk_packages(tl.__path__, prefix="torchlens."):
        modules[info.name] = importlib.import_module(info.name)
    return modules


def _defined_at_top_level(tree: ast.Module) -> set:
    """The names a module binds itself at top level (a def, a class, an assignment, inside a
    top-level `if` or `try` too), not the names it imports."""
    names = set()

    def bind(target):
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, (ast.If, ast.For, ast.While, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return names


def _imported_from_package(modules: dict) -> dict:
    """source module -> {name: importing modules}, for every `from <torchlens module> import name`
    (relative or absolute, at module level or inside a function) in the package's source."""
    imported = {}
    for importer, module in modules.items():
        path = pathlib.Path(module.__file__)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = importer.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in modules or source == importer:
                continue
            for alias in node.names:
                imported.setdefault(source, {}).setdefault(alias.name, set()).add(importer)
    return imported


def test_every_module_declares_all_and_lists_what_the_package_imports_from_it():
    """A module that defines public functions or classes declares `__all__`; every name in an
    `__all__` exists; and a public name a module defines that another torchlens module imports
    (`from .x import name`) is in `x.__all__` (a submodule, a private name or a name `x` itself
    imports from elsewhere is not)."""
    modules = _all_modules()
    problems = []
    for name, module in sorted(modules.items()):
        exported = getattr(module, "__all__", None)
        own = sorted(item for item, obj in vars(module).items()
                     if not item.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                     and obj.__module__ == name)
        if exported is None and own:
            problems.append(f"{name}: no __all__ (it defines {', '.join(own)})")
        absent = [item for item in exported or () if not hasattr(module, item)]
        if absent:
            problems.append(f"{name}: __all__ names what the module lacks: {', '.join(absent)}")
    for source, names in sorted(_imported_from_package(modules).items()):
        if source in USER_API_MODULES:
            continue
        defined = _defined_at_top_level(ast.parse(pathlib.Path(modules[source].__file__).read_text()))
        exported = set(getattr(modules[source], "__all__", ()))
        missing = {item: importers for item, importers in names.items()
                   if not item.startswith("_") and item in defined and f"{source}.{item}" not in modules
                   and item not in exported}
        if missing:
            problems.append(f"{source}: __all__ lacks names other torchlens modules import: " + "; ".join(
                f"{item} (by {', '.join(sorted(importers))})" for item, importers in sorted(missing.items())))
    if problems:
        pytest.fail("modules whose __all__ is missing or incomplete:\n  " + "\n  ".join(problems), pytrace=False)
