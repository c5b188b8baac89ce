"""Concrete shapes for graphs compiled with dynamic shapes, resolved cheaply per call.

With `dynamic=True` an op's sizes are sympy expressions over the graph's size symbols (`s0`,
`(s0 + 1)//2`). Rather than reading every output tensor's shape at run time, we generate at compile
time one small Python function that reads each symbol once from the graph inputs (an int input, or
a size of an input tensor) and evaluates every expression: a fraction of a microsecond per call.
Symbols no input determines (unbacked sizes from `nonzero`) stay symbolic on the line.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import sympy
import torch
from torch import fx
from torch.utils._sympy.printers import PythonPrinter

from ..torch_internals.node_meta import example_value

__all__ = ["ShapeResolver", "maybe_resolver", "symbolic_shape"]

_printer = PythonPrinter()


def expr_text(expr) -> str:
    """How a symbolic size is shown with `symbolic_shapes=True`: `s0`, `2*s0`, `(s0//2)`."""
    return _printer.doprint(expr)


def symbol_sources(gm: fx.GraphModule) -> Dict[sympy.Symbol, str]:
    """For each size symbol, Python code reading its value from the graph's inputs `args`."""
    sources: Dict[sympy.Symbol, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, node in enumerate(placeholders):
        value = example_value(node)
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            sources.setdefault(value.node.expr, f"args[{position}]")
    for position, node in enumerate(placeholders):
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, f"args[{position}].size({dim})")
    return sources


class ShapeResolver:
    """`resolve(args)` -> the concrete shapes of the dynamic ops' outputs, in plan order.

    `exprs` holds, per dynamic op, a tuple of output shapes whose entries are ints or sympy
    expressions.
    """

    def __init__(self, exprs: Sequence[Tuple[Tuple, ...]], sources: Dict[sympy.Symbol, str]):
        self.source = self._generate(exprs, sources)
        namespace: Dict[str, object] = {"math": math, "torch": torch}  # what the printer's output uses
        exec(compile(self.source, "<torchlens shape resolver>", "exec"), namespace)
        # (exec's namespace holds objects: this one is the function the generated source defines)
        self.resolve: Callable[[Sequence], List] = namespace["resolve"]  # type: ignore[assignment]

    @staticmethod
    def _generate(exprs, sources) -> str:
        used = set()
        rendered = []
        for outputs in exprs:
            shapes = []
            for shape in outputs:
                dims = []
                for size in shape:
                    if isinstance(size, int):
                        dims.append(str(size))
                    elif isinstance(size, sympy.Symbol) and size in sources:
                        used.add(size)  # read as it is: an int, or a jagged tensor's nested int (`j1`)
                        dims.append(_printer.doprint(size))
                    elif size.free_symbols <= set(sources):
                        used |= size.free_symbols
                        dims.append(f"int({_printer.doprint(size)})")
                    else:  # an unbacked size: no input tells its value, show it symbolically
                        dims.append(repr(expr_text(size)))
                shapes.append("(" + "".join(d + ", " for d in dims) + ")")
            rendered.append("(" + "".join(s + ", " for s in shapes) + ")")
        lines = ["def resolve(args):"]
        lines += [f"    {symbol} = {sources[symbol]}" for symbol in sorted(used, key=str)]
        lines.append("    return [" + ", ".join(rendered) + "]")
        return "\n".join(lines) + "\n"


def symbolic_shape(shape) -> Tuple:
    """A shape with sympy entries turned into display strings."""
    return tuple(size if isinstance(size, int) else expr_text(size) for size in shape)


def maybe_resolver(dynamic_exprs, gm: fx.GraphModule) -> Optional[ShapeResolver]:
    if not dynamic_exprs:
        return None
    return ShapeResolver(dynamic_exprs, symbol_sources(gm))
