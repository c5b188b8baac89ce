"""Statistics of integer tensors are exact: min and max as the integers the tensor holds, past 2**53
too (token ids, hashes, timestamps), for every integer dtype, eager and compiled, and in a saved
trace; mean and sd, shown to four digits, are those digits of the exact mean and sd."""

from __future__ import annotations

import io
import math
import re
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchlens as tl
from torchlens.fx_backend import stats_pass
from torchlens.measure.stats import FEW_INTEGERS, few_int_values, small_int_vector
from torchlens.narration.stats_text import fmt

INTEGER_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64] + [
    dtype for dtype in (getattr(torch, name, None) for name in ("uint16", "uint32", "uint64")) if dtype is not None]


class TokenHasher(nn.Module):
    """Token ids turned into 64-bit keys, as a deduplicating or bucketing step does: offsets past
    2**53 and 2**62, and a multiplicative hash that wraps around."""

    def forward(self, ids):
        past_2_53 = ids + (2**53 + 1)
        past_2_62 = ids * 2 + (2**62 + 1)
        hashed = ids * -7046029254386353131
        return past_2_53, past_2_62, hashed


class Widths(nn.Module):
    """Values near 2**53 and 2**62 in every integer dtype (wrapped where narrower; unsigned 64-bit
    ones past 2**63)."""

    def forward(self, x):
        outs = [x.to(dtype) for dtype in INTEGER_DTYPES if dtype is not getattr(torch, "uint64", None)]
        if getattr(torch, "uint64", None) is not None:
            outs.append((x - 2**63).to(torch.uint64))  # x + 2**63: up to 2**63 + 2**62 + 15
        return tuple(outs)


IDS = torch.tensor([[0, 1, 5, 7], [7, 3, 0, 2]])
WIDE = torch.tensor([0, 1, 2**53 + 1, 2**62 + 1, 2**62 + 15, -(2**62) - 3])


def expected_text(values: list) -> str:
    """`min=.. max=.. mean=.. sd=..` of exact integers: min and max exact, mean and sd the exact
    values rounded as every statistic is shown."""
    mean = Fraction(sum(values), len(values))
    variance = sum((Fraction(v) - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return f"min={min(values)} max={max(values)} mean={fmt(float(mean))} sd={fmt(math.sqrt(variance))}"


def stats_of_lines(text: str) -> dict:
    """`#N` -> the statistics segment of each op line."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"#(\d+)\s.*\| (.*)$", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    return found


def check_exact(trace, text: str) -> int:
    """Every integer op's line shows its output's exact statistics; returns how many were checked."""
    lines = stats_of_lines(text)
    checked = 0
    for event in trace.ops:
        value = trace.values[event.ordinal]
        if len(value) != 1 or value[0].dtype not in INTEGER_DTYPES:
            continue
        assert lines[event.ordinal] == expected_text(value[0].reshape(-1).tolist()), (event, value[0])
        checked += 1
    return checked


def narrated_trace(model, x, **kwargs):
    sink = io.StringIO()
    trace = tl.trace(model, x, value_stats="exact", narrate=tl.options.NarrationOptions(sink=sink), **kwargs)
    return trace, sink.getvalue()


@pytest.mark.parametrize("read", ["now", "deferred"])
@pytest.mark.parametrize("model, x", [(TokenHasher(), IDS), (Widths(), WIDE)], ids=["hashes", "widths"])
def test_eager_integer_statistics_are_exact(model, x, read, request):
    """Read as each op returns (the CPU's way) or once at the end of the forward (an accelerator's)."""
    if read == "deferred":  # (no line printed live, which would be read at once)
        request.getfixturevalue("deferred_reads")
        trace = tl.trace(model, x, value_stats="exact")
        text = trace.narrate()
    else:
        trace, text = narrated_trace(model, x)
    # every op: the input, the adds and multiplies, a conversion to each dtype (and a subtraction)
    assert check_exact(trace, text) == (5 if isinstance(model, TokenHasher) else len(INTEGER_DTYPES) + 2)


def test_values_past_2_53_print_as_themselves_and_a_spread_of_2_is_no_sd_of_0():
    trace, text = narrated_trace(TokenHasher(), IDS)
    lines = stats_of_lines(text)
    assert lines[trace.ops[1].ordinal].startswith(f"min={2**53 + 1} max={2**53 + 8} ")
    # 2**62 + 1 + (0, 2, 10, 14, 14, 6, 0, 4): each is 2**62 in float64, whose sd would be 0
    assert lines[trace.ops[3].ordinal] == f"min={2**62 + 1} max={2**62 + 15} mean=4.612e+18 sd=5.8"
    assert trace.ops[3].stats.min == 2**62 + 1 and isinstance(trace.ops[3].stats.min, int)


class AtTheBoundary(nn.Module):
    """Integers one past float64's exact ones, one tensor on each side: -2**53 - 1 and 2**53 + 1
    round to -2**53 and 2**53 in float64, which themselves are exact, as every other element is."""

    def forward(self, ids):
        return ids - (2**53 + 1), ids + (2**53 - 1)


def test_integers_one_past_2_53_are_measured_as_integers_not_from_their_rounded_float64_copies():
    """Read as each op returns, an integer tensor is measured from its float64 copy while that is
    exact: a copy whose extreme is exactly 2**53 may be a rounded 2**53 + 1, so its min, max, mean
    and sd are taken from the integers (from the copy, -2**53 - 1 would show as -2**53 and the sd
    of three consecutive integers as 0.5774)."""
    trace, text = narrated_trace(AtTheBoundary(), torch.tensor([0, 1, 2]))
    assert check_exact(trace, text) == 3
    below, above = (trace.ops[i].stats for i in (1, 2))
    assert (below.min, below.max) == (-(2**53) - 1, -(2**53) + 1) and below.sd == 1.0
    assert (above.min, above.max) == (2**53 - 1, 2**53 + 1) and above.sd == 1.0
    lines = stats_of_lines(text)
    assert lines[trace.ops[1].ordinal] == f"min={-(2**53) - 1} max={-(2**53) + 1} mean=-9.007e+15 sd=1"
    assert lines[trace.ops[2].ordinal] == f"min={2**53 - 1} max={2**53 + 1} mean=9.007e+15 sd=1"


def test_a_tracked_run_measures_integers_exactly_too():
    trace, text = narrated_trace(TokenHasher(), IDS, on_nonfinite="track")
    assert check_exact(trace, text) == 5


def exact_texts(trace) -> list:
    """The exact statistics of each op of `trace`, in order (every op here is an integer one)."""
    return [expected_text(trace.values[event.ordinal][0].reshape(-1).tolist()) for event in trace.ops]


@pytest.mark.parametrize("way", ["after_call", "fused"])
def test_compiled_integer_statistics_are_exact(way, monkeypatch):
    """Measured after the graph call (the CPU's way) or fused into the graph (an accelerator's),
    the statistics are the exact ones, as eager's are."""
    if way == "fused":
        monkeypatch.setattr(stats_pass, "AFTER_CALL_BYTES", 0)
    for model, x in ((TokenHasher(), IDS), (Widths(), WIDE[:5])):
        sink = io.StringIO()
        compiled = tl.compile(model, value_stats="exact", compiler="eager",
                              narrate=tl.options.NarrationOptions(sink=sink))
        compiled(x)
        trace, _ = narrated_trace(model, x)
        assert list(stats_of_lines(sink.getvalue()).values()) == exact_texts(trace)


def test_a_dynamic_size_fused_in_a_graph_is_exact_and_an_empty_one_says_so(monkeypatch):
    class Kept(nn.Module):
        def forward(self, x):
            return x[x > 0] + (2**62 + 1)

    monkeypatch.setattr(stats_pass, "AFTER_CALL_BYTES", 0)
    sink = io.StringIO()
    compiled = tl.compile(Kept(), value_stats="exact", compiler="eager", dynamic=True,
                          narrate=tl.options.NarrationOptions(sink=sink))
    for x in (torch.tensor([1, -2, 3]), torch.tensor([-1, -2]), torch.tensor([5, 0, 7, 9])):
        compiled(x)
    adds = [line.split("| ")[-1] for line in sink.getvalue().splitlines() if " add " in line]
    assert adds == [expected_text([2**62 + 2, 2**62 + 4]), "stats n/a (empty)",
                    expected_text([2**62 + 6, 2**62 + 8, 2**62 + 10])]


@pytest.mark.slow
def test_inductor_integer_statistics_are_exact_fused_in_the_graph(monkeypatch):
    monkeypatch.setattr(stats_pass, "AFTER_CALL_BYTES", 0)
    sink = io.StringIO()
    tl.compile(TokenHasher(), value_stats="exact", narrate=tl.options.NarrationOptions(sink=sink))(IDS)
    trace, _ = narrated_trace(TokenHasher(), IDS)
    assert list(stats_of_lines(sink.getvalue()).values()) == exact_texts(trace)


def test_a_saved_trace_keeps_integer_statistics_exact(tmp_path):
    trace, text = narrated_trace(TokenHasher(), IDS)
    loaded = tl.load(trace.save(tmp_path / "hashes.tl"))
    assert loaded.narrate() == trace.narrate()
    for event, again in zip(trace.ops, loaded.ops):
        assert (again.stats.min, again.stats.max) == (event.stats.min, event.stats.max)
    assert loaded.ops[3].stats.max == 2**62 + 15 and isinstance(loaded.ops[3].stats.max, int)


def test_integer_statistics_of_a_large_tensor_stay_exact():
    """Sums over 100,000 elements near 2**62, spread over 1,000 values (a spread their float64 copies
    would lose): the mean and sd are still those of the integers."""
    class Offsets(nn.Module):
        def forward(self, x):
            return x + (2**62 + 1)

    x = torch.arange(100_000) % 1000
    trace, text = narrated_trace(Offsets(), x)
    values = trace.values[trace.ops[1].ordinal][0]
    assert stats_of_lines(text)[trace.ops[1].ordinal] == expected_text(values.tolist())


_BOUNDS = {dtype: (int(torch.iinfo(dtype).min), int(torch.iinfo(dtype).max)) for dtype in INTEGER_DTYPES
           if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), dtype=st.sampled_from(sorted(_BOUNDS, key=str)), numel=st.integers(1, FEW_INTEGERS),
       scale=st.sampled_from([8, 2**20, 2**31, 2**46, 2**53, 2**62]))
def test_few_integers_summed_in_python_give_the_reductions_floats_bit_for_bit_or_step_aside(data, dtype, numel,
                                                                                            scale):
    """A small integer tensor's statistics vector summed in Python is the float64 reductions' own,
    down to the bit, whenever those could not round; past that (sums near 2**53 and beyond) it
    steps aside and the reductions run."""
    low, high = _BOUNDS[dtype]
    values = data.draw(st.lists(st.integers(max(low, -scale), min(high, scale)), min_size=numel, max_size=numel))
    tensor = torch.tensor(values, dtype=dtype)
    few = few_int_values(tensor)
    if few is None:
        assert max(map(abs, values)) * numel >= 2**25, values  # (only sums that could round step aside)
        return
    reduced = small_int_vector(tensor.to(torch.float64)).tolist()
    assert list(map(repr, few)) == list(map(repr, reduced)), (few, reduced)


def test_few_integers_past_float64_s_exact_ones_step_aside_even_when_close_together():
    """Values past 2**53 round when converted to float64, so their deviations there are not the
    integers': however small their spread, the Python sums step aside."""
    close = torch.tensor([2**53 + 1, 2**53, 2**53 + 3])
    assert few_int_values(close) is None
    assert few_int_values(-close) is None
    assert few_int_values(close - 4) is not None  # (all below 2**53: exact either way)


def test_a_transformers_forward_s_token_ids_and_positions_are_summed_in_python(monkeypatch):
    """Token ids, positions and masks are small integer tensors: their exact statistics cost a read
    each, no reductions, and read as the reductions would make them."""
    transformers = pytest.importorskip("transformers")
    from torchlens.measure import recipes

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model, ids = transformers.GPT2Model(config).eval(), torch.tensor([[5, 17, 3, 99, 42, 0, 7]])
    with torch.no_grad():
        fast = tl.record(model, ids, value_stats="exact")
        reduced: list = []
        monkeypatch.setattr(recipes, "few_int_values", lambda tensor: reduced.append(tensor.numel()))
        slow = tl.record(model, ids, value_stats="exact")
    integers = [event for event in fast.events if getattr(event.stats, "kind", None) == "exact"
                and isinstance(event.stats.min, int)]
    measured = {id(event.stats) for event in integers}  # (a view shares what it views)
    assert len(measured) >= 2 and len(reduced) == len(measured), (integers, reduced)  # the ids, the positions
    assert fast.narrate() == slow.narrate()
