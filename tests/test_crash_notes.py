"""The notes of a compiled crash tail say how the attempted op was located, and never claim
something false: not "no torch call was in flight" when locating was skipped, not "draws random
numbers" when nothing drew, not "located by replaying" when nothing was replayed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl

NOT_RERUN = ("-- dynamo raised while tracing; not located: the model has modules in training mode, "
             "and re-running it eagerly could change them")
RANDOM = "replay caveat: the graph draws random numbers; the replay drew its own"
LIVE = "-- located live: the graph runs op by op, and this op had started but not returned"


def _fail(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


# -- a shape error dynamo finds while tracing ---------------------------------------------------


class Normed(nn.Module):
    """A batch norm (whose statistics a second forward would change) ahead of a too-wide linear."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.norm(x))  # 3 features into a 4-feature linear


def test_a_tracing_error_in_training_mode_says_locating_was_skipped_and_why():
    model = Normed().train()
    compiled = tl.compile(model, compiler="eager", dynamic=True)
    exc = _fail(lambda: compiled(torch.randn(2, 3)))
    assert isinstance(exc, torch._dynamo.exc.TorchRuntimeError)
    tail = exc.partial_trace.narrate(last=3).splitlines()
    assert "no torch call was in flight" not in "\n".join(tail)
    assert tail[-2] == NOT_RERUN
    assert tail[-1].startswith("!! attempted #2 <dynamo tracing>  test_crash_notes.py:")
    assert tail[-1].endswith("  inputs: [2,3] f32 cpu  (not proven culprit)")  # the forward's inputs
    assert model.norm.num_batches_tracked.item() == 0, "the forward was not run again"


def test_a_tracing_error_in_a_compiled_function_says_it_was_not_located():
    weight = torch.randn(4, 4)

    def project(x):
        return x @ weight

    compiled = torch.compile(project, backend="torchlens", options={"compiler": "eager"}, dynamic=True)
    compiled(torch.randn(2, 4))  # the string backend narrates from the first graph it compiles on
    exc = _fail(lambda: compiled(torch.randn(2, 3)))
    tail = exc.partial_trace.narrate(last=3).splitlines()
    assert "no torch call was in flight" not in "\n".join(tail)
    assert tail[-2] == ("-- dynamo raised while tracing; not located: only a compiled module's forward is run "
                        "again eagerly, and this callable is not a module")
    assert tail[-1].startswith("!! attempted #2 <dynamo tracing>")


# -- the random-numbers caveat of a replay ------------------------------------------------------


class Draws(nn.Module):
    """Runs `before` on a constant, then an embedding fed an out-of-range index, then `after`."""

    def __init__(self, before, after=None):
        super().__init__()
        self.before, self.after = before, after
        self.embed = nn.Embedding(8, 4)

    def forward(self, idx):
        noise = self.before(torch.ones(1, 1, 2, 4))
        out = self.embed(idx + noise.reshape(2, 4).long() * 0)
        return out if self.after is None else out + self.after(out)


def _replayed_tail(model):
    compiled = tl.compile(model, compiler="eager")
    exc = _fail(lambda: compiled(torch.full((2, 4), 100)))
    assert isinstance(exc, IndexError)
    tail = exc.partial_trace.narrate(last=4)
    assert "-- located by replaying the compiled graph op by op" in tail
    assert tail.splitlines()[-1].startswith("!! attempted") and "embedding @embed" in tail.splitlines()[-1]
    return tail


@pytest.mark.parametrize("before", [
    lambda x: F.dropout(x, 0.5, training=False),
    nn.Dropout(0.5).eval(),
    lambda x: F.alpha_dropout(x, 0.5, training=False),
    lambda x: F.rrelu(x, training=False),  # tagged as seeded by torch: draws only in training
    lambda x: F.scaled_dot_product_attention(x, x, x),  # its CPU kernel is tagged seeded; no dropout
    F.normalize,  # named like a random op ("normal...")
], ids=["dropout-training-false", "dropout-module-eval", "alpha-dropout-eval", "rrelu-eval", "attention",
        "normalize"])
def test_no_random_caveat_when_nothing_drew(before):
    assert RANDOM not in _replayed_tail(Draws(before))


@pytest.mark.parametrize("before", [
    lambda x: x + torch.rand(2, 4).reshape(x.shape),
    lambda x: torch.randn_like(x),
    lambda x: F.dropout(x, 0.5, training=True),
    lambda x: x.clone().bernoulli_(0.5),
], ids=["rand", "randn-like", "dropout-training", "bernoulli-in-place"])
def test_the_random_caveat_when_the_graph_drew_before_the_failure(before):
    assert RANDOM in _replayed_tail(Draws(before))


def test_no_random_caveat_for_a_draw_after_the_failing_op():
    """The failed call never reached it, and neither did the replay."""
    assert RANDOM not in _replayed_tail(Draws(lambda x: x, after=torch.rand_like))


# -- live mode ----------------------------------------------------------------------------------

_CALLS = []


@torch.library.custom_op("torchlens_crash_notes::counted", mutates_args=())
def counted(x: torch.Tensor) -> torch.Tensor:
    _CALLS.append(1)
    return x.clone()


@counted.register_fake
def _(x):
    return torch.empty_like(x)


class CountsThenLooksUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, idx):
        self.calls.add_(1)  # state a replay would change a second time
        return self.embed(counted(idx))


def test_live_mode_says_it_located_the_op_live_and_replays_nothing():
    model = CountsThenLooksUp()
    compiled = tl.compile(model, compiler="eager", live=True)
    compiled(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]]))
    _CALLS.clear()
    exc = _fail(lambda: compiled(torch.full((2, 4), 100)))
    assert isinstance(exc, IndexError)
    assert len(_CALLS) == 1 and model.calls.item() == 2, "the graph's ops ran once: no replay"
    tail = exc.partial_trace.narrate(last=3).splitlines()
    assert "replay" not in "\n".join(tail) and "not replayed" not in "\n".join(tail)
    assert tail[-2] == LIVE
    assert tail[-1].startswith("!! attempted #4 embedding @embed  test_crash_notes.py:")
    assert tail[-1].endswith("  inputs: [2,4] i64 cpu (min=100 max=100), [8,4] f32 cpu  (not proven culprit)")
    assert exc.partial_trace.attempt.op == "embedding" and exc.partial_trace.attempt.module == "embed"


def test_live_mode_names_the_op_in_flight_with_its_real_input_sizes_under_dynamic_shapes():
    model = CountsThenLooksUp()
    compiled = tl.compile(model, compiler="eager", live=True, dynamic=True)
    compiled(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]]))
    exc = _fail(lambda: compiled(torch.full((3, 5), 100)))
    tail = exc.partial_trace.narrate(last=2).splitlines()
    assert tail[-2] == LIVE
    assert tail[-1].startswith("!! attempted #") and " embedding @embed  " in tail[-1]
    assert "inputs: [3,5] i64 cpu (min=100 max=100), [8,4] f32 cpu" in tail[-1]


class Selects(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x, idx):
        return torch.index_select(self.fc(x).relu(), 1, idx)  # an out-of-range index fails at run time


def test_live_mode_names_the_op_after_the_last_narrated_when_the_frame_is_gone():
    # FX re-raises an error from generated code without its traceback: the graph's frame cannot
    # be read, and the op in flight is the one after the last op the call narrated.
    compiled = tl.compile(Selects().eval(), compiler="eager", live=True)
    compiled(torch.ones(2, 3), torch.tensor([0]))
    exc = _fail(lambda: compiled(torch.ones(2, 3), torch.tensor([7])))
    tail = exc.partial_trace.narrate(last=3).lines
    assert tail[-3].startswith("-- live mode ran this graph op by op, eagerly: the exception is the eager op's")
    assert tail[-2] == "-- located live: the op after the last one narrated (its inputs could not be read)"
    assert tail[-1].startswith("!! attempted #5 index_select") and "inputs: not read" in tail[-1]
    assert " relu " in exc.partial_trace.narrate(last=4).lines[-4]
    assert isinstance(exc, RuntimeError)
