"""Debugging tools built on recordings: `tl.debug.compare` aligns two traces op by op."""

from .compare import DEFAULT_TOLERANCES, CompareReport, CompareRow, compare, tolerance_for

__all__ = ["compare", "CompareReport", "CompareRow", "DEFAULT_TOLERANCES", "tolerance_for"]
