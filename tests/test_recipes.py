"""The statistics ladder's cheap recipes: a tracking screen that never misses a NaN or an infinity,
exact statistics from sums that agree with float64, and the same recipe for both substrates."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import tiny_gpt, tokens
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchlens as tl
from torchlens.events import Stats
from torchlens.measure.recipes import CONDITION_LIMIT, recipe

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


class Copy(nn.Module):
    """One op whose output holds exactly the input's values."""

    def forward(self, x):
        return x * 1


def direct_counts(x: torch.Tensor):
    values = x.abs() if x.is_complex() else x
    return (int(torch.isnan(values).sum()), int(torch.isposinf(values).sum()), int(torch.isneginf(values).sum()))


def tracked_counts(x: torch.Tensor, **kwargs):
    stats = tl.record(Copy(), x, on_nonfinite="track", value_stats="reuse", **kwargs).ops[-1].stats
    return stats.nan, stats.posinf, stats.neginf


@contextlib.contextmanager
def count_aten(*names):
    """Count calls of these ATen ops (by overload packet name) made inside the block."""
    seen = []

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in names:
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Counter():
        yield seen


# -- the tracking screen -------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(FLOATS),
    size=st.integers(1, 300),
    planted=st.lists(st.tuples(st.integers(0, 299), st.sampled_from(["nan", "inf", "-inf", "max", "-max"])),
                     max_size=6),
    scale=st.sampled_from([1.0, 1e3, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_the_screen_never_misses_a_nonfinite_value_and_counts_exactly(dtype, size, planted, scale, seed):
    """Random tensors with NaN, infinities and the dtype's largest values (whose sums overflow)
    planted anywhere: the counts always equal direct ones, whatever the screen saw."""
    x = (torch.randn(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)
    biggest = torch.finfo(dtype).max
    for index, what in planted:
        x[index % size] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "max": biggest, "-max": -biggest}[what]
    assert tracked_counts(x) == direct_counts(x)


def test_an_overflowing_sum_of_finite_values_is_counted_not_assumed_finite_or_nonfinite():
    for dtype in (torch.float16, torch.float32, torch.float64):
        biggest = torch.finfo(dtype).max
        x = torch.full((8,), biggest, dtype=dtype)  # the sum overflows: the screen cannot vouch
        assert tracked_counts(x) == (0, 0, 0)
        rec = tl.record(Copy(), x, on_nonfinite="track")
        assert rec.findings == () and rec.footer_extra[-1] == "no non-finite values"


def test_infinities_of_both_signs_that_cancel_in_the_sum_are_both_counted():
    x = torch.tensor([1.0, math.inf, -math.inf, 2.0])
    assert tracked_counts(x) == (0, 1, 1)
    assert tracked_counts(torch.tensor([math.nan, 1e38, 1e38, -1e38])) == (1, 0, 0)


def test_complex_outputs_are_screened_by_magnitude():
    x = torch.tensor([1 + 1j, complex(math.nan, 0), complex(0, math.inf)], dtype=torch.complex64)
    assert tracked_counts(x) == direct_counts(x) == (1, 1, 0)


def test_only_outputs_the_screen_flags_are_counted_with_masks():
    """On the CPU the screen is one sum per output: finite outputs cost no `isnan`/`isinf` masks;
    only the outputs holding non-finite values (here the causal mask's healthy -inf) are counted."""
    model, x = tiny_gpt(), tokens()
    with count_aten("isnan", "isposinf", "isneginf") as masks, count_aten("sum") as sums:
        rec = tl.record(model, x, on_nonfinite="track", value_stats="reuse")
    holding = [e for e in rec.ops if e.stats is not None and e.stats.nonfinite]
    assert [e.op for e in holding] == ["masked_fill", "masked_fill"] and str(holding[0].stats) == "-inf=112"
    assert len(masks) == 3 * len(holding), "finite outputs were masked instead of screened"
    assert len(sums) >= len([e for e in rec.ops if e.outputs[0].dtype == torch.float32]) // 2
    assert rec.footer_extra[-1].startswith("no non-finite findings")

    class LogAfter(nn.Module):
        def forward(self, x):
            y = torch.log(x)  # NaN for the negative entries
            return (y * 0).sum() + x.sum()

    x = torch.tensor([1.0, -1.0, 2.0])
    with count_aten("isnan") as masks:
        rec = tl.record(LogAfter(), x, on_nonfinite="track", value_stats="reuse")
    flagged = [e for e in rec.ops if e.stats is not None and e.stats.nan]
    assert [e.op for e in flagged] == ["log", "mul", "sum", "add"]
    assert len(masks) == len(flagged)  # counted only where the screen flagged
    assert rec.first_nonfinite.op == "log" and str(flagged[0].stats) == "nan=1"


def test_an_accelerator_keeps_its_counts_in_the_deferred_vector(deferred_reads):
    """Read once per forward, the tensor is gone when the vector is read: counts are computed
    from the start (no screen), and they are exact."""
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, math.nan])
    assert tracked_counts(x) == (2, 1, 1)
    assert recipe("float", "off", immediate=False).layout == "counts"


# -- exact statistics from sums ----------------------------------------------------------------------


def float64_stats(x: torch.Tensor):
    values = (x.abs() if x.is_complex() else x).double().reshape(-1)
    values = values[torch.isfinite(values)]
    return values.min().item(), values.max().item(), values.mean().item(), values.std().item()


def exact(x: torch.Tensor, narrate=None):
    return tl.record(Copy(), x, value_stats="exact", narrate=narrate).ops[-1].stats


@pytest.mark.parametrize("dtype", FLOATS + [torch.complex64])
@pytest.mark.parametrize("shape, layout", [((64, 768), "contiguous"), ((768, 64), "transposed"), ((5,), "contiguous")])
def test_exact_statistics_equal_float64_for_every_float_dtype_and_layout(dtype, shape, layout):
    base = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3 + 0.5
    x = base.to(dtype)
    if layout == "transposed":
        x = x.t()
    got = exact(x)
    want = float64_stats(x)
    for name, value in zip(("min", "max", "mean", "sd"), want):
        assert getattr(got, name) == pytest.approx(value, rel=1e-5, abs=1e-6), (name, dtype, layout)
    assert (got.nan, got.posinf, got.neginf) == (0, 0, 0)


@pytest.mark.parametrize("offset", [1e2, 1e4, -3e5])
def test_a_large_mean_against_a_small_spread_gets_its_sd_about_the_mean(offset):
    """Subtracting sums would lose the sd's digits here; past `CONDITION_LIMIT` it is measured
    about the mean instead, and agrees with float64 over the same float32 values."""
    x = offset + torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 1e-2
    assert (x.double().square().mean() / x.double().var()).item() > CONDITION_LIMIT
    got = exact(x)
    _, _, mean, sd = float64_stats(x)
    assert got.mean == pytest.approx(mean, rel=1e-6) and got.sd == pytest.approx(sd, rel=1e-4)


def test_exact_statistics_with_nonfinite_values_summarise_the_finite_ones_and_count_the_rest():
    x = torch.tensor([1.0, 2.0, math.nan, 3.0, math.inf, -math.inf, math.inf])
    got = exact(x)
    assert (got.min, got.max, got.mean, got.nan, got.posinf, got.neginf) == (1, 3, 2, 1, 2, 1)
    assert got.sd == pytest.approx(1.0)
    big = torch.full((16,), torch.finfo(torch.float32).max)  # finite, but the sum overflows
    got = exact(big)
    assert got.min == got.max == got.mean == pytest.approx(torch.finfo(torch.float32).max)
    assert (got.nan, got.posinf, got.neginf) == (0, 0, 0)


def test_exact_statistics_on_the_cpu_mask_only_the_outputs_holding_nonfinite_values():
    model, x = tiny_gpt(), tokens()
    with count_aten("isnan", "isinf", "isfinite", "isposinf", "isneginf") as masks:
        rec = tl.record(model, x, value_stats="exact")
    holding = [e for e in rec.ops if e.stats is not None and e.stats.nonfinite]
    assert [e.op for e in holding] == ["masked_fill", "masked_fill"]  # the causal mask's -inf
    assert 0 < len(masks) <= 4 * len(holding)
    assert holding[0].stats.neginf == 112 and holding[0].stats.max is not None  # the finite ones summarised
    measured = [e.stats for e in rec.ops if getattr(e.stats, "kind", None) == "exact"]
    assert len(measured) > 20 and all(s.sd is not None for s in measured)
    integers = [e for e in rec.ops if e.outputs[0].dtype == torch.long and getattr(e.stats, "kind", None) == "exact"]
    assert integers and all(isinstance(e.stats.min, int) and e.stats.nan is None for e in integers)


# -- one ladder for both substrates ----------------------------------------------------------------


@pytest.mark.parametrize("rung", ["exact", "off", "reuse", "sampled"])
def test_eager_and_graph_recipes_agree_on_what_is_shown_and_measured(rung):
    for kind in ("float", "int", "bool"):
        eager = recipe(kind, rung, immediate=False)
        graph = recipe(kind, rung, in_graph=True)
        assert (eager.kind, eager.shown, eager.measures) == (graph.kind, graph.shown, graph.measures), kind
        assert eager.layout == graph.layout and graph.lean == (graph.layout in ("counts", "moments+counts"))


def test_an_accelerator_reads_a_printed_exact_line_once_even_for_a_large_mean(deferred_reads):
    """Off the CPU every read is a sync: a printed exact line takes the two-pass vector in one read,
    not sums plus a second pass about the mean."""
    from helpers import count_host_syncs

    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) + 5
    lines = []
    with count_host_syncs() as syncs:
        tl.record(Copy(), x, value_stats="exact", narrate=lines.append)
    printed = [line for line in lines if line.lstrip().startswith("#")]
    reads = [s for s in syncs if s[0] == "function"]
    assert len(printed) == 2 and len(reads) == len(printed), syncs


def test_the_sd_of_a_large_tensor_keeps_its_digits():
    """Ten million elements: a float32 dot product would lose the sd's fifth digit."""
    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(4)) * 2 + 0.5
    got = exact(x)
    _, _, mean, sd = float64_stats(x)
    assert got.sd == pytest.approx(sd, rel=1e-6) and got.mean == pytest.approx(mean, rel=1e-6)


# -- statistics shared between views of the same elements -----------------------------------------


class FusedHeads(nn.Module):
    """GPT-2's attention input: one projection split in three, each part viewed as heads and
    transposed (`heads=False`: the parts as they are). The parts are not dense (each skips the
    other two), but a part, its view and its transpose hold the same elements."""

    def __init__(self, heads: bool):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.heads = heads

    def forward(self, x):
        parts = self.qkv(x).split(32, dim=2)
        if self.heads:
            parts = [part.view(1, 8, 4, 8).transpose(1, 2) for part in parts]
        return torch.stack([part.sum() for part in parts])


@pytest.mark.parametrize("rung,tracking", [("exact", False), ("off", True), ("reuse", True)])
def test_views_of_a_split_part_share_its_statistics_instead_of_reducing_again(rung, tracking):
    x = torch.randn(1, 8, 32)
    counts = []
    for heads in (False, True):
        torch.manual_seed(0)
        model = FusedHeads(heads)
        with count_aten("sum", "aminmax", "dot") as reductions:
            rec = tl.record(model, x, value_stats=rung, on_nonfinite="track" if tracking else None)
        counts.append(len(reductions))
    split = next(e for e in rec.ops if e.op == "split")
    views = [e for e in rec.ops if e.op in ("view", "transpose")]
    assert len(views) == 6 and all(v.stats is split.stats.parts[i // 2] for i, v in enumerate(views))
    assert counts[0] == counts[1], "the views were reduced again"
    if rung == "exact":
        part = model.qkv(x).detach()[..., 32:64]
        assert views[2].stats.mean == pytest.approx(part.double().mean().item(), rel=1e-6)
        assert views[2].stats.max == part.max().item()


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       strides=st.lists(st.integers(0, 6), min_size=3, max_size=3),
       other_order=st.permutations([0, 1, 2]), offset=st.integers(0, 5))
def test_tensors_with_one_elements_key_hold_the_same_elements_as_often(sizes, strides, other_order, offset):
    """`element_key` may call two views the same only if they address the same storage elements,
    each as many times: random strided views (repeats, gaps, overlaps) against a reordering of
    their dimensions, and against every other view drawn."""
    from torchlens.measure.memory import element_key as _elements

    storage = torch.arange(200, dtype=torch.float64)
    strides = strides[:len(sizes)]
    view = storage.as_strided(sizes, strides, offset)
    order = [i for i in other_order if i < len(sizes)]
    reordered = storage.as_strided([sizes[i] for i in order], [strides[i] for i in order], offset)
    assert _elements(view) == _elements(reordered)
    flat = storage.as_strided((view.numel(),), (1,), offset)
    if _elements(view) == _elements(flat):
        assert sorted(view.reshape(-1).tolist()) == flat.tolist()
    for other in (storage.as_strided(sizes, [s + 1 for s in strides], offset), view[..., :1], view.flip(-1)):
        if _elements(other) == _elements(view):
            assert sorted(other.reshape(-1).tolist()) == sorted(view.reshape(-1).tolist())


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_transformers_gpt2_head_views_have_their_own_elements_statistics(mode):
    """transformers' GPT-2 splits one `c_attn` projection in three and views each part as heads:
    whether shared (no_grad) or measured again (inference tensors have no version counter to
    share by), every head view's exact statistics are those of its own elements."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 256, (1, 16))
    with mode():
        trace = tl.trace(model, ids, value_stats="exact")
    splits = [e for e in trace.ops if e.op == "split"]
    assert len(splits) == 2
    by_ordinal = {e.ordinal: e for e in trace.ops}
    shared = 0
    for split in splits:
        heads = [by_ordinal[split.ordinal + k] for k in range(1, 7)]  # view, transpose of each part
        assert [e.op for e in heads] == ["view", "transpose"] * 3
        for event in heads:
            v = trace.value(event.ordinal).double()
            assert event.stats.min == v.min().item() and event.stats.max == v.max().item()
            assert event.stats.mean == pytest.approx(v.mean().item(), abs=1e-6)
            assert event.stats.sd == pytest.approx(v.std().item(), rel=1e-5)
            shared += any(event.stats is part for part in split.stats.parts)  # (key and value come first)
    assert shared == (12 if mode is torch.no_grad else 0)


class TransposedOutput(nn.Module):
    """A linear layer's output, then its transpose (a view of the same elements) in a submodule."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.show = Transposer()

    def forward(self, x):
        return self.show(self.fc(x))


class Transposer(nn.Module):
    def forward(self, y):
        return y.t()


@pytest.mark.parametrize("select_all", [True, False])
def test_a_printed_view_of_an_unprinted_output_shows_statistics_read_for_its_line(deferred_reads, select_all):
    """On an accelerator an output that is not printed is measured into the forward's one deferred
    read; a printed view of the same elements must not take those unread statistics for its line."""
    torch.manual_seed(0)
    model, x = TransposedOutput(), torch.randn(3, 4)
    lines = []
    select = None if select_all else tl.in_module("show")
    tl.record(model, x, value_stats="exact", narrate=tl.options.NarrationOptions(sink=lines.append, select=select))
    [line] = [line for line in lines if " t " in line and line.lstrip().startswith("#")]
    y = model.fc(x).detach().double()
    low, high = line.split("min=")[1].split()[0], line.split("max=")[1].split()[0]
    assert math.isclose(float(low), y.min().item(), rel_tol=1e-3, abs_tol=1e-4), line
    assert math.isclose(float(high), y.max().item(), rel_tol=1e-3, abs_tol=1e-4), line


# -- a compiled graph's returned outputs, read together --------------------------------------------


def awkward_outputs():
    """Outputs a graph may return, each taking a different road through the "sums" and "screen"
    recipes: plain, transposed, float64, past a million elements (float64 squares), finite but
    overflowing sums, a large mean against a tiny spread, NaN and infinities, empty, an integer,
    half precision (the ladder's road), the rare roads transposed, and a view of an earlier one (shared)."""
    generator = torch.Generator().manual_seed(3)
    plain = torch.randn(64, 48, generator=generator)
    huge = torch.full((16,), torch.finfo(torch.float32).max)
    nonfinite = torch.tensor([1.0, math.nan, -math.inf, 2.0, math.inf])
    return [plain, torch.randn(48, 64, generator=generator).t(), torch.randn(300, generator=generator).double(),
            torch.randn(1 << 20, generator=generator) + 3, huge, 1e4 + torch.randn(4096, generator=generator) * 1e-2,
            nonfinite, torch.empty(0), torch.arange(7), torch.randn(33, generator=generator).half(),
            (1e4 + torch.randn(64, 64, generator=generator) * 1e-2).t(), torch.stack([nonfinite] * 3).t(),
            plain.view(-1), nonfinite.clone()]


@pytest.mark.parametrize("rung,tracking", [("exact", False), ("exact", True), ("off", True), ("reuse", True)])
def test_outputs_read_together_give_each_tensor_what_reading_it_alone_gives(rung, tracking):
    """`Meter.measure_all` (a compiled graph's returned outputs, one transfer to the host) fills every
    field as measuring the tensors one by one does, whatever road each tensor takes; a view of an
    earlier output shares its statistics in both."""
    from torchlens.measure.meter import Meter

    fields = Stats.__slots__
    tensors = awkward_outputs()
    alone = [Meter(rung, tracking).measure(t, False) for t in tensors]
    together = Meter(rung, tracking).measure_all(tensors)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], i
    assert together[-2] is together[0]  # the view, read once
    assert together[6].nan == 1 and together[6].posinf == 1 and together[6].neginf == 1


@pytest.mark.parametrize("rung,tracking", [("exact", False), ("off", True)])
def test_a_tensor_that_cannot_be_measured_with_the_others_spoils_only_its_own_statistics(monkeypatch, rung,
                                                                                         tracking):
    """A failure while reading the outputs together (out of memory copying one of them, say) is
    what measuring each alone gives: that tensor says "n/a" and is not kept for views to share,
    the others are measured."""
    from torchlens.measure import recipes
    from torchlens.measure.meter import Meter

    def failing(real):
        def reduce(f, *args):
            if f.numel() == 7:
                raise RuntimeError("no memory")
            return real(f, *args)
        return reduce

    monkeypatch.setattr(recipes, "sum_parts", failing(recipes.sum_parts))
    monkeypatch.setattr(torch.Tensor, "sum", failing(torch.Tensor.sum))
    tensors = [torch.arange(5.0), torch.arange(7.0), torch.randn(3, 4)]
    alone, together = Meter(rung, tracking), Meter(rung, tracking)
    expected = [alone.measure(t, False) for t in tensors]
    got = together.measure_all(tensors)
    for a, b in zip(expected, got):
        assert [getattr(a, f) for f in Stats.__slots__] == [getattr(b, f) for f in Stats.__slots__]
    assert [s.kind for s in got] == ["na" if i == 1 else ("exact" if rung == "exact" else "counts") for i in range(3)]
    assert set(together._known) == set(alone._known)


def test_a_compiled_graph_reads_its_statistics_to_the_host_once_per_call():
    """After the call, the returned outputs' reductions are read in one transfer, not one a tensor."""
    model, x = tiny_gpt(), tokens()
    compiled = tl.compile(model, value_stats="exact", compiler="eager")
    compiled(x)
    reads = []
    original = torch.Tensor.tolist

    def counted(self):
        reads.append(self.numel())
        return original(self)

    torch.Tensor.tolist = counted
    try:
        compiled(x)
    finally:
        torch.Tensor.tolist = original
    rec = compiled.torchlens.last_recording
    floats = {id(e.stats) for e in rec.ops
              if getattr(e.stats, "kind", None) == "exact" and e.outputs[0].dtype == torch.float32}
    assert len(floats) > 20
    together = [n for n in reads if n > 9]  # (integers and bools are read on their own, as 5 and 1)
    assert together == [4 * len(floats)], reads


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("hole", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_never_calls_a_nan_or_an_infinity_finite(dtype, hole):
    """The one read that lets a tracked compiled call replay the one before: any NaN or infinity,
    in any float dtype, at any place among many tensors, a transposed view included, says "not
    shown finite"."""
    from torchlens.measure.recipes import all_finite

    tensors = [torch.randn(64, 33).to(dtype), torch.randn(7).to(dtype).t(), torch.randn(5, 9).to(dtype).t()]
    assert all_finite(tensors)
    for position in range(len(tensors)):
        holed = [t.clone() for t in tensors]  # (a clone keeps a transposed view's strides)
        holed[position][..., -1] = hole
        assert not all_finite(holed + [t.t() for t in tensors])


def test_all_finite_tells_finite_values_apart_from_what_it_cannot_show_finite():
    """Half-precision values far past their own largest sum are summed in float32 (shown finite);
    float32 values whose sum overflows, complex and integer tensors, and tensor subclasses are
    not shown finite (measured one by one instead); nothing at all is."""
    from torchlens.measure.recipes import all_finite

    assert all_finite([torch.full((1000,), 60000.0, dtype=torch.float16)])
    assert all_finite([]) and all_finite([torch.empty(0, 3)])
    assert not all_finite([torch.full((4,), 3e38)])
    assert not all_finite([torch.ones(3, dtype=torch.complex64)])
    assert not all_finite([torch.ones(3), torch.ones(3, dtype=torch.int64)])
    assert not all_finite([nn.Parameter(torch.ones(3))])
