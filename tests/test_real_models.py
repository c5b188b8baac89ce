"""Models we did not write: transformers' and torch.nn's own architectures, narrated as they are.

Each model (see `real_models.py`) is a tiny random-weight build, run under `torch.no_grad()` and
under `torch.inference_mode()`. For each we check that narration balances its module lines, leaves
the model's outputs bit for bit as they are, measures exact statistics that agree with a float64
computation over the kept values, and blames a NaN planted in one weight on the op that reads it.
The same holds under CPU bfloat16 autocast, where the narration shows the lowered dtypes. Some are
narrated through a whole training step (train mode, dropout drawing, backward), which must leave the
loss, every gradient and the random number stream bit for bit as they are. A few are also compiled
with the torchlens backend.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import io
import math
import re

import pytest
import torch
from real_models import REAL_MODELS, TRAINING

import torchlens as tl

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
    """A mean or sd left out, and said to be (`(mean/sd overflowed)`), where float32 sums
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


# -- autocast -----------------------------------------------------------------------------------


@contextlib.contextmanager
def bf16_autocast():
    """How models are run for inference in reduced precision on CPU."""
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        yield


# Not nn.TransformerEncoder: it fails under CPU autocast without torchlens. Its layers choose their
# fast path after checking `torch.is_autocast_enabled()`, which without a device type asks about
# CUDA autocast only; so with a padding mask (a nested tensor) the fused
# `_transformer_encoder_layer_fwd` runs under bf16 autocast and raises "expected scalar type Float
# but found BFloat16". (nn.Transformer, below, runs the same layers under autocast.)
AUTOCAST_NAMES = [name for name in NAMES if name != "nn_transformer_encoder"]
TRACKED = {"value_stats": "exact", "on_nonfinite": "track"}
LOWERED = ("linear", "conv1d")  # ops CPU autocast runs in bfloat16


def assert_clean_footer(name, text):
    """Every op measured and nothing non-finite, or only the -inf the model always absorbs."""
    line = footer(text)
    if name in LEGITIMATELY_NONFINITE:
        op, module = LEGITIMATELY_NONFINITE[name]
        absorbed = rf"; no non-finite findings \(-inf born at #\d+ {re.escape(op)} @{re.escape(module)} absorbed by later ops\)$"
        assert re.search(absorbed, line), line
    else:
        assert line.endswith("; no non-finite values"), line


def _bf16_value(x):
    return x is not None and torch.tensor(x, dtype=torch.bfloat16).item() == x


def test_nn_transformer_encoder_fails_under_cpu_autocast_without_torchlens():
    """Why it is left out above: when torch fixes it, this fails and it joins the autocast tests."""
    model, args, kwargs = built("nn_transformer_encoder")
    with bf16_autocast(), pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
        model(*args, **kwargs)


@pytest.mark.parametrize("name", AUTOCAST_NAMES)
def test_autocast_narration_keeps_outputs_and_shows_bf16(name):
    model, args, kwargs = built(name)
    sink = io.StringIO()
    with bf16_autocast():
        recording = tl.record(model, *args, narrate=sink, **TRACKED, **kwargs)
    assert_bitwise_equal(recording.output, plain(name, bf16_autocast))
    text = sink.getvalue()
    modules, ops = check_module_lines(text)
    assert modules >= 1 and ops == len(recording.ops)
    # what autocast lowered is narrated as bfloat16, measured in it; the rest keeps its dtype
    lines = {int(m["ordinal"]): m["rest"].split()[1] for m in map(OP.match, text.splitlines()) if m}
    lowered = [e for e in recording.ops if e.op in LOWERED]
    if any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        assert any(e.op == "linear" for e in lowered), "no linear op narrated"
    wrong = [f"#{e.ordinal} {e.op}: {lines[e.ordinal]} {e.stats!r}" for e in lowered
             if not (e.outputs[0].dtype == torch.bfloat16 and lines[e.ordinal] == "bf16"
                     and e.stats.kind == "exact" and e.stats.nan == 0
                     and _bf16_value(e.stats.min) and _bf16_value(e.stats.max))]
    assert not wrong, f"{len(wrong)} of {len(lowered)}: " + "; ".join(wrong[:3])
    assert "f32" in lines.values()  # (not every op: autocast leaves most in float32)
    # a clean forward has no finding, and every op was measured
    assert recording.findings == () and recording.first_nonfinite is None
    assert_clean_footer(name, text)


@pytest.mark.parametrize("name", AUTOCAST_NAMES)
def test_autocast_nan_in_a_weight_is_blamed_on_the_op_that_reads_it(name):
    spec = REAL_MODELS[name]
    model, args, kwargs = spec.poisoned()
    sink = io.StringIO()
    with bf16_autocast():
        recording = tl.record(model, *args, narrate=sink, **TRACKED, **kwargs)
        expected = model(*args, **kwargs)
    first = recording.first_nonfinite
    assert first is not None, "the NaN was not found"
    assert (first.op, first.module) in spec.blame, f"blamed {first!r}"
    assert recording.findings[0].text == (
        f"NaN in {spec.weight} (nan=1), first read by #{first.ordinal} {first.op} @{first.module}")
    if first.op in LOWERED:
        assert first.outputs[0].dtype == torch.bfloat16
    assert (nans(first.stats) or 0) > 0, f"{first!r}: {first.stats!r}"
    assert f"#{first.ordinal} {first.op} @{first.module}" in footer(sink.getvalue())
    assert_bitwise_equal(recording.output, expected)


# -- training -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def built_for_training(name):
    return TRAINING[name].built()


def training_step(name, model, seed, narrate=None):
    """Forward, loss and backward from `seed`, under a `Recorder` when narrating. Returns the loss,
    the gradients, the random number state after the step, and the recorder."""
    _, args, kwargs = built_for_training(name)
    recorder = tl.recording.Recorder(model, narrate=narrate, **TRACKED) if narrate else contextlib.nullcontext()
    torch.manual_seed(seed)
    with torch.enable_grad(), recorder:
        loss = TRAINING[name].loss(model(*args, **kwargs))
        loss.backward()
    grads = {path: p.grad for path, p in model.named_parameters()}
    return loss.detach(), grads, torch.get_rng_state(), recorder


@pytest.mark.parametrize("name", list(TRAINING))
def test_a_narrated_training_step_is_bitwise_the_plain_one(name):
    model, args, kwargs = built_for_training(name)
    assert model.training
    loss, grads, rng, _ = training_step(name, copy.deepcopy(model), seed=0)
    assert all(g is not None for g in grads.values()), [p for p, g in grads.items() if g is None]
    sink = io.StringIO()
    got_loss, got_grads, got_rng, recorder = training_step(name, copy.deepcopy(model), seed=0, narrate=sink)
    # dropout draws: another seed gives another loss (else equal losses would prove nothing)
    torch.manual_seed(1)
    with torch.no_grad():
        other = TRAINING[name].loss(model(*args, **kwargs))
    assert not torch.equal(other, loss), "dropout drew nothing"
    assert torch.equal(got_loss, loss), f"loss {got_loss.item()!r} narrated, {loss.item()!r} plain"
    assert got_grads.keys() == grads.keys()
    differ = [path for path, g in grads.items() if got_grads[path] is None or not torch.equal(got_grads[path], g)]
    assert not differ, f"{len(differ)} of {len(grads)} gradients differ: {differ[:3]}"
    same_stream = torch.equal(got_rng, rng)
    assert same_stream, "narration drew random numbers of its own"
    (recording,) = recorder.recordings
    text = sink.getvalue()
    modules, ops = check_module_lines(text)
    assert modules >= 1 and ops == len(recording.ops)
    assert any(e.op == "dropout" for e in recording.ops), "no dropout narrated"
    assert recording.findings == () and recording.first_nonfinite is None
    assert_clean_footer(name, text)


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


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_statistics_are_eager_statistics(name, mode):
    """On the CPU a compiled graph returns the outputs to measure and they are measured after the
    call, with eager's recipes: each op's statistics and the tracking verdict read as eager's."""
    model, args, kwargs = built(name)
    torch._dynamo.reset()
    try:
        compiled = tl.compile(model, value_stats="exact", on_nonfinite="track", compiler="eager")
        with mode():
            got = compiled(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    assert_close(got, plain(name, mode), atol=1e-6)
    with mode():
        eager = tl.record(model, *args, value_stats="exact", on_nonfinite="track", **kwargs)
    recording = compiled.torchlens.last_recording
    # dynamo's graphs differ from the eager call sequence in places (an `expand` for a `getitem`,
    # results nothing reads dropped): compare the ops both have, aligned in order
    ours, theirs = recording.ops, eager.ops
    matcher = difflib.SequenceMatcher(None, [e.op for e in ours], [e.op for e in theirs], autojunk=False)
    pairs = [(ours[a + k], theirs[b + k]) for a, b, size in matcher.get_matching_blocks() for k in range(size)]
    pairs = [(mine, other) for mine, other in pairs if mine.outputs == other.outputs]  # the same tensors
    assert len(pairs) >= 0.7 * len(ours)
    for mine, other in pairs:
        got, want = mine.stats, other.stats
        if isinstance(want, tl.StatsGroup) or want.kind != "exact":
            continue
        assert (got.kind, got.nan, got.posinf, got.neginf) == (want.kind, want.nan, want.posinf, want.neginf), mine.op
        for key in ("min", "max", "mean", "sd"):
            assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-5, abs=1e-6), (mine.op, key)
    assert recording.footer_extra[-1] == eager.footer_extra[-1]
