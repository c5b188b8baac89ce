"""Ranks agreeing on a watch's verdicts, so that every rank takes the same path (and issues the
same collectives) at the same step: one small all-reduce per question, under a process group of
several ranks; in a single process, plain answers."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..debug.across_ranks import collective_device
from ..narration.ranks import rank_and_world_size

__all__ = ["agree", "first_rank_text", "flag", "total", "values_by_rank"]


def agree(raised: Optional[torch.Tensor]) -> bool:
    """Whether `raised` (a 0-dim bool or 0/1 tensor, on the tensors' device; None for 0) is set on
    any rank: one small all-reduce under a process group of several ranks, then a host read."""
    if rank_and_world_size()[1] > 1:
        import torch.distributed as dist

        value = (raised if raised is not None else torch.zeros((), dtype=torch.int64)).to(collective_device(None))
        value = value.to(torch.int64).reshape(1)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
    return raised is not None and bool(raised)


def total(row: torch.Tensor) -> List[float]:
    """`row` (a 1-dim float64 tensor, on the tensors' device) summed over the ranks, on the host:
    one all-reduce under a process group of several ranks, then one host read; in a single
    process, the one read. Every rank gets the same numbers, so takes the same decisions."""
    if rank_and_world_size()[1] > 1:
        import torch.distributed as dist

        row = row.to(collective_device(None))
        dist.all_reduce(row, op=dist.ReduceOp.SUM)
    return row.tolist()


def values_by_rank(value: Optional[float]) -> List[Optional[float]]:
    """Each rank's `value` (None where a rank has none), the same list on every rank: one small
    all-reduce under a process group of several ranks; `[value]` in a single process."""
    rank, world = rank_and_world_size()
    if world == 1:
        return [value]
    import torch.distributed as dist

    row = torch.zeros(2 * world, dtype=torch.float64, device=collective_device(None))
    if value is not None:
        row[2 * rank], row[2 * rank + 1] = value, 1.0
    dist.all_reduce(row, op=dist.ReduceOp.SUM)
    got = row.tolist()
    return [got[2 * r] if got[2 * r + 1] else None for r in range(world)]


def flag(value) -> torch.Tensor:
    """`value`'s truth as a 0/1 tensor, for `agree` (what this rank found, known on the host)."""
    return torch.tensor(int(bool(value)))


def first_rank_text(text: Optional[str]) -> Tuple[Optional[int], Optional[str]]:
    """(the lowest rank that has a `text`, that text), the same on every rank; (None, None) when
    none has one. In a single process: (0, text), or (None, None)."""
    rank, world = rank_and_world_size()
    if world == 1:
        return (0, text) if text is not None else (None, None)
    import torch.distributed as dist

    lowest = torch.tensor([rank if text is not None else world], dtype=torch.int64, device=collective_device(None))
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    winner = int(lowest.item())
    if winner == world:
        return None, None
    message = [text if rank == winner else None]
    dist.broadcast_object_list(message, src=winner)
    return winner, message[0]
