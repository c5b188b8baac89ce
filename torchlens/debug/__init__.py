"""Debugging tools built on recordings: `tl.debug.compare` aligns two traces op by op;
`tl.debug.across_ranks` says on which rank of a distributed job a non-finite value was born."""

from .across_ranks import RankReport, across_ranks
from .compare import DEFAULT_TOLERANCES, CompareReport, CompareRow, compare, tolerance_for

__all__ = ["across_ranks", "compare", "CompareReport", "CompareRow", "DEFAULT_TOLERANCES", "RankReport",
           "tolerance_for"]
