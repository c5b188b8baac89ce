"""`tl.debug.bisect`: the smallest compiler change that makes a real divergence appear.

A compiled run that differs from eager is first judged against float64 (`tl.debug.reference`,
`compare(..., reference=)`). Only a *real* divergence on the compiled side is the compiler's to
answer for, so:

- no real divergence (every difference is rounding): nothing to bisect, and the report says so;
- a real divergence where eager is the side far from float64 (compiled nearer): eager is wrong,
  not the compiler; said, not bisected;
- otherwise torch's compiler bisector (`torch._inductor.compiler_bisector.CompilerBisector`) is
  driven over the torchlens backend: it tries the backends in order (`eager`, `aot_eager`,
  `aot_eager_decomp_partition`, `inductor`), then, in the first one that shows the real
  divergence, turns its subsystems off one at a time (passes, decompositions, lowerings, a few
  config changes) and bisects the applications of the one whose absence cures it. Each try is a
  fresh compile traced with `tl.trace(..., compiled=)` and compared with the eager trace against
  the reference: a try is good when it has no real divergence.

torch.compile would put the bisector's backend in place of ours (it reads the bisector's backend
when a model is compiled); while a try compiles, the bisector's backend is hidden from that one
read and handed to the torchlens backend as the compiler underneath, so every try keeps each op's
value (a seam: `torch_seams`, "compiler bisector"). The bisector's own progress lines are kept in
`BisectReport.log`, not printed.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time
from typing import List, Optional

import torch
from torch import nn

from ..core.generators import RandomState
from ..core.structure import check_model
from ..errors import OptionValueError
from ..torch_internals.seams import degraded
from .compare import compare
from .reference import random_ops, reference
from .report import CompareReport
from .rows import CompareRow

__all__ = ["BisectReport", "bisect"]

COMPILER, ROUNDING, EAGER, NEITHER, UNREPRODUCED = "compiler", "rounding", "eager", "neither", "unreproduced"


class BisectReport:
    """What `tl.debug.bisect` found.

    - `verdict`: "compiler" (a compiler change makes the real divergence appear: `backend`,
      `subsystem`, `application`, `detail` say which), "rounding" (no real divergence: nothing to
      bisect), "eager" (eager is the side far from float64), "neither" (both sides are as far
      from float64: the model's own precision, not the compiler), or "unreproduced" (the real
      divergence of the first compiled run did not come back in the bisection's runs).
    - `row`: the first real divergence (a `CompareRow`: op, module, ordinals, ulps), from the
      bisection's last run that showed it (the one nearest the culprit), else the first run's.
    - `compared`: the `CompareReport` of eager against the first compiled run (with the reference).
    - `runs`: how many compiled runs the bisection took; `seconds`: how long it all took;
      `log`: the bisector's progress lines.
    """

    def __init__(self, verdict: str, compared: CompareReport, row: Optional[CompareRow] = None):
        self.verdict = verdict
        self.compared = compared
        self.row = row
        self.backend: Optional[str] = None
        self.subsystem: Optional[str] = None
        self.application: Optional[int] = None
        self.detail: Optional[str] = None
        self.config_change: Optional[str] = None
        self.runs = 0
        self.seconds = 0.0
        self.log = ""

    def __str__(self) -> str:
        row = self.row
        where = f"{self.compared.tag}{row.ordinal} {row.where}" if row is not None else ""
        if self.verdict == ROUNDING:
            return f"nothing to bisect: {self.compared.verdict()}"
        if self.verdict == EAGER and row is not None:  # (these verdicts are about a row)
            return (f"nothing to bisect: at {where} eager is the side far from float64 ({row.ulps_a:.3g} ulps, "
                    f"compiled {row.ulps_b:.3g}): the eager computation is wrong there, not the compiler")
        if self.verdict == NEITHER and row is not None:
            return (f"nothing to bisect: at {where} eager and compiled are both far from float64 (eager "
                    f"{row.ulps_a:.3g} ulps, compiled {row.ulps_b:.3g}): the model's precision, not the compiler")
        if self.verdict == UNREPRODUCED:
            return (f"the real divergence at {where} did not come back in {self.runs} bisection runs: a "
                    f"nondeterministic compile or kernel; nothing located")
        if self.subsystem is None:
            change = f"backend {self.backend} (none of its subsystems alone)"
        elif self.config_change is not None:
            change = f"{self.backend} unless {self.config_change}"
        else:
            change = f"{self.backend} subsystem \"{self.subsystem}\", application {self.application}"
            if self.detail:
                change += f" ({self.detail})"
        text = f"real divergence at {where} appears with {change}; {self.runs} compiled runs, {self.seconds:.0f} s"
        if row is not None and row.op in random_ops():
            text += (f" ({row.op} draws random numbers: compiled code draws them otherwise than eager's kernels, "
                     f"which torch does not promise to match; eval() the model, or set "
                     f"torch._inductor.config.fallback_random = True to draw as eager does)")
        return text

    def __repr__(self) -> str:
        return f"<BisectReport {self.verdict}: {self}>"


def bisect(model: nn.Module, *args, **kwargs) -> BisectReport:
    """Find what makes `model`'s compiled run (inductor, through the torchlens backend) really
    diverge from eager: judged against a float64 reference, then bisected with torch's compiler
    bisector to a backend, subsystem and application. Keyword arguments go to the forward."""
    check_model(model, "tl.debug.bisect")
    bisector = _bisector()
    from ..api import trace

    started = time.perf_counter()
    with _same_draws() as again:
        ref = reference(model, *args, **kwargs)
        eager = trace(model, *args, **kwargs)
        torch._dynamo.reset()
        again()
        compiled = trace(model, *args, compiled={"compiler": "inductor"}, **kwargs)
        compared = compare(eager, compiled, reference=ref)
        first = compared.first_real
        if first is None:
            report = BisectReport(ROUNDING, compared)
        elif first.closer != "a":
            report = BisectReport(EAGER if first.closer == "b" else NEITHER, compared, first)
        else:
            report = _run_bisector(bisector, model, args, kwargs, eager, ref, compared, again)
    report.seconds = time.perf_counter() - started
    return report


@contextlib.contextmanager
def _same_draws():
    """Every run of a bisection draws the random numbers the first drew (a model in training mode:
    its dropout masks): yields `again()`, which puts the generators back to where they were at the
    start. Afterwards the user's random stream goes on as if the bisection had not run."""
    start = RandomState()
    try:
        yield start.restore
    finally:
        start.restore()


def _bisector():
    try:
        from torch._inductor.compiler_bisector import BACKENDS, CompilerBisector  # noqa: F401
    except ImportError as exc:
        degraded("compiler bisector", exc)
        raise OptionValueError(f"tl.debug.bisect needs torch's compiler bisector, which this torch "
                               f"({torch.__version__}) lacks") from exc
    return CompilerBisector


def _run_bisector(bisector, model, args, kwargs, eager, ref, compared: CompareReport, again) -> BisectReport:
    from ..api import trace

    seen: List[CompareRow] = []
    runs = [0]

    def good() -> bool:
        torch._dynamo.reset()
        backend = bisector.get_backend()
        runs[0] += 1
        again()
        with _backend_kept(bisector):
            compiled = trace(model, *args, compiled={"compiler": _compiler(bisector, backend)}, **kwargs)
        real = compare(eager, compiled, reference=ref).first_real
        if real is not None:
            seen.append(real)
        return real is None

    log = io.StringIO()
    enabled, cache = bisector.bisection_enabled, bisector.in_process_cache
    try:
        with contextlib.redirect_stdout(log):
            result = bisector.do_bisect(good)
    finally:
        with contextlib.redirect_stdout(log):
            _bisector_state_restored(bisector, enabled, cache)
        torch._dynamo.reset()
    if result is None:
        report = BisectReport(UNREPRODUCED, compared, compared.first_real)
    else:
        report = BisectReport(COMPILER, compared, seen[-1] if seen else compared.first_real)
        report.backend, report.subsystem = result.backend, result.subsystem
        report.application, report.detail = result.bisect_number, _readable(result.debug_info)
        change = _config_change(result.backend, result.subsystem)
        if change is not None:
            report.config_change, report.detail = change, None
    report.runs, report.log = runs[0], log.getvalue()
    return report


def _readable(debug_info) -> Optional[str]:
    """The bisector's note on the application it found, an operator written as torch writes it
    (`aten.addmm.default`, not its repr)."""
    if debug_info is None:
        return None
    return re.sub(r"<OpOverload\(op='([\w.]+)', overload='(\w+)'\)>", r"\1.\2", str(debug_info))


def _bisector_state_restored(bisector, enabled: bool, cache) -> None:
    """Leave the bisector as it was found. `do_bisect` restores it when an object of its frame is
    freed, which a frame kept alive (a traceback someone holds) delays: until then every
    `torch.compile` would still run the bisector's backend."""
    if bisector.bisection_enabled != enabled or bisector.in_process_cache != cache:
        bisector.delete_bisect_status()
        bisector.bisection_enabled, bisector.in_process_cache = enabled, cache


def _config_change(backend: str, subsystem: Optional[str]) -> Optional[str]:
    """`config.field=value` when the bisector's finding is a config change that cures it."""
    from torch._inductor.compiler_bisector import BACKENDS, ConfigChange

    return next((f"{item.config_name} config sets {item.config_field}={item.config_value!r}"
                 for item in BACKENDS.get(backend, ()) if item.name == subsystem and isinstance(item, ConfigChange)),
                None)


def _compiler(bisector, backend: Optional[str]):
    """The compiler under the torchlens backend for a try: the bisector's backend; inductor with
    the config change the bisector is testing applied (torch.compile applies it to its own
    inductor, which the torchlens backend does not go through)."""
    backend = backend or "inductor"
    if backend != "inductor":
        return backend

    def inductor_with_changes(gm, example_inputs):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        with config.patch(bisector.get_config_change("inductor") or {}):
            return compile_fx(gm, example_inputs)

    return inductor_with_changes


@contextlib.contextmanager
def _backend_kept(bisector):
    """Hide the bisector's backend from torch.compile's read of it (which would replace the
    torchlens backend); every other reader, inductor's subsystems among them, still sees it."""
    original = bisector.__dict__["get_backend"]
    compile_code = torch.compile.__code__
    read = original.__func__

    def get_backend(cls):
        if sys._getframe(1).f_code is compile_code:
            return None
        return read(cls)

    bisector.get_backend = classmethod(get_backend)
    try:
        yield
    finally:
        bisector.get_backend = original
