"""`tl.watch`: the cheap per-step check, the exact replay of a faulty step, and what it decides.

Each scenario trains a model with an unchanged loop (forward, backward, `optimizer.step()`,
`zero_grad`) and plants one fault at a known step; the watch must catch that step, before the
optimizer changes a weight, and name where the value was born.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens.errors import NonFiniteError, OptionTypeError, OptionValueError


class SqrtNet(nn.Module):
    """`where(h > 0, sqrt(h), 0)` on `|fc(x)|`: finite forwards; where `h == 0` (an all-zero input
    with a zero bias), the backward makes `0 * inf = NaN`, which reaches the weights."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(self.drop(x)).abs()
        return torch.where(h > 0, h.sqrt(), torch.zeros_like(h)).sum()


def _zero_input_step(model):
    """What makes SqrtNet's backward NaN: a zero input and a zero bias."""
    with torch.no_grad():
        model.fc.bias.zero_()
    return torch.zeros(3, 4)


def _state(model, optimizer):
    return ([p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict()["state"]))


def _same_state(a, b) -> bool:
    (params_a, opt_a), (params_b, opt_b) = a, b
    if not all(torch.equal(x, y) for x, y in zip(params_a, params_b)):
        return False
    if opt_a.keys() != opt_b.keys():
        return False
    return all(torch.equal(opt_a[k][name], opt_b[k][name]) for k in opt_a for name in opt_a[k])


def _train(model, optimizer, inputs, plant=None):
    """The plain loop; `plant(step, model)` may replace the step's input."""
    for step, x in enumerate(inputs):
        if plant is not None:
            planted = plant(step, model)
            x = x if planted is None else planted
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad()


class MaskedSqrtNet(nn.Module):
    """`where(h > 0, sqrt(h), 0)` on `fc(x)`, negatives included: the forward makes NaN where `h < 0`
    and masks it (the output is finite); the backward multiplies that NaN into the gradient."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.where(h > 0, h.sqrt(), torch.zeros_like(h)).sum()


def test_a_gradient_nan_made_of_a_masked_forward_nan_is_named_at_the_forwards_birth(tmp_path):
    """The outputs are finite and the gradients are not: the replay's first backward finding is a
    consequence of the NaN the forward's sqrt made and masked, so the fault names that birth."""
    torch.manual_seed(0)
    model = MaskedSqrtNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        with pytest.raises(NonFiniteError) as caught:
            model(torch.randn(3, 4)).backward()
            optimizer.step()
    fault = caught.value.fault
    assert fault.phase == "forward" and fault.reproduced, fault
    assert fault.finding.startswith("NaN born at #") and " sqrt" in fault.finding, fault.finding
    assert watch.faults == [fault]


def _inputs(n, shape=(3, 4), seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for _ in range(n)]


def test_a_backward_born_nan_is_caught_at_its_step_before_the_update_and_the_sqrt_is_named(tmp_path):
    torch.manual_seed(0)
    model = SqrtNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sink = io.StringIO()
    inputs = _inputs(5)
    with tl.watch(model, optimizer, out=tmp_path, narrate=sink) as watch:
        with pytest.raises(NonFiniteError) as caught:
            for step, x in enumerate(inputs):
                if step == 3:
                    x = _zero_input_step(model)
                    before = _state(model, optimizer)
                model(x).backward()
                optimizer.step()
                optimizer.zero_grad()
    fault = caught.value.fault
    assert fault.step == 3 and step == 3
    assert _same_state(before, _state(model, optimizer)), "the update ran although the step was faulty"
    assert fault.reproduced is True and fault.replay == 1 and fault.phase == "backward"
    assert "SqrtBackward0" in fault.finding and "sqrt" in fault.finding and "test_watch.py:" in fault.finding
    assert "non-finite gradients in 2 of 2 parameters (fc.weight, fc.bias)" in fault.what
    assert str(fault) in str(caught.value)
    assert sink.getvalue() == f"!! watch: {fault}\n"
    assert all(p.grad is not None and not torch.isfinite(p.grad).all() for p in model.parameters()), \
        "the replay must put the step's own gradients back"
    assert (tmp_path / "step-3" / "replay.html").read_text().startswith("<!DOCTYPE html>")
    loaded = tl.load(fault.trace)
    assert loaded.backward[0].first_nonfinite.op == "SqrtBackward0"
    assert watch.faults == [fault] and watch.steps == 4


def test_healthy_training_under_the_watch_is_bitwise_plain_training_and_finds_nothing(tmp_path):
    def run(watched: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        watch = tl.watch(model, optimizer, out=tmp_path) if watched else None
        held = []
        for x in _inputs(14, (5, 8)):
            loss = model(x).pow(2).mean()
            loss.backward()
            if watch is not None:
                held.append(watch.held_bytes)
            optimizer.step()
            optimizer.zero_grad()
        if watch is not None:
            assert watch.faults == [] and watch.spikes == [] and watch.steps == 14
            # references and RNG states, not copies: this step's, and the previous step's (a spike's
            # replay needs it), its batch counted whole (5 x 8 floats)
            assert max(held) < 11 << 10 and held[0] < 6 << 10, held
            watch.close()
        return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    plain, watched = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], watched[0]))
    assert torch.equal(plain[1], watched[1]), "the watch must not draw from the global generator"
    assert not list(tmp_path.iterdir()), "a healthy run writes nothing"


def test_skip_leaves_weights_and_optimizer_state_as_they_were_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    model = SqrtNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    states = {}
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step, x in enumerate(_inputs(6)):
            if step == 2:
                x = _zero_input_step(model)
            states[step] = _state(model, optimizer)
            model(x).backward()
            optimizer.step()
            if step == 2:
                assert all(p.grad is None for p in model.parameters())
            optimizer.zero_grad()
        states["end"] = _state(model, optimizer)
    assert [f.step for f in watch.faults] == [2]
    assert _same_state(states[2], states[3]), "a skipped step changed the weights or the optimizer's state"
    assert not _same_state(states[3], states[4]), "training must go on after a skip"
    assert all(torch.isfinite(p).all() for p in states["end"][0])
    assert int(optimizer.state_dict()["state"][0]["step"]) == 5


class OnceNaN(nn.Module):
    """A NaN that appears once (the 3rd call): what a flaky kernel or a bit flip looks like."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.fc(x)
        if self.calls == 3:
            y = y * torch.tensor(float("nan"))
        return y.pow(2).mean()


def test_a_fault_no_replay_reproduces_is_called_transient_and_its_inputs_are_saved(tmp_path):
    torch.manual_seed(0)
    model = OnceNaN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = _inputs(5)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        _train(model, optimizer, inputs)
    [fault] = watch.faults
    assert fault.step == 2 and fault.reproduced is False and fault.replays == 2
    assert "transient" in str(fault) and "not reproduced in 2 replays" in str(fault)
    assert "non-finite outputs in the forward" in fault.what
    assert model.calls == 5 + 2, "two replays of the one forward"
    saved = torch.load(fault.inputs, weights_only=False)
    assert torch.equal(saved[0]["args"][0], inputs[2])


class AccumulatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.fc(x).abs().sqrt().sum()  # at fc(x) == 0 the backward makes 0 * inf = NaN


def test_gradient_accumulation_replays_every_micro_batch_and_names_the_failing_one(tmp_path):
    torch.manual_seed(0)
    model = AccumulatedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    micro = [torch.rand(2, 4) for _ in range(8)]
    micro[6] = torch.zeros(2, 4)  # fc(x) == 0 exactly
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step in range(2):
            for i in range(4):
                (model(micro[step * 4 + i]) / 4).backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 1 and fault.micro_batches == 4 and fault.micro_batch == 3
    assert fault.reproduced and "micro-batch 3 of 4" in str(fault) and "SqrtBackward0" in fault.finding


class LogitsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(x).abs().sqrt()


def test_a_loss_computed_outside_the_model_is_replayed_from_the_gradient_into_the_output(tmp_path):
    torch.manual_seed(0)
    model = LogitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.tensor([1, 2, 0])
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step, x in enumerate(_inputs(4)):
            if step == 1:
                with torch.no_grad():
                    model.fc.bias.zero_()
                x = torch.zeros(3, 4)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 1 and fault.reproduced and "SqrtBackward0" in fault.finding


def test_without_the_gradient_into_the_output_the_fault_is_not_called_transient(tmp_path):
    torch.manual_seed(0)
    model = LogitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.fc.bias.zero_()
    with tl.watch(model, optimizer, out=tmp_path, on_fault="report", narrate=None, max_bytes=0) as watch:
        F.cross_entropy(model(torch.zeros(3, 4)), torch.tensor([1, 2, 0])).backward()
        optimizer.step()
    [fault] = watch.faults
    assert fault.reproduced is None and "over max_bytes=0" in fault.why
    assert "not replayed to its birth" in str(fault)


def test_check_outputs_screens_the_outputs_alone(tmp_path):
    torch.manual_seed(0)
    model = SqrtNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, check="outputs", on_fault="report", narrate=None) as watch:
        _train(model, optimizer, _inputs(3), plant=lambda step, m: _zero_input_step(m) if step == 1 else None)
    assert watch.faults == [], "a gradient-only fault is not what check='outputs' looks at"
    model2 = OnceNaN()
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with tl.watch(model2, optimizer2, out=tmp_path, check="outputs", on_fault="skip", narrate=None) as watch:
        _train(model2, optimizer2, _inputs(4))
    assert [f.step for f in watch.faults] == [2]


def test_a_learning_rate_that_makes_training_diverge_is_caught_at_the_first_non_finite_step(tmp_path):
    def model_and_optimizer():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, torch.optim.SGD(model.parameters(), lr=2e6)

    data = [(x, x.sum(1, keepdim=True)) for x in _inputs(40, (6, 4))]
    model, optimizer = model_and_optimizer()
    first = None
    for step, (x, y) in enumerate(data):  # without the watch: where the gradients first go non-finite
        F.mse_loss(model(x), y).pow(4).backward()
        if first is None and not all(torch.isfinite(p.grad).all() for p in model.parameters()):
            first = step
        optimizer.step()
        optimizer.zero_grad()
    assert first is not None and first > 0
    model, optimizer = model_and_optimizer()
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        with pytest.raises(NonFiniteError) as caught:
            for x, y in data:
                F.mse_loss(model(x), y).pow(4).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert caught.value.fault.step == first and watch.faults == [caught.value.fault]
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the diverging update must not have run"


def test_bad_arguments_are_typed_errors_that_name_the_fix():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OptionValueError, match="did you mean 'raise'"):
        tl.watch(model, optimizer, on_fault="rais")
    with pytest.raises(OptionValueError, match="'grads' or 'outputs'"):
        tl.watch(model, optimizer, check="everything")
    with pytest.raises(OptionTypeError, match="torch.optim.Optimizer"):
        tl.watch(model, "adam")
    with pytest.raises(tl.errors.ModelTypeError):
        tl.watch(lambda x: x, optimizer)
    with pytest.raises(OptionValueError, match="at least 1"):
        tl.watch(model, optimizer, replays=0)


def test_close_removes_every_hook_and_a_closed_watch_sees_nothing(tmp_path):
    model = SqrtNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = tl.watch(model, optimizer, out=tmp_path)
    assert model._forward_hooks and model._forward_pre_hooks and optimizer._optimizer_step_pre_hooks
    out = model(_inputs(1)[0])
    watch.close()
    watch.close()
    assert not model._forward_hooks and not model._forward_pre_hooks and not optimizer._optimizer_step_pre_hooks
    out.backward()  # the hook on the output of a forward watched before close() does nothing now
    _train(model, optimizer, [_zero_input_step(model)])
    assert watch.faults == [] and watch.held_bytes == 0


class TwoPartNet(nn.Module):
    """SqrtNet's body with a head of its own, for a loop that steps the two with two optimizers."""

    def __init__(self):
        super().__init__()
        self.body = SqrtNet()
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        return self.head(self.body(x).reshape(1, 1)).sum()


def _two_optimizer_run(tmp_path, on_fault=None, plant_at=None):
    """AdamW over two param groups of the body (its own lr and weight decay each), SGD with momentum
    for the head, a StepLR schedule on the AdamW, `clip_grad_norm_` before the updates."""
    torch.manual_seed(0)
    model = TwoPartNet()
    body = torch.optim.AdamW([{"params": [model.body.fc.weight], "lr": 1e-2, "weight_decay": 0.1},
                              {"params": [model.body.fc.bias], "lr": 5e-3, "weight_decay": 0.0}])
    head = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(body, step_size=2, gamma=0.5)
    watch = tl.watch(model, [body, head], out=tmp_path, on_fault=on_fault, narrate=None) if on_fault else None
    states = []
    for step, x in enumerate(_inputs(8)):
        if step == plant_at:
            x = _zero_input_step(model.body)
        states.append((_state(model, body), _state(model, head)))
        model(x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a NaN gradient makes every gradient NaN
        body.step()
        head.step()
        schedule.step()
        body.zero_grad()
        head.zero_grad()
    states.append((_state(model, body), _state(model, head)))
    if watch is not None:
        watch.close()
    return model, watch, states, body


def test_two_optimizers_param_groups_a_schedule_and_clipping_are_one_step_each(tmp_path):
    _, _, plain, _ = _two_optimizer_run(tmp_path)
    _, healthy, watched, _ = _two_optimizer_run(tmp_path, on_fault="raise")
    assert healthy.faults == [] and healthy.steps == 8, "the second optimizer's step is the same training step"
    assert all(_same_state(a, b) for pa, pb in zip(plain, watched) for a, b in zip(pa, pb)), \
        "two optimizers under the watch must train bitwise as without it"

    model, watch, states, body = _two_optimizer_run(tmp_path, on_fault="skip", plant_at=3)
    [fault] = watch.faults
    assert fault.step == 3 and watch.steps == 8 and fault.reproduced and "SqrtBackward0" in fault.finding
    assert "in 4 of 4 parameters" in fault.what, "clipping spread the NaN to every gradient, the head's too"
    assert all(_same_state(a, b) for a, b in zip(states[3], states[4])), \
        "neither optimizer may update on the skipped step"
    assert not _same_state(states[4][0], states[5][0]), "training goes on after the skip"
    assert body.param_groups[1]["lr"] == 5e-3 * 0.5 ** 4, "the schedule is the user's: it stepped every step"
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- when a replay cannot tell: the fault says why, and is never called transient ---------------------


def test_an_input_overwritten_in_place_before_the_step_is_named_instead_of_calling_the_fault_transient(tmp_path):
    torch.manual_seed(0)
    model = SqrtNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = torch.empty(3, 4)  # one reused input buffer, the next batch loaded into it early
    batches = _inputs(4)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step, batch in enumerate(batches):
            buffer.copy_(_zero_input_step(model) if step == 1 else batch)
            model(buffer).backward()
            if step + 1 < len(batches):
                buffer.copy_(batches[step + 1])  # prefetch: the step's own input is gone
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 1 and fault.reproduced is None
    assert fault.why == "the step's inputs were changed in place after its forward, so the replay is not the step"
    assert "transient" not in str(fault) and "not replayed to its birth" in str(fault)


def test_gradients_made_outside_the_models_outputs_are_not_replayed_and_say_so(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step, x in enumerate(_inputs(2)):
            model(x)  # (its output unused this step: the loss is a penalty on the weights alone)
            if step == 1:
                with torch.no_grad():
                    model.weight[0, 0] = 0.0  # d sqrt(|w|) at 0: inf * 0 = NaN
            model.weight.abs().sqrt().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 1 and fault.reproduced is None and "weight" in fault.what
    assert fault.why == "no backward reached the model's outputs, so the gradients were not replayed"
    assert "transient" not in str(fault)


class CachedNet(SqrtNet):
    """SqrtNet that appends each forward's input to a cache of fixed room, as a KV cache does: a
    replay runs one forward more than the loop made room for."""

    def __init__(self, room: int):
        super().__init__()
        self.cache, self.room = [], room

    def forward(self, x):
        if len(self.cache) == self.room:
            raise RuntimeError(f"cache full ({self.room} entries)")
        self.cache.append(x)
        return super().forward(x)


def test_a_replay_that_raises_is_named_with_its_error_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    model = CachedNet(room=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        _train(model, optimizer, _inputs(2), plant=lambda step, m: _zero_input_step(m) if step == 1 else None)
        model.cache.clear()
        _train(model, optimizer, _inputs(2))
    [fault] = watch.faults
    assert fault.step == 1 and fault.reproduced is None
    assert fault.why == "the replay raised RuntimeError: cache full (2 entries)"
    assert "transient" not in str(fault)
    assert watch.steps == 4 and all(torch.isfinite(p).all() for p in model.parameters())


class Activation(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


class ActivatedNet(nn.Module):
    """`act(fc(x)).sum()`, the value that goes bad born inside the `act` submodule."""

    def __init__(self, fn):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), Activation(fn)

    def forward(self, x):
        return self.act(self.fc(x)).sum()


@pytest.mark.parametrize("fn, phase, op", [(lambda h: h.abs().sqrt(), "backward", "SqrtBackward0"),
                                           (lambda h: h.log(), "forward", "log")])
def test_the_fault_names_the_submodule_the_value_was_born_in(tmp_path, fn, phase, op):
    torch.manual_seed(0)
    model = ActivatedNet(fn)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        model.fc.weight.abs_()
        model.fc.bias.fill_(1.0)  # fc(x) > 0 for x >= 0: finite until the planted step
    bad = torch.zeros(3, 4) if phase == "backward" else torch.full((3, 4), -10.0)

    def plant(step, m):
        if step == 1 and phase == "backward":
            with torch.no_grad():
                m.fc.bias.zero_()
        return bad if step == 1 else None

    inputs = [x.abs() for x in _inputs(2)]
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        _train(model, optimizer, inputs, plant=plant)
    [fault] = watch.faults
    assert fault.step == 1 and fault.reproduced and fault.phase == phase
    assert op in fault.finding and fault.finding.split().count("@act") == 1, fault.finding
    assert fault.finding.split()[-1].startswith("test_watch.py:"), "the line that made it ends the finding"


# -- forwards that are not a step's: evaluation under no_grad, and a forward that raised --------------


@pytest.mark.parametrize("evaluation", [torch.no_grad, torch.inference_mode])
def test_evaluation_forwards_between_steps_are_not_part_of_a_step(tmp_path, evaluation):
    torch.manual_seed(0)
    model = SqrtNet()
    twin = copy.deepcopy(model)
    inputs, held_out = _inputs(4), _inputs(2, seed=7)

    def loop(model, optimizer):
        torch.manual_seed(1)  # (the same dropout masks in both runs)
        losses = []
        for step, x in enumerate(inputs):
            model.train()
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            with evaluation():
                losses += [model(v) for v in held_out]
                if step == 2:
                    losses.append(model(torch.full((3, 4), float("nan"))))  # a bad batch, never trained on
        return losses

    plain = loop(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="raise", narrate=None) as watch:
        watched = loop(model, optimizer)
        assert watch.faults == [] and watch.steps == 4
        assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) for a, b in zip(plain, watched))
        assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))
        # a faulty step after an evaluation: the replay is the step's one forward, not the evaluation's
        model.train()
        with pytest.raises(NonFiniteError) as caught:
            model(_zero_input_step(model)).backward()
            optimizer.step()
    fault = caught.value.fault
    assert fault.step == 4 and fault.micro_batches == 1 and fault.reproduced and "SqrtBackward0" in fault.finding


def test_a_forward_that_raised_and_was_skipped_is_not_replayed_with_the_step(tmp_path):
    torch.manual_seed(0)
    model = CachedNet(room=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step, x in enumerate(_inputs(4)):
            if step == 2:
                model.room = len(model.cache)  # this batch's forward raises; the loop skips it
                with pytest.raises(RuntimeError, match="cache full"):
                    model(x)
                model.room = 100
                x = _zero_input_step(model)
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 2 and fault.micro_batches == 1 and fault.reproduced
    assert "SqrtBackward0" in fault.finding


def _guarded_train(model, optimizer, inputs, plant=None):
    """A loop with its own guard: a step whose loss or gradients are not finite is dropped with
    `zero_grad()` and no `optimizer.step()`."""
    for step, x in enumerate(inputs):
        planted = plant(step, model) if plant is not None else None
        loss = model(x if planted is None else planted)
        loss.backward()
        if not torch.isfinite(loss) or not all(torch.isfinite(p.grad).all() for p in model.parameters()):
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()


def test_a_step_the_loop_drops_itself_is_judged_by_its_outputs_at_the_next_forward(tmp_path):
    torch.manual_seed(0)
    model = SqrtNet()  # NaN gradients at step 1, finite outputs: the loop's guard drops the step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="raise", narrate=None) as watch:
        _guarded_train(model, optimizer, _inputs(4), plant=lambda step, m: _zero_input_step(m) if step == 1 else None)
    assert watch.faults == [] and watch.steps == 4, "gradients never applied are no fault"
    model = OnceNaN()  # NaN outputs at step 2: dropped by the guard, and still a fault
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="report", narrate=None) as watch:
        _guarded_train(model, optimizer, _inputs(5))
    [fault] = watch.faults
    assert fault.step == 2 and "non-finite outputs in the forward" in fault.what and fault.reproduced is False
    assert watch.steps == 5 and model.calls == 5 + 2


# -- bounds and bookkeeping a long run relies on ---------------------------------------------------


class WideLogits(nn.Module):
    """Logits of 512 classes (8 KB of gradient per micro-batch of 4) for a loss computed outside;
    `sqrt(|fc(x)|)` makes the backward NaN where an input row is zero (the bias is zero)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 512)
        with torch.no_grad():
            self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(x).abs().sqrt()


def _accumulated_step(tmp_path, max_bytes, bad_micro_batch=None):
    """One step of 8 micro-batches, the loss outside the model: (held bytes before the update, faults)."""
    torch.manual_seed(0)
    model = WideLogits()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = [x + 0.5 for x in _inputs(8, (4, 4))]
    if bad_micro_batch is not None:
        micro[bad_micro_batch - 1] = torch.zeros(4, 4)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="report", narrate=None, max_bytes=max_bytes) as watch:
        for x in micro:
            (F.cross_entropy(model(x), torch.tensor([1, 2, 3, 4])) / 8).backward()
        held = watch.held_bytes
        optimizer.step()
    return held, watch.faults


def test_max_bytes_bounds_the_gradients_a_whole_accumulated_step_keeps_not_each_one(tmp_path):
    floor, _ = _accumulated_step(tmp_path, max_bytes=0)  # what any step holds: the generators' states
    grad_bytes = 4 * 512 * 4
    held, faults = _accumulated_step(tmp_path, max_bytes=3 * grad_bytes)
    assert faults == [] and held == floor + 3 * grad_bytes, (held, floor)
    # the micro-batch whose gradient was dropped for the bound is faulty: said, never called transient
    _, [fault] = _accumulated_step(tmp_path, max_bytes=3 * grad_bytes, bad_micro_batch=8)
    assert fault.reproduced is None and "over max_bytes" in fault.why and "transient" not in str(fault)
    # within the bound, the same fault is replayed to the sqrt
    _, [fault] = _accumulated_step(tmp_path, max_bytes=8 * grad_bytes, bad_micro_batch=8)
    assert fault.reproduced and fault.micro_batch == 8 and "SqrtBackward0" in fault.finding


def test_a_step_dropped_with_zero_grad_set_to_none_false_ends_at_the_next_forward(tmp_path):
    torch.manual_seed(0)
    model = OnceNaN()  # NaN outputs at step 2, which the loop's guard drops with zero_grad(set_to_none=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="report", narrate=None) as watch:
        for x in _inputs(5):
            loss = model(x)
            loss.backward()
            if not torch.isfinite(loss):
                optimizer.zero_grad(set_to_none=False)  # the gradients are zeroed in place, not dropped
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    [fault] = watch.faults
    assert fault.step == 2 and fault.micro_batches == 1, "the dropped step's forward rolled into the next step"
    assert watch.steps == 5


class NormedSqrt(nn.Module):
    """Linear, BatchNorm (running statistics, dropout-free) and `where(h > 0, sqrt(h), 0)` on the
    head's `|output|`: a zeroed head makes the backward NaN while every forward is finite."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.head(self.body(x)).abs()
        return torch.where(h > 0, h.sqrt(), torch.zeros_like(h)).sum()


def _batchnorm_run(tmp_path, watched: bool):
    """Six steps, the head zeroed for step 3 (NaN gradients): skipped by the watch, or by the loop."""
    torch.manual_seed(0)
    model = NormedSqrt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    watch = tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) if watched else None
    head = copy.deepcopy(model.head.state_dict())
    for step, x in enumerate(_inputs(6, (5, 4))):
        if step in (3, 4):  # zeroed for step 3, put back for step 4
            with torch.no_grad():
                for name, value in model.head.named_parameters():
                    value.copy_(head[name] if step == 4 else torch.zeros_like(value))
        model(x).backward()
        if step == 3 and not watched:
            optimizer.zero_grad()  # what the watch's skip does
        optimizer.step()
        optimizer.zero_grad()
    if watch is not None:
        assert [f.step for f in watch.faults] == [3] and watch.faults[0].reproduced
        watch.close()
    return model.state_dict()


def test_a_replay_leaves_batchnorm_running_statistics_as_the_step_left_them(tmp_path):
    plain, watched = _batchnorm_run(tmp_path, False), _batchnorm_run(tmp_path, True)
    assert plain.keys() == watched.keys()
    for name in plain:
        assert torch.equal(plain[name], watched[name]), f"{name} differs: the replay changed the model's state"


def test_a_replayed_forward_that_makes_nan_outputs_is_exact_nan_matching_nan(tmp_path):
    torch.manual_seed(0)
    model = ActivatedNet(lambda h: h.log())  # log of a negative: NaN outputs, deterministically
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        model.fc.weight.abs_()
        model.fc.bias.fill_(1.0)
    inputs = [x.abs() for x in _inputs(3)]
    inputs[1] = torch.full((3, 4), -10.0)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        _train(model, optimizer, inputs)
    [fault] = watch.faults
    assert fault.step == 1 and fault.reproduced and fault.replay == 1
    assert fault.notes == [], f"an exact replay was noted as inexact: {fault.notes}"


# -- a loss computed outside the model ----------------------------------------------------------------


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 5))

    def forward(self, x):
        return self.net(x)


def _labels(step: int, bad_step: int, n: int = 3):
    """Labels for a step; at `bad_step`, every one ignored (a batch of padding, say): the mean over
    no labels is 0/0, and its backward sends exactly zero into the logits."""
    return torch.full((n,), -100) if step == bad_step else torch.arange(n) % 5


def test_a_nan_loss_computed_outside_the_model_is_a_fault_named_at_the_losss_ops(tmp_path):
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sink = io.StringIO()
    with tl.watch(model, optimizer, out=tmp_path, narrate=sink) as watch:
        with pytest.raises(NonFiniteError) as caught:
            for step, x in enumerate(_inputs(5)):
                before = _state(model, optimizer)
                loss = F.cross_entropy(model(x), _labels(step, 2))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    fault = caught.value.fault
    assert step == 2 and fault.step == 2 and torch.isnan(loss)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters()), "finite, zero gradients"
    assert _same_state(before, _state(model, optimizer)), "the update ran on the NaN loss's step"
    assert fault.what == "a non-finite loss (the tensor backward() started from)"
    assert fault.phase == "loss" and fault.reproduced is None and fault.micro_batch == 1
    assert fault.finding.startswith("NaN loss from the model's finite outputs (forward 1): it went non-finite in "
                                    "its ops outside the model (LogSoftmaxBackward0 -> NllLossBackward0"), fault.finding
    assert "backward() called at test_watch.py:" in fault.finding and "not replayed" in str(fault)
    assert sink.getvalue() == f"!! watch: {fault}\n" and watch.faults == [fault]


def test_a_nan_loss_in_one_micro_batch_names_it_and_skip_trains_on_as_the_loop_would(tmp_path):
    def run(watched: bool):
        torch.manual_seed(0)
        model = Classifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        watch = tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) if watched else None
        batches = iter(_inputs(12))
        for step in range(3):
            for micro in range(4):
                F.cross_entropy(model(next(batches)), _labels(step * 4 + micro, 6)).div(4).backward()
            if step == 1 and not watched:
                optimizer.zero_grad()  # what the watch's skip does
            optimizer.step()
            optimizer.zero_grad()
        if watch is not None:
            watch.close()
        return [p.detach().clone() for p in model.parameters()], watch

    (plain, _), (params, watch) = run(False), run(True)
    [fault] = watch.faults
    assert fault.step == 1 and fault.micro_batch == 3 and fault.micro_batches == 4 and fault.phase == "loss"
    assert "in the loss of micro-batch 3 of 4" in str(fault) and "DivBackward0" in fault.finding
    assert all(torch.equal(a, b) for a, b in zip(plain, params)), "skip must train as the loop's own skip"


def test_a_finite_loss_of_zero_labels_is_no_fault_and_the_backward_is_put_back_at_close(tmp_path):
    original = torch.autograd.backward
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        assert torch.autograd.backward is not original
        for step, x in enumerate(_inputs(3)):
            # every label ignored with reduction="sum": 0, not 0/0
            F.cross_entropy(model(x), _labels(step, 1), reduction="sum").backward()
            optimizer.step()
            optimizer.zero_grad()
    assert watch.faults == [] and watch.steps == 3
    assert torch.autograd.backward is original, "the watch left its wrapper on torch.autograd.backward"


class AuxLossNet(nn.Module):
    """Returns its logits; keeps an auxiliary loss on itself (as a mixture of experts keeps its
    balancing loss) that the loop adds to its own. `log` of a negative makes the auxiliary NaN
    inside the model while the logits stay finite."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.ones(()))
        self.aux = None

    def forward(self, x):
        logits = self.fc(x)
        self.aux = (self.scale * x.sum(-1)).log().mean()
        return logits


def test_a_nan_loss_that_read_a_tensor_the_model_made_but_did_not_return_is_replayed_into_the_model(tmp_path):
    torch.manual_seed(0)
    model = AuxLossNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = [x.abs() + 0.1 for x in _inputs(3)]
    inputs[1] = -inputs[1]  # log of a negative sum: NaN inside the model, finite logits
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for x in inputs:
            (F.cross_entropy(model(x), torch.tensor([0, 1, 2])) + 0.1 * model.aux).backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 1 and fault.what.startswith("a non-finite loss")
    assert fault.reproduced and fault.phase == "forward" and "log" in fault.finding, fault.finding
    assert "outside the model" not in fault.finding, "the NaN was born inside the model, not in the loss's ops"
    # the same loop, the auxiliary finite and every label ignored: the replay finds nothing, the loss is named
    model = AuxLossNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step, x in enumerate([x.abs() + 0.1 for x in _inputs(3)]):
            (F.cross_entropy(model(x), _labels(step, 1)) + 0.1 * model.aux).backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 1 and fault.phase == "loss" and fault.reproduced is None
    assert "in a tensor of forward 1 that is not an output (not screened)" in fault.finding, fault.finding
    assert str(fault).endswith("; the model's replay found nothing there, and the loop's loss is not replayed")


# -- what an optimizer's update writes -----------------------------------------------------------------


class Bag(nn.Module):
    """An embedding of 32 rows of which each batch reads a few, and a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.embed(ids)).mean()


def _ids(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 8, (6,), generator=generator) for _ in range(n)]  # rows 8..31: never read


def test_adamw_with_eps_0_raises_from_the_update_that_wrote_its_nan_naming_finite_gradients(tmp_path):
    torch.manual_seed(0)
    model = Bag()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        with pytest.raises(NonFiniteError) as caught:
            for step, ids in enumerate(_ids(4)):  # noqa: B007 (read after the loop: where it stopped)
                model(ids).backward()
                optimizer.step()
                optimizer.zero_grad()
    fault = caught.value.fault
    assert step == 0 and fault.step == 0 and fault.phase == "update" and fault.reproduced is None
    nan = int(torch.isnan(model.embed.weight).sum())
    assert nan == 8 * (32 - len(set(_ids(1)[0].tolist()))), "every row the batch did not read: 0/0"
    assert fault.what == "non-finite values in 1 of 3 parameters after the AdamW update (embed.weight)"
    assert fault.finding == f"NaN in embed.weight (nan={nan}) written by that update, from finite gradients"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters()), "the step's gradients, as the update saw"
    assert watch.faults == [fault] and not list(tmp_path.iterdir()), "an update fault writes no replay"


def test_a_learning_rate_spike_that_overflows_a_weight_is_named_at_its_own_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None):
        with pytest.raises(NonFiniteError) as caught:
            for step, x in enumerate(_inputs(6)):
                optimizer.param_groups[0]["lr"] = 3e38 if step == 3 else 0.1  # a schedule's bug
                model(x).pow(2).mean().mul(1e3).backward()
                optimizer.step()
                optimizer.zero_grad()
    fault = caught.value.fault
    assert step == 3 and fault.step == 3 and fault.phase == "update"
    assert fault.finding.startswith("inf in ") and "from finite gradients" in fault.finding, fault.finding


def test_float16_adam_whose_eps_rounds_to_zero_is_caught_at_the_first_update(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)  # 1e-8 is 0 in float16
    inputs = [x.half() for x in _inputs(3)]
    for x in inputs:
        x[:, 0] = 0.0  # a feature that is always 0: its weights' gradient is 0, and Adam's step 0/0
    with tl.watch(model, optimizer, out=tmp_path, on_fault="report", narrate=None) as watch:
        for x in inputs:
            model(x).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    first = watch.faults[0]
    assert first.step == 0 and first.phase == "update", first
    # (a gradient whose square underflows float16 gives m/0 = inf beside the 0/0 NaNs)
    assert first.finding.startswith("NaN and inf in weight (nan=3, inf=") and "from finite gradients" in first.finding
    # later steps read the NaN weight: a source, with what wrote it said beside it
    assert [f.step for f in watch.faults] == [0, 1, 2] and watch.faults[1].phase == "forward"
    assert "weight holds the non-finite values step 0's Adam update wrote (from finite gradients)" in watch.faults[1].notes


def test_skip_cannot_take_an_update_back_and_says_so(tmp_path):
    torch.manual_seed(0)
    model = Bag()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0)
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        model(_ids(1)[0]).backward()
        optimizer.step()
    [fault] = watch.faults
    assert fault.phase == "update" and fault.notes == ["the update had run: on_fault='skip' cannot take it back"]


def test_a_nan_written_into_a_weight_by_the_loop_is_not_blamed_on_the_update(tmp_path):
    torch.manual_seed(0)
    model = Bag()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        for step, ids in enumerate(_ids(4)):
            if step == 2:
                with torch.no_grad():
                    model.embed.weight[30, 1] = float("nan")  # a row no batch reads
            model(ids).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert watch.faults == [] and watch.steps == 4, "the update did not write that NaN"
    assert int(torch.isnan(model.embed.weight).sum()) == 1


def test_check_outputs_leaves_updates_unscreened_and_registers_no_update_hook(tmp_path):
    torch.manual_seed(0)
    model = Bag()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0)
    with tl.watch(model, optimizer, out=tmp_path, check="outputs", on_fault="report", narrate=None) as watch:
        assert not optimizer._optimizer_step_post_hooks
        model(_ids(1)[0]).backward()
        optimizer.step()
    assert watch.faults == []
