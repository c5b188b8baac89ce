"""Distributed costs, side by side in one job of real gloo ranks on the CPU.

1. An FSDP2 training step (transformers Llamas of two sizes and GPT-2 small's own config, 124M
   parameters; `fully_shard` per decoder layer and the root; forward, backward, SGD step) plain,
   narrated by a `Recorder`, and tracked by a `Recorder` with
   `backward=True, on_nonfinite="track"`: each mode a block of steps after a warm-up, fastest of
   the rounds, on every rank (rank 0 reports).
2. A tensor-parallel MLP's forward (2 ranks), plain, narrated and tracked.
3. `tl.debug.across_ranks` on 2, 4 and 8 ranks: time per call (its few small reductions).

    python benchmarks/distributed_bench.py [--quick] [--json report.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torchlens as tl  # noqa: E402

SIZES = {  # (hidden size, decoder layers, tokens per sequence)
    "tiny": (64, 2, 32),
    "small": (256, 4, 64),
    "gpt2": (768, 12, 64),  # GPT-2 small's config (with --quick: one of its layers)
}


def _sharded(name: str, quick: bool):
    """The model of `SIZES[name]`, sharded per layer and at the root."""
    hidden, layers, _ = SIZES[name]
    if name != "gpt2":
        return _llama(hidden, layers)
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, bos_token_id=0, eos_token_id=0, n_layer=1 if quick else layers))
    for block in model.transformer.h:
        fully_shard(block)
    return fully_shard(model)


def _llama(hidden: int, layers: int):
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _step(model, optimizer, ids):
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def _fsdp_step_times(size: str, steps: int, rounds: int, quick: bool) -> dict:
    tokens = SIZES[size][2]
    model = _sharded(size, quick)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, tokens), generator=torch.Generator().manual_seed(dist.get_rank()))
    modes = {
        "plain": None,
        "narrate": dict(narrate=lambda line: None),
        "track": dict(backward=True, on_nonfinite="track"),
    }
    best = {}
    for _ in range(rounds):
        for name, options in modes.items():
            def block(n, options=options):
                if options is None:
                    for _ in range(n):
                        _step(model, optimizer, ids)
                    return
                with tl.recording.Recorder(model, keep=1, **options):
                    for _ in range(n):
                        _step(model, optimizer, ids)
            block(1)  # warm-up
            dist.barrier()
            start = time.perf_counter()
            block(steps)
            elapsed = (time.perf_counter() - start) / steps
            best[name] = min(best.get(name, elapsed), elapsed)
    return {name: {"ms": value * 1e3, "multiplier": value / best["plain"]} for name, value in best.items()}


def _tp_forward_times(calls: int, rounds: int, width: int = 256) -> dict:
    """A tensor-parallel MLP's forward (column-wise then row-wise, four blocks of `width`), no_grad."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                            for _ in range(4)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {}
    for index in range(4):
        plan[f"{index}.0"], plan[f"{index}.2"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, mesh, plan)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(0))
    modes = {"plain": lambda: _landed(model(x)),
             "narrate": lambda: _landed(tl.record(model, x, narrate=lambda line: None).output),
             "track": lambda: _landed(tl.record(model, x, on_nonfinite="track").output)}
    best = {}
    with torch.no_grad():
        for _ in range(rounds):
            for name, run in modes.items():
                run()  # warm-up
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                elapsed = (time.perf_counter() - start) / calls
                best[name] = min(best.get(name, elapsed), elapsed)
    return {name: {"ms": value * 1e3, "multiplier": value / best["plain"]} for name, value in best.items()}


def _landed(output: torch.Tensor) -> torch.Tensor:
    """`output` once its collective has arrived, as a user's next use of it would wait.

    The row-wise layer's all-reduce returns an `AsyncCollectiveTensor`; dropped unwaited, its work
    stays registered until the process ends, and gloo can abort the process tearing it down then.
    """
    wait = getattr(output, "wait", None)
    return wait() if callable(wait) else output


def _across_ranks_time(calls: int) -> float:
    recording = tl.record(nn.Linear(4, 4), torch.ones(2, 4), on_nonfinite="track")
    tl.debug.across_ranks(recording)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        tl.debug.across_ranks(recording)
    return (time.perf_counter() - start) / calls


def _worker(rank: int, world: int, workdir: str, quick: bool, fsdp: bool) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous-{world}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    result = {"world_size": world}
    try:
        if fsdp:
            result["fsdp_step"] = {size: _fsdp_step_times(size, 2 if quick else steps, 1 if quick else 3, quick)
                                   for size, steps in (("tiny", 10), ("small", 10), ("gpt2", 4))}
            result["tp_forward"] = _tp_forward_times(2 if quick else 50, 1 if quick else 5)
            if not quick:  # (GPT-2 small's width: the layers tensor parallel is for are wide)
                result["tp_forward_768"] = _tp_forward_times(20, 5, width=768)
        result["across_ranks_ms"] = _across_ranks_time(5 if quick else 50) * 1e3
        dist.barrier()
        unwaited = torch._C._distributed_c10d._get_work_registry_size()
        if unwaited:  # an output never waited for stays registered: a timing that stopped before it landed
            raise RuntimeError(f"{unwaited} collective call(s) were never waited for on rank {rank}")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(workdir, f"result-{world}.json"), "w") as f:
            json.dump(result, f)
    # Leave before interpreter teardown: gloo's worker threads can outlive destroy_process_group,
    # and one releasing a tensor while the interpreter finalizes aborts the rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _row_text(rows: dict) -> str:
    return ", ".join(f"{name} {row['ms']:.1f} ms ({row['multiplier']:.2f}x)" for name, row in rows.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps and calls: checks that it runs")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for world in (2, 4, 8):
            torch.multiprocessing.spawn(_worker, args=(world, workdir, args.quick, world == 2), nprocs=world)
            with open(os.path.join(workdir, f"result-{world}.json")) as f:
                results.append(json.load(f))
    for result in results:
        line = f"{result['world_size']} ranks: across_ranks {result['across_ranks_ms']:.2f} ms/call"
        print(line)
        for size, rows in result.get("fsdp_step", {}).items():
            model = "GPT-2 small" if size == "gpt2" else f"{size} Llama"
            print(f"  FSDP2 {model} {SIZES[size]} step: " + _row_text(rows))
        if "tp_forward" in result:
            print("  tensor-parallel MLP forward (4 blocks, width 256): " + _row_text(result["tp_forward"]))
        if "tp_forward_768" in result:
            print("  tensor-parallel MLP forward (4 blocks, width 768): " + _row_text(result["tp_forward_768"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
