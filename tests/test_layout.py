"""The package's shape: imports go one way (no cycles), and the compiled substrate stands beside the
eager one, taking from it only the capture mode (for code between graphs) and the eager re-run
(which locates a failure dynamo reports without a location)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchlens"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict:
    """module -> the package modules it imports, at module level or inside a function (a late
    import still makes one module depend on the other)."""
    graph = {}
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = _resolve(name, path.name == "__init__.py", node.level, node.module or "")
                else:
                    target = node.module or ""
                if not target.startswith("torchlens"):
                    continue
                for alias in node.names:  # `from . import debug` names a module
                    candidate = f"{target}.{alias.name}"
                    edges.add(candidate if candidate in modules else target)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.startswith("torchlens."))
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def _cycle(graph: dict):
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "torchlens.core.session" in graph and graph["torchlens.core.session"], "the graph reader found no imports"
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or ())


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_compiled_substrate_takes_only_the_capture_mode_and_the_eager_rerun_from_eager():
    graph = import_graph()
    used = {edge for module, edges in graph.items() if module.startswith("torchlens.fx_backend")
            for edge in edges if edge.startswith("torchlens.eager")}
    assert used <= {"torchlens.eager.capture", "torchlens.eager.runner"}, used


def test_core_modules_import_neither_substrate():
    graph = import_graph()
    substrates = ("torchlens.eager", "torchlens.fx_backend")
    for module, edges in graph.items():
        if module.startswith(substrates) or module in ("torchlens", "torchlens.api", "torchlens.recording"):
            continue
        assert not {edge for edge in edges if edge.startswith(substrates)}, module


# what each package below the substrates may import: "" is the package root's modules (the public
# types: events, findings, errors, options, selectors, results)
_LAYERS = {
    "torch_internals": {""},
    "narration": {""},
    "measure": {"", "torch_internals", "narration"},
    # the pass keeps a one-op repro's inputs (repro.kept) and, with backward=True, notes autograd's
    # nodes for the backward (forward_pass -> backward)
    "core": {"", "torch_internals", "narration", "measure", "repro", "backward"},
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in _LAYERS) else ""


def test_each_layer_imports_only_the_layers_below_it():
    """torch's internals and text at the bottom, the measurement core above them, the pass every
    substrate feeds above that: a package that reaches up (measure importing core, say) fails."""
    graph = import_graph()
    reached = {(module, edge) for module, edges in graph.items() if _package(module) in _LAYERS
               for edge in edges if _package(edge) != _package(module)
               and _package(edge) not in _LAYERS[_package(module)]}
    assert reached == set(), sorted(reached)
    assert any(_package(module) == "measure" for module in graph), "no measure package found"


def long_functions(limit: int = 60) -> list:
    """Functions of the package longer than `limit` lines (from `def` to their last line)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_sixty_lines():
    """A function that does one thing fits on a screen; a longer one is two jobs to split."""
    assert long_functions() == []
    assert long_functions(limit=40), "the scan found no function at all"
