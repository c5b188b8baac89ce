"""One aligned op of a comparison, `CompareRow`, and the statuses and verdicts it takes.

A row is made by the numeric diff (`diff`), which gives its status and verdict, judged against
float64 by `judging`, and read and rendered by `report`: the one type they all share.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["BOTH", "DIVERGED", "NOT_COMPARABLE", "ONLY_A", "ONLY_B", "UNCHECKED", "WITHIN", "CompareRow"]

BOTH, ONLY_A, ONLY_B = "both", "only_a", "only_b"
WITHIN, DIVERGED, NOT_COMPARABLE, UNCHECKED = "within", "diverged", "not comparable", "unchecked"


@dataclasses.dataclass(eq=False, slots=True)  # (eq=False: a row is equal to itself only)
class CompareRow:
    """One aligned op: where it is in each trace and how its values compare.

    - `status`: "both" (matched), "only_a" or "only_b" (present in one trace only).
    - `module`, `op`: the op's module path ("" for the root) and name.
    - `ordinal_a`, `ordinal_b`: its `#N` in each trace (None where absent); `ordinal` is trace_b's,
      or trace_a's for an op only in a.
    - `shapes_match`, `dtypes_match`: whether the outputs agree in shape / dtype (None unless both).
    - `max_abs`, `max_rel`: the largest absolute and relative difference over all outputs (None
      unless the values were compared); `inf` where a NaN or an infinity is on one side only.
    - `rtol`, `atol`: the tolerance the values were held to.
    - `depth`: the op's module depth, as narration indents it.
    - `verdict`: "within", "diverged", "not comparable" or "unchecked" (a side kept no value);
      None for one-sided rows. `reason` says why a row is not comparable or unchecked.
    - With a reference (`compare(..., reference=)`), for a row whose sides differ: `judgement`
      ("rounding", "real", or "unjudged" with `reason` saying why: no float64 op to pair it with,
      integer outputs, or after a random op where float64 drew other numbers), `closer` ("a", "b",
      or None when both are as far from float64),
      `ulps_a`, `ulps_b` (each side's distance from float64 in ulps of its own dtype), `allowed`
      (the most ulps rounding allows there). None otherwise.
    """

    status: str
    module: str
    op: str
    ordinal_a: Optional[int]
    ordinal_b: Optional[int]
    shapes_match: Optional[bool] = None
    dtypes_match: Optional[bool] = None
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    rtol: Optional[float] = None
    atol: Optional[float] = None
    verdict: Optional[str] = None
    reason: str = ""
    depth: int = 0  # the module depth narration indents the op by (module calls from the root)
    judgement: Optional[str] = None
    closer: Optional[str] = None
    ulps_a: Optional[float] = None
    ulps_b: Optional[float] = None
    allowed: Optional[float] = None
    own_a: Optional[float] = None
    own_b: Optional[float] = None
    off: Optional[str] = None

    @property
    def ordinal(self) -> int:
        ordinal = self.ordinal_b if self.ordinal_b is not None else self.ordinal_a
        assert ordinal is not None  # (a row has one side at least)
        return ordinal

    @property
    def within_tolerance(self) -> Optional[bool]:
        """True or False for compared rows; None where there was nothing to compare."""
        return None if self.verdict in (None, UNCHECKED) else self.verdict == WITHIN

    @property
    def diverged(self) -> bool:
        """Out of tolerance or not comparable: what `first_divergence` looks for."""
        return self.verdict in (DIVERGED, NOT_COMPARABLE)

    @property
    def where(self) -> str:
        """The op as narration names it: `linear @blocks.1.fc`, or just `add` at the root."""
        return f"{self.op} @{self.module}" if self.module else self.op

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "within_tolerance": self.within_tolerance}

    def __repr__(self) -> str:
        return f"CompareRow({self.status} #{self.ordinal} {self.where}: {self.verdict})"

