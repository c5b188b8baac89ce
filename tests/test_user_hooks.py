"""Ops a user's own forward hook runs (a probe, a steering hook) belong to the module, eagerly as
they do compiled: one rule in both substrates."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import check_nesting, module_hook_counts
from torch import nn

import torchlens as tl


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, input):
        return self.b(self.a(input))


def steer(module, args, output):
    return output * 2 + 1


def body(lines):
    return [line for line in lines if not line.startswith("--")]


def test_hook_ops_are_inside_the_module_eager_and_compiled_alike():
    model = Two()
    model.a.register_forward_hook(steer)
    before = module_hook_counts(model)
    sink = io.StringIO()
    rec = tl.record(model, torch.ones(1, 2), narrate=sink)
    eager = sink.getvalue().splitlines()
    check_nesting(sink.getvalue())
    assert [(e.op, e.module) for e in rec.ops] == [("input", ""), ("linear", "a"), ("mul", "a"), ("add", "a"),
                                                   ("linear", "b")]
    assert module_hook_counts(model) == before  # our closing hook is gone again
    lines = []
    with torch.no_grad():
        tl.compile(model, narrate=lines.append, compiler="eager")(torch.ones(1, 2))
    assert body(lines) == body(eager)


def test_a_hook_that_raises_still_closes_the_module_and_leaves_nothing_behind():
    model = Two()

    def broken(module, args, output):
        raise RuntimeError("hook bug")

    model.a.register_forward_hook(broken)
    before = module_hook_counts(model)
    with pytest.raises(RuntimeError, match="hook bug") as info:
        tl.record(model, torch.ones(1, 2))
    assert module_hook_counts(model) == before
    tail = info.value.partial_trace.narrate(last=3).lines
    assert tail[-1].startswith("!! attempted") and "@a" in "\n".join(tail)


def test_a_steering_hook_on_a_transformers_block_is_narrated_inside_the_block():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2Model(config).eval()

    def add_direction(module, args, output):
        return (output[0] + 0.5,) + tuple(output[1:]) if isinstance(output, tuple) else output + 0.5

    model.h[0].register_forward_hook(add_direction)
    with torch.no_grad():
        plain = model(torch.arange(6)[None]).last_hidden_state
        sink = io.StringIO()
        rec = tl.record(model, torch.arange(6)[None], narrate=sink)
    check_nesting(sink.getvalue())
    assert torch.equal(rec.output.last_hidden_state, plain)
    lines = sink.getvalue().splitlines()
    exit_h0 = lines.index("< h.0")
    assert " add " in lines[exit_h0 - 1] and "@h.0" in lines[exit_h0 - 1]  # the hook's add, inside h.0
    assert lines[exit_h0 + 1] == "> h.1 (GPT2Block)"  # and nothing of it left for the parent
