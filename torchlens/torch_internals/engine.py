"""Autograd's engine, asked in one place which run of it this thread is in and to call back at a
run's end. Both are private to torch (the seam table's "graph task" row probes them): a backward's
narration tells one run from another by its graph task, and ends a run in a final callback."""

from __future__ import annotations

import torch

__all__ = ["graph_task_id", "queue_final_callback"]

graph_task_id = torch._C._current_graph_task_id  # -1 outside a run of the engine


def queue_final_callback(fn) -> None:
    """Have the engine call `fn` once the run this thread is in has finished."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
