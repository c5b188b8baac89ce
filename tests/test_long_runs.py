"""Long tracked training runs leave the garbage collector little to do: a step under
`Recorder(backward=True, on_nonfinite="track")` makes no reference cycles, and the objects it leaves
alive (what a full collection must walk, once enough of them reach the oldest generation) stay
within a bound measured on this model. Counted, not timed: the same code gives the same counts.

`benchmarks/gc_bench.py` measures what this costs over 1,000 steps (full collections, step time).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import torchlens as tl

transformers = pytest.importorskip("transformers")


def gpt2_training():
    """A transformers GPT-2 (small config) and one AdamW step of it."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        optimizer.step()

    return model, step


@contextlib.contextmanager
def collector_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def per_step(step, steps: int = 3):
    """(cyclic garbage, objects moved into the oldest generation) per call of `step`: after each
    call the young generations are collected, so what is alive then is promoted, as in a long run
    whose collections fall at the end of a step."""
    with collector_paused():
        step()  # what the first step makes once (optimizer state, the interned descriptions)
        gc.collect()
        garbage = promoted = 0
        for _ in range(steps):
            step()
            before = len(gc.get_objects(generation=2))
            garbage += gc.collect(1)
            promoted += len(gc.get_objects(generation=2)) - before
    return garbage / steps, promoted / steps


def test_a_tracked_training_step_makes_no_more_cyclic_garbage_than_a_plain_one():
    """The pass's pipeline (session, meter, tracker, capture) is freed when the pass ends, not
    left in reference cycles for the collector (it was a few hundred objects a step)."""
    model, step = gpt2_training()
    plain_garbage, _ = per_step(step)
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track", keep=1):
        tracked_garbage, _ = per_step(step)
    assert tracked_garbage <= plain_garbage


def test_a_compiled_tracked_call_makes_no_more_cyclic_garbage_than_a_plain_one():
    """The compiled pass lets go of the wrapper call's frame as it ends (the frame holds the
    cleanup bound to the pass: a cycle that kept each call's pass for the collector)."""
    model, _ = gpt2_training()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = torch.compile(model, backend="eager")
    narrated = tl.compile(model, compiler="eager", on_nonfinite="track")
    with torch.no_grad():
        plain_garbage, _ = per_step(lambda: plain(ids))
        tracked_garbage, _ = per_step(lambda: narrated(ids))
    assert tracked_garbage <= plain_garbage


# Measured on this model (torch 2.13, transformers 5): 1,625 objects a step alive at its end under
# `keep=1, tail=1000` (30 of them a plain step's), against 2,992 before op descriptions were shared,
# the backward's hook handles dropped and the tail kept without a tuple per event. Undoing one of
# them alone gives 2,534, 1,915 and 1,796.
PROMOTED_PER_STEP = 1_750


def test_a_tracked_training_step_leaves_a_bounded_number_of_objects_alive():
    model, step = gpt2_training()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track", keep=1, tail=1000) as recorder:
        _, promoted = per_step(step)
        events = len(recorder.recordings[-1].events) + len(recorder.recordings[-1].backward[0].events)
    assert events == 331 and len(recorder.tail) == 4 * 171  # each step recorded whole, the tail holds all four
    # (what is left alive: the kept recording's events and statistics, and the graph its output holds)
    assert promoted < PROMOTED_PER_STEP, promoted
