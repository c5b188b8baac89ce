"""Forward verdicts at their edges: complex outputs, empty outputs, writes into part of a tensor,
values no measured op explains, the same weight read twice, infinities held back until their fate,
and a footer that counts what it claims."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import torchlens as tl


def narrated(model, *args, **options):
    sink = io.StringIO()
    rec = tl.record(model, *args, narrate=tl.options.NarrationOptions(sink=sink), **options)
    return sink.getvalue(), rec


def footer(text: str) -> str:
    return text.splitlines()[-1]


def texts(rec) -> list:
    return [finding.text for finding in rec.findings]


# -- complex outputs ---------------------------------------------------------------------------------


class ComplexDivision(nn.Module):
    def forward(self, x):
        z = torch.complex(x, x)
        return (z / 0).abs()  # complex division by zero: infinite magnitudes


def test_an_infinity_born_in_a_complex_output_is_named_at_its_op():
    _, rec = narrated(ComplexDivision(), torch.ones(3), on_nonfinite="track")
    assert rec.first_nonfinite is not None and rec.first_nonfinite.op == "div"
    assert texts(rec)[0].startswith("+inf born at #3 div (+inf=3")


def test_raise_lets_a_complex_infinity_run_but_tracking_reports_it_reaching_the_output():
    _, rec = narrated(ComplexDivision(), torch.ones(3), on_nonfinite="raise")
    assert texts(rec)[-1] == "+inf reaches the output out (born at #3 div)"


# -- empty outputs -----------------------------------------------------------------------------------


class EmptySlice(nn.Module):
    def forward(self, x):
        return x + 1, x[:0] * 2


def test_an_empty_output_holds_nothing_non_finite_and_is_not_counted_as_unmeasured():
    text, rec = narrated(EmptySlice(), torch.ones(3), on_nonfinite="track")
    assert rec.findings == ()
    assert footer(text).endswith("; no non-finite values")
    assert "not measured" not in footer(text)


# -- writes into part of a tensor --------------------------------------------------------------------


class WriteEvenElements(nn.Module):
    def forward(self, x):
        y = torch.log(x)  # NaN in the last element only
        y[::2].mul_(2)  # an in-place write of elements 0 and 2: the last element stays as log made it
        return y.sum()


def test_a_nan_outside_a_strided_in_place_write_still_comes_from_the_op_that_made_it():
    text, rec = narrated(WriteEvenElements(), torch.tensor([1.0, 2.0, 3.0, -1.0]), on_nonfinite="track")
    assert texts(rec) == ["NaN born at #2 log (nan=1)"]
    assert "sum" not in footer(text)


# -- values no measured op explains ------------------------------------------------------------------


class AfterSparse(nn.Module):
    """A NaN made by sparse ops (which are not measured), first met at a dense op."""

    def forward(self, x):
        a = (x.to_sparse() * float("nan")).to_dense()
        b = (x.to_sparse() * float("nan")).to_dense()
        return a + b


def test_a_nan_first_met_after_ops_that_were_not_measured_is_first_seen_once_never_born():
    text, rec = narrated(AfterSparse(), torch.ones(3), on_nonfinite="track")
    [finding] = rec.findings  # the second sighting of an unmeasured origin says nothing new
    assert finding.text.startswith("NaN first seen at #4 to_dense (nan=3); not everything it read was measured")
    assert not finding.birth
    assert "4 not measured (4 sparse_coo)" in footer(text)


class MaskedWithSparse(nn.Module):
    def forward(self, x):
        s = x.to_sparse()
        mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
        return x.masked_fill(mask, float("-inf")).softmax(-1), s


def test_the_footer_counts_every_measured_op_when_some_were_not_measured():
    text, rec = narrated(MaskedWithSparse(), torch.ones(3, 3), on_nonfinite="track")
    assert rec.findings == ()
    # measured: the input, ones, triu, masked_fill (it holds -inf) and softmax; not: to_sparse
    assert footer(text).endswith("no non-finite findings (-inf from #5 masked_fill absorbed by later ops) "
                                 "in the 5 measured; 1 not measured (1 sparse_coo)")


# -- the same weight read twice ----------------------------------------------------------------------


class SharedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        with torch.no_grad():
            self.fc.weight[0, 0] = float("nan")

    def forward(self, x, y):
        return self.fc(x), self.fc(y)


def test_a_nan_weight_read_by_two_calls_is_one_finding_at_the_first_read():
    _, rec = narrated(SharedLinear(), torch.ones(1, 3), torch.ones(1, 3), on_nonfinite="track")
    assert texts(rec) == ["NaN in fc.weight (nan=1), first read by #3 linear @fc"]


# -- infinities held back until their fate -----------------------------------------------------------


class OverflowReturned(nn.Module):
    def forward(self, x):
        big = (x * 100).exp()
        return big - big, big


def test_an_overflow_that_makes_a_nan_and_reaches_the_output_is_named_once():
    text, rec = narrated(OverflowReturned(), torch.ones(3), on_nonfinite="track")
    assert texts(rec) == [
        "+inf born at #3 exp (+inf=3: an overflow, a division by zero or a log of zero)",
        "NaN born at #4 sub (nan=3) (out of +inf born at #3 exp)",
        "+inf reaches the output out[1] (born at #3 exp)",
    ]
    # the footer: the first finding, then the NaN, then how many more
    assert footer(text).endswith("first non-finite: +inf born at #3 exp (+inf=3: an overflow, a division by "
                                 "zero or a log of zero); then NaN born at #4 sub (nan=3) (out of +inf born "
                                 "at #3 exp) (+1 more finding)")


class LogDeterminant(nn.Module):
    def forward(self, x):
        sign, logabs = torch.linalg.slogdet(x)
        return logabs


def test_an_infinity_born_in_the_second_output_of_an_op_is_counted_there():
    _, rec = narrated(LogDeterminant(), torch.zeros(2, 2), on_nonfinite="track")
    assert texts(rec)[0] == ("-inf born at #2 linalg_slogdet (-inf=1: an overflow, a division by zero or a "
                             "log of zero)")


class CausalMaskBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.full((3, 3), float("-inf")), 1))

    def forward(self, x):
        return (x @ x.T + self.mask).softmax(-1)


def test_an_absorbed_infinity_from_a_mask_buffer_is_named_by_the_buffer():
    text, rec = narrated(CausalMaskBuffer(), torch.ones(3, 3), on_nonfinite="track")
    assert rec.findings == ()
    assert footer(text).endswith("no non-finite findings (-inf from mask absorbed by later ops)")


# -- a float view of integer memory ------------------------------------------------------------------


class FloatBits(nn.Module):
    def forward(self, bits):
        copied = bits + 0
        return copied.view(torch.float32) * 1


def test_a_float_view_of_integer_memory_is_where_its_nan_is_born():
    bits = torch.tensor([0x7FC00000, 0x3F800000], dtype=torch.int32)  # a quiet NaN, then 1.0
    for value_stats in ("off", "exact"):
        _, rec = narrated(FloatBits(), bits, on_nonfinite="track", value_stats=value_stats)
        assert texts(rec) == ["NaN born at #3 view (nan=1)"], value_stats


# -- values written by scalars and by calls that return nothing -------------------------------------


class ListMask(nn.Module):
    def forward(self, x):
        mask = torch.tensor([0.0, float("-inf"), 0.0])  # an additive mask from a list literal
        return (x + mask).softmax(-1)


def test_an_infinity_from_a_list_literal_is_carried_in_and_absorbed():
    text, rec = narrated(ListMask(), torch.ones(3), on_nonfinite="track")
    assert rec.findings == ()
    assert footer(text).endswith("no non-finite findings (-inf from #2 tensor absorbed by later ops)")


class ListNaN(nn.Module):
    def forward(self, x):
        return x + x.new_tensor([0.0, float("nan"), 0.0])


def test_a_nan_in_a_list_literal_is_written_by_a_scalar_argument():
    _, rec = narrated(ListNaN(), torch.ones(3), on_nonfinite="track")
    assert texts(rec) == ["NaN written by a scalar argument of #2 new_tensor"]


class ForeachByKeyword(nn.Module):
    def forward(self, x):
        y = x * 1
        torch._foreach_mul_(self=[y], scalar=float("nan"))  # writes y, returns nothing
        return y.sum()


def test_a_nan_written_by_a_foreach_call_with_keyword_arguments_is_named_at_the_write():
    _, rec = narrated(ForeachByKeyword(), torch.ones(3), on_nonfinite="track")
    assert texts(rec) == ["NaN written by a scalar argument of #3 _foreach_mul_"]
    assert rec.first_nonfinite.op == "_foreach_mul_"


class ReadsWeightThrough(nn.Module):
    """`contiguous()` and `to()` of a tensor that already is so return the tensor itself: the
    call read the weight, it did not write it."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        return x @ self.how(self.w)


@pytest.mark.parametrize("how, op", [(lambda w: w.contiguous(), "contiguous"), (lambda w: w.to(torch.float32), "to"),
                                     (lambda w: w.type_as(w), "type_as")])
def test_a_nan_weight_read_through_a_call_that_returns_it_unchanged_is_named(how, op):
    model = ReadsWeightThrough(how)
    with torch.no_grad():
        model.w[1, 1] = float("nan")
    rec = tl.record(model, torch.ones(2, 3), on_nonfinite="track")
    assert texts(rec) == [f"NaN in w (nan=1), first read by #2 {op}"]
