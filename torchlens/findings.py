"""What a non-finite verdict says: a `Finding`, and its `FindingKind`, so that nothing reads a
finding's text back to tell what it is (the footer, saved traces, the cross-rank verdict).

The kinds are the verdict rules, one member each (docs/statistics.md has the same table):

| kind | made when | a birth? |
|---|---|---|
| `NAN_BORN` | an op produced NaN although nothing it read (scalars included) held NaN | yes |
| `NAN_WRITTEN` | a scalar argument wrote the NaN (`fill_(nan)`, `x * float("nan")`) | yes |
| `INF_BORN` | an op produced +inf/-inf nothing it read held (overflow, x/0, log 0), and the infinity later turned into a NaN or reached the output; absorbed, it is no finding | yes |
| `FIRST_SEEN` | a non-finite value at an op not all of whose reads were measured (once per kind) | no |
| `NONFINITE_SOURCE` | a parameter, buffer or constant holds NaN, named at the first op that reads it | no |
| `NONFINITE_INPUT` | a forward input holds NaN | no |
| `REACHES_OUTPUT` | an infinity reaches a forward output, wherever it came from | no |
| `CARRIED_IN` | a collective (`all_reduce`, `all_gather_into_tensor`, ...) brought a non-finite value nothing this rank sent held: another rank's (`tl.debug.across_ranks` finds whose) | no |
| `GRADIENT_BORN` | a backward node produced a non-finite gradient from finite ones, and its forward op read and produced finite values | yes |
| `GRADIENT_FROM_FORWARD` | a non-finite gradient made from finite ones by a node whose forward op read or produced a non-finite value (which it computes with), or reaching an output that held one | no |
| `GRADIENT_FIRST_SEEN` | a non-finite gradient no watched node sent (a hook, a node outside the forward, an overwrite, unmeasured inputs) | no |
| `GRADIENT_FROM_OUTSIDE` | the gradient arriving at a forward output is non-finite, the output's values finite (the loss) | yes |
"""

from __future__ import annotations

import enum
from typing import Optional

__all__ = ["KINDS", "NAN", "NEGINF", "POSINF", "Finding", "FindingKind", "bits", "kind_names"]

# The kinds of non-finite value, as bits (a tensor may hold several).
NAN, POSINF, NEGINF = 1, 2, 4
KINDS = ((NAN, "NaN"), (POSINF, "+inf"), (NEGINF, "-inf"))


def kind_names(kinds: int) -> str:
    """`NaN and +inf`: the kinds set in `kinds`."""
    return " and ".join(name for bit, name in KINDS if kinds & bit)


def bits(nan, posinf, neginf) -> int:
    """The kinds held, from counts (or flags) of each."""
    return (NAN if nan else 0) | (POSINF if posinf else 0) | (NEGINF if neginf else 0)


class FindingKind(enum.Enum):
    """Which verdict rule made a finding (see the module's table); `birth` says whether it names
    where the value was born rather than where it was first seen or where it went; `consequence`,
    whether the value it names was made of one the forward read or produced (what to chase is that
    value, named in its text and, where the forward made a finding of it, there)."""

    NAN_BORN = ("NaN born", True)
    NAN_WRITTEN = ("NaN written by a scalar", True)
    INF_BORN = ("infinity born", True)
    FIRST_SEEN = ("first seen", False)
    NONFINITE_SOURCE = ("non-finite source", False)
    NONFINITE_INPUT = ("non-finite input", False)
    REACHES_OUTPUT = ("infinity reaches the output", False)
    CARRIED_IN = ("carried in by a collective", False)
    GRADIENT_BORN = ("gradient born", True)
    GRADIENT_FROM_FORWARD = ("gradient out of a forward non-finite value", False, True)
    GRADIENT_FIRST_SEEN = ("gradient first seen", False)
    GRADIENT_FROM_OUTSIDE = ("gradient from outside the forward", True)

    def __init__(self, label: str, birth: bool, consequence: bool = False):
        self.label = label
        self.birth = birth
        self.consequence = consequence


class Finding:
    """One verdict, to be read by its fields, not its text:

    - `kind`: the rule that made it (`FindingKind`; None only for a finding loaded from a trace
      saved before kinds were recorded, whose `birth` is then the saved flag);
    - `event`: the op (or backward node) it is shown at, and from it `ordinal`, `op` and `module`
      (the module path, "" for the root);
    - `source`: for a value no op produced, its name: the parameter or buffer
      (`model.embed_tokens.weight`) or the forward input (`x`); None otherwise;
    - `birth`, `consequence`: see `FindingKind`; `text`: the `!!` line's words; `live`: known as
      its op's line was narrated (the `!!` line then follows it).
    """

    __slots__ = ("text", "event", "live", "kind", "_birth", "source")

    def __init__(self, text: str, event, kind: Optional[FindingKind], birth: Optional[bool] = None,
                 source: Optional[str] = None):
        self.text = text
        self.event = event
        self.live = False
        self.kind = kind
        self._birth = kind.birth if kind is not None else bool(birth)
        self.source = source

    @property
    def ordinal(self) -> Optional[int]:
        """The `#N` (a backward node's `~N`) of the op it is shown at."""
        return self.event.ordinal if self.event is not None else None

    @property
    def op(self) -> Optional[str]:
        """The name of the op (or backward node) it is shown at."""
        return self.event.op if self.event is not None else None

    @property
    def module(self) -> Optional[str]:
        """The path of the module that op ran in ("" for the root)."""
        return self.event.scope.path if self.event is not None else None

    @property
    def birth(self) -> bool:
        """Whether the finding names where the value was born (not only where it was seen)."""
        return self._birth

    @property
    def consequence(self) -> bool:
        """Whether it is a backward's non-finite gradient made of a value the forward read or
        produced (`FindingKind.GRADIENT_FROM_FORWARD`): that value, not this node, is what to chase."""
        return self.kind is not None and self.kind.consequence

    def __repr__(self) -> str:
        kind = self.kind.name if self.kind is not None else "?"
        tag = "~" if hasattr(self.event, "forward") else "#"  # a backward node's, as its line writes it
        return f"<Finding {kind} at {tag}{self.ordinal} {self.op}: {self.text}>"
