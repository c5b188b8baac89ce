"""Debugging tools built on recordings: `tl.debug.compare` aligns two traces op by op."""
