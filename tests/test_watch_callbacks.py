"""The framework adapters of `tl.watch` on short real training runs with a planted fault: a
transformers `Trainer` (a GPT-NeoX from a small config) and a PyTorch Lightning `Trainer`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens.errors import NonFiniteError, SpikeError
from torchlens.watching import SpikeRule
from torchlens.watching.callbacks import LightningWatch, TrainerWatch

VOCAB = 48


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, 10), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_trainer(tmp_path, watch, plant_at: int, steps: int = 6):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    transformers.logging.set_verbosity_error()

    class PlantNaN(transformers.TrainerCallback):
        """At step `plant_at`, a NaN in the output head: the next forward's loss is NaN."""

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == plant_at:
                with torch.no_grad():
                    model.lm_head.weight[3, 0] = float("nan")

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=32)
    model = transformers.GPTNeoXForCausalLM(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=2,
                                          learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                          use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(16), callbacks=[PlantNaN(), watch])
    return trainer, model


def test_the_transformers_callback_stops_the_trainer_at_the_planted_step(tmp_path):
    watch = TrainerWatch(out=tmp_path / "watch", narrate=None)
    trainer, model = _hf_trainer(tmp_path, watch, plant_at=3)
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    fault = caught.value.fault
    assert fault.step == 3 and fault.reproduced and "lm_head.weight" in fault.finding, fault.finding
    assert "non-finite outputs" in fault.what
    # the update of the faulty step did not run: only the planted element is not finite
    assert int((~torch.isfinite(model.lm_head.weight)).sum()) == 1
    assert watch.faults == [fault] and not model._forward_hooks, "the watch closes when training ends"


def test_the_transformers_callback_in_skip_mode_lets_training_finish(tmp_path):
    watch = TrainerWatch(out=tmp_path / "watch", narrate=None, on_fault="skip")
    trainer, model = _hf_trainer(tmp_path, watch, plant_at=2, steps=4)
    trainer.train()
    assert [f.step for f in watch.faults] == [2, 3], "the planted NaN stays, so each later step is skipped too"
    assert int((~torch.isfinite(model.lm_head.weight)).sum()) == 1


class _Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.fc(x).abs().sqrt())


def _lightning_module():
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _Regressor()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return pl, Module()


def _lightning_data(bad_batch: int):
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(16, 4, generator=generator) + 0.1
    x[bad_batch * 2:bad_batch * 2 + 2] = 0.0  # fc(0) == 0: the backward's 0 * inf = NaN
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.rand(16, 1, generator=generator)),
                                       batch_size=2, shuffle=False)


def test_the_lightning_callback_stops_the_fit_before_the_faulty_update(tmp_path):
    pl, module = _lightning_module()
    watch = LightningWatch(out=tmp_path / "watch", narrate=None)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[watch])
    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(module, _lightning_data(bad_batch=3))
    fault = caught.value.fault
    assert fault.step == 3 and fault.reproduced and "SqrtBackward0" in fault.finding, fault.finding
    assert all(torch.isfinite(p).all() for p in module.parameters()), "the faulty update ran"
    assert watch.faults == [fault] and not module._forward_hooks, "the watch closes when the fit fails"


def test_the_lightning_callback_in_skip_mode_trains_on_with_finite_weights(tmp_path):
    pl, module = _lightning_module()
    watch = LightningWatch(out=tmp_path / "watch", narrate=None, on_fault="skip")
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[watch])
    trainer.fit(module, _lightning_data(bad_batch=2))
    assert [f.step for f in watch.faults] == [2] and watch.faults[0].reproduced
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert not module._forward_hooks, "the watch closes when the fit ends"
    assert tl.load(watch.faults[0].trace).backward[0].first_nonfinite.op == "SqrtBackward0"


# -- a loss computed outside the model, and an update that writes NaN, through the frameworks --------


class _PaddedTokens(_Tokens):
    """`_Tokens` whose items from `padded` on have every label ignored (a batch of padding)."""

    def __init__(self, n: int, padded: int):
        super().__init__(n)
        self.padded = padded

    def __getitem__(self, i):
        item = super().__getitem__(i)
        return item if i < self.padded else {**item, "labels": torch.full_like(item["labels"], -100)}


def _outside_loss_trainer(tmp_path, watch, padded: int = 16, **arguments):
    """A transformers `Trainer` whose `compute_loss` computes the loss from the logits, outside the
    model, over `_PaddedTokens` read in order (so the batch of padding is a known step)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    transformers.logging.set_verbosity_error()

    class OutsideLoss(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logits = model(input_ids=inputs["input_ids"]).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten())

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=32)
    model = transformers.GPTNeoXForCausalLM(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=6, per_device_train_batch_size=2,
                                          learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                          use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
                                          train_sampling_strategy="sequential", **arguments)
    trainer = OutsideLoss(model=model, args=args, train_dataset=_PaddedTokens(16, padded), callbacks=[watch])
    return trainer, model


def test_the_transformers_callback_catches_a_nan_loss_its_compute_loss_makes_outside_the_model(tmp_path):
    watch = TrainerWatch(out=tmp_path / "watch", narrate=None)
    trainer, model = _outside_loss_trainer(tmp_path, watch, padded=6)  # items 6 and 7: the batch of step 3
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    fault = caught.value.fault
    assert fault.step == 3 and fault.phase == "loss" and "NllLossBackward0" in fault.finding, fault.finding
    assert "accelerate/accelerator.py:" in fault.finding, "the backward() call is accelerate's, for the Trainer"
    assert watch.faults == [fault] and not model._forward_hooks
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_transformers_callback_raises_at_step_0_when_adam_epsilon_0_writes_nan(tmp_path):
    watch = TrainerWatch(out=tmp_path / "watch", narrate=None)
    trainer, model = _outside_loss_trainer(tmp_path, watch, adam_epsilon=0.0)
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    fault = caught.value.fault
    assert fault.step == 0 and fault.phase == "update" and "gpt_neox.embed_in.weight (nan=" in fault.finding, fault
    assert "from finite gradients" in fault.finding and not model._forward_hooks


class _Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.embed(ids))


def _lightning_classifier(eps: float):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _Lookup()

        def forward(self, ids):
            return self.net(ids)

        def training_step(self, batch, batch_idx):
            ids, y = batch
            return F.cross_entropy(self(ids), y)  # the loss outside the module's forward

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=eps)

    return pl, Module()


def _lightning_labels(padded_batch: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (16,), generator=generator)
    y = torch.randint(0, 3, (16,), generator=generator)
    y[padded_batch * 2:padded_batch * 2 + 2] = -100
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, y), batch_size=2, shuffle=False)


def _fit(pl, module, watch, tmp_path, data):
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[watch])
    trainer.fit(module, data)


def test_the_lightning_callback_catches_a_nan_loss_its_training_step_makes(tmp_path):
    pl, module = _lightning_classifier(eps=1e-8)
    watch = LightningWatch(out=tmp_path / "watch", narrate=None)
    with pytest.raises(NonFiniteError) as caught:
        _fit(pl, module, watch, tmp_path, _lightning_labels(padded_batch=3))
    fault = caught.value.fault
    assert fault.step == 3 and fault.phase == "loss" and "NllLossBackward0" in fault.finding, fault.finding
    assert all(torch.isfinite(p).all() for p in module.parameters()) and not module._forward_hooks


def test_the_lightning_callback_raises_from_the_update_that_writes_nan(tmp_path):
    pl, module = _lightning_classifier(eps=0.0)
    watch = LightningWatch(out=tmp_path / "watch", narrate=None)
    with pytest.raises(NonFiniteError) as caught:
        _fit(pl, module, watch, tmp_path, _lightning_labels(padded_batch=99))
    fault = caught.value.fault
    assert fault.step == 0 and fault.phase == "update" and "net.embed.weight (nan=" in fault.finding, fault.finding
    assert watch.faults == [fault] and not module._forward_hooks


def test_the_transformers_callback_takes_the_spike_keywords_and_names_weights_written_outside_the_optimizer(
        tmp_path):
    transformers = pytest.importorskip("transformers")

    class ScaleHead(transformers.TrainerCallback):
        """At step 6, the output head's weights multiplied by 100 in place (not by the optimizer)."""

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 6:
                with torch.no_grad():
                    model.lm_head.weight.mul_(100)

    watch = TrainerWatch(out=tmp_path / "watch", narrate=None, on_spike="raise", spike=SpikeRule(window=4, warmup=4))
    trainer, model = _hf_trainer(tmp_path, watch, plant_at=-1, steps=8)
    trainer.add_callback(ScaleHead())
    with pytest.raises(SpikeError) as caught:
        trainer.train()
    spike = caught.value.spike
    assert spike.step == 6 and spike.verdict == "weights", spike
    assert "written outside the optimizer since that step: lm_head.weight" in spike.evidence, spike
    assert watch.spikes == [spike] and not model._forward_hooks, "the watch closes when training stops"


def test_the_lightning_callback_takes_the_spike_keywords_and_names_the_batch_and_its_first_module(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(4, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.head(torch.relu(self.fc(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=generator), torch.randn(24, 1, generator=generator)
    x[20:22] *= 1000  # batch 10
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2, shuffle=False)
    watch = LightningWatch(out=tmp_path / "watch", narrate=None, on_spike="skip", spike=SpikeRule(window=6, warmup=6))
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[watch])
    trainer.fit(Module(), data)
    [spike] = watch.spikes
    assert spike.step == 10 and spike.verdict == "batch" and spike.module == "fc", spike
