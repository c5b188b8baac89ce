"""Tracking under FSDP2 (`fully_shard`, gloo, real ranks) finds nothing on clean inputs.

FSDP2 gives each unsharded parameter memory back before a forward (`untyped_storage().resize_`),
views it and copies the all-gathered values into the views; the all-gather's output buffer is
`empty` and filled by an asynchronous collective. Measured at the views, those bytes once printed
NaNs that were not there. Each job runs its scenarios on every rank and writes what it saw to
`result-{rank}.json`. Runs marked "stale" fill the memory FSDP2 gets back with 0xFF bytes (NaN as
float32), as reused memory may hold: then any read of it before the copy is a false finding, every
time, instead of now and then.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

import torchlens as tl

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch was built without gloo")

MODES = ({"on_nonfinite": "track", "value_stats": "exact"}, {"on_nonfinite": "track", "value_stats": "reuse"},
         {"on_nonfinite": "track"})


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _sharded_mlp() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _sharded_llama():
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


class StaleMemory:
    """Fill the memory FSDP2 gives its unsharded parameters back with 0xFF bytes (a NaN in float32)."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        self.modules = (_fsdp_param, _fsdp_param_group)
        self.original = _fsdp_param.alloc_storage
        self.calls = 0

    def __enter__(self):
        def alloc_storage(tensor):
            self.original(tensor)
            tensor.untyped_storage().fill_(0xFF)
            self.calls += 1

        for module in self.modules:
            module.alloc_storage = alloc_storage
        return self

    def __exit__(self, *exc):
        for module in self.modules:
            module.alloc_storage = self.original


def _texts(recording) -> list:
    return [finding.text for finding in recording.findings]


def _tracked_forwards(model, inputs, repeats: int, stale: bool) -> dict:
    """Findings of tracked forwards in every mode, and the lines that were left unread."""
    seen = {"findings": [], "unread": set(), "outputs_equal": True, "stale_calls": 0}
    with StaleMemory() if stale else _nothing() as memory:
        plain = model(inputs)
        for _ in range(repeats):
            for options in MODES:
                recording = tl.record(model, inputs, **options)
                seen["findings"] += _texts(recording)
                out = recording.output
                out = out.logits if hasattr(out, "logits") else out
                reference = plain.logits if hasattr(plain, "logits") else plain
                seen["outputs_equal"] &= torch.equal(out, reference)
                seen["unread"] |= {part.note for event in recording.ops for part in _parts(event.stats)
                                   if part.kind == "na"}
        seen["stale_calls"] = memory.calls if memory is not None else 0
    seen["unread"] = sorted(note for note in seen["unread"] if note)
    return seen


def _parts(stats) -> tuple:
    if stats is None:
        return ()
    return tuple(getattr(stats, "parts", (stats,)))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _training(make, batches, stale: bool) -> dict:
    """Tracked training steps (forward and backward) against the same steps without torchlens."""
    narrated, plain = make(), make()
    results = {"findings": []}
    rng_after = []
    with StaleMemory() if stale else _nothing():
        for model, recorder in ((narrated, True), (plain, False)):
            torch.manual_seed(1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for x in batches:
                optimizer.zero_grad()
                if recorder:
                    with tl.recording.Recorder(model, backward=True, on_nonfinite="track",
                                               value_stats="exact") as rec:
                        loss = model(x).square().mean()
                        loss.backward()
                    for recording in rec.recordings:
                        results["findings"] += _texts(recording)
                        results["findings"] += [f.text for b in recording.backward for f in b.findings]
                        results["backwards"] = results.get("backwards", 0) + len(recording.backward)
                else:
                    model(x).square().mean().backward()
                optimizer.step()
            rng_after.append(torch.get_rng_state())
    results["rng_equal"] = torch.equal(*rng_after)  # narration draws nothing from the generator
    results["weights_equal"] = all(torch.equal(a.full_tensor(), b.full_tensor())
                                   for a, b in zip(narrated.parameters(), plain.parameters()))
    return results


def _scenarios(rank: int, workdir: str, llama: bool) -> dict:
    result = {}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    model = _sharded_mlp()
    result["mlp_stale"] = _tracked_forwards(model, x, 3, stale=True)
    result["mlp"] = _tracked_forwards(model, x, 10, stale=False)
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    result["mlp_training"] = _training(_sharded_mlp, batches, stale=True)
    result["poisoned_step"] = _poisoned_step(rank)
    if llama:  # (the two-rank job: also the torchtitan layout, blocks compiled)
        result["compiled"] = _compiled_blocks(x.shape[1])
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        result["llama_stale"] = _tracked_forwards(_sharded_llama(), ids, 2, stale=True)
        result["llama_training"] = _training(lambda: _LossOf(_sharded_llama()), [ids, ids], stale=True)
    return result


def _poisoned_step(rank: int) -> dict:
    """A tracked training step in which rank 1's batch holds a NaN: FSDP2's reduce-scatter writes it
    into every rank's sharded gradients after the backward's graph is done."""
    model = _sharded_mlp()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        x[0, 0] = float("nan")
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as recorder:
        model(x).square().mean().backward()
    recording = recorder.recordings[0]
    return {"forward": _texts(recording), "backward": [(f.text, f.kind.name) for b in recording.backward
                                                         for f in b.findings],
            "first_rank": tl.debug.across_ranks(recorder).first_rank}


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _compiled_blocks(width: int) -> dict:
    """torchtitan's layout: `fully_shard` per block and on the root, each block compiled (aot_eager)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(_Block(width), _Block(width))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    for index, block in enumerate(model):
        model[index] = tl.compile(block, compiler="aot_eager", on_nonfinite="track", value_stats="exact")
    seen = {"findings": [], "recorded": 0}
    with StaleMemory():
        for step in range(3):
            model(torch.randn(4, width, generator=torch.Generator().manual_seed(step)))
            for block in model:
                recording = block.torchlens.last_recording
                seen["recorded"] += recording is not None
                seen["findings"] += _texts(recording) if recording is not None else []
    recording = model[0].torchlens.last_recording
    seen["transcript"] = recording.narrate(engine_ops=True)
    seen["folded"] = recording.narrate().splitlines()
    return seen


class _LossOf(nn.Module):
    """A causal LM whose output is its logits (what `_training` squares)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def _saved_scenario(rank: int, workdir: str) -> dict:
    """A traced forward of the sharded MLP, saved by this rank and loaded again."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    trace = tl.trace(_sharded_mlp(), x, value_stats="exact")
    loaded = tl.load(trace.save(os.path.join(workdir, f"fsdp-{rank}.tl")))
    return {"engines": [[event.engine for event in run.ops] for run in (trace, loaded)],
            "unfolded": [run.narrate(engine_ops=True) for run in (trace, loaded)],
            "folded": [run.narrate() for run in (trace, loaded)]}


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory):
    return run_ranks(_saved_scenario, 2, tmp_path_factory.mktemp("fsdp-saved"))


def test_a_saved_fsdp2_trace_keeps_which_ops_were_fsdp2_s_own(saved_on_two_ranks):
    """Loaded on another machine, a rank's trace still folds FSDP2's own ops (the all-gather that
    unshards each layer, its buffers and views) out of the model's lines and counts them in the
    footer, as the live trace does; `engine_ops=True` still shows them, marked."""
    for result in saved_on_two_ranks:
        (live, loaded), (live_all, loaded_all), (live_folded, loaded_folded) = (
            result["engines"], result["unfolded"], result["folded"])
        engine_ops = sum(engine == "FSDP2" for engine in live)
        assert engine_ops > 0 and set(live) == {None, "FSDP2"}, live
        assert loaded == live
        assert loaded_all == live_all and loaded_folded == live_folded
        assert " all_gather_single " in loaded_all and "[FSDP2]" in loaded_all
        lines = loaded_folded.splitlines()
        assert not any(" all_gather_single " in line or " empty " in line for line in lines), lines
        assert [line.split()[1] for line in lines if line.lstrip().startswith("#")] == [
            "input", "linear", "relu", "linear", "relu", "linear"]
        assert f"; {engine_ops} engine ops folded ({engine_ops} of FSDP2; engine_ops=True shows them)" in lines[-1]


def _run(tmp_path_factory, world_size: int, llama: bool) -> list:
    return run_ranks(_scenarios, world_size, tmp_path_factory.mktemp(f"fsdp{world_size}"), llama)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory, 2, llama=True)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _run(tmp_path_factory, 4, llama=False)


def _check_forwards(seen: dict, stale: bool) -> None:
    assert seen["findings"] == [], seen["findings"][:3]
    assert seen["outputs_equal"]
    if stale:  # the memory FSDP2 gets back was read by nothing before the copy into it
        assert seen["stale_calls"] > 0, "FSDP2 no longer calls alloc_storage: the stale-memory runs test nothing"
        assert "not seen written" in seen["unread"], seen["unread"]


@pytest.mark.slow
def test_tracked_fsdp2_forwards_find_nothing_on_clean_inputs_on_every_rank(two_ranks):
    for result in two_ranks:
        _check_forwards(result["mlp_stale"], stale=True)
        _check_forwards(result["mlp"], stale=False)


@pytest.mark.slow
def test_tracked_fsdp2_training_steps_find_nothing_and_train_like_plain_fsdp2(two_ranks):
    """Bitwise the same weights after the steps (so the same gradients), and the same RNG state."""
    for result in two_ranks:
        assert result["mlp_training"]["findings"] == [], result["mlp_training"]["findings"][:3]
        assert result["mlp_training"]["backwards"] == 3  # each step's backward was narrated and judged
        assert result["mlp_training"]["weights_equal"] and result["mlp_training"]["rng_equal"]


@pytest.mark.slow
def test_a_llama_sharded_per_decoder_layer_is_tracked_without_false_findings(two_ranks):
    for result in two_ranks:
        _check_forwards(result["llama_stale"], stale=True)
        assert result["llama_training"]["findings"] == [], result["llama_training"]["findings"][:3]
        assert result["llama_training"]["weights_equal"] and result["llama_training"]["rng_equal"]


@pytest.mark.slow
def test_four_fsdp2_ranks_find_nothing_on_clean_inputs(four_ranks):
    for result in four_ranks:
        _check_forwards(result["mlp_stale"], stale=True)
        _check_forwards(result["mlp"], stale=False)
        assert result["mlp_training"]["findings"] == [] and result["mlp_training"]["weights_equal"]


@pytest.mark.slow
def test_compiled_fsdp2_blocks_narrate_their_all_gather_and_find_nothing(two_ranks):
    for result in two_ranks:
        compiled = result["compiled"]
        assert compiled["recorded"] == 6 and compiled["findings"] == [], compiled["findings"][:3]
        lines = compiled["transcript"].splitlines()
        gather = next(line for line in lines if " all_gather_single " in line)
        assert "group of 2  [FSDP2]" in gather and "finite" in gather, gather
        assert "1 compiled graph call" in lines[-1] and "no non-finite values" in lines[-1], lines[-1]
        folded = compiled["folded"]  # by default FSDP2's own ops are folded, and counted
        assert not any(" all_gather_single " in line or " empty " in line for line in folded), folded
        assert "engine ops folded (" in folded[-1] and "of FSDP2; engine_ops=True shows them)" in folded[-1]
        assert any(" linear " in line for line in folded)


@pytest.mark.slow
def test_the_rank_fsdp2_poisoned_through_its_reduce_scatter_is_told_so(two_ranks):
    rank0, rank1 = (result["poisoned_step"] for result in two_ranks)
    assert rank1["forward"] == ["NaN in the input input (nan=1)"]
    assert rank0["forward"] == []
    (text, kind), = rank0["backward"]
    assert kind == "CARRIED_IN"
    assert text.startswith("NaN in the gradients of 6 parameters (0.weight, 0.bias, 2.weight, ...) after the "
                           "backward: this backward's own gradients were finite, then something outside the graph"), text
    assert rank0["first_rank"] == rank1["first_rank"] == 1


def _restated_scenario(rank: int, workdir: str) -> dict:
    """Compiled FSDP2 blocks with exact statistics alone, three steps (inputs 0, 1, 0): each
    block's transcript per step, with later calls restated and with restating turned off."""
    from torch.distributed.fsdp import fully_shard

    from torchlens.fx_backend.compiled_pass import CompiledPass

    def steps() -> list:
        torch.manual_seed(0)
        model = nn.Sequential(_Block(8), _Block(8))
        for block in model:
            fully_shard(block)
        fully_shard(model)
        for index, block in enumerate(model):
            model[index] = tl.compile(block, compiler="aot_eager", value_stats="exact")
        seen = []
        with torch.no_grad():
            for seed in (0, 1, 0):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + 10 * rank)))
                seen.append([block.torchlens.last_recording.narrate(engine_ops=True) for block in model])
        return seen

    restated = steps()
    original = CompiledPass._restates
    CompiledPass._restates = lambda self, plan: False  # type: ignore[method-assign]
    try:
        fresh = steps()
    finally:
        CompiledPass._restates = original  # type: ignore[method-assign]
    return {"restated": restated, "fresh": fresh}


def test_compiled_fsdp2_blocks_restated_read_as_recorded_afresh_on_two_ranks(tmp_path):
    """On 2 gloo ranks, FSDP2 blocks compiled with exact statistics: the calls restated from the
    one before (their all-gathers narrated as FSDP2's) read exactly as calls recorded afresh, and
    each step's statistics are its own."""
    for result in run_ranks(_restated_scenario, 2, tmp_path):
        restated, fresh = result["restated"], result["fresh"]
        assert restated == fresh
        # the model's own lines, numbers aside (FSDP2's own ops differ between a first unshard and the next)
        bodies = [[[line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#") and "[FSDP2]" not in line]
                   for text in step] for step in restated]
        assert bodies[0] == bodies[2] != bodies[1]
        assert "[FSDP2]" in restated[1][0] and "min=" in restated[1][0]
