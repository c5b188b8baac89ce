"""Running a test's scenarios on real `torch.distributed` ranks: gloo processes on this machine.

`run_ranks(scenarios, world_size, workdir, *args)` starts `world_size` processes, joins them into a
process group, runs `scenarios(rank, workdir, *args)` on each and returns what each returned (a
JSON-able dict), rank by rank. A rank that raises fails the call with its traceback, and so does a
rank that ends with collectives nobody waited for.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

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
        fail_on_unwaited_collectives()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    exit_without_finalizing()


def fail_on_unwaited_collectives() -> None:
    """Raise if this rank issued collectives it never waited for (what torch would only print
    at the process's termination, which `exit_without_finalizing` skips)."""
    unwaited = torch._C._distributed_c10d._get_work_registry_size()
    if unwaited:
        raise RuntimeError(f"{unwaited} collective call(s) were never waited for on this rank")


def exit_without_finalizing() -> None:
    """End a rank whose result is on disk without tearing the interpreter down.

    A process that built DDP keeps its gloo process group alive past `destroy_process_group`
    (torch 2.13 holds a reference to it), so gloo's worker threads outlive the rank's Python
    code. When a worker drops its last finished collective while the interpreter finalizes, the
    tensor it releases needs the GIL, the thread exits taking it, and the process aborts with
    "terminate called without an active exception" (1 run in 18 to 80 of a 4-rank DDP job, with or
    without torchlens). Leaving with `os._exit` skips that teardown; the work it would have done
    for a test (flushing, the unwaited-collectives check) is done here and before.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
