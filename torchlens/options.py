"""Narration options and the validation of every capture keyword.

`narrate=` accepts several spellings; `resolve_narrate` turns any of them into one
`NarrationOptions` (or None for "off"), so the rest of the code sees a single shape. Nothing here
reads the environment: narration is only ever turned on by code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Tuple

from .errors import OptionTypeError, OptionValueError, describe_choices, suggest
from .narration.sinks import check_writable, checked_sink, sink_kind
from .selectors import Selector, as_selector

__all__ = ["NarrationOptions", "VALUE_STATS", "ON_NONFINITE", "STATS_ON", "DTENSOR_STATS"]

VALUE_STATS = ("off", "reuse", "sampled", "exact")
DTENSOR_STATS = ("local", "global")  # a DTensor's statistics: of this rank's shard, or of the whole tensor
ON_NONFINITE = (None, "track", "raise")
STATS_ON = ("ops", "module_outputs")

_FIELDS = (
    "sink",
    "sites",
    "select",
    "max_lines",
    "prefix",
    "depth",
    "normalize",
    "tail_on_error",
    "on_error_only",
    "symbolic_shapes",
    "engine_ops",
    "overwrite",
)


class NarrationOptions:
    """How a run is narrated.

    - `sink`: where lines go: None/True (stderr), a path (appended, flushed per line), a text
      stream (flushed per line, not closed), a callable taking one line, or a `logging.Logger`.
    - `sites`: add the user's `file:line` that issued each op.
    - `select`: a selector (`tl.in_module(...)`) or a predicate over events; others are not printed.
    - `max_lines`: stop after this many lines, with one note; the footer counts the rest.
    - `prefix`: put this string at the start of every line (for grepping mixed logs).
    - `depth`: narrate modules down to this depth; ops of deeper modules are folded into the
      exit line of their depth-`depth` ancestor as a count.
    - `normalize`: strip what differs between machines (directories of sites, device indices).
    - `tail_on_error`: on a failure, show the last this-many lines — those the narration did not
      already print (each line appears once) — then the attempted op. 0 prints just the failure
      and the attempted op.
    - `on_error_only`: narrate nothing unless the forward fails; then print the tail.
    - `symbolic_shapes`: in compiled graphs with dynamic shapes, show sizes symbolically (`[s0,16]`).
    - `engine_ops`: show the ops a distributed engine (FSDP2, DDP, tensor parallel) runs for itself
      inside the model's modules, tagged `[FSDP2]`; by default they are folded and the footer
      counts them (docs/distributed.md).
    - `overwrite`: a path sink starts the file afresh instead of appending to it, once per use of
      these options (a `tl.record` call, a `Recorder` block, a compiled model's life); appended to
      a file that already holds lines, a run begins with one `-- new run` note instead.
    """

    __slots__ = (*_FIELDS, "_opened")

    def __init__(
        self,
        *,
        sink=None,
        sites: bool = False,
        select=None,
        max_lines=None,
        prefix: str = "",
        depth=None,
        normalize: bool = False,
        tail_on_error: int = 20,
        on_error_only: bool = False,
        symbolic_shapes: bool = False,
        engine_ops: bool = False,
        overwrite: bool = False,
        **unknown,
    ):
        if unknown:
            name = next(iter(unknown))
            raise OptionTypeError(
                f"NarrationOptions got an unknown option {name!r}{suggest(name, _FIELDS)}; "
                f"accepted: {', '.join(_FIELDS)}"
            )
        sink = checked_sink(sink)  # its kind; a path's template fields and directory, before any forward runs
        self.sink = sink
        self.sites = check_bool("NarrationOptions", "sites", sites)
        self.select = None if select is None else as_selector(select)
        self.max_lines = check_count("NarrationOptions", "max_lines", max_lines, none_means="no limit")
        self.prefix = check_prefix("NarrationOptions", prefix)
        self.depth = check_count("NarrationOptions", "depth", depth, none_means="every depth")
        self.normalize = check_bool("NarrationOptions", "normalize", normalize)
        self.tail_on_error = check_count("NarrationOptions", "tail_on_error", tail_on_error)
        self.on_error_only = check_bool("NarrationOptions", "on_error_only", on_error_only)
        self.symbolic_shapes = check_bool("NarrationOptions", "symbolic_shapes", symbolic_shapes)
        self.engine_ops = check_bool("NarrationOptions", "engine_ops", engine_ops)
        self.overwrite = check_bool("NarrationOptions", "overwrite", overwrite)
        self._opened = False  # a sink was opened with these options already (`first_opening`)

    def first_opening(self) -> bool:
        """Whether a run opening its sink now is the first to with these options: it starts the
        file (afresh with `overwrite`, else after a `-- new run` note) where later ones go on."""
        first, self._opened = not self._opened, True
        return first

    def replace(self, **changes) -> "NarrationOptions":
        """A copy with some options changed."""
        values = {name: getattr(self, name) for name in _FIELDS}
        values.update(changes)
        return NarrationOptions(**values)

    def __eq__(self, other) -> bool:
        return isinstance(other, NarrationOptions) and all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    def __repr__(self) -> str:
        defaults = NarrationOptions()
        changed = [f"{f}={getattr(self, f)!r}" for f in _FIELDS if getattr(self, f) != getattr(defaults, f)]
        return "NarrationOptions(" + ", ".join(changed) + ")"


def _breaks_lines(text: str) -> bool:
    """Whether `text` holds a character `str.splitlines` breaks at (\n, \r, \x0b, \u2028...): a prefix
    with one would split every narrated line in two for anyone reading the transcript back."""
    return len(("x" + text + "x").splitlines()) > 1


def check_bool(owner: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(f"{owner}({name}=...) takes True or False, got {value!r}")
    return value


def check_prefix(owner: str, prefix) -> str:
    if not isinstance(prefix, str):
        raise OptionTypeError(f"{owner}(prefix=...) takes a string, got {type(prefix).__name__}")
    if _breaks_lines(prefix):
        raise OptionValueError(f"{owner}(prefix={prefix!r}) takes a string without a newline or "
                               "other line break: each line's prefix must stay on that line")
    return prefix


def check_count(owner: str, name: str, value, *, minimum: int = 0, none_means: Optional[str] = None):
    """Validate a count argument (`max_lines=`, `last=`, `keep=`...) of `owner`, the same way everywhere.

    A wrong kind (a float, a string, a bool) is an `OptionTypeError`, a number below `minimum` an
    `OptionValueError`; both messages name `owner(name=...)` and say what is accepted. None is
    accepted only where it means something, and `none_means` says what (shown in the message).
    """
    if value is None and none_means is not None:
        return None
    accepted = f"a whole number >= {minimum}" + (f" or None ({none_means})" if none_means is not None else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"{owner}({name}=...) takes {accepted}, got {value!r}")
    if value < minimum:
        raise OptionValueError(f"{owner}({name}={value}): takes {accepted}")
    return value


NARRATE_ACCEPTS = (
    "narrate= takes True (stderr), False/None (off), a file path, a text stream, a callable taking "
    "one line, a logging.Logger, a selector such as tl.in_module('...'), or tl.options.NarrationOptions(...)"
)


def resolve_narrate(narrate):
    """Turn any accepted spelling of `narrate=` into `NarrationOptions`, or None when off."""
    if narrate is None or narrate is False:
        return None
    if narrate is True:
        return NarrationOptions()
    if isinstance(narrate, NarrationOptions):
        return narrate
    if isinstance(narrate, Selector):
        return NarrationOptions(select=narrate)
    if sink_kind(narrate) is not None:
        return NarrationOptions(sink=narrate)
    raise OptionTypeError(f"{NARRATE_ACCEPTS}; got {narrate!r} ({type(narrate).__name__})")


def check_choice(name: str, value, choices, takes: str = "one of ") -> str:
    """A string keyword (`name=`) that must be one of `choices`: the same two errors everywhere."""
    if not isinstance(value, str):
        raise OptionTypeError(f"{name}= takes {takes}{describe_choices(choices)}, got {value!r}")
    if value not in choices:
        raise OptionValueError(f"{name}={value!r}{suggest(value, choices)}: accepted are {describe_choices(choices)}")
    return value


def check_on_nonfinite(value):
    if value is not None and not isinstance(value, str):
        raise OptionTypeError(f"on_nonfinite= takes one of {describe_choices(ON_NONFINITE)}, got {value!r}")
    if value is not None and value not in ON_NONFINITE:
        hint = suggest(value, ("track", "raise"))
        raise OptionValueError(f"on_nonfinite={value!r}{hint}: accepted are {describe_choices(ON_NONFINITE)}")
    return value


@dataclasses.dataclass(eq=False, slots=True)
class Settings:
    """What the caller asked for, validated: the capture keywords shared by every entry point."""

    narration: Optional[NarrationOptions]
    value_stats: str = "off"
    on_nonfinite: Optional[str] = None
    keep_values: bool = False
    keep_on_cpu: bool = False
    max_bytes: Optional[int] = None
    backward: bool = False  # narrate the backward through the graph each forward builds
    # "global": a DTensor's statistics are the whole tensor's, at one collective per measured DTensor
    dtensor_stats: str = "local"

    @property
    def sites(self) -> bool:
        return self.narration is not None and self.narration.sites


def make_settings(narrate, value_stats="off", on_nonfinite=None, *, keep_values=False, keep_on_cpu=False,
                  max_bytes=None, backward=False, dtensor_stats="local") -> Settings:
    """Validate the capture keywords every entry point shares and bundle them."""
    if value_stats == "reuse" and on_nonfinite is None:
        raise OptionValueError(
            "value_stats='reuse' prints what non-finite tracking computed; turn tracking on with "
            "on_nonfinite='track' (or 'raise'), or pick value_stats='sampled' or 'exact'"
        )
    narration = check_keyword("narrate", "narrate", narrate)
    if narration is not None:
        check_writable(narration.sink)
        _check_overwrite(narration)
    return Settings(
        narration,
        check_keyword("value_stats", "value_stats", value_stats),
        check_keyword("on_nonfinite", "on_nonfinite", on_nonfinite),
        keep_values=keep_values,
        keep_on_cpu=keep_on_cpu,
        max_bytes=max_bytes,
        backward=check_keyword("backward", "backward", backward),
        dtensor_stats=check_keyword("dtensor_stats", "dtensor_stats", dtensor_stats),
    )


def _check_overwrite(narration: NarrationOptions) -> None:
    """Under a process group, one file every rank writes cannot be started afresh: a rank would
    erase the lines another already wrote."""
    from .narration.ranks import shared_sink_tag

    if narration.overwrite and sink_kind(narration.sink) == "path" and shared_sink_tag(narration.sink):
        raise OptionValueError(
            f"NarrationOptions(overwrite=True) on {str(narration.sink)!r}, a file every rank writes: one rank would "
            f"erase what another already wrote; name a file per rank ('run-{{rank}}.log') or remove the file "
            f"before the job starts")


def check_stats_on(owner: str, value) -> str:
    if not isinstance(value, str):
        raise OptionTypeError(f"{owner} stats_on= takes {describe_choices(STATS_ON)}, got {value!r}")
    if value not in STATS_ON:
        raise OptionValueError(f"{owner} stats_on={value!r}: accepted are {describe_choices(STATS_ON)}")
    return value


def check_compiler(compiler):
    """A backend callable, or the name of a registered dynamo backend other than torchlens itself."""
    if callable(compiler):
        return compiler
    if not isinstance(compiler, str):
        raise OptionTypeError(f"compiler= takes a backend name such as 'inductor' or 'eager', or a backend "
                              f"callable; got {compiler!r}")
    if compiler == "torchlens":
        raise OptionValueError("compiler='torchlens' would instrument the graph twice; name the compiler "
                               "underneath, e.g. 'inductor'")
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=()) + ["eager"]
    if compiler not in known:
        raise OptionValueError(f"compiler={compiler!r}{suggest(compiler, known)}: not a registered backend; "
                               f"known: {', '.join(sorted(set(known)))}")
    return compiler


# -- every capture keyword, which entry points take it, and how it is checked ----------------------

RECORD, TRACE, RECORDER, COMPILE = "tl.record", "tl.trace", "Recorder", "tl.compile"


class Keyword(NamedTuple):
    """A torchlens keyword: the entry points that take it, and its check `(owner, value) -> value`
    (raises `OptionTypeError` / `OptionValueError` naming `owner(name=...)` and what is accepted)."""

    name: str
    takes: Tuple[str, ...]
    check: Callable[[str, Any], Any]


KEYWORDS: Tuple[Keyword, ...] = (
    Keyword("narrate", (RECORD, TRACE, RECORDER, COMPILE), lambda owner, value: resolve_narrate(value)),
    Keyword("value_stats", (RECORD, TRACE, RECORDER, COMPILE),
            lambda owner, value: check_choice("value_stats", value, VALUE_STATS)),
    Keyword("on_nonfinite", (RECORD, TRACE, RECORDER, COMPILE), lambda owner, value: check_on_nonfinite(value)),
    Keyword("keep_on_cpu", (TRACE,), lambda owner, value: check_bool(owner, "keep_on_cpu", value)),
    Keyword("max_bytes", (TRACE,), lambda owner, value: check_count(owner, "max_bytes", value, none_means="no limit")),
    Keyword("keep", (RECORDER,), lambda owner, value: check_count(owner, "keep", value, none_means="every pass")),
    Keyword("tail", (RECORDER,),
            lambda owner, value: check_count(owner, "tail", value, minimum=1, none_means="no tail")),
    Keyword("backward", (RECORD, TRACE, RECORDER, COMPILE), lambda owner, value: check_bool(owner, "backward", value)),
    # (a compiled graph measures the local shards it computes on: "global" is eager narration's)
    Keyword("dtensor_stats", (RECORD, TRACE, RECORDER),
            lambda owner, value: check_choice("dtensor_stats", value, DTENSOR_STATS)),
    Keyword("live", (COMPILE,), lambda owner, value: check_bool(owner, "live", value)),
    Keyword("compiler", (COMPILE,), lambda owner, value: check_compiler(value)),
    Keyword("stats_on", (COMPILE,), check_stats_on),
)
_BY_NAME = {keyword.name: keyword for keyword in KEYWORDS}


def keywords_of(entry: str) -> Tuple[str, ...]:
    """The names of the keywords `entry` (RECORD, TRACE, RECORDER, COMPILE) takes, in table order."""
    return tuple(keyword.name for keyword in KEYWORDS if entry in keyword.takes)


def check_keyword(owner: str, name: str, value):
    """`value` of keyword `name`, checked as the table says (the same for every entry point)."""
    return _BY_NAME[name].check(owner, value)


def misplaced(entry: str, name: str, value) -> Optional[str]:
    """Where option `name` belongs when it was handed to `entry`, which does not take it: a
    narration option goes inside `narrate=`, another entry point's keyword to that entry point.
    The text says the fix with the user's own value; None when `name` is no torchlens option.

    Used where a forward's `**kwargs` would otherwise receive the option and silently drop it
    (`tl.record(llama, ids, sites=True)` narrated no sites and said nothing)."""
    if name in _FIELDS:
        return (f"{name!r} is a narration option: pass it inside narrate=, as "
                f"narrate=tl.options.NarrationOptions({name}={value!r}) (sink= says where the lines go)")
    keyword = _BY_NAME.get(name)
    if keyword is None or entry in keyword.takes:
        return None
    takers = [_SPELLED.get(taker, taker) for taker in keyword.takes]
    return (f"{name!r} is an option of {' or '.join(takers)}, not of {entry}: pass it to "
            f"{takers[0]}(..., {name}={value!r})")


_SPELLED = {RECORDER: "tl.recording.Recorder"}
