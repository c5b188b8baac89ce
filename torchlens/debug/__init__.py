"""Debugging tools built on recordings: `tl.debug.compare` aligns two traces op by op, and with
`tl.debug.reference` (the model in float64) judges each divergence rounding or real, and
`tl.debug.bisect` names the compiler change that makes a real one appear;
`tl.debug.across_ranks` says on which rank of a distributed job a non-finite value was born."""

from .across_ranks import RankReport, across_ranks
from .bisect import BisectReport, bisect
from .compare import compare
from .diff import DEFAULT_TOLERANCES, tolerance_for
from .reference import Reference, reference
from .report import CompareReport
from .rows import CompareRow

__all__ = ["across_ranks", "bisect", "BisectReport", "compare", "CompareReport", "CompareRow", "DEFAULT_TOLERANCES",
           "RankReport", "Reference", "reference", "tolerance_for"]
