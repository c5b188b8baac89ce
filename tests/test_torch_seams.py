"""Every private torch internal torchlens relies on is in one table (`torchlens.torch_internals.seams`): this
test fails when a torch upgrade moved one, and a seam that stops applying at run time warns once,
saying what the user loses, instead of narrating a wrong transcript in silence."""

from __future__ import annotations

import ast
import collections
import pathlib
import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.torch_internals import seams as torch_seams


def test_every_seam_applies_on_the_installed_torch():
    broken = {name: why for name, why in torch_seams.check().items() if why is not None}
    assert broken == {}, f"torch {torch.__version__} moved what these rely on: {broken}"


def test_each_row_says_what_is_patched_where_and_what_is_lost():
    names = [seam.name for seam in torch_seams.SEAMS]
    assert len(names) == len(set(names))
    for seam in torch_seams.SEAMS:
        assert seam.relies_on and seam.where and seam.lost, seam


def test_the_dynamo_rules_are_applied_once_a_capture_meets_dynamo():
    """Applies is not enough: the patches must be in place after a capture ran around compiled code."""
    from torch._dynamo import output_graph, utils
    from torch._dynamo.variables import torch_function
    from torch._dynamo.variables.tensor import TensorVariable

    inner = torch.compile(nn.Linear(2, 2), backend="eager")
    tl.record(nn.Sequential(inner), torch.randn(1, 2))
    tl.compile(nn.Linear(2, 2), compiler="eager")(torch.randn(1, 2))
    assert getattr(torch_function.SymbolicTorchFunctionState.__init__, "torchlens_rule", False)
    assert getattr(utils.set_torch_function_mode_stack, "torchlens_rule", False)
    assert getattr(output_graph.OutputGraph.call_user_compiler, "torchlens_rule", False)
    assert TensorVariable.__dict__["call_method"].__name__ == "marking"


def test_a_probe_notices_a_moved_internal(monkeypatch):
    from torch._dynamo.variables import torch as torch_variables

    monkeypatch.delattr(torch_variables.TorchInGraphFunctionVariable, "_get_handlers")
    assert torch_seams.check()["fast-path handlers"] == "TorchInGraphFunctionVariable has no _get_handlers"


def test_a_seam_that_stops_applying_warns_once_with_what_is_lost(monkeypatch):
    """The fast-path handlers dynamo keeps cannot be read: narration goes on, and says once what is lost."""
    from torch._dynamo.variables import torch as torch_variables

    monkeypatch.setattr(torch_seams, "_warned", set())

    def moved(*args, **kwargs):
        raise AttributeError("moved in this torch")

    monkeypatch.setattr(torch_variables.TorchInGraphFunctionVariable, "_get_handlers", moved)
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).eval()
    x = torch.randn(1, 3, 8)
    with pytest.warns(tl.errors.NarrationWarning) as caught:
        with torch.no_grad():
            recording = tl.record(model, x)
    messages = [str(w.message) for w in caught if "not shaped as this torchlens expects" in str(w.message)]
    assert len(messages) == 1, messages
    assert "_get_handlers" in messages[0] and "breaks its graph at every fast-path check" in messages[0]
    with torch.no_grad():
        assert torch.equal(recording.output, model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tl.errors.NarrationWarning)
        with torch.no_grad():
            tl.record(model, x)  # said once per process


# -- the table is complete by construction: every private access is a row's ------------------------

_PACKAGE = pathlib.Path(torch_seams.__file__).parent.parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> set:
    """The private attribute names torch's own objects carry (read from torch, not listed by hand):
    of tensors, modules, autograd nodes, graphs, operators, hook handles, DTensors."""
    import torch.distributed.tensor as dtensor
    import torch.fx
    import torch.utils.hooks

    graph_module = torch.fx.symbolic_trace(nn.Linear(2, 2))
    objects = [torch.ones(1), nn.Linear(1, 1), torch.ones(1, requires_grad=True).mul(2).grad_fn, graph_module,
               graph_module.graph, next(iter(graph_module.graph.nodes)), torch.ops.aten.add.Tensor, torch.ops.aten.add,
               torch.utils.hooks.RemovableHandle(collections.OrderedDict()), dtensor.DTensor, torch.Generator(),
               torch.autograd.Function]
    return {name for thing in objects for name in dir(thing) if _private(name)}


def _own_attributes() -> set:
    """The attribute names torchlens's own classes and objects define (its `_x` is its business)."""
    ours = set()
    for path in _PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        ours.add(item.name)
                    elif isinstance(item, ast.Assign):
                        ours.update(t.id for t in item.targets if isinstance(t, ast.Name))
                        ours.update(c.value for c in ast.walk(item.value)
                                    if isinstance(c, ast.Constant) and isinstance(c.value, str))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        ours.add(item.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
    return ours


def _chain(node) -> list:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _torch_roots(tree) -> dict:
    """The names a module binds to torch or to something reached through it, each with the dotted
    path it stands for (`import torch`; `from torch._C import _functorch`; `_M = torch.nn.modules.module`)."""
    roots = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            roots.update((alias.asname or alias.name, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            roots.update(((alias.asname or alias.name).split(".")[0], alias.asname and alias.name or "torch")
                         for alias in node.names if alias.name.split(".")[0] == "torch")
        elif isinstance(node, ast.Assign) and _chain(node.value)[:1] == ["torch"]:
            roots.update((target.id, ".".join(_chain(node.value))) for target in node.targets
                         if isinstance(target, ast.Name))
    return roots


def private_accesses() -> dict:
    """module -> {name}: every private torch name the package imports or reads (`torch._C._x`,
    `from torch._dynamo import y`, `tensor._version`), by the module that does; a dotted path
    through a private part is named by its last part (`torch._dynamo.utils.orig_code_map`:
    `orig_code_map`)."""
    attributes = _torch_private_attributes() - _own_attributes()
    found = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(_PACKAGE).with_suffix("").parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        roots, names = _torch_roots(tree), set()
        inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[-1] for alias in node.names
                             if alias.name.split(".")[0] == "torch" and any(map(_private, alias.name.split("."))))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                in_private = any(map(_private, node.module.split(".")))
                names.update(alias.name for alias in node.names if in_private or _private(alias.name))
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                parts = _chain(node)
                full = [*roots[parts[0]].split("."), *parts[1:]] if parts[:1] and parts[0] in roots else []
                if any(map(_private, full[1:])):
                    names.add(full[-1])
                elif node.attr in attributes:
                    names.add(node.attr)
        if names:
            found[module] = names
    return found


def _seam_modules(where: str) -> set:
    """The package modules a row's `where` names (`eager.capture.exclude_from_dynamo, mode_stack`)."""
    modules = {".".join(path.relative_to(_PACKAGE).with_suffix("").parts) for path in _PACKAGE.rglob("*.py")}
    named = set()
    for place in where.replace(",", " ").split():
        parts = place.strip("()`").split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                named.add(".".join(parts[:end]))
                break
    return named


def test_every_private_torch_access_is_a_seam_rows_and_named_in_it():
    """What a torch upgrade can break is in the table by construction, not by care: each private
    name a module reads must be named by a row whose `where` is that module (the table itself,
    which probes them all, is exempt)."""
    rows = [(_seam_modules(seam.where), seam.relies_on) for seam in torch_seams.SEAMS]
    missing = {}
    for module, names in private_accesses().items():
        if module == "torch_internals.seams":
            continue
        uncovered = sorted(name for name in names
                           if not any(module in modules and name in relies_on for modules, relies_on in rows))
        if uncovered:
            missing[module] = uncovered
    assert missing == {}, f"private torch reached outside the seam table (add a row, or name it in one): {missing}"


def test_the_completeness_scan_sees_each_kind_of_private_access():
    """The scan itself can fail to see: it must find a private import, a private chain through an
    alias, and a torch object's private attribute, in code written for it."""
    code = ("import torch\nfrom torch._C import _functorch\n_M = torch.nn.modules.module\n"
            "def f(t):\n    return t._version, _M._global_forward_hooks, torch.overrides._get_current_function_mode_stack()\n")
    tree = ast.parse(code)
    roots = _torch_roots(tree)
    assert roots["_functorch"] == "torch._C._functorch" and roots["_M"] == "torch.nn.modules.module"
    assert "_version" in _torch_private_attributes()


def node_meta_reads(tree: ast.AST) -> set:
    """The string keys of a node's `meta` that code reads by a literal (`node.meta.get("val")`,
    `node.meta["val"]`, `"val" in node.meta`)."""
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            owner, key = node.func.value, node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript):
            owner, key = node.value, node.slice
        elif isinstance(node, ast.Compare) and len(node.comparators) == 1 and isinstance(node.ops[0], ast.In):
            owner, key = node.comparators[0], node.left
        else:
            continue
        if isinstance(owner, ast.Attribute) and owner.attr == "meta" and isinstance(key, ast.Constant):
            keys.add(key.value)
    return keys


def test_dynamo_node_meta_is_read_only_where_its_seam_row_says():
    """The keys dynamo writes into a graph node's meta are dynamo's, not torch.fx's contract: a
    module reading one by name, outside `node_meta`, would escape the row's probe."""
    outside = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(_PACKAGE).with_suffix("").parts)
        keys = node_meta_reads(ast.parse(path.read_text(encoding="utf-8")))
        if keys and module != "torch_internals.node_meta":
            outside[module] = sorted(keys)
    assert outside == {}, f"dynamo's node meta read outside torchlens/torch_internals/node_meta.py: {outside}"
    code = 'def f(n):\n    return n.meta.get("val"), n.meta["stack_trace"], "nn_module_stack" in n.meta, d.get("x")\n'
    assert node_meta_reads(ast.parse(code)) == {"val", "stack_trace", "nn_module_stack"}


def test_the_node_meta_probe_notices_a_key_dynamo_stopped_writing(monkeypatch):
    from torchlens.torch_internals import node_meta

    monkeypatch.setattr(node_meta, "module_stack", lambda node: None)
    assert torch_seams.check()["node meta"] == "a captured graph's nodes carry no nn_module_stack naming their module"
    monkeypatch.undo()
    monkeypatch.setattr(node_meta, "stack_trace", lambda node: None)
    assert torch_seams.check()["node meta"] == "a captured graph's nodes carry no stack_trace of the user's lines"
