"""Narration across threads, and captures inside captures.

Threads: the capture mode lives on the calling thread's mode stack and the global module hooks
answer only their own thread, so two threads narrating at once must each get exactly the bytes a
lone run gives, and a plain forward in another thread must stay unnarrated. The switch interval is
made tiny so that threads really interleave op by op; each test checks that runs overlapped.

Nesting: a `tl.record` called inside a forward that is itself narrated (eagerly, by a `Recorder`,
or compiled) is supported: the inner recording is what a standalone one would be, and the outer
narration shows the inner model's ops once, never the inner capture's own work.
"""

from __future__ import annotations

import io
import sys
import threading
import time

import pytest
import torch
from helpers import OP_LINE, op_lines
from models import Tiny, conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl


@pytest.fixture
def interleaving():
    """Let the interpreter switch threads every few bytecodes instead of every 5 ms."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def narrated(model, x, **options):
    sink = io.StringIO()
    tl.record(model, x, narrate=sink, **options)
    return sink.getvalue()


def run_together(jobs, rounds):
    """Run each job `rounds` times in its own thread, all starting at once.

    Returns, per job, the list of (start, end, result); a job's exception fails the test.
    """
    barrier = threading.Barrier(len(jobs))
    results = [[] for _ in jobs]
    errors = []

    def work(index, job):
        try:
            barrier.wait()
            for _ in range(rounds):
                start = time.perf_counter()
                value = job()
                results[index].append((start, time.perf_counter(), value))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def overlapped(first, second) -> bool:
    return any(a0 < b1 and b0 < a1 for a0, a1, _ in first for b0, b1, _ in second)


def test_two_threads_narrating_two_models_each_get_their_lone_bytes(interleaving, recwarn):
    gpt, conv, x_gpt, x_conv = tiny_gpt(), conv_net(), tokens(), images()
    alone_gpt, alone_conv = narrated(gpt, x_gpt, value_stats="exact"), narrated(conv, x_conv)
    gpt_runs, conv_runs = run_together(
        [lambda: narrated(gpt, x_gpt, value_stats="exact"), lambda: narrated(conv, x_conv)], rounds=8)
    assert overlapped(gpt_runs, conv_runs), "the two threads never ran at the same time"
    assert all(text == alone_gpt for _, _, text in gpt_runs)
    assert all(text == alone_conv for _, _, text in conv_runs)
    assert "conv2d" not in alone_gpt and "embedding" not in alone_conv  # what a stray line would show
    assert not [w for w in recwarn if issubclass(w.category, tl.errors.NarrationWarning)]


def test_one_model_narrated_in_three_threads_at_once(interleaving):
    model, x = tiny_gpt(), tokens()
    alone = narrated(model, x)
    runs = run_together([lambda: narrated(model, x)] * 3, rounds=6)
    assert overlapped(runs[0], runs[1])
    assert [text for job in runs for _, _, text in job] == [alone] * 18


def test_two_threads_calling_two_compiled_models_each_narrate_every_pass_intact(interleaving):
    models = [(tiny_gpt(), tokens()), (conv_net(), images())]
    sinks = [[], []]
    compiled = [tl.compile(model, narrate=sink.append, compiler="eager") for (model, _), sink in zip(models, sinks)]
    for fn, (_, x) in zip(compiled, models):
        fn(x)  # compiled here, before the threads start
    alone = ["\n".join(sink[1:]) for sink in sinks]  # one pass, without its "-- pass 1" header
    for sink in sinks:
        sink.clear()
    runs = run_together([lambda: compiled[0](models[0][1]), lambda: compiled[1](models[1][1])], rounds=8)
    assert overlapped(runs[0], runs[1])
    for sink, text in zip(sinks, alone):
        passes = "\n".join(sink).split("\n-- pass ")
        assert len(passes) == 8
        assert all(one.split("\n", 1)[1] == text for one in passes)


class Paused(nn.Module):
    """Tiny whose forward waits, in the narrated thread only, until another thread says go."""

    def __init__(self):
        super().__init__()
        self.inner = Tiny()
        self.narrated_thread = None
        self.go = threading.Event()
        self.waiting = threading.Event()

    def forward(self, x):
        y = self.inner(x)
        if threading.get_ident() == self.narrated_thread:
            self.waiting.set()
            assert self.go.wait(30)
        return y * 2


def test_a_plain_forward_in_another_thread_is_not_narrated():
    """While thread A is inside its narrated forward, thread B runs the same model plainly."""
    model, x = Paused(), torch.randn(1, 2)
    alone = narrated(model, x)
    sink = io.StringIO()
    recording = []

    def narrate_in_a():
        model.narrated_thread = threading.get_ident()
        recording.append(tl.record(model, x, narrate=sink))

    thread = threading.Thread(target=narrate_in_a)
    thread.start()
    assert model.waiting.wait(30)
    plain = model(x) + model.inner(x).sum()  # thread B: model, and a submodule on its own
    model.go.set()
    thread.join()
    assert sink.getvalue() == alone
    assert [e.op for e in recording[0].events if e.kind is tl.EventKind.OP] == ["linear", "relu", "mul"]
    assert plain.shape == (1, 2)


def test_a_recorder_counts_only_its_own_threads_passes():
    model, x = Paused(), torch.randn(1, 2)
    model.go.set()
    sink = io.StringIO()
    with tl.recording.Recorder(model, narrate=sink) as recorder:
        model(x)
        worker = threading.Thread(target=lambda: [model(x) for _ in range(3)])
        worker.start()
        worker.join()
        model(x)
    assert recorder.passes == 2
    assert sink.getvalue().count("-- end:") == 2


# -- captures inside captures --------------------------------------------------------------------


class RecordsInside(nn.Module):
    """A forward that records its submodule with `tl.record` (as a library helper might)."""

    def __init__(self, **options):
        super().__init__()
        self.inner = Tiny()
        self.head = nn.Linear(2, 2)
        self.options = options
        self.inner_texts = []
        self.inner_recordings = []

    def forward(self, x):
        sink = io.StringIO()
        recording = tl.record(self.inner, x, narrate=sink, **self.options)
        self.inner_texts.append(sink.getvalue())
        self.inner_recordings.append(recording)
        return self.head(recording.output) * 2


OUTER_OPS = ["input", "linear", "relu", "linear", "mul"]


def ops_of(text):
    return [OP_LINE.match(line).group("op") for line in op_lines(text)]


@pytest.mark.parametrize("inner_options", [{}, {"value_stats": "exact"}, {"on_nonfinite": "track"}],
                         ids=["plain", "exact-stats", "tracking"])
def test_a_record_inside_a_narrated_forward_narrates_both_and_nothing_of_its_own(inner_options):
    model, x = RecordsInside(**inner_options), torch.randn(1, 2)
    outer = narrated(model, x, value_stats="sampled")
    assert ops_of(outer) == OUTER_OPS, "the inner capture's statistics must not show as ops"
    assert "> inner (Tiny)" in outer and "  > inner.proj (Linear)" in outer
    assert model.inner_texts[0] == narrated(model.inner, x, **inner_options)
    assert torch.equal(model.inner_recordings[0].output, model.inner(x))


def test_a_sink_that_calls_torch_inside_a_nested_capture_stays_out_of_both():
    touched = []

    def torch_sink(line):
        touched.append(torch.tensor([len(line)]).sum())

    class Nested(RecordsInside):
        def forward(self, x):
            recording = tl.record(self.inner, x, narrate=torch_sink)
            return self.head(recording.output) * 2

    outer_lines = []
    tl.record(Nested(), torch.randn(1, 2), narrate=lambda line: (outer_lines.append(line), torch_sink(line)))
    assert ops_of("\n".join(outer_lines)) == OUTER_OPS
    assert touched  # the sinks did run torch


def test_a_recorder_inside_a_recorder_gives_each_the_same_passes():
    model, x = Tiny(), torch.randn(1, 2)
    outer_sink, inner_sink = io.StringIO(), io.StringIO()
    with tl.recording.Recorder(model, narrate=outer_sink, value_stats="exact") as outer:
        model(x)
        with tl.recording.Recorder(model, narrate=inner_sink, on_nonfinite="track") as inner:
            model(x)
    assert (outer.passes, inner.passes) == (2, 1)
    assert ops_of(inner_sink.getvalue()) == ["input", "linear", "relu"]
    assert ops_of(outer_sink.getvalue()) == ["input", "linear", "relu"] * 2


def test_a_failure_inside_a_nested_record_reaches_the_caller_with_the_outer_trace():
    class Failing(nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(2, 2)
            self.bad = Failing()

        def forward(self, x):
            return tl.record(self.bad, self.pre(x)).output

    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        tl.record(Outer(), torch.randn(1, 2))
    partial = info.value.partial_trace
    assert [e.op for e in partial.events if e.kind is tl.EventKind.OP] == ["linear", "ones"]
    assert partial.attempt.op == "matmul" and partial.attempt.scope.path == "bad"


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("inner", ["tl.compile exact stats", "tl.trace compiled"])
def test_a_compiled_capture_inside_a_narrated_forward_shows_none_of_its_own_work(inner):
    """Its statistics and kept copies are computed by the compiled graph and around it: none of
    that is the model's, so the outer narration shows only the outer model's own ops, and the
    compiled graph call as one `compiled` op."""
    texts = []

    class CallsCompiled(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = Tiny(), nn.Linear(2, 2)
            self.compiled = tl.compile(self.inner, narrate=texts.append, value_stats="exact", compiler="eager")

        def forward(self, x):
            if inner == "tl.trace compiled":
                y = tl.trace(self.inner, x, narrate=texts.append, compiled={"compiler": "eager"}).output
            else:
                y = self.compiled(x)
            return self.head(y)

    model, x = CallsCompiled(), torch.randn(1, 2)
    outer = narrated(model, x, value_stats="sampled")
    assert ops_of(outer) == ["input", "compiled", "linear"], outer  # the graph call is one op
    assert ops_of("\n".join(texts)) == ["input", "linear", "relu"]


def test_a_record_inside_a_compiled_forward_runs_eagerly_once_per_call():
    model, x = RecordsInside(), torch.randn(1, 2)
    lines = []
    compiled = tl.compile(model, narrate=lines.append, compiler="eager")
    for _ in range(2):
        assert torch.equal(compiled(x), model.head(model.inner(x)) * 2)
    alone = narrated(model.inner, x)
    assert model.inner_texts == [alone, alone]
    compiled_ops = ops_of("\n".join(lines))
    assert compiled_ops == OUTER_OPS * 2, "the compiled narration shows the inner model's ops, run between graphs"


def test_a_foreign_model_recorded_inside_a_forward_closes_in_the_outer_transcript():
    """The outer capture names the foreign model's calls `<Sequential>...`; meeting its unknown
    submodules must not make it forget the call it has open, or every later op stays inside it."""
    foreign = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    class Outer(nn.Module):
        def forward(self, x):
            y = tl.record(foreign, x.sin()).output
            return y.cos() + 1

    recording = tl.record(Outer(), torch.randn(2, 4))
    ops = [(e.op, e.scope.path) for e in recording.events if e.kind is tl.EventKind.OP]
    assert ops == [("sin", ""), ("linear", "<Sequential>.<Linear>"), ("relu", "<Sequential>.<ReLU>"),
                   ("cos", ""), ("add", "")]
    enters = sum(e.kind is tl.EventKind.ENTER for e in recording.events)
    assert enters == sum(e.kind is tl.EventKind.EXIT for e in recording.events) == 3


def _llama_with_a_compiled_layer():
    pytest.importorskip("transformers")
    from real_models import llama_with_a_compiled_mlp

    return llama_with_a_compiled_mlp()


def _graphs_compiled(run) -> int:
    from torch._dynamo.utils import counters

    counters.clear()
    run()
    return counters["stats"]["unique_graphs"]


def _in_threads(work, threads: int = 8) -> list:
    errors = []

    def guarded():
        try:
            work()
        except Exception as exc:  # (raised in a thread: carried to the test)
            errors.append(exc)

    started = [threading.Thread(target=guarded) for _ in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    return errors


def test_captures_in_eight_threads_around_a_compiled_layer_recompile_nothing_plain_does_not(recwarn):
    """Captures add no global hook of their own: dynamo guards a compiled frame on those hooks'
    keys, and captures that registered their own made it recompile at every forward (threads
    recompiled each other's frames, and dynamo raised KeyError)."""
    model = _llama_with_a_compiled_layer()
    ids = torch.arange(12).reshape(2, 6) % 64
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            tl.record(model, input_ids=ids)  # warm-up: the compiles a capture's first forward needs
            expected = model(input_ids=ids).last_hidden_state  # and a plain forward's
            recordings = []

            def plain():
                with torch.no_grad():  # (grad mode is per thread)
                    for _ in range(50):
                        model(input_ids=ids)

            def recorded():
                with torch.no_grad():
                    for _ in range(50):
                        recordings.append(tl.record(model, input_ids=ids))

            assert _graphs_compiled(lambda: _in_threads(plain)) == 0
            errors = []
            assert _graphs_compiled(lambda: errors.extend(_in_threads(recorded))) == 0, \
                "captures made the compiled layer recompile"
            assert _graphs_compiled(lambda: [tl.record(model, input_ids=ids) for _ in range(10)]) == 0
    finally:
        torch._dynamo.reset()
    assert errors == []
    assert len(recordings) == 400
    first = [(event.op, event.scope.path) for event in recordings[0].ops]
    assert ("compiled", "layers.1.mlp") in first and ("linear", "layers.0.self_attn.q_proj") in first
    assert all([(event.op, event.scope.path) for event in r.ops] == first for r in recordings)
    assert all(torch.equal(r.output.last_hidden_state, expected) for r in recordings)
    assert not [w for w in recwarn if "global hooks" in str(w.message)], \
        "torch warns that global hooks fire an extra time for a compiled module: not for torchlens's own"
