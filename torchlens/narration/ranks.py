"""Which process of a distributed job is narrating: path templates and the rank tag of shared sinks.

Under `torch.distributed` every rank runs the same script, so every rank narrates. Two ways keep
their lines apart:

- a path template, `narrate="narration-{rank}.log"`, gives each rank its own file. The fields are
  filled in when the run opens its sink (the process group is often initialised after the options
  are made), from the process group if one is initialised, else from the `RANK` / `WORLD_SIZE`
  variables `torchrun` sets, else rank 0 of 1;
- any other sink (stderr, a stream, a callable, a logger, a path without `{rank}`) is shared by the
  ranks that write to it, so when a run opens it while a process group of more than one rank is
  initialised, each of its lines starts with `[rank N] `.
"""

from __future__ import annotations

import os
import string
from typing import Optional, Tuple

from ..errors import OptionValueError

__all__ = ["expand_path", "rank_and_world_size", "shared_sink_tag", "template_fields", "world_size"]

FIELDS = ("rank", "world_size")
_FORMATTER = string.Formatter()


def rank_and_world_size() -> Tuple[int, int]:
    """This process's rank and the job's size: from the process group, else torchrun's environment."""
    group = _initialized_group_size()
    if group is not None:
        import torch.distributed as dist

        return dist.get_rank(), group
    return _env_int("RANK", 0), max(1, _env_int("WORLD_SIZE", 1))


def world_size() -> int:
    """The default process group's size; 1 without one."""
    return _initialized_group_size() or 1


def _initialized_group_size() -> Optional[int]:
    """The default process group's size, or None when no group is initialised (or torch was built
    without distributed support)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except Exception:  # a half-torn-down group: narrate as a single process rather than fail the run
        return None
    return None


def _env_int(name: str, default: int) -> int:
    """An integer from the environment; a missing or malformed value means `default` (a stray
    variable must not stop a run that only narrates)."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def template_fields(path: str, argument: str = "narrate") -> Tuple[str, ...]:
    """The fields a sink path names, checked: an unknown field or a stray brace is an error now,
    not a surprise when the run opens its file."""
    try:
        parsed = list(_FORMATTER.parse(path))
    except ValueError as exc:
        raise OptionValueError(
            f"{argument}={path!r}: {exc}; a sink path may name {_accepted()}, and a literal brace is "
            f"written twice ('{{{{' or '}}}}')"
        ) from None
    fields = []
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if field not in FIELDS or conversion is not None or spec:  # '{rank:03}' would need an int spec
            shown = "{" + field + ("!" + conversion if conversion else "") + (":" + spec if spec else "") + "}"
            raise OptionValueError(
                f"{argument}={path!r} names {shown}, which a sink path cannot fill in: it may name "
                f"{_accepted()} (filled in per process under torch.distributed); write a literal "
                f"brace twice ('{{{{' or '}}}}')"
            )
        fields.append(field)
    return tuple(fields)


def _accepted() -> str:
    return " and ".join("{" + name + "}" for name in FIELDS)


def expand_path(path: str) -> str:
    """The file this process writes for the sink path `path` (validated by `template_fields`)."""
    if "{" not in path and "}" not in path:
        return path
    rank, world_size = rank_and_world_size()
    return path.format(rank=rank, world_size=world_size)


def is_per_rank_path(target) -> bool:
    """Whether a sink target gives each rank its own file (a path naming `{rank}`)."""
    if not isinstance(target, (str, os.PathLike)):
        return False
    path = os.fspath(target)
    if not isinstance(path, str) or "{" not in path:
        return False
    try:
        return "rank" in template_fields(path)
    except OptionValueError:
        return False


def shared_sink_tag(target) -> str:
    """`[rank N] ` for a sink several ranks write to while a process group of more than one rank
    is initialised; '' otherwise (one process, or a per-rank file)."""
    size = _initialized_group_size()
    if size is None or size <= 1 or is_per_rank_path(target):
        return ""
    return f"[rank {rank_and_world_size()[0]}] "
