"""`tl.watch` on loss spikes: a finite loss (or gradients' norm) far above its recent level is
caught before the update, replayed on its own batch and on the previous step's, and called the
batch's (with the first module out of range), the weights' (with the update and the parameters it
changed most) or transient; `on_spike` decides what happens next."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
import torch.nn.functional as F
from models import GlitchOnce
from torch import nn

import torchlens as tl
from torchlens.errors import OptionTypeError, OptionValueError, SpikeError
from torchlens.watching import SpikeRule

RULE = SpikeRule(window=10, warmup=10)


class ConvNet(nn.Module):
    """A small conv net without normalization: an input 1000x its scale reaches the logits."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def _train(model, optimizer, steps: int, plant=None, tmp_path=None, compiled=False, **watch_keywords):
    """Train `model` on random images for `steps` steps under a watch; `plant(step, x, optimizer)`
    may change a batch or the learning rate. Returns (watch, losses, the narrated lines)."""
    generator = torch.Generator().manual_seed(1)
    log = io.StringIO()
    runner = torch.compile(model, backend="eager") if compiled else model
    losses = []
    if watch_keywords.get("on_spike", "report") is not None:
        watch_keywords.setdefault("spike", RULE)
    with tl.watch(runner, optimizer, out=tmp_path, narrate=log, **watch_keywords) as watch:
        for step in range(steps):
            x, y = torch.randn(4, 3, 12, 12, generator=generator), torch.randint(0, 5, (4,), generator=generator)
            if plant is not None:
                x = plant(step, x, optimizer)
            loss = F.cross_entropy(runner(x), y)
            losses.append(float(loss.detach()))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return watch, losses, log.getvalue()


def _inputs_times_1000(at: int):
    return lambda step, x, optimizer: x * 1000 if step == at else x


def _learning_rate_times_1000(at: int):
    def plant(step, x, optimizer):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * 1000 if step == at else 0.01
        return x

    return plant


@pytest.mark.parametrize("compiled", [False, True])
def test_a_batch_1000x_its_scale_is_called_the_batch_and_the_first_module_that_sees_it_is_named(tmp_path, compiled):
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch, losses, log = _train(model, optimizer, 16, _inputs_times_1000(13), tmp_path, compiled=compiled)
    [spike] = watch.spikes
    assert spike.step == 13 and "loss" in spike.which and spike.loss == pytest.approx(losses[13], rel=1e-5)
    assert spike.verdict == "batch", spike
    assert (spike.module, spike.module_type, spike.measured) == ("stem", "Conv2d", "output")
    assert 500 < spike.ratio < 2000  # (the bias keeps it just off 1000)
    assert "the batch: the same weights give step 12's batch what it had" in log and "first out of range: stem" in log
    saved = torch.load(spike.inputs, weights_only=False)
    assert torch.equal(saved[0]["args"][0], torch.load(spike.inputs, weights_only=False)[0]["args"][0])
    assert float(saved[0]["args"][0].abs().max()) > 500, "the saved batch is the spiking one"
    page = open(spike.html, encoding="utf-8").read()
    assert "<svg" in page and "stem" in page and "the spiking batch" in page
    names = sorted(os.path.basename(p) for p in spike.traces)
    assert names == ["healthy.tl", "spike.tl"]
    trace = tl.load(spike.traces[0])
    assert any(event.is_op for event in trace.events)
    assert watch.faults == [] and watch.steps == 16


def test_a_learning_rate_1000x_for_one_step_is_called_the_weights_and_its_update_named(tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch, losses, log = _train(model, optimizer, 14, _learning_rate_times_1000(12), tmp_path)
    spike = watch.spikes[0]
    assert spike.step == 13, "the update of step 12 is what the loss of step 13 reads"
    assert spike.verdict == "weights", spike
    assert "since then, the update of step 12, and no other write seen" in spike.evidence
    name, before, after = spike.parameters[0]
    assert after / before > 2 or before / after > 2, spike.parameters
    assert name in dict(model.named_parameters())


def test_on_spike_raise_stops_before_the_update_and_skip_trains_on_without_it(tmp_path):
    def run(on_spike):
        torch.manual_seed(0)
        model = ConvNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        seen = {}

        def plant(step, x, optimizer):
            if step == 13:
                seen["before"] = [p.detach().clone() for p in model.parameters()]
            if step == 14:
                seen["after"] = [p.detach().clone() for p in model.parameters()]
            return x * 1000 if step == 13 else x

        try:
            watch, _, log = _train(model, optimizer, 16, plant, tmp_path / str(on_spike), on_spike=on_spike)
        except SpikeError as error:
            return error, seen, model
        return watch, seen, log

    error, seen, model = run("raise")
    assert isinstance(error, SpikeError) and error.spike.step == 13 and error.spike.verdict == "batch"
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], model.parameters())), "raised before the update"
    watch, seen, _ = run("skip")
    assert [s.step for s in watch.spikes] == [13] and watch.steps == 16
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"])), "skip: no update at the spike"
    watch, seen, _ = run("report")
    assert not all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"])), "report: the update ran"
    watch, _, log = run(None)
    assert watch.spikes == [] and log == ""


def test_a_spike_no_replay_repeats_is_called_transient_and_its_batch_saved(tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    model.body.insert(1, GlitchOnce(at=14))  # (the 14th forward: step 13)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch, _, log = _train(model, optimizer, 16, None, tmp_path, on_spike="skip")
    [spike] = watch.spikes
    assert spike.step == 13 and spike.verdict == "transient", spike
    assert "its replay gives output RMS" in spike.evidence and "against the step's" in spike.evidence
    assert os.path.exists(spike.inputs)


class SqrtNet(nn.Module):
    """`sqrt` of a ReLU: a batch of tiny positive values makes its gradient huge while the loss
    stays where it was (a spike of the gradients alone)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)).add(1e-30).sqrt())


def test_a_spike_of_the_gradients_alone_is_judged_on_the_gradients_and_its_module_named(tmp_path):
    watch = _gradient_spike_run(tmp_path)
    spike = watch.spikes[0]
    assert spike.step == 12 and spike.which == "gradients", watch.spikes
    assert spike.grad_norm > 10 * spike.grad_level
    assert spike.verdict == "batch", spike
    assert (spike.module, spike.measured) == ("fc", "gradient") and spike.ratio > 10, spike
    assert not any("optimizer.step() saw" in note for note in spike.notes), "no clipping: the norms agree"


def test_healthy_noisy_training_of_a_transformers_model_reports_no_spike_at_the_defaults(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses, norms = [], []
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        for _ in range(300):
            ids = torch.randint(0, 128, (2, 16), generator=generator)
            loss = model(input_ids=ids, labels=ids).loss
            losses.append(float(loss.detach()))
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
    assert watch.spikes == [] and watch.faults == [] and watch.steps == 300
    # the run is noisy: the rule saw variation it let pass
    assert max(losses[20:]) / min(losses[20:]) > 1.04 and max(norms[20:]) / min(norms[20:]) > 1.5, (losses, norms)
    assert not list(tmp_path.iterdir())


def _gpt2_pattern_run(tmp_path, compiled: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                 n_positions=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    embed = model.get_input_embeddings()
    runner = torch.compile(model, backend="eager") if compiled else model
    generator = torch.Generator().manual_seed(0)
    with tl.watch(runner, optimizer, out=tmp_path, narrate=None, spike=RULE) as watch:
        for step in range(192):  # it learns to count: each next token is this one + 1
            ids = (torch.randint(0, 64, (4, 1), generator=generator) + torch.arange(16)) % 64
            embeddings = embed(ids).detach() * (1000 if step == 190 else 1)
            runner(inputs_embeds=embeddings, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return watch


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_on_gpt2_a_batch_of_embeddings_1000x_is_the_batch_and_the_first_module_after_them_is_named(
        tmp_path, compiled):
    watch = _gpt2_pattern_run(tmp_path, compiled)
    [spike] = watch.spikes
    assert spike.step == 190 and spike.verdict == "batch", spike
    assert spike.module == "transformer.drop" and spike.ratio > 100, spike
    assert spike.loss > 10 * spike.loss_level


def test_bad_spike_options_are_typed_errors_that_name_the_fix():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OptionValueError, match="report"):
        tl.watch(model, optimizer, on_spike="reprot")
    with pytest.raises(OptionTypeError, match="SpikeRule"):
        tl.watch(model, optimizer, spike={"window": 5})
    with pytest.raises(OptionValueError, match="on_spike=None"):
        tl.watch(model, optimizer, on_spike=None, spike=SpikeRule(window=5))
    with pytest.raises(OptionValueError, match="window=0"):
        SpikeRule(window=0)
    with pytest.raises(OptionTypeError, match="rtol"):
        SpikeRule(rtol="2")
    with pytest.raises(OptionValueError, match="atol"):
        SpikeRule(atol=math.nan)


def _judged(values, rule=None):
    from torchlens.watching.checks import ScreenRead
    from torchlens.watching.spikes import SpikeCheck

    check = SpikeCheck(rule or SpikeRule())
    return [i for i, v in enumerate(values) if check.judge(ScreenRead(False, v, None)) is not None]


def test_the_rule_flags_a_value_far_above_its_window_and_lets_skewed_noise_and_a_new_level_pass():
    generator = torch.Generator().manual_seed(0)
    steady = (2.0 + 0.1 * torch.randn(200, generator=generator)).tolist()
    assert _judged(steady) == []
    assert _judged(steady[:120] + [20.0] + steady[120:]) == [120]
    assert _judged(steady[:5] + [20.0] + steady[5:]) == [], "nothing is judged during the warmup"
    # small batches' losses are skewed: three times the median is ordinary, and not a spike
    skewed = torch.empty(400).exponential_(generator=generator).tolist()
    assert max(v / sorted(skewed)[200] for v in skewed) > 3 and _judged(skewed) == []
    # a lasting change of level is called a spike until it is the window's median
    shifted = _judged(steady[:100] + [v * 5 for v in steady[100:]])
    assert shifted and shifted[0] == 100 and max(shifted) < 100 + SpikeRule().window


class NormedNet(nn.Module):
    """BatchNorm (running statistics a replay would move) and dropout (masks a replay would draw)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def test_a_reported_spike_leaves_training_bitwise_what_it_is_without_the_watch(tmp_path):
    def run(watched: bool):
        torch.manual_seed(0)
        model = NormedNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(3)
        watch = tl.watch(model, optimizer, out=tmp_path, narrate=None, spike=RULE) if watched else None
        for step in range(16):
            x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
            for group in optimizer.param_groups:
                group["lr"] = 10.0 if step == 12 else 1e-2
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        if watch is not None:
            watch.close()
        state = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
        return state, torch.get_rng_state(), watch

    plain, plain_rng, _ = run(False)
    watched, watched_rng, watch = run(True)
    assert watch.spikes and watch.spikes[0].step == 13, watch.spikes
    assert all(torch.equal(a, b) for a, b in zip(plain, watched)), "the replays changed the training"
    assert torch.equal(plain_rng, watched_rng), "the replays drew from the global generator"


class TwoInputs(nn.Module):
    """Two inputs on two branches: a spike in the second is first seen by `side`, not by `main`."""

    def __init__(self):
        super().__init__()
        self.main, self.side, self.head = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x, z):
        return self.head(torch.relu(self.main(x) + self.side(z)))


def test_the_module_named_is_the_first_out_of_range_not_merely_the_first_that_ran(tmp_path):
    torch.manual_seed(0)
    model = TwoInputs()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None, spike=RULE) as watch:
        for step in range(14):
            x, z = torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)
            y = torch.randint(0, 3, (8,), generator=generator)
            F.cross_entropy(model(x, z * (1000 if step == 12 else 1)), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    spike, after = watch.spikes  # (reported: the spike's update ran, and the next step paid for it)
    assert (spike.step, spike.verdict, spike.module) == (12, "batch", "side"), spike
    assert (after.step, after.verdict) == (13, "weights") and "the updates of steps 11-12" in after.evidence, after
    in_range = dict(spike.magnitudes[0].outputs)["main"] / dict(spike.magnitudes[1].outputs)["main"]
    assert 1 / 3 < in_range < 3, "main ran first and stayed in range"


def _gradient_spike_run(tmp_path, clip=None, max_bytes=None):
    """SqrtNet trained 13 steps; at step 12 a batch whose every pre-activation is about 1e-6
    (sqrt's slope there is 500): the gradients spike, the loss does not."""
    torch.manual_seed(0)
    model = SqrtNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    keywords = {} if max_bytes is None else {"max_bytes": max_bytes}
    with tl.watch(model, optimizer, out=tmp_path, narrate=None, spike=RULE, **keywords) as watch:
        for step in range(13):
            x = torch.rand(8, 4, generator=generator) + 0.5
            if step == 12:
                with torch.no_grad():
                    x = torch.linalg.solve(model.fc.weight, torch.full((4,), 1e-6) - model.fc.bias).expand(8, 4).clone()
            model(x).pow(2).mean().backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return watch


def test_a_clipped_gradients_spike_is_not_called_transient_for_the_norm_its_replay_cannot_clip(tmp_path):
    [spike] = _gradient_spike_run(tmp_path, clip=8.0).spikes
    assert spike.grad_norm == pytest.approx(8.0), "the norm judged is the one the optimizer saw, clipped"
    assert (spike.verdict, spike.module, spike.measured) == ("batch", "fc", "gradient"), spike
    assert any("the one optimizer.step() saw (clipped or unscaled); its replay's is" in note for note in spike.notes)


def test_a_gradients_spike_whose_backward_was_not_kept_is_said_not_measured(tmp_path):
    [spike] = _gradient_spike_run(tmp_path, max_bytes=0).spikes
    assert spike.verdict is None and spike.module is None and "backward was not replayed" in spike.why, spike


def test_a_spiking_batch_changed_in_place_after_its_forward_is_not_called_transient(tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    buffer = torch.empty(4, 3, 12, 12)  # a loader that refills one buffer
    with tl.watch(model, optimizer, out=tmp_path, narrate=None, spike=RULE, on_spike="skip") as watch:
        for step in range(14):
            buffer.copy_(torch.randn(4, 3, 12, 12, generator=generator) * (1000 if step == 13 else 1))
            loss = F.cross_entropy(model(buffer), torch.randint(0, 5, (4,), generator=generator))
            loss.backward()
            buffer.normal_(generator=generator)  # the next batch is loaded before the step
            optimizer.step()
            optimizer.zero_grad()
    [spike] = watch.spikes
    assert spike.verdict is None and "changed in place after its forward" in spike.why, spike


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("write", ["neg_", "data"])
def test_weights_written_outside_the_optimizer_are_named_even_when_their_magnitude_is_unchanged(tmp_path, write):
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    teacher = nn.Linear(6, 4)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None, spike=RULE, on_spike="skip") as watch:
        for step in range(62):
            x = torch.randn(16, 6, generator=generator)
            y = teacher(x).argmax(-1).detach()
            if step == 60:  # the head negated: the same magnitude, the opposite answers
                with torch.no_grad():
                    head = model.net[2]
                    if write == "neg_":
                        head.weight.neg_()
                        head.bias.neg_()
                    else:
                        head.weight.data = -head.weight.data
                        head.bias.data = -head.bias.data
            F.cross_entropy(model(x), y).backward()  # a loss computed outside the model
            optimizer.step()
            optimizer.zero_grad()
    spike = next(s for s in watch.spikes if s.step == 60)
    assert spike.verdict == "weights" and "moved by" in spike.evidence, spike
    if write == "neg_":  # (its version counter moved)
        assert "written outside the optimizer since that step: net.2.weight, net.2.bias" in spike.evidence, spike
    else:  # a write through .data moves no counter, and a sign flip keeps the sums of squares: not seen,
        # so the update is named as what ran, not as what caused it
        assert "since then, the update of step 59, and no other write seen" in spike.evidence, spike


def test_a_spike_whose_files_cannot_be_written_still_raises(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match="making the spike's directory"):
        with pytest.raises(SpikeError) as caught:
            _train(model, optimizer, 16, _inputs_times_1000(13), blocker, on_spike="raise")
    assert caught.value.spike.verdict == "batch" and caught.value.spike.html is None


def test_under_gradient_accumulation_the_micro_batch_s_call_is_named_and_every_micro_batch_traced(tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None, spike=RULE, on_spike="skip") as watch:
        for step in range(14):
            for micro in range(2):
                x = torch.randn(4, 3, 12, 12, generator=generator) * (1000 if (step, micro) == (12, 1) else 1)
                (F.cross_entropy(model(x), torch.randint(0, 5, (4,), generator=generator)) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    [spike] = watch.spikes
    assert (spike.step, spike.verdict, spike.module) == (12, "batch", "stem (call 2)"), spike
    assert sorted(os.path.basename(p) for p in spike.traces) == ["healthy-2.tl", "healthy.tl", "spike-2.tl",
                                                                  "spike.tl"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nn_transformer_under_autocast_with_inference_mode_evaluations_between_steps(tmp_path, dtype):
    """torch's own TransformerEncoder, trained under CPU autocast with evaluation forwards under
    `inference_mode` and `no_grad` between steps: quiet while healthy, and a learning rate 1000x
    for one step is the weights' at the next step."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None, spike=SpikeRule(window=20, warmup=20)) as watch:
        for step in range(34):
            x, y = torch.randn(4, 6, 16, generator=generator), torch.randint(0, 4, (4,), generator=generator)
            for group in optimizer.param_groups:
                group["lr"] = 1.0 if step == 30 else 1e-3
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(model(x).mean(1).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.inference_mode():
                model(x)
            with torch.no_grad():
                model(x)
    assert watch.faults == [] and watch.steps == 34
    assert watch.spikes and watch.spikes[0].step == 31, watch.spikes
    assert watch.spikes[0].verdict == "weights" and "the update of step 30" in watch.spikes[0].evidence, watch.spikes[0]
