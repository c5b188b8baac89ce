"""`tl.watch` on models it did not write and on the training idioms a real run has: transformers
models that return their own loss, a compiled model, mixed precision with a `GradScaler`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens.errors import NonFiniteError

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _gpt_neox():
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.1,
                                        attention_dropout=0.1)
    return transformers.GPTNeoXForCausalLM(config), "gpt_neox.embed_in"


def _phi3():
    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     pad_token_id=0, resid_pdrop=0.1, tie_word_embeddings=False)
    return transformers.Phi3ForCausalLM(config), "model.embed_tokens"


def _opt():
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.1, pad_token_id=1, tie_word_embeddings=False)
    return transformers.OPTForCausalLM(config), "model.decoder.embed_tokens"


@pytest.mark.parametrize("build", [_gpt_neox, _phi3, _opt], ids=["gpt_neox", "phi3", "opt"])
def test_a_transformers_model_with_labels_is_caught_at_the_step_its_nan_row_is_read(build, tmp_path):
    torch.manual_seed(0)
    model, embedding = build()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(8, VOCAB, (2, 12), generator=generator) for _ in range(5)]
    batches[3][1, 4] = 5  # the one token whose embedding row holds the NaN
    with torch.no_grad():
        model.get_submodule(embedding).weight[5, 3] = float("nan")
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        with pytest.raises(NonFiniteError) as caught:
            for step, ids in enumerate(batches):
                if step == 3:
                    before = [p.detach().clone() for p in model.parameters()]
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    fault = caught.value.fault
    assert fault.step == 3 and fault.reproduced and fault.phase == "forward"
    assert "non-finite outputs in the forward" in fault.what
    assert f"{embedding}.weight" in fault.finding, fault.finding
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
               for a, b in zip(before, model.parameters())), "the faulty update ran"
    assert fault.recording.findings[0].event.op == "embedding" and watch.faults == [fault]


def test_transformers_training_with_dropout_is_bitwise_the_same_under_the_watch(tmp_path):
    def run(watched):
        torch.manual_seed(0)
        model, _ = _gpt_neox()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        watch = tl.watch(model, optimizer, out=tmp_path) if watched else None
        for _ in range(12):
            ids = torch.randint(0, VOCAB, (2, 10), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if watch is not None:
            assert watch.faults == [] and watch.steps == 12
            watch.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


class Boom(torch.autograd.Function):
    """Identity forward; a backward that overflows at any loss scale (x 1e39 is inf in float32)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e39


class AmpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.boom = False

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.boom:
            h = Boom.apply(h)
        return self.fc2(h).float()


def _amp_step(model, optimizer, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def test_steps_a_gradscaler_skips_for_overflow_are_its_normal_work_not_faults(tmp_path):
    torch.manual_seed(0)
    model = AmpNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)  # the first steps overflow when scaled
    with tl.watch(model, optimizer, out=tmp_path, scaler=scaler, narrate=None) as watch:
        weights = []
        for _ in range(6):
            weights.append(model.fc1.weight.detach().clone())
            _amp_step(model, optimizer, scaler, torch.randn(4, 8), torch.randn(4, 1) * 1000)
        assert scaler.get_scale() <= 2.0 ** 121, "the scaler skipped these steps"
        assert torch.equal(weights[0], weights[-1]), "skipped steps leave the weights"
        assert watch.faults == [] and watch.steps == 6
    assert "update" not in vars(scaler) and "scale" not in vars(scaler), "close() puts the scaler's methods back"


def test_a_scale_that_collapses_below_one_is_a_fault_replayed_to_the_node_that_overflows(tmp_path):
    torch.manual_seed(0)
    model = AmpNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with tl.watch(model, optimizer, out=tmp_path, scaler=scaler, narrate=None) as watch:
        for _ in range(3):  # healthy steps (the scale stays at 4 well inside growth_interval)
            _amp_step(model, optimizer, scaler, torch.randn(4, 8), torch.randn(4, 1))
        model.boom = True
        with pytest.raises(NonFiniteError) as caught:
            for step in range(3, 10):  # noqa: B007 (read after the loop: where it stopped)
                _amp_step(model, optimizer, scaler, torch.randn(4, 8), torch.randn(4, 1))
    fault = caught.value.fault
    assert step == 5 and fault.step == 5 and scaler.get_scale() == 0.5
    assert "scale collapsed to 0.5" in fault.what and watch.faults == [fault]
    assert fault.reproduced and "BoomBackward" in fault.finding and "gradient born" in fault.finding


def test_a_nan_loss_under_a_gradscaler_raises_from_the_same_step(tmp_path):
    torch.manual_seed(0)
    model = AmpNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 8)
    with tl.watch(model, optimizer, out=tmp_path, scaler=scaler, narrate=None) as watch:
        _amp_step(model, optimizer, scaler, x, torch.randn(4, 1))
        before = model.fc1.weight.detach().clone()
        with pytest.raises(NonFiniteError) as caught:
            _amp_step(model, optimizer, scaler, x, torch.full((4, 1), float("nan")))
    fault = caught.value.fault
    assert fault.step == 1 and fault.what == "a non-finite loss (given to scaler.scale)"
    assert torch.equal(before, model.fc1.weight)
    # the loss went NaN outside the model (a NaN target), its outputs finite: named on the loss's graph
    assert fault.phase == "loss" and fault.reproduced is None, fault.finding
    assert fault.finding.startswith("NaN loss from the model's finite outputs (forward 1)"), fault.finding
    assert "(MseLossBackward0, as autograd names them)" in fault.finding
    assert "scaler.scale called at test_watch_models.py:" in fault.finding
    assert watch.steps == 2


class CompiledOnlyNaN(nn.Module):
    """A stand-in for a compiler bug: a NaN only the compiled graph makes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bad = False

    def forward(self, x):
        y = self.fc(x)
        if self.bad and torch.compiler.is_compiling():
            y = y * torch.tensor(float("nan"))
        return y.pow(2).mean()


def test_a_compiled_model_is_replayed_eagerly_and_compiled_when_eager_finds_nothing(tmp_path):
    torch.manual_seed(0)
    model = CompiledOnlyNaN()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(compiled, optimizer, out=tmp_path, on_fault="skip", narrate=None, compiler="eager") as watch:
        for step in range(4):
            model.bad = step == 2  # (dynamo guards on the flag: step 2 compiles the faulty graph)
            compiled(torch.randn(3, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 2 and fault.reproduced and fault.compiled_only
    assert fault.replay == 3 and "NaN written" in fault.finding and "compiled, after the eager replays" in str(fault)


def test_a_compiled_models_fault_that_eager_reproduces_is_named_eagerly(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.watch(compiled, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step in range(3):
            x = torch.randn(3, 4)
            if step == 1:
                x[0, 0] = float("inf")
            compiled(x).sin().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    [fault] = watch.faults
    assert fault.step == 1 and fault.reproduced and not fault.compiled_only and fault.replay == 1


def _llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.1)
    return transformers.LlamaForCausalLM(config)


def _qwen2():
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(config)


def test_a_causal_lm_loss_computed_outside_over_an_all_padding_batch_is_caught_at_its_step(tmp_path):
    torch.manual_seed(0)
    model = _llama().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        with pytest.raises(NonFiniteError) as caught:
            for step in range(5):
                ids = torch.randint(0, VOCAB, (2, 10), generator=generator)
                labels = torch.full_like(ids, -100) if step == 3 else ids  # a batch of padding only
                before = [p.detach().clone() for p in model.parameters()]
                logits = model(input_ids=ids).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    fault = caught.value.fault
    assert step == 3 and fault.step == 3 and fault.phase == "loss" and watch.faults == [fault]
    assert "LogSoftmaxBackward0 -> NllLossBackward0" in fault.finding and "(forward 1)" in fault.finding
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the update ran"


def test_adamw_with_eps_0_on_a_qwen2_raises_at_step_0_naming_the_embedding_rows_it_wrote(tmp_path):
    torch.manual_seed(0)
    model = _qwen2().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0)
    ids = torch.randint(0, VOCAB // 2, (2, 10), generator=torch.Generator().manual_seed(0))  # half the vocabulary
    with tl.watch(model, optimizer, out=tmp_path, narrate=None) as watch:
        with pytest.raises(NonFiniteError) as caught:
            for step in range(3):  # noqa: B007 (read after the loop: where it stopped)
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    fault = caught.value.fault
    assert step == 0 and fault.step == 0 and fault.phase == "update" and watch.faults == [fault]
    assert "model.embed_tokens.weight (nan=" in fault.finding and "from finite gradients" in fault.finding
    assert "after the AdamW update" in fault.what


def test_an_exact_replay_of_nan_outputs_on_a_gpt2_adds_no_note(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()  # dropout on: the replay draws the same masks
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with tl.watch(model, optimizer, out=tmp_path, on_fault="skip", narrate=None) as watch:
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    first = watch.faults[0]
    assert first.step == 1 and first.reproduced and first.replay == 1 and first.phase == "forward"
    assert first.notes == [], f"an exact replay was noted as inexact: {first.notes}"
