"""Models we did not write: transformers' and torch.nn's own architectures, narrated as they are.

Each model (see `real_models.py`) is a tiny random-weight build, run under `torch.no_grad()` and
under `torch.inference_mode()`. For each we check that narration balances its module lines, leaves
the model's outputs bit for bit as they are, measures exact statistics that agree with a float64
computation over the kept values, and blames a NaN planted in one weight on the op that reads it.
A few are also compiled with the torchlens backend.
"""

from __future__ import annotations

import functools
import io
import math
import re

import pytest
import torch

import torchlens as tl
from real_models import REAL_MODELS

pytest.importorskip("transformers")

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
NAMES = list(REAL_MODELS)

# T5 buckets relative positions through log(relative_position / max_exact), which is log(0) = -inf
# on the diagonal (a `where` then discards it): every T5 forward holds a legitimately non-finite
# value before any weight is read. The tracker must call it absorbed, not a finding; it is tested
# as such below, and in the NaN-blame tests like every other model.
LEGITIMATELY_NONFINITE = {"t5": ("log", "encoder.block.0.layer.0.SelfAttention")}
FINITE_NAMES = [name for name in NAMES if name not in LEGITIMATELY_NONFINITE]

# A few, to keep compile time small. Not nn.TransformerEncoder: torch itself leaves its fast path
# when compiling (mask_check under torch.compile), so compiled and eager differ without torchlens.
COMPILED = ["qwen2", "distilbert", "nn_transformer"]


@functools.lru_cache(maxsize=None)
def built(name):
    """One build per model for the tests that do not change it (a NaN test builds its own)."""
    return REAL_MODELS[name].build()


@functools.lru_cache(maxsize=None)
def plain(name, mode):
    """The model's own output, without torchlens, under `mode`."""
    model, args, kwargs = built(name)
    with mode():
        return model(*args, **kwargs)


@pytest.fixture(params=list(MODES))
def mode(request):
    return MODES[request.param]


# -- helpers ----------------------------------------------------------------------------------


def tensors(value, path="out"):
    """Every tensor in a forward's output, with where it is: walks ModelOutput, dicts, tuples, lists."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):  # ModelOutput is an OrderedDict holding its non-None fields
        return [item for key, v in value.items() for item in tensors(v, f"{path}[{key!r}]")]
    if isinstance(value, (tuple, list)):
        return [item for i, v in enumerate(value) for item in tensors(v, f"{path}[{i}]")]
    return []


def assert_bitwise_equal(got, expected):
    """`torch.equal` on every tensor of the output (NaNs, as a poisoned model makes, must be where
    the plain forward has them, and everything else equal)."""
    got, expected = tensors(got), tensors(expected)
    assert [path for path, _ in got] == [path for path, _ in expected]
    assert expected, "the forward returned no tensor"
    for (path, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if a.is_floating_point() and bool(b.isnan().any()):
            same_nans = torch.equal(a.isnan(), b.isnan())
            assert same_nans, f"{path}: NaNs in other places than in the plain forward"
            a, b = a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)
        same = torch.equal(a, b)  # (named, so that a failure does not print both tensors)
        assert same, f"{path} differs from the plain forward (max abs diff {(a - b).abs().max().item():.3g})"


def assert_close(got, expected, atol=1e-6):
    got, expected = tensors(got), tensors(expected)
    assert [path for path, _ in got] == [path for path, _ in expected]
    assert expected, "the forward returned no tensor"
    for (path, a), (_, b) in zip(got, expected):
        assert a.shape == b.shape, path
        close = torch.allclose(a, b, rtol=0, atol=atol)
        assert close, f"{path}: max abs diff {(a - b).abs().max().item():.3g}"


ENTER = re.compile(r"^(?P<indent> *)> (?P<path>\S+) \((?P<type>[\w.]+)\)$")
EXIT = re.compile(r"^(?P<indent> *)< (?P<path>\S+)(?:  \[\d+ ops? folded\])?$")
OP = re.compile(r"^(?P<indent> *)#(?P<ordinal>\d+) +(?P<op>\S+) +(?P<rest>.*)$")


def check_module_lines(text):
    """Every `> path` has its `< path`, properly nested; `>`, `<` and `#` lines are indented two
    spaces per open module, and an op inside a module names that module. Returns (modules, ops)."""
    stack, modules, ops = [], 0, 0
    for line in text.splitlines():
        if m := ENTER.match(line):
            assert len(m["indent"]) == 2 * len(stack), f"wrong indent: {line!r} with open {stack}"
            stack.append(m["path"])
            modules += 1
        elif m := EXIT.match(line):
            assert stack and stack[-1] == m["path"], f"unbalanced exit {line!r} with open {stack}"
            stack.pop()
            assert len(m["indent"]) == 2 * len(stack), f"wrong indent: {line!r} with open {stack}"
        elif m := OP.match(line):
            assert len(m["indent"]) == 2 * len(stack), f"wrong indent: {line!r} with open {stack}"
            at = re.search(r"  @(\S+)", m["rest"])
            assert (at and at[1]) == (stack[-1] if stack else None), f"op {line!r} not in its module {stack}"
            ops += 1
    assert not stack, f"modules never closed: {stack}"
    return modules, ops


def footer(text):
    lines = [line for line in text.splitlines() if line.startswith("-- ")]
    assert lines, "no footer"
    return lines[-1]


def record(name, mode, **options):
    model, args, kwargs = built(name)
    with mode():
        return tl.record(model, *args, **options, **kwargs)


def nans(stats):
    """NaNs counted in an op's output (a multi-output op's `StatsGroup` summed); None if not counted."""
    parts = getattr(stats, "parts", (stats,))
    if stats is None or any(part.nan is None for part in parts):
        return None
    return sum(part.nan for part in parts)


# -- narration ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_module_lines_balance(name, mode):
    sink = io.StringIO()
    recording = record(name, mode, narrate=sink)
    text = sink.getvalue()
    modules, ops = check_module_lines(text)
    assert ops >= 1 and modules >= 1, text[-2000:]
    assert ops == len(recording.ops)
    assert text == recording.narrate()
    assert footer(text).startswith("-- end:")


# -- outputs ------------------------------------------------------------------------------------


SETTINGS = {
    "off": {"value_stats": "off"},
    "exact": {"value_stats": "exact"},
    "track": {"on_nonfinite": "track"},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", NAMES)
def test_outputs_are_bitwise_those_of_the_plain_forward(name, mode, setting):
    recording = record(name, mode, narrate=io.StringIO(), **SETTINGS[setting])
    assert_bitwise_equal(recording.output, plain(name, mode))


# -- exact statistics ---------------------------------------------------------------------------


NESTED_OR_STRIDED = (torch.strided, torch.jagged)


def elements(tensor):
    """Every element of a tensor, flat; a nested tensor (`nn.TransformerEncoder`'s fast path) by its
    components."""
    if tensor.is_nested:
        return tensor.values() if tensor.layout == torch.jagged else torch.cat([p.reshape(-1) for p in tensor.unbind()])
    return tensor.reshape(-1)


def _close(got, want, rel=1e-4, abs_=1e-6):
    return got is not None and math.isfinite(got) and abs(got - want) <= abs_ + rel * abs(want)


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _declared_overflow(stats, key, v):
    """A mean or sd left out, and said to be (`(mean/sd overflowed float32)`), where float32 sums
    of these values really do overflow: attention masks filled with finfo(float32).min. The
    package reduces in float32 and drops such a moment rather than print `inf` (stats.py,
    `_drop_overflowed`). Anything else missing is a failure."""
    if getattr(stats, key) is not None or "overflowed" not in (stats.note or "") or key not in stats.note:
        return False
    return v.abs().sum().item() > _FLOAT32_MAX or v.square().sum().item() > _FLOAT32_MAX


@pytest.mark.parametrize("live", [False, True], ids=["deferred", "live"])
@pytest.mark.parametrize("name", NAMES)
def test_exact_statistics_are_those_of_the_kept_values(name, mode, live):
    """Read at the end of the forward (no narration) and per printed line (narrated live)."""
    model, args, kwargs = built(name)
    with mode():
        trace = tl.trace(model, *args, value_stats="exact", narrate=io.StringIO() if live else None, **kwargs)
    compared, wrong = 0, []
    for event in trace.ops:
        if len(event.outputs) != 1:
            continue
        value = trace.value(event.ordinal)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.layout in NESTED_OR_STRIDED):
            continue
        v = elements(value.detach()).to(torch.float64)
        if not (v.numel() and bool(torch.isfinite(v).all())):
            continue
        compared += 1
        stats = event.stats
        if isinstance(stats, tl.StatsGroup) and len(stats.parts) == 1:
            stats = stats.parts[0]
        want = {"min": v.min().item(), "max": v.max().item(), "mean": v.mean().item()}
        if v.numel() > 1:  # the unbiased sd of a single value is undefined
            want["sd"] = v.std(correction=1).item()
        if stats is None or stats.kind != "exact":
            wrong.append(f"#{event.ordinal} {event.op} @{event.module}: stats {stats!r}")
            continue
        # min and max are values of the tensor: exact; the mean and sd agree to float32 rounding, scaled
        # by the size of the values reduced
        scale = max(1.0, v.abs().max().item())
        bad = [key for key in ("min", "max") if getattr(stats, key) != want[key]]
        bad += [key for key in ("mean", "sd") if key in want
                and not _close(getattr(stats, key), want[key], abs_=1e-6 * scale)
                and not _declared_overflow(stats, key, v)]
        if bad:
            wrong.append(f"#{event.ordinal} {event.op} @{event.module}: "
                         + ", ".join(f"{key}={getattr(stats, key)!r} want {want[key]!r}" for key in bad))
    assert compared >= 5, f"only {compared} ops compared"
    assert not wrong, f"{len(wrong)} of {compared} ops: " + "; ".join(wrong[:3])


# -- non-finite values --------------------------------------------------------------------------


@pytest.mark.parametrize("name", FINITE_NAMES)
def test_a_clean_forward_has_no_nonfinite_value(name, mode):
    sink = io.StringIO()
    recording = record(name, mode, narrate=sink, on_nonfinite="track")
    assert recording.first_nonfinite is None
    assert "no non-finite values" in footer(sink.getvalue())


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_in_a_weight_is_blamed_on_the_op_that_reads_it(name, mode):
    spec = REAL_MODELS[name]
    model, args, kwargs = spec.poisoned()
    sink = io.StringIO()
    with mode():
        recording = tl.record(model, *args, narrate=sink, on_nonfinite="track", **kwargs)
    first = recording.first_nonfinite
    assert first is not None, "the NaN was not found"
    assert (first.op, first.module) in spec.blame, f"blamed {first!r}"
    assert (nans(first.stats) or 0) > 0, f"{first!r}: {first.stats!r}"
    line = footer(sink.getvalue())
    assert "no non-finite values" not in line, line
    assert f"#{first.ordinal} {first.op} @{first.module}" in line, line
    with mode():
        expected = model(*args, **kwargs)
    assert_bitwise_equal(recording.output, expected)  # tracking left even the NaNs where they were


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_in_a_weight_stops_the_forward_at_the_op_that_reads_it(name, mode):
    spec = REAL_MODELS[name]
    model, args, kwargs = spec.poisoned()
    with mode(), pytest.raises(tl.errors.NonFiniteError) as info:
        tl.record(model, *args, on_nonfinite="raise", **kwargs)
    partial = info.value.partial_trace
    assert isinstance(partial, tl.PartialTrace)
    last = partial.ops[-1]
    assert (last.op, last.module) in spec.blame, f"stopped at {last!r}"
    assert (nans(last.stats) or 0) > 0, f"{last!r}: {last.stats!r}"
    assert all(not nans(e.stats) for e in partial.ops[:-1])
    assert f"#{last.ordinal} {last.op} @{last.module}" in str(info.value)


@pytest.mark.parametrize("name", sorted(LEGITIMATELY_NONFINITE))
def test_a_legitimate_minus_inf_is_absorbed_not_a_finding(name, mode):
    op, module = LEGITIMATELY_NONFINITE[name]
    recording = record(name, mode, on_nonfinite="track")
    assert recording.findings == () and recording.first_nonfinite is None
    born = next(e for e in recording.ops if e.stats is not None and e.stats.nonfinite)
    assert (born.op, born.module) == (op, module), f"first -inf at {born!r}"
    assert born.stats.neginf > 0 and not born.stats.nan and not born.stats.posinf
    assert recording.footer_extra[-1] == (
        f"no non-finite findings (-inf born at #{born.ordinal} {op} @{module} absorbed by later ops)")
    raised = record(name, mode, on_nonfinite="raise")  # a healthy model runs through
    assert_bitwise_equal(raised.output, plain(name, mode))


# -- compiled -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_narration_matches_eager(name):
    model, args, kwargs = built(name)
    sink = io.StringIO()
    torch._dynamo.reset()
    try:
        compiled = tl.compile(model, narrate=sink, compiler="eager")
        with torch.no_grad():
            got = compiled(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    assert_close(got, plain(name, torch.no_grad), atol=1e-6)
    text = sink.getvalue()
    modules, ops = check_module_lines(text)
    assert ops >= 10 and modules >= 2, text[-2000:]
    assert "compiled graph call" in footer(text)
