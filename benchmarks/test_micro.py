"""Micro-benchmarks of the hot paths (pytest-benchmark):

    python -m pytest benchmarks/test_micro.py --benchmark-only

Each one times a single unit of per-op work: rendering one line, writing one line to each kind of
sink, the eager capture of one op (with and without narration), the statistics of one tensor, and
a GPT-2 skeleton's forward under each statistics mode (its per-op cost, where the real model's
compute and this machine's noise hide it); a training step of a chain of small ops under each
backward mode and anomaly mode (the cost per forward op and backward node).
They are not part of the test suite (`tests/`), and carry no thresholds: compare runs over time.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.events import OP, Event, Scope, TensorMeta
from torchlens.measure.meter import Meter
from torchlens.narration import grammar
from torchlens.narration.narrator import Narrator
from torchlens.narration.sinks import open_sink

ROOT = Scope("", "Model", None)
BLOCK = Scope("blocks.3.mlp.fc", "Linear", Scope("blocks.3.mlp", "MLP", Scope("blocks.3", "Block", ROOT)))
EVENT = Event(OP, 1234, "linear", BLOCK, (TensorMeta((8, 64, 768), torch.float32, torch.device("cpu")),),
              "transformers/models/gpt2/modeling_gpt2.py:312")


def test_render_one_op_line(benchmark):
    benchmark(grammar.render_event, EVENT, True, False)


def test_narrate_one_event_through_the_narrator(benchmark):
    narrator = Narrator(tl.options.NarrationOptions(sink=lambda line: None, sites=True))
    benchmark(narrator.feed, EVENT)


@pytest.mark.parametrize("kind", ["path", "stream", "callable", "logger"])
def test_write_one_line_to_a_sink(benchmark, kind, tmp_path):
    target = {
        "path": str(tmp_path / "bench.log"),
        "stream": io.StringIO(),
        "callable": lambda line: None,
        "logger": logging.getLogger("torchlens.bench.silent"),
    }[kind]
    sink = open_sink(target)
    line = grammar.render_event(EVENT, True, False)
    benchmark(sink.write, line)
    sink.close()


class Loop(nn.Module):
    """1000 ops of one kind: time per op = time per call / 1000."""

    def forward(self, x):
        for _ in range(1000):
            x = torch.relu(x)
        return x


@pytest.mark.parametrize("narrate", [False, True], ids=["record", "narrate-file"])
def test_eager_capture_of_1000_ops(benchmark, narrate, tmp_path):
    model, x = Loop(), torch.randn(16)
    target = str(tmp_path / "ops.log") if narrate else None
    benchmark(lambda: tl.record(model, x, narrate=target))


def test_plain_eager_1000_ops_for_reference(benchmark):
    model, x = Loop(), torch.randn(16)
    benchmark(model, x)


@pytest.mark.parametrize("rung,tracking", [("off", True), ("exact", False), ("sampled", False)])
@pytest.mark.parametrize("size", [4096, 1 << 20], ids=["4k", "1M"])
def test_statistics_of_one_tensor_read_live(benchmark, rung, tracking, size):
    tensor = torch.randn(size)
    # a meter per call: one meter shares statistics it already took of the same, unchanged tensor
    benchmark(lambda: Meter(rung, tracking).measure(tensor, True))


@pytest.fixture(scope="module")
def gpt2_skeleton():
    """GPT-2's structure (12 blocks, 527 ops a forward) with almost no compute (`n_embd=48`)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(n_embd=48, n_head=12)).eval()
    return model, torch.randint(0, 1000, (1, 64))


@pytest.mark.parametrize("mode", ["plain", "record", "track", "reuse", "exact"])
def test_gpt2_skeleton_forward(benchmark, gpt2_skeleton, mode):
    """Per op of a mode = (its time - plain's) / 527; `track` - `record` is the tracker's own."""
    model, ids = gpt2_skeleton
    kwargs = {"record": {}, "track": {"on_nonfinite": "track"}, "exact": {"value_stats": "exact"},
              "reuse": {"on_nonfinite": "track", "value_stats": "reuse"}}.get(mode)
    with torch.no_grad():
        if kwargs is None:
            benchmark(model, ids)
        else:
            benchmark(lambda: tl.record(model, ids, **kwargs))


class SmallOpChain(nn.Module):
    """150 rounds of `sin(x * w) + x` on 16 elements: 450 forward ops and 451 backward nodes whose
    compute and reads cost next to nothing, so a mode's time over plain is its cost per op/node."""

    def __init__(self, rounds: int = 150):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16))
        self.rounds = rounds

    def forward(self, x):
        for _ in range(self.rounds):
            x = torch.sin(x * self.w) + x
        return x.sum()


CHAIN_MODES = {  # Recorder keywords per mode (None: no Recorder)
    "plain": None, "anomaly": None, "record": {}, "record_backward": {"backward": True},
    "track": {"on_nonfinite": "track"}, "track_backward": {"backward": True, "on_nonfinite": "track"},
}


@pytest.mark.parametrize("mode", list(CHAIN_MODES))
def test_small_op_chain_training_step(benchmark, mode):
    """A forward and backward of `SmallOpChain` (one thread): per forward op and backward node, a
    mode's cost against plain and against `torch.autograd.detect_anomaly()` (which records the
    stack at every node: pytest's own frames make it dearer here than from a script)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, x = SmallOpChain(), torch.randn(16)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).backward()

    keywords = CHAIN_MODES[mode]
    if keywords is not None:
        context = tl.recording.Recorder(model, keep=0, **keywords)
    elif mode == "anomaly":
        context = torch.autograd.detect_anomaly()
    else:
        context = contextlib.nullcontext()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # anomaly mode warns that it is on
            with context:
                benchmark(step)
    finally:
        torch.set_num_threads(threads)
