"""What capture must never do: leave state behind, sync the device, or disturb the user's error."""

from __future__ import annotations

import io
import traceback

import pytest
import torch
from helpers import count_host_syncs, leftover_state, module_hook_counts
from models import Tiny, conv_net, images, tiny_gpt, tokens

import torchlens as tl


class Interrupting(torch.nn.Module):
    def __init__(self, error):
        super().__init__()
        self.inner = Tiny()
        self.error = error

    def forward(self, x):
        x = self.inner(x)
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "interrupt"])
@pytest.mark.parametrize("entry", ["record", "trace", "recorder"])
def test_no_hook_or_mode_is_left_after_a_failed_run(entry, error, tmp_path):
    model = Interrupting(error)
    hooks_before, state_before = module_hook_counts(model), leftover_state()
    with pytest.raises(type(error)):
        if entry == "recorder":
            with tl.recording.Recorder(model, narrate=tmp_path / "r.log"):
                model(torch.randn(1, 2))
        else:
            getattr(tl, entry)(model, torch.randn(1, 2), narrate=tmp_path / "r.log")
    assert module_hook_counts(model) == hooks_before
    assert leftover_state() == state_before
    # and torch still runs normally afterwards
    assert torch.equal(Tiny().eval()(torch.zeros(1, 2)).shape and torch.zeros(1), torch.zeros(1))


def test_an_interrupt_caught_inside_a_recorder_block_ends_its_pass_as_a_partial_trace():
    """Forward hooks never see a KeyboardInterrupt: the pass it cut short is closed when the next
    begins, and the next passes are recorded on their own."""
    class InterruptedOnce(Interrupting):
        def forward(self, x):
            if self.error is None:
                return self.inner(x)
            error, self.error = self.error, None
            raise error

    model, sink = InterruptedOnce(KeyboardInterrupt()), io.StringIO()
    with tl.recording.Recorder(model, narrate=sink) as recorder:
        try:
            model(torch.randn(1, 2))
        except KeyboardInterrupt:
            pass
        model(torch.randn(1, 2))
        model(torch.randn(1, 2))
        state_inside = leftover_state()
    assert recorder.passes == 3
    assert [type(r).__name__ for r in recorder.recordings] == ["PartialTrace", "Recording", "Recording"]
    assert "KeyboardInterrupt" in recorder.recordings[0].error
    assert sink.getvalue().count("-- end:") == 2
    assert state_inside == leftover_state(), "the interrupted pass kept its mode or counter installed"


def test_no_hook_or_mode_is_left_after_success():
    model = tiny_gpt()
    hooks_before = module_hook_counts(model)
    tl.record(model, tokens(), narrate=lambda line: None)
    with tl.recording.Recorder(model):
        model(tokens())
    assert module_hook_counts(model) == hooks_before


@pytest.mark.parametrize("make,inputs", [(tiny_gpt, tokens), (conv_net, images)])
def test_metadata_narration_makes_no_host_sync(make, inputs, tmp_path):
    model, x = make(), inputs()
    with count_host_syncs() as counted:
        tl.record(model, x, narrate=tl.options.NarrationOptions(sink=tmp_path / "n.log", sites=True))
    assert counted == []


def test_the_sync_counter_sees_syncs_made_under_capture():
    """The counter must catch a sync issued inside a captured forward, or the zero above means nothing."""

    class Syncing(torch.nn.Module):
        def forward(self, x):
            return x * x.sum().item()

    with count_host_syncs() as counted:
        tl.record(Syncing(), torch.ones(3), narrate=lambda line: None)
    assert ("function", "item") in counted and any(kind == "dispatch" for kind, _ in counted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_metadata_narration_passes_cuda_sync_debug_mode():
    model, x = tiny_gpt().cuda(), tokens().cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tl.record(model, x, narrate=lambda line: None)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _user_frames(exc):
    return [
        (f.filename, f.lineno, f.name)
        for f in traceback.extract_tb(exc.__traceback__)
        if "/torchlens/" not in f.filename and "/torch/" not in f.filename
    ]


def test_the_users_exception_keeps_its_type_message_and_frames():
    model, bad = tiny_gpt(), tokens(1, 40)  # longer than the position table: an IndexError
    try:
        model(bad)
    except Exception as exc:
        plain = exc
    with pytest.raises(type(plain)) as info:
        tl.record(model, bad, narrate=lambda line: None)
    assert str(info.value) == str(plain)
    frames = _user_frames(info.value)
    assert frames[-len(_user_frames(plain)) + 1:] == _user_frames(plain)[1:]
    files = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    first_model_frame = next(i for i, name in enumerate(files) if "/torch/" in name)
    assert not any("/torchlens/" in name for name in files[first_model_frame:]), \
        "below the entry call, the traceback holds only the user's and torch's frames"


@pytest.mark.parametrize("options", [{}, {"value_stats": "exact"}, {"on_nonfinite": "track"}],
                         ids=["metadata-only path", "statistics path", "tracking path"])
def test_an_internal_failure_warns_and_never_masks_the_run(monkeypatch, options):
    """Whichever path records an op (the short one of metadata-only captures, or the general one),
    a failure of torchlens there warns once, the forward's output is untouched, and the verdict
    does not claim what was not recorded."""
    from torchlens.core import pipeline, session

    def broken(self, *a, **k):
        raise ZeroDivisionError("torchlens bug")

    monkeypatch.setattr(session.Session, "add_op", broken)  # the metadata-only path
    monkeypatch.setattr(pipeline.Pipeline, "op", broken)  # the general one
    model, x = tiny_gpt(), tokens()
    lines = []
    with pytest.warns(tl.errors.NarrationWarning, match="torchlens bug"):
        rec = tl.record(model, x, narrate=lines.append, **options)
    assert torch.equal(rec.output, model(x))
    assert not [event for event in rec.events if event.kind is tl.EventKind.OP]
    if options.get("on_nonfinite"):
        assert "nothing is claimed" in lines[-1], lines[-1]  # the verdict covers the input alone


class _CountingSink:
    """A sink object that counts what it is given and how often it is closed."""

    def __init__(self):
        from torchlens.narration.sinks import Sink

        outer = self
        self.lines, self.closes = [], 0

        class Counting(Sink):
            def write(self, line):
                outer.lines.append(line)

            def close(self):
                outer.closes += 1

        self.sink = Counting()


class _Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(x) @ torch.ones(3, 3)  # a shape error after one op


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
def test_every_pass_closes_the_sink_it_opened_once_and_a_shared_one_is_closed_by_its_owner(fails):
    model, x = (_Boom() if fails else Tiny()), torch.randn(1, 2)

    def run(call):
        try:
            call()
        except RuntimeError:
            assert fails

    counting = _CountingSink()
    options = tl.options.NarrationOptions(sink=counting.sink)
    run(lambda: tl.record(model, x, narrate=options))
    assert counting.closes == 1 and counting.lines[-1].startswith(("-- end", "!!"))
    run(lambda: tl.trace(model, x, narrate=options))
    assert counting.closes == 2
    compiled = tl.compile(model, narrate=options, compiler="eager")
    for _ in range(2):
        run(lambda: compiled(x))
    assert counting.closes == 4, "each compiled forward closes the sink it opened"

    shared = _CountingSink()
    with tl.recording.Recorder(model, narrate=tl.options.NarrationOptions(sink=shared.sink)):
        for _ in range(2):
            run(lambda: model(x))
        assert shared.closes == 0, "a Recorder's passes share its sink and leave it open"
    assert shared.closes == 1


def test_a_failure_reading_how_a_compiled_call_ended_leaves_the_call_and_torch_as_they_were(monkeypatch):
    """The compiled forward's end reads dynamo's wrapper frame; if that fails, the user's result
    (or exception) is untouched, one warning says so, and no mode, hook or active pass is left."""
    from torchlens.fx_backend import dynamo_seams

    model, x = Tiny(), torch.randn(1, 2)
    compiled = tl.compile(model, narrate=lambda line: None, compiler="eager")
    expected = compiled(x)
    state_before = leftover_state()

    def broken():
        raise ZeroDivisionError("torchlens bug")

    monkeypatch.setattr(dynamo_seams, "call_outcome", broken)
    with pytest.warns(tl.errors.NarrationWarning, match="torchlens bug"):
        out = compiled(x)
    assert torch.equal(out, expected)
    assert leftover_state() == state_before
    with pytest.raises(RuntimeError, match="size|shape|match"), pytest.warns(tl.errors.NarrationWarning):
        compiled(torch.randn(1, 3))  # the user's own error comes through unchanged
    assert leftover_state() == state_before


@torch.compiler.disable
def _run_eagerly(y):
    return y.sin() + 1


class _TwoGaps(torch.nn.Module):
    """Ops dynamo runs eagerly (`_run_eagerly`), a compiled graph (`b`), then eager ops again."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _run_eagerly(self.b(_run_eagerly(self.a(x)))).cos()


def _fail_once(monkeypatch, owner, name):
    """Make `owner.name` raise a bug of torchlens's the first time it is called."""
    original, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("torchlens bug")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def test_a_gap_capture_a_failure_turned_off_stays_off_after_the_next_graph(monkeypatch):
    """Off means off for the rest of the forward: the next compiled graph does not turn the capture
    of the code between graphs back on, and the footer says not everything was recorded."""
    from torchlens.fx_backend.gaps import GapCapture

    _fail_once(monkeypatch, GapCapture, "locate")  # at the first op run between graphs: `sin`
    model, x, lines = _TwoGaps(), torch.randn(2, 4), []
    compiled = torch.compile(model, backend="torchlens", options={"narrate": lines.append, "compiler": "eager"})
    with pytest.warns(tl.errors.NarrationWarning, match="torchlens bug"):
        out = compiled(x)
    assert torch.equal(out, model(x))
    ops = [line.split()[1] for line in lines if line.lstrip().startswith("#")]
    assert ops == ["input", "linear", "linear", "cos"], lines  # the graphs' ops only, no later `sin`
    assert lines[-1].endswith("; not everything after an internal error recording an op was recorded"), lines[-1]


def test_an_eager_capture_a_failure_turned_off_stays_off_after_a_compiled_graph_call(monkeypatch):
    """The same in an eager capture: a compiled submodule's graph call does not turn it back on."""
    from torchlens.eager.capture import OpReporter

    class CompiledInside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.compile(torch.nn.Linear(4, 4), backend="eager")

        def forward(self, x):
            return self.b(self.a(x).relu()).tanh()

    model, x, lines = CompiledInside(), torch.randn(2, 4), []
    model(x)  # compiled before the capture
    _fail_once(monkeypatch, OpReporter, "record_op")  # at the first op: `linear`
    with pytest.warns(tl.errors.NarrationWarning, match="torchlens bug"):
        recording = tl.record(model, x, narrate=lines.append, on_nonfinite="track")
    assert torch.equal(recording.output, model(x))
    assert [e.op for e in recording.events if e.kind is tl.EventKind.OP] == [], lines
    assert "not everything after an internal error recording an op was recorded, so nothing is claimed" in lines[-1]


def _llama_with_a_compiled_mlp():
    pytest.importorskip("transformers")
    from real_models import llama_with_a_compiled_mlp

    return llama_with_a_compiled_mlp()


def _global_module_hooks() -> tuple:
    module = torch.nn.modules.module
    return (dict(module._global_forward_pre_hooks), dict(module._global_forward_hooks),
            dict(module._global_forward_hooks_always_called), module._has_any_global_hook)


@pytest.mark.parametrize("ending", ["returned", "raised", "interrupted"])
def test_with_dynamo_loaded_a_capture_leaves_no_global_module_hook_whichever_way_it_ends(ending):
    """While a global forward hook is registered, every module call of every model in the process
    takes `Module._call_impl`'s slow path (a plain 12-block forward cost 1.34-1.40x). Captures
    kept their shared hooks for the life of any process that had loaded dynamo; now the process
    is left with torch's own hook dictionaries and check, however the capture ended."""
    import torch._dynamo  # noqa: F401  (loaded, as in any process that compiled something)

    model = _llama_with_a_compiled_mlp()
    ids = torch.tensor([[3, 4, 5, 6]])
    before = _global_module_hooks()

    class Ending(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, ids):
            out = self.inner(input_ids=ids).last_hidden_state
            if ending == "raised":
                raise RuntimeError("boom")
            if ending == "interrupted":
                raise KeyboardInterrupt
            return out

    expected = {"returned": None, "raised": RuntimeError, "interrupted": KeyboardInterrupt}[ending]
    if expected is None:
        tl.record(Ending(), ids, narrate=io.StringIO())
    else:
        with pytest.raises(expected):
            tl.record(Ending(), ids, narrate=io.StringIO())
    assert _global_module_hooks() == before
    module = torch.nn.modules.module
    left = [hook for hooks in (module._global_forward_pre_hooks, module._global_forward_hooks)
            for hook in hooks.values() if getattr(hook, "__module__", "").startswith("torchlens")]
    assert left == []


def test_a_compiled_submodule_compiles_once_per_state_over_alternating_captures_and_plain_forwards():
    """Dynamo guards a frame that calls modules on the global hook dictionaries: empty or not, and
    their keys. Captures put their hooks back under the same keys each time, so a compiled
    submodule has one compiled entry for plain forwards and one for narrated ones, however many
    captures come and go (new keys each time recompiled it at every capture)."""
    from torch._dynamo.utils import counters

    model = _llama_with_a_compiled_mlp()
    ids = torch.tensor([[3, 4, 5, 6]])
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids).last_hidden_state
            tl.record(model, input_ids=ids)
            counters.clear()
            for _ in range(12):  # more than dynamo's default recompile limit of 8
                recording = tl.record(model, input_ids=ids)
                assert torch.equal(model(input_ids=ids).last_hidden_state, expected)
            assert counters["stats"]["unique_graphs"] == 0
    finally:
        torch._dynamo.reset()
    assert ("compiled", "layers.1.mlp") in [(event.op, event.scope.path) for event in recording.ops]
    assert torch.equal(recording.output.last_hidden_state, expected)
