"""`tl.debug.across_ranks`: which rank a non-finite value was born on, one answer for every rank.

Under `torch.distributed` each rank's recording knows only its own ops: a rank whose gradients
turned NaN through DDP's all-reduce finds them "carried in", the rank whose batch held the NaN
finds where it came from. The first question of a multi-rank NaN hunt is which of them it was.

Called on every rank (it is a collective), `across_ranks(recording)` finds each rank's first
finding that is not "carried in" (`FindingKind.CARRIED_IN`), keyed by where it is in the program:
pass, then forward before backward, then op (or node) ordinal. The ranks agree on the smallest key
with one min-reduction of a few integers (O(1) data per rank, whatever the job's size); the winning
rank broadcasts its finding's text. Ties (several ranks born at the same place: a NaN in a weight
every replica holds) are counted with one more reduction and listed with one more only when there
are any. Each rank's own first finding is gathered only when asked (`per_rank=True`).

From saved traces no process group is needed: `across_ranks([tl.load(p) for p in paths])`, rank
`i` being the `i`-th trace.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..findings import FindingKind
from ..narration.grammar import plural

__all__ = ["RankReport", "across_ranks", "collective_device"]

# where nothing was found: after every key a finding can have
_NOTHING = (2 ** 40, 2 ** 20, 2 ** 40)


class _Origin(NamedTuple):
    key: Tuple[int, int, int]  # (pass, phase: 0 the forward, 1 + n its n-th backward, ordinal)
    text: str
    where: str  # "the forward of pass 1", "the backward of pass 2"


class RankReport:
    """What `across_ranks` found: the same on every rank.

    - `first_rank`: the rank where the first non-finite value was born (None when no rank found one);
      `tied`: every rank born at that same place (`first_rank` is the lowest).
    - `finding`: that rank's finding (its text), `where`: in which pass and phase.
    - `carried`: how many ranks received non-finite values through a collective.
    - `per_rank`: each rank's first finding's text (None for a rank with none), when asked for.
    - `str(report)`: a few readable lines.
    """

    def __init__(self, world_size: int, first_rank: Optional[int], tied: Tuple[int, ...], finding: Optional[str],
                 where: Optional[str], carried: int, per_rank: Optional[List[Optional[str]]]):
        self.world_size = world_size
        self.first_rank = first_rank
        self.tied = tied
        self.finding = finding
        self.where = where
        self.carried = carried
        self.per_rank = per_rank

    def __str__(self) -> str:
        if self.first_rank is None:
            if self.carried:
                head = (f"{plural(self.carried, 'rank')} received non-finite values through a collective, and no rank "
                        f"found where they were born (a rank without tracking, or values that came from outside "
                        f"the recorded passes)")
            else:
                head = f"no non-finite value on any of the {self.world_size} ranks"
        else:
            others = [rank for rank in self.tied if rank != self.first_rank]
            also = f" (also on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
            head = f"first on rank {self.first_rank}, in {self.where}: {self.finding}{also}"
            if self.carried:
                head += f"\n{plural(self.carried, 'rank')} received non-finite values through a collective"
        if self.per_rank is not None:
            head += "".join(f"\n  rank {rank}: {text or 'nothing found'}" for rank, text in enumerate(self.per_rank))
        return head

    def __repr__(self) -> str:
        return f"<RankReport first_rank={self.first_rank} of {self.world_size}>"


def across_ranks(recordings, group=None, per_rank: bool = False) -> RankReport:
    """The cross-rank verdict. `recordings`: this rank's recording (or trace, or a `Recorder`, whose
    passes are searched in order), called on every rank of `group` (default: the whole job); or a
    list of every rank's saved trace (`tl.load`), rank `i` the `i`-th, with no process group."""
    if isinstance(recordings, (list, tuple)):
        origins = [_origin(_passes(item)) for item in recordings]
        carried = [_carried(_passes(item)) for item in recordings]
        return _report(len(origins), origins, sum(carried), per_rank=True)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tl.debug.across_ranks(recording) is a collective: call it on every rank after "
                           "torch.distributed.init_process_group, or pass a list of every rank's saved trace "
                           "(tl.debug.across_ranks([tl.load(p) for p in paths]))")
    passes = _passes(recordings)
    return _collective_report(_origin(passes), _carried(passes), group, per_rank)


def _passes(source) -> list:
    """(pass number, recording) of the recordings to search, in program order."""
    recordings = getattr(source, "recordings", None)
    if recordings is not None and not hasattr(source, "events"):  # a Recorder (that kept its last passes)
        first = getattr(source, "passes", len(recordings)) - len(recordings) + 1
        return list(enumerate(recordings, first))
    if hasattr(source, "findings"):
        return [(1, source)]
    raise TypeError(f"tl.debug.across_ranks takes a recording, a trace, a Recorder or a list of saved traces, "
                    f"not {type(source).__name__}")


def _origin(passes: Sequence) -> Optional[_Origin]:
    """This rank's first finding that is not carried in, with its key."""
    best = None
    for number, recording in passes:
        phases = [(0, f"the forward of pass {number}", recording.findings)]
        phases += [(1 + i, f"the backward of pass {number}", backward.findings)
                   for i, backward in enumerate(getattr(recording, "backward", ()))]
        for phase, where, findings in phases:
            for finding in findings:
                if finding.kind is FindingKind.CARRIED_IN:
                    continue
                ordinal = finding.event.ordinal if finding.event is not None else _NOTHING[2] - 1
                origin = _Origin((number, phase, ordinal), finding.text, where)
                if best is None or origin.key < best.key:
                    best = origin
    return best


def _carried(passes: Sequence) -> int:
    """1 if this rank received non-finite values through a collective, else 0."""
    for _, recording in passes:
        for findings in [recording.findings] + [b.findings for b in getattr(recording, "backward", ())]:
            if any(finding.kind is FindingKind.CARRIED_IN for finding in findings):
                return 1
    return 0


def _report(world_size: int, origins: List[Optional[_Origin]], carried: int, per_rank: bool) -> RankReport:
    """The report from every rank's origin, at hand (saved traces)."""
    keys = [origin.key if origin is not None else _NOTHING for origin in origins]
    first = min(keys) if keys else _NOTHING
    if first == _NOTHING:
        return RankReport(world_size, None, (), None, None, carried, _texts(origins) if per_rank else None)
    tied = tuple(rank for rank, key in enumerate(keys) if key == first)
    winner = origins[tied[0]]
    assert winner is not None  # its key is the first of them all, not _NOTHING
    return RankReport(world_size, tied[0], tied, winner.text, winner.where, carried,
                      _texts(origins) if per_rank else None)


def _texts(origins) -> List[Optional[str]]:
    return [origin.text if origin is not None else None for origin in origins]


def _collective_report(origin: Optional[_Origin], carried: int, group, per_rank: bool) -> RankReport:
    """The report, agreed on by every rank of `group` with a few small reductions."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = collective_device(group)
    key = origin.key if origin is not None else _NOTHING
    # one reduction: the smallest key, lexicographically (each part is below 2**41, packed in int64 slots)
    packed = torch.tensor([_pack(key)], dtype=torch.int64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MIN, group=group)
    first = _unpack(int(packed.item()))
    mine = key == first and first != _NOTHING
    # one more: how many ranks are tied there, the lowest of them, how many received values
    counts = torch.tensor([int(mine), carried], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    ties, carried_total = counts.tolist()
    lowest = torch.tensor([rank if mine else world], dtype=torch.int64, device=device)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    winner = int(lowest.item())
    texts: Optional[List[Optional[str]]] = None
    if per_rank:  # every rank's own first finding: O(world) data, only when asked
        texts = [None] * world
        dist.all_gather_object(texts, origin.text if origin is not None else None, group=group)
    if first == _NOTHING:
        return RankReport(world, None, (), None, None, carried_total, texts)
    told = origin if rank == winner else None  # the winner is a rank whose key is the first: it has an origin
    message = [told.text if told is not None else None, told.where if told is not None else None]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, winner) if group is not None else winner,
                               group=group)
    tied: Tuple[int, ...] = (winner,)
    if ties > 1:  # which ranks: a flag each, summed (only when several were born at the same place)
        flags = torch.zeros(world, dtype=torch.int64, device=device)
        flags[rank] = int(mine)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
        tied = tuple(int(r) for r in torch.nonzero(flags).flatten().tolist())
    return RankReport(world, winner, tied, message[0], message[1], carried_total, texts)


def _pack(key: Tuple[int, int, int]) -> int:
    """(pass, phase, ordinal) as one int64 ordered as the tuple is: 20 + 3 + 40 bits."""
    number, phase, ordinal = (min(part, limit) for part, limit in zip(key, (2 ** 20 - 1, 7, 2 ** 40 - 1)))
    return (number << 43) | (phase << 40) | ordinal


def _unpack(value: int) -> Tuple[int, int, int]:
    key = (value >> 43, (value >> 40) & 7, value & (2 ** 40 - 1))
    return _NOTHING if key == (2 ** 20 - 1, 7, 2 ** 40 - 1) else key


def collective_device(group) -> torch.device:
    """Where the group's collectives run: the CPU for gloo, the current accelerator for NCCL."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
