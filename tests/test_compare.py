"""`tl.debug.compare` through the public API: alignment, tolerances, the report, bad input."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from models import conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl

DIM = 8


class ResidualBlock(nn.Module):
    """`x + fc2(relu(fc1(x)))`; `extra_op` multiplies by 1.0 first (a no-op that adds one `mul`),
    `broken` makes the forward fail on entry."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.extra_op = False
        self.broken = False

    def forward(self, x):
        if self.extra_op:
            x = x * 1.0
        if self.broken:
            x = x.view(-1, 3)  # 4 x 8 values do not fill rows of 3: the forward fails here
        return x + self.fc2(torch.relu(self.fc1(x)))


class ThreeBlocks(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.blocks = nn.Sequential(ResidualBlock(dim), ResidualBlock(dim), ResidualBlock(dim))

    def forward(self, x):
        return self.blocks(x)


def three_blocks(seed: int = 0) -> ThreeBlocks:
    torch.manual_seed(seed)
    return ThreeBlocks().eval()


def vectors(batch: int = 4, seed: int = 2) -> torch.Tensor:
    return torch.randn(batch, DIM, generator=torch.Generator().manual_seed(seed))


def perturbed(model: nn.Module, parameter: str, amount: float = 0.05, index=(0, 0)) -> nn.Module:
    """A copy of `model` with one weight nudged at `index` (an element by default)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.get_parameter(parameter)[index] += amount
    return twin


def op_event(trace, module: str, op: str):
    return next(event for event in trace.ops if event.module == module and event.op == op)


def test_perturbed_weight_in_second_block_is_the_first_divergence():
    model, x = three_blocks(), vectors()
    trace_a = tl.trace(model, x)
    trace_b = tl.trace(perturbed(model, "blocks.1.fc1.weight"), x)
    report = tl.debug.compare(trace_a, trace_b)

    first = report.first_divergence
    perturbed_linear = op_event(trace_b, "blocks.1.fc1", "linear")
    assert (first.op, first.module, first.ordinal) == ("linear", "blocks.1.fc1", perturbed_linear.ordinal)
    assert first.status == "both" and first.verdict == "diverged" and first.max_abs > 1e-3 and first.max_rel > 0
    before = report.rows[:report.rows.index(first)]
    assert before and all(row.within_tolerance and row.max_abs == 0 for row in before)
    assert report.counts["only_a"] == report.counts["only_b"] == 0
    assert report.counts["matched"] == len(trace_a.ops)


def test_an_inserted_op_aligns_as_one_row_only_in_b():
    model, x = three_blocks(), vectors()
    patched = copy.deepcopy(model)
    patched.blocks[1].extra_op = True
    trace_a, trace_b = tl.trace(model, x), tl.trace(patched, x)
    report = tl.debug.compare(trace_a, trace_b)

    extra = [row for row in report.rows if row.status != "both"]
    assert [(row.status, row.op, row.module, row.ordinal_a) for row in extra] == [("only_b", "mul", "blocks.1", None)]
    assert report.counts["matched"] == len(trace_a.ops) == len(trace_b.ops) - 1
    assert report.counts["within_tolerance"] == report.counts["matched"]
    assert report.first_divergence is None
    after = report.rows[report.rows.index(extra[0]) + 1:]
    assert after and all(row.ordinal_b == row.ordinal_a + 1 for row in after)

    reverse = tl.debug.compare(trace_b, trace_a)
    assert [(row.status, row.op) for row in reverse.rows if row.status != "both"] == [("only_a", "mul")]


def test_fp32_against_bf16_autocast_aligns_fully_and_scales_tolerance():
    model, x = tiny_gpt(), tokens()
    full = tl.trace(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = tl.trace(model, x)
    report = tl.debug.compare(full, mixed)
    counts = report.counts

    assert counts["only_a"] == counts["only_b"] == 0 and counts["matched"] == len(full.ops) == len(mixed.ops)
    assert counts["not_comparable"] == 0
    qkv = next(row for row in report.rows if row.module == "blocks.0.attn.qkv")
    assert qkv.dtypes_match is False and qkv.rtol == tl.debug.DEFAULT_TOLERANCES[torch.bfloat16][0]
    # autocast runs the residual add in fp32 on bf16 matmul results: it inherits bf16's tolerance
    residual = next(row for row in report.rows if row.module == "blocks.0" and row.op == "add")
    assert residual.dtypes_match and residual.rtol == tl.debug.DEFAULT_TOLERANCES[torch.bfloat16][0]
    # what is asserted: at least 90% of matched ops are within the scaled default tolerance, while
    # float32's tolerance imposed on every op leaves fewer than 30% within (only exact-equal ones)
    assert counts["within_tolerance"] >= 0.9 * counts["matched"]
    unscaled = tl.debug.compare(full, mixed, rtol=1e-5, atol=1e-5).counts
    assert unscaled["within_tolerance"] < 0.3 * unscaled["matched"]


def test_float64_against_float32_compares_in_float64_with_float32_tolerance():
    model, x = conv_net(), images()
    report = tl.debug.compare(tl.trace(model, x), tl.trace(copy.deepcopy(model).double(), x.double()))
    assert report.first_divergence is None
    assert all(row.dtypes_match is False and row.max_abs < 1e-4 for row in report.rows)
    assert report.rows[-1].max_abs > 0  # float32 rounding shows, measured in float64
    assert {row.rtol for row in report.rows} == {tl.debug.DEFAULT_TOLERANCES[torch.float32][0]}


def test_same_model_twice_has_no_divergence_and_a_stable_report():
    model, x = conv_net(), images()
    report = tl.debug.compare(tl.trace(model, x), tl.trace(model, x))
    assert report.first_divergence is None
    assert all(row.verdict == "within" and row.max_abs == 0 for row in report.rows)
    text = str(report)
    assert text == str(report) == str(tl.debug.compare(tl.trace(model, x), tl.trace(model, x)))
    lines = text.splitlines()
    assert lines[0] == f"no divergence: {len(report.rows)} matched ops within tolerance"
    assert lines[-1] == f"  ... {len(report.rows)} ops within tolerance"


def test_report_string_leads_with_the_first_divergence():
    model, x = three_blocks(), vectors()
    report = tl.debug.compare(tl.trace(model, x), tl.trace(perturbed(model, "blocks.1.fc1.weight"), x))
    first = report.first_divergence
    lines = str(report).splitlines()
    assert lines[0].startswith(
        f"first divergence: #{first.ordinal} linear @blocks.1.fc1 (a #{first.ordinal_a}, b #{first.ordinal_b}): "
        f"max abs diff {first.max_abs:.2e}, max rel diff {first.max_rel:.2e}")
    assert lines[1].startswith(f"{len(report.rows)} aligned ops: {len(report.rows)} in both")
    # the matching run before the divergence is folded into one count line
    assert lines[3].endswith("ops within tolerance") and lines[3].lstrip().startswith("...")
    assert any("diverged" in line and "blocks.1.fc1" in line for line in lines)
    assert str(report) == str(report)


class TwoHeads(nn.Module):
    """Two linear heads on the input with `between` elementwise ops of their own between them: a
    nudged head weight diverges its own row only, so the rows between stay within tolerance."""

    def __init__(self, between: int):
        super().__init__()
        self.head_a, self.head_b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.between = between

    def forward(self, x):
        a = self.head_a(x)
        y = x
        for _ in range(self.between):
            y = y + 1.0
        return a, y, self.head_b(x)


@pytest.mark.parametrize("between, folded", [(3, None), (4, "  ... 2 ops within tolerance")])
def test_the_folded_table_shows_a_lone_row_between_shown_ones_and_folds_longer_runs(between, folded):
    torch.manual_seed(0)
    model = TwoHeads(between)
    nudged = perturbed(perturbed(model, "head_a.weight"), "head_b.weight")
    report = tl.debug.compare(tl.trace(model, vectors()), tl.trace(nudged, vectors()))
    assert [row.verdict for row in report.rows if row.verdict != "within"] == ["diverged", "diverged"]
    row_lines = str(report).splitlines()[3:]  # after the summary, the counts and the header
    elisions = [line for line in row_lines if "within tolerance" in line]
    # each head's row and its neighbours are shown; with three ops between, the middle one would
    # be the only row hidden, so it is shown instead of a count line that says less
    assert elisions == ([] if folded is None else [folded])
    assert len(row_lines) == len(report.rows) - (0 if folded is None else 2) + len(elisions)


def test_to_rows_gives_plain_dicts():
    model, x = three_blocks(), vectors()
    report = tl.debug.compare(tl.trace(model, x), tl.trace(perturbed(model, "blocks.1.fc1.weight"), x))
    rows = report.to_rows()
    assert len(rows) == len(report.rows)
    json.dumps(rows)  # plain values only
    assert rows[0] == {
        "status": "both", "module": "", "op": "input", "ordinal_a": 1, "ordinal_b": 1,
        "shapes_match": True, "dtypes_match": True, "max_abs": 0.0, "max_rel": 0.0,
        "rtol": 1e-5, "atol": 1e-5, "verdict": "within", "reason": "", "depth": 0, "within_tolerance": True,
        "judgement": None, "closer": None, "ulps_a": None, "ulps_b": None, "allowed": None,
        "own_a": None, "own_b": None, "off": None,
    }
    diverged = next(row for row in rows if row["verdict"] == "diverged")
    assert (diverged["module"], diverged["op"]) == ("blocks.1.fc1", "linear")
    assert diverged["within_tolerance"] is False and diverged["max_abs"] == report.first_divergence.max_abs


def test_multi_output_ops_compare_every_output():
    model, x = tiny_gpt(), tokens()
    # nudge only the value projection: split's third output differs, its first two do not
    twin = perturbed(model, "blocks.0.attn.qkv.weight", index=(2 * 32, 0))
    report = tl.debug.compare(tl.trace(model, x), tl.trace(twin, x))
    assert (report.first_divergence.module, report.first_divergence.op) == ("blocks.0.attn.qkv", "linear")
    split = next(row for row in report.rows if row.op == "split")
    assert split.verdict == "diverged" and split.max_abs > 0
    first_view = next(row for row in report.rows if row.op == "view")  # q, from split's first output
    assert first_view.verdict == "within" and first_view.max_abs == 0


def test_mismatched_shapes_and_dtype_kinds_are_not_comparable():
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    narrow = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    report = tl.debug.compare(tl.trace(wide, x), tl.trace(narrow, x))
    first = report.first_divergence
    assert (first.module, first.verdict, first.reason) == ("0", "not comparable", "shapes [3,8] vs [3,6]")
    assert first.max_abs is None and first.shapes_match is False
    assert str(report).splitlines()[0].endswith("not comparable, shapes [3,8] vs [3,6]")

    as_float = tl.debug.compare(tl.trace(nn.Identity(), x), tl.trace(nn.Identity(), x.long()))
    assert as_float.first_divergence.reason == "dtypes f32 vs i64"


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Tenths(nn.Module):
    def forward(self, x):
        return (x * 10).long()


def test_nan_in_the_same_place_is_equal_and_on_one_side_diverges():
    with_nan = torch.tensor([-1.0, 2.0])
    same = tl.debug.compare(tl.trace(Log(), with_nan), tl.trace(Log(), with_nan.clone()))
    assert same.first_divergence is None and same.rows[-1].max_abs == 0
    one_sided = tl.debug.compare(tl.trace(Log(), with_nan), tl.trace(Log(), torch.tensor([1.0, 2.0])))
    log_row = one_sided.rows[-1]
    assert log_row.op == "log" and log_row.max_abs == float("inf") and log_row.within_tolerance is False


def test_integer_outputs_compare_exactly_whatever_the_tolerance():
    report = tl.debug.compare(tl.trace(Tenths(), torch.tensor([0.1, 0.25])),
                              tl.trace(Tenths(), torch.tensor([0.1, 0.35])), atol=10.0)
    long_row = report.rows[-1]
    assert long_row.verdict == "diverged" and long_row.max_abs == 1.0 and (long_row.rtol, long_row.atol) == (0, 0)
    assert report.rows[0].verdict == "within"  # the float input: within atol=10


def test_given_tolerances_override_the_defaults():
    model, x = three_blocks(), vectors()
    trace_a, trace_b = tl.trace(model, x), tl.trace(perturbed(model, "blocks.1.fc1.weight", amount=1e-4), x)
    assert tl.debug.compare(trace_a, trace_b).first_divergence is not None
    loose = tl.debug.compare(trace_a, trace_b, rtol=0, atol=1e-2)
    assert loose.first_divergence is None and {row.atol for row in loose.rows} == {1e-2}


def test_an_op_without_a_kept_value_is_unchecked_not_diverged():
    model, x = three_blocks(), vectors()
    trace_a, trace_b = tl.trace(model, x), tl.trace(model, x)
    linear = op_event(trace_b, "blocks.0.fc1", "linear")
    del trace_b.values[linear.ordinal]
    report = tl.debug.compare(trace_a, trace_b)
    row = next(row for row in report.rows if row.ordinal_b == linear.ordinal)
    assert (row.verdict, row.reason, row.within_tolerance) == ("unchecked", "no kept value in b", None)
    assert report.first_divergence is None and report.counts["unchecked"] == 1
    assert str(report).splitlines()[0].endswith(", 1 unchecked")


def test_a_partial_trace_with_values_compares_up_to_the_failure():
    model, x = three_blocks(), vectors()
    broken = copy.deepcopy(model)
    broken.blocks[2].broken = True
    with pytest.raises(RuntimeError) as failure:
        tl.trace(broken, x)
    partial = failure.value.partial_trace
    report = tl.debug.compare(tl.trace(model, x), partial)
    assert report.first_divergence is None
    assert report.counts["matched"] == len(partial.ops) and report.counts["only_b"] == 0
    assert {row.module for row in report.rows if row.status == "only_a"} == {"blocks.2", "blocks.2.fc1", "blocks.2.fc2"}


def test_bad_input_is_a_typed_error_that_says_what_to_pass():
    model, x = three_blocks(), vectors()
    trace = tl.trace(model, x)
    with pytest.raises(tl.errors.CompareInputError, match=r"use tl\.trace\(\.\.\.\), which keeps values"):
        tl.debug.compare(tl.record(model, x), trace)
    with pytest.raises(TypeError, match=r"trace_b is a list, not a trace; pass what tl\.trace"):
        tl.debug.compare(trace, [trace])

    broken = copy.deepcopy(model)
    broken.blocks[0].broken = True
    with pytest.raises(RuntimeError) as failure:
        tl.record(broken, x)
    with pytest.raises(tl.errors.CompareInputError, match=r"PartialTrace without kept values.*tl\.trace\(\.\.\.\)"):
        tl.debug.compare(trace, failure.value.partial_trace)

    with pytest.raises(tl.errors.OptionTypeError, match="rtol"):
        tl.debug.compare(trace, trace, rtol="tight")
    with pytest.raises(tl.errors.OptionValueError, match="atol"):
        tl.debug.compare(trace, trace, atol=-1.0)


def test_long_reports_fold_matching_runs_and_cap_their_rows():
    model, x = tiny_gpt(), tokens()
    report = tl.debug.compare(tl.trace(model, x), tl.trace(perturbed(model, "tok.weight", index=slice(None)), x))
    full = report.table(elide=False, max_rows=None).splitlines()
    assert len(full) == 3 + len(report.rows)
    folded = report.table(max_rows=None).splitlines()
    assert len(folded) < len(full)
    capped = report.table(max_rows=5).splitlines()
    assert capped[:8] == folded[:8]
    assert capped[8:] == [f"... {len(folded) - 8} more lines (report.table(max_rows=None) shows all)"]


def test_a_report_exactly_max_rows_long_is_not_cut_and_one_row_more_is():
    model, x = three_blocks(), vectors()
    report = tl.debug.compare(tl.trace(model, x), tl.trace(perturbed(model, "blocks.1.fc1.weight"), x))
    rows = len(report.rows)
    whole = report.table(elide=False, max_rows=rows).splitlines()
    assert whole == report.table(elide=False, max_rows=None).splitlines() and len(whole) == 3 + rows
    cut = report.table(elide=False, max_rows=rows - 1).splitlines()
    assert cut[:-1] == whole[:-1] and cut[-1] == "... 1 more line (report.table(max_rows=None) shows all)"


def test_plot_marks_the_first_divergence(tmp_path):
    pytest.importorskip("matplotlib")
    model, x = three_blocks(), vectors()
    report = tl.debug.compare(tl.trace(model, x), tl.trace(perturbed(model, "blocks.1.fc1.weight"), x))
    figure = report.plot(tmp_path / "diff.png")
    assert (tmp_path / "diff.png").stat().st_size > 0
    axes = figure.axes[0]
    assert axes.get_yscale() == "log"
    first = report.first_divergence
    marker_x = [line.get_xdata()[0] for line in axes.lines if line.get_linestyle() == "--"]
    assert marker_x == [report.rows.index(first) + 1]
    labels = [text.get_text().strip() for text in axes.texts]
    assert labels == [f"first divergence: #{first.ordinal} linear @blocks.1.fc1"]


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    model, x = three_blocks(), vectors()
    trace = tl.trace(model, x)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        tl.debug.compare(trace, trace).plot()


# -- eager against compiled ----------------------------------------------------------------------


@pytest.mark.slow
def test_eager_and_inductor_traces_align_op_for_op_within_float32_tolerance():
    model, x = tiny_gpt(), tokens(2, 8)
    with torch.no_grad():
        eager = tl.trace(model, x)
        compiled = tl.trace(model, x, compiled=True)
    report = tl.debug.compare(eager, compiled)
    assert report.first_divergence is None, str(report)
    assert report.counts["matched"] == len(eager.ops) == len(compiled.ops)
    assert report.counts["only_a"] == report.counts["only_b"] == 0
    assert torch.allclose(compiled.output, eager.output, atol=1e-5)


def test_an_altered_compiled_op_is_the_first_divergence():
    def gelu_becomes_relu(gm, example_inputs):
        """A compiler with a bug: it swaps one op of the graph for another."""
        for node in gm.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "__name__", "") == "gelu":
                node.target = torch.relu
                break
        gm.recompile()
        return gm.forward

    model, x = tiny_gpt(), tokens(2, 8)
    eager = tl.trace(model, x)
    compiled = tl.trace(model, x, compiled={"compiler": gelu_becomes_relu})
    first = tl.debug.compare(eager, compiled).first_divergence
    assert (first.op, first.module) == ("gelu", "blocks.0.mlp")
    assert first.max_abs > 0.01


def test_compiled_keyword_is_checked():
    with pytest.raises(tl.errors.OptionTypeError, match="compiled="):
        tl.trace(tiny_gpt(), tokens(), compiled="yes")


# -- transcripts ---------------------------------------------------------------------------------


def test_a_traces_transcript_is_the_live_narration_and_runs_repeat_byte_for_byte(tmp_path):
    paths = [tmp_path / "one.log", tmp_path / "two.log"]
    traces = [tl.trace(tiny_gpt(), tokens(), narrate=tl.options.NarrationOptions(sink=path, sites=True,
                                                                                   normalize=True))
              for path in paths]
    assert traces[0].narrate() == paths[0].read_text()
    assert paths[0].read_bytes() == paths[1].read_bytes()


# -- alignment on everything both sides share ------------------------------------------------------


def _op(ordinal, op, shape, module=""):
    from torchlens.events import OP, Event, Scope, TensorMeta

    return Event(OP, ordinal, op, Scope(module, "M", None), (TensorMeta(tuple(shape), torch.float32, torch.device("cpu")),))


def test_an_extra_twin_on_one_side_does_not_shift_the_pairing():
    from torchlens.debug.align import align

    a = [_op(1, "view", [2, 4]), _op(2, "getitem", [1, 1, 1, 1]), _op(3, "getitem", [1, 1, 7, 1]), _op(4, "add", [2, 4])]
    b = [_op(1, "view", [2, 4]), _op(2, "getitem", [1, 1, 7, 1]), _op(3, "add", [2, 4])]
    pairs = [(x.ordinal if x else None, y.ordinal if y else None) for x, y in align(a, b)]
    assert pairs == [(1, 1), (2, None), (3, 2), (4, 3)]


def test_an_op_whose_shape_really_changed_still_pairs_with_its_twin():
    from torchlens.debug.align import align

    a = [_op(1, "linear", [2, 4]), _op(2, "relu", [2, 4])]
    b = [_op(1, "linear", [2, 5]), _op(2, "relu", [2, 5])]
    assert [(x.ordinal, y.ordinal) for x, y in align(a, b)] == [(1, 1), (2, 2)]


def test_mistral_eager_against_compiled_has_no_false_divergence():
    pytest.importorskip("transformers")
    from real_models import REAL_MODELS

    model, args, kwargs = REAL_MODELS["mistral"].build()
    with torch.no_grad():
        eager = tl.trace(model, *args, **kwargs)
        compiled = tl.trace(model, *args, compiled={"compiler": "eager"}, **kwargs)
    report = tl.debug.compare(eager, compiled)
    assert report.first_divergence is None, report.first_divergence
    counts = report.counts
    assert counts["not_comparable"] == 0 and counts["matched"] == counts["within_tolerance"] > 100
