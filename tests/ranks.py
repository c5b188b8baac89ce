"""Running a test's scenarios on real `torch.distributed` ranks: gloo processes on this machine.

`run_ranks(scenarios, world_size, workdir, *args)` starts `world_size` processes, joins them into a
process group, runs `scenarios(rank, workdir, *args)` on each and returns what each returned (a
JSON-able dict), rank by rank. A rank that raises fails the call with its traceback.
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist


def run_ranks(scenarios, world_size: int, workdir, *args) -> list:
    workdir = str(workdir)
    torch.multiprocessing.spawn(_rank, args=(scenarios, world_size, workdir, args), nprocs=world_size, join=True)
    results = []
    for rank in range(world_size):
        with open(os.path.join(workdir, f"result-{rank}.json")) as f:
            results.append(json.load(f))
    return results


def _rank(rank: int, scenarios, world_size: int, workdir: str, args) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method="file://" + os.path.join(workdir, "rendezvous"), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = scenarios(rank, workdir, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
