"""`tl.watch` under DDP on real gloo ranks: the ranks agree a step is faulty (one small all-reduce),
each replays locally without DDP's gradient all-reduce, and every rank names the rank of birth."""

from __future__ import annotations

import pytest
import torch
from models import GlitchOnce
from ranks import run_ranks
from torch import nn

import torchlens as tl
from torchlens.errors import NonFiniteError

pytestmark = pytest.mark.slow


class ZeroSqrt(nn.Module):
    """`sqrt(|fc(x)|)`: an all-zero input makes the backward's `0 * inf = NaN`."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.fc(x).abs().sqrt()).sum()


def _batches(rank: int, steps: int, bad_step: int, bad_rank: int):
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.rand(3, 4, generator=generator) + 0.1 for _ in range(steps)]
    if rank == bad_rank:
        batches[bad_step] = torch.zeros(3, 4)
    return batches


def _raise_scenario(rank: int, workdir: str, bad_rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(ZeroSqrt())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fault, before, step = None, None, None
    with tl.watch(model, optimizer, out=workdir, narrate=None) as watch:
        try:
            for step, x in enumerate(_batches(rank, 5, 2, bad_rank)):  # noqa: B007 (returned: where it stopped)
                before = [p.detach().clone() for p in model.parameters()]
                model(x).backward()
                optimizer.step()
                optimizer.zero_grad()
        except NonFiniteError as exc:
            fault = exc.fault
    return {"step": step, "fault_step": fault.step if fault else None, "reproduced": fault.reproduced if fault else None,
            "birth_rank": fault.birth_rank if fault else None, "rank": fault.rank if fault else None,
            "finding": fault.finding if fault else None, "text": str(fault),
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
            "trace": fault.trace if fault else None, "faults": len(watch.faults)}


def test_two_ddp_ranks_stop_at_the_same_step_and_both_name_the_rank_it_was_born_on(tmp_path):
    results = run_ranks(_raise_scenario, 2, tmp_path, 1)
    for rank, result in enumerate(results):
        assert result["step"] == 2 and result["fault_step"] == 2 and result["faults"] == 1, result
        assert result["unchanged"], f"rank {rank} applied the faulty update"
        assert result["reproduced"] is True and result["birth_rank"] == 1 and result["rank"] == rank
        assert "SqrtBackward0" in result["finding"], result
    assert "born on rank 1" in results[0]["text"] and "born on rank" not in results[1]["text"]
    assert results[1]["trace"].endswith("rank-1/step-2/replay.tl")
    assert tl.load(results[1]["trace"]).backward[0].first_nonfinite.op == "SqrtBackward0"


def _skip_scenario(rank: int, workdir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(ZeroSqrt())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tl.watch(model, optimizer, out=workdir, on_fault="skip", narrate=None) as watch:
        for x in _batches(rank, 6, 3, 2):
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, weights)
    return {"faults": [(f.step, f.birth_rank, f.reproduced) for f in watch.faults],
            "finite": bool(torch.isfinite(weights).all()),
            "replicas_equal": all(torch.equal(gathered[0], g) for g in gathered), "steps": watch.steps}


def test_four_ddp_ranks_skip_the_faulty_step_together_and_stay_replicas(tmp_path):
    results = run_ranks(_skip_scenario, 4, tmp_path)
    for result in results:
        assert result["faults"] == [[3, 2, True]] and result["steps"] == 6, result
        assert result["finite"] and result["replicas_equal"], result


def _fsdp_zero_sqrt():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ZeroSqrt()
    fully_shard(model.fc)
    return fully_shard(model)


def _local(model) -> list:
    return [p.detach().to_local().clone() for p in model.parameters()]


def _fsdp_scenario(rank: int, workdir: str) -> dict:
    """Under FSDP2 the replay runs the model's own all-gathers and reduce-scatter (they are its
    modules' hooks), so the rank the NaN was not born on replays the values it was sent."""
    result = {}
    model = _fsdp_zero_sqrt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tl.watch(model, optimizer, out=workdir + "/raise", narrate=None) as watch:
        try:
            for step, x in enumerate(_batches(rank, 5, 2, 1)):  # noqa: B007 (read after the loop: where it stopped)
                before = _local(model)
                model(x).backward()
                optimizer.step()
                optimizer.zero_grad()
        except NonFiniteError as exc:
            fault = exc.fault
            result["raised"] = {"step": step, "fault_step": fault.step, "birth_rank": fault.birth_rank,
                                "finding": fault.finding, "text": str(fault),
                                "unchanged": all(torch.equal(a, b) for a, b in zip(before, _local(model)))}
    model = _fsdp_zero_sqrt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    states = []
    with tl.watch(model, optimizer, out=workdir + "/skip", on_fault="skip", narrate=None) as watch:
        for x in _batches(rank, 5, 3, 0):
            states.append(_local(model))
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()
    result["skipped"] = {"faults": [(f.step, f.birth_rank, f.reproduced) for f in watch.faults],
                         "kept": all(torch.equal(a, b) for a, b in zip(states[3], states[4])),
                         "moved": not all(torch.equal(a, b) for a, b in zip(states[2], states[3])),
                         "finite": all(bool(torch.isfinite(p).all()) for p in _local(model)), "steps": watch.steps}
    return result


def test_fsdp2_ranks_stop_together_name_the_birth_rank_and_skip_together(tmp_path):
    results = run_ranks(_fsdp_scenario, 2, tmp_path)
    for rank, result in enumerate(results):
        raised = result["raised"]
        assert raised["step"] == 2 and raised["fault_step"] == 2 and raised["birth_rank"] == 1, raised
        assert raised["unchanged"], f"rank {rank} applied the faulty update to its shard"
        assert "SqrtBackward0" in raised["finding"], raised
        assert result["skipped"]["faults"] == [[3, 0, True]] and result["skipped"]["steps"] == 5, result
        skipped = result["skipped"]
        assert skipped["kept"] and skipped["moved"] and skipped["finite"], f"rank {rank}: {skipped}"
    # rank 0 was sent the NaN by the reduce-scatter: the birth on rank 1 leads, what it saw follows
    assert "born on rank 1: " in results[0]["raised"]["text"]
    assert "; on this rank: NaN in the gradient of fc.weight after the backward" in results[0]["raised"]["text"]


def _llama_steps(rank: int, watched: bool, workdir: str) -> tuple:
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1)
    model = LlamaForCausalLM(config).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(10 + rank)
    watch = tl.watch(model, optimizer, out=workdir, narrate=None) if watched else None
    torch.manual_seed(rank)  # each rank's dropout masks its own
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    faults = None
    if watch is not None:
        faults, _ = [str(f) for f in watch.faults], watch.close()
    return [p.detach().to_local().clone() for p in model.parameters()], faults


def _llama_scenario(rank: int, workdir: str) -> dict:
    plain, _ = _llama_steps(rank, False, workdir)
    watched, faults = _llama_steps(rank, True, workdir)
    return {"same": all(torch.equal(a, b) for a, b in zip(plain, watched)), "faults": faults}


def test_a_transformers_llama_under_fsdp2_trains_bitwise_as_plain_under_the_watch(tmp_path):
    pytest.importorskip("transformers")
    for rank, result in enumerate(run_ranks(_llama_scenario, 2, tmp_path)):
        assert result["faults"] == [], f"rank {rank}: {result['faults']}"
        assert result["same"], f"rank {rank}: the watch changed FSDP2 training (dropout on)"


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(x)


def _loss_and_update_scenario(rank: int, workdir: str) -> dict:
    """Two runs on DDP: rank 1's labels at step 2 are all ignored (a NaN loss, zero gradients:
    after DDP's all-reduce no rank's gradients show it); then rank 1's learning rate at step 3 is
    a spike (its update alone overflows a weight: a rank-local bug)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for case in ("loss", "update"):
        torch.manual_seed(0)
        model = DDP(Logits())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        with tl.watch(model, optimizer, out=f"{workdir}/{case}", narrate=None) as watch:
            try:
                for step in range(5):
                    x, y = torch.randn(3, 4, generator=generator), torch.tensor([0, 1, 2])
                    if case == "loss" and step == 2 and rank == 1:
                        y = torch.full((3,), -100)
                    if case == "update":
                        optimizer.param_groups[0]["lr"] = 3e38 if (step, rank) == (3, 1) else 0.1
                    before = [p.detach().clone() for p in model.parameters()]
                    torch.nn.functional.cross_entropy(model(x), y).mul(1e3).backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except NonFiniteError as exc:
                fault = exc.fault
                results[case] = {"step": step, "fault_step": fault.step, "phase": fault.phase,
                                 "birth_rank": fault.birth_rank, "finding": fault.finding, "text": str(fault),
                                 "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
                                 "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                                 "faults": len(watch.faults)}
    return results


def test_ddp_ranks_stop_together_at_a_nan_loss_or_an_update_one_rank_made_and_name_that_rank(tmp_path):
    results = run_ranks(_loss_and_update_scenario, 2, tmp_path)
    for rank, result in enumerate(results):
        loss, update = result["loss"], result["update"]
        assert loss["step"] == loss["fault_step"] == 2 and loss["phase"] == "loss" and loss["birth_rank"] == 1, loss
        assert "NllLossBackward0" in loss["finding"] and loss["unchanged"] and loss["faults"] == 1, loss
        assert update["step"] == update["fault_step"] == 3 and update["phase"] == "update", update
        assert update["birth_rank"] == 1 and update["finding"].startswith("inf in fc."), update
        assert update["finite"] == (rank == 0), "both updates ran: rank 1's wrote the inf, rank 0's finite values"
    assert "on rank 1: NaN loss" in results[0]["loss"]["text"] and "on rank" not in results[1]["loss"]["text"]
    assert results[0]["update"]["text"].startswith("rank 0 step 3: non-finite values written by an update on "
                                                   "another rank; on rank 1: inf in fc.")


class SpikyNet(nn.Module):
    """A small MLP without normalization: a batch 1000x its scale reaches the loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x))).pow(2).mean()


def _spike_scenario(rank: int, workdir: str, wrap: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchlens.watching import SpikeRule

    torch.manual_seed(0)
    model = SpikyNet()
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.fc)
        model = fully_shard(model)
    else:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + rank)
    with tl.watch(model, optimizer, out=workdir, on_spike="skip", narrate=None,
                  spike=SpikeRule(window=8, warmup=8)) as watch:
        for step in range(12):
            x = torch.randn(6, 4, generator=generator) * (1000 if step == 10 and rank == 1 else 1)
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()
    replicas_equal = None
    if wrap == "ddp":  # (FSDP2's shards differ in size from rank to rank: nothing to compare)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.zeros_like(weights) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, weights)
        replicas_equal = all(torch.equal(gathered[0], g) for g in gathered)
    return {"spikes": [(s.step, s.verdict, s.batch_rank, s.module) for s in watch.spikes],
            "text": [str(s) for s in watch.spikes], "steps": watch.steps, "replicas_equal": replicas_equal}


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_a_spike_on_one_rank_is_judged_at_the_same_step_on_every_rank_and_its_batch_named(tmp_path, wrap):
    results = run_ranks(_spike_scenario, 2, tmp_path, wrap)
    for result in results:
        [(step, verdict, batch_rank, _)] = result["spikes"]
        assert (step, verdict, batch_rank) == (10, "batch", 1), result
        assert result["steps"] == 12, result
    assert results[1]["spikes"][0][3] == "fc", "the rank whose batch it was names the first module that saw it"
    assert "the batch of rank 1" in results[0]["text"][0], results[0]["text"]
    if wrap == "ddp":
        assert results[0]["replicas_equal"], "both ranks skipped the spiking step's update together"


def _transient_scenario(rank: int, workdir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchlens.watching import SpikeRule

    torch.manual_seed(0)
    inner = SpikyNet()
    inner.fc = nn.Sequential(inner.fc, GlitchOnce(at=11 if rank == 1 else 0))
    model = DDP(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + rank)
    with tl.watch(model, optimizer, out=workdir, on_spike="skip", narrate=None,
                  spike=SpikeRule(window=8, warmup=8)) as watch:
        for _ in range(12):
            model(torch.randn(6, 4, generator=generator)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"spikes": [(s.step, s.verdict, s.evidence) for s in watch.spikes]}


def test_a_transient_spike_on_one_rank_is_called_transient_on_every_rank(tmp_path):
    results = run_ranks(_transient_scenario, 2, tmp_path)
    for result in results:
        [(step, verdict, _)] = result["spikes"]
        assert (step, verdict) == (10, "transient"), result
    assert "the replay on rank 1 does not give that rank's outputs again" in results[0]["spikes"][0][2], results
    assert "its replay gives" in results[1]["spikes"][0][2], results
