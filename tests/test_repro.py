"""One-op repros: `.repro(directory)` writes a script and the op's inputs that, run alone in a fresh
process with plain torch, raise the same exception or produce the same non-finite values."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

import pytest
import torch
from models import conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl


def run_script(path):
    """Run a repro in a fresh interpreter, from a directory that is not the tests' (no shared imports)."""
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, cwd=path.parent)
    return done.returncode, done.stdout + done.stderr


def test_a_failed_forward_replays_its_attempted_op_alone(tmp_path):
    with pytest.raises(IndexError) as info:
        tl.record(tiny_gpt(), torch.tensor([[1, 2, 99]]))
    script = info.value.partial_trace.repro(tmp_path / "repro")
    assert script.name == "repro.py" and (script.parent / "inputs.pt").exists()
    code, out = run_script(script)
    assert code == 0, out
    assert "raised: IndexError: index out of range in self" in out and "reproduced" in out
    assert "Failure of #3 embedding @tok" in script.read_text()


@pytest.mark.slow
def test_a_copied_or_pickled_partial_trace_still_replays(tmp_path):
    model = tiny_gpt()
    with pytest.raises(RuntimeError) as info:
        model.blocks[0].attn.out = nn.Linear(16, 32)  # a wrong width: its input is a non-leaf of the graph
        tl.record(model, tokens())
    partial = info.value.partial_trace
    kept = partial.attempt.call
    assert kept.copied and kept.args[0].grad_fn is None  # a copy: the forward's graph is not held
    assert kept.origins[0] == (True, False)  # ... of an activation inside the graph, replayed as one
    for clone in (copy.deepcopy(partial), pickle.loads(pickle.dumps(partial))):
        code, out = run_script(clone.repro(tmp_path / str(id(clone))))
        assert code == 0, out


def test_a_conv_net_shape_error_replays_the_convolution_with_its_weights(tmp_path):
    model = conv_net()
    with pytest.raises(RuntimeError) as info:
        tl.record(model, torch.randn(1, 4, 16, 16))  # four channels for a three-channel stem
    partial = info.value.partial_trace
    assert partial.attempt.op == "conv2d"
    code, out = run_script(partial.repro(tmp_path))
    assert code == 0, out
    assert "RuntimeError" in out and "t1 [8, 3, 3, 3]" in out  # the stem's weight travelled with it


class LogOfNegative(nn.Module):
    """A NaN born inside the model: the log of a linear layer's negative outputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.log(self.fc(x)))


def test_a_nan_born_at_an_op_replays_from_finite_inputs_to_the_same_nan(tmp_path):
    torch.manual_seed(0)
    model, x = LogOfNegative(), torch.randn(3, 4)
    recording = tl.record(model, x, on_nonfinite="track")
    assert recording.first_nonfinite.op == "log"
    script = recording.repro(tmp_path)
    code, out = run_script(script)
    assert code == 0, out
    assert "inputs: t0 [3, 4] torch.float32 finite" in out and "output: nan=" in out
    assert "NaN born at #" in script.read_text()  # the finding travels in the docstring


def test_a_nan_weight_in_a_tracked_transformer_replays_the_op_that_read_it(tmp_path):
    model = tiny_gpt()
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[3, 5] = float("nan")
    recording = tl.record(model, tokens(), on_nonfinite="track", value_stats="reuse")
    code, out = run_script(recording.repro(tmp_path))
    assert code == 0, out
    assert "t1 [128, 32] torch.float32 nan=1" in out and "reproduced" in out


def test_raise_stops_at_the_op_and_its_partial_trace_replays_it(tmp_path):
    torch.manual_seed(0)
    model = LogOfNegative()
    with pytest.raises(tl.errors.NonFiniteError) as info:
        tl.record(model, torch.randn(3, 4), on_nonfinite="raise")
    code, out = run_script(info.value.partial_trace.repro(tmp_path))
    assert code == 0, out and "output: nan=" in out


@pytest.mark.slow
def test_a_real_transformer_failure_and_nan_replay(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                           max_position_embeddings=16, attn_implementation="eager")
    model = transformers.DistilBertModel(config).eval()
    with pytest.raises(IndexError) as info:
        tl.record(model, torch.tensor([[1, 2, 60]]))
    code, out = run_script(info.value.partial_trace.repro(tmp_path / "failure"))
    assert code == 0, out
    with torch.no_grad():
        model.transformer.layer[1].ffn.lin1.weight[0, 0] = float("inf")
    recording = tl.record(model, torch.tensor([[1, 2, 3, 4]]), on_nonfinite="track")
    first = recording.first_nonfinite
    script = recording.repro(tmp_path / "nan")
    code, out = run_script(script)
    assert code == 0, out
    assert f"#{first.ordinal} {first.op} @{first.module}" in script.read_text()


def test_a_compiled_failure_replays_the_node_the_graph_replay_found(tmp_path):
    compiled = tl.compile(tiny_gpt(), compiler="eager")
    with pytest.raises(Exception) as info:
        compiled(torch.tensor([[1, 2, 99]]))
    script = info.value.partial_trace.repro(tmp_path)
    code, out = run_script(script)
    assert code == 0, out
    assert "the inputs are the replay's" in script.read_text()


def test_inputs_are_kept_only_when_something_goes_non_finite_and_within_the_bound(tmp_path, monkeypatch):
    healthy = tl.record(tiny_gpt(), tokens(), on_nonfinite="track")  # its causal mask's -inf: carried in
    assert healthy.kept_calls == {}
    plain = tl.record(tiny_gpt(), tokens())
    assert plain.kept_calls == {}
    from torchlens.repro import kept

    monkeypatch.setattr(kept, "MAX_BYTES", 16)  # less than the log's [3, 4] input
    torch.manual_seed(0)
    recording = tl.record(LogOfNegative(), torch.randn(3, 4), on_nonfinite="track")
    with pytest.raises(tl.errors.ReproError, match="over the 16-byte bound"):
        recording.repro(tmp_path)


def test_an_op_that_wrote_its_input_says_the_kept_input_is_what_it_wrote(tmp_path):
    class InPlaceLog(nn.Module):
        def forward(self, x):
            return (x - 1).log_()

    recording = tl.record(InPlaceLog(), torch.zeros(3), on_nonfinite="track")
    script = recording.repro(tmp_path)
    assert "wrote its result into one of its inputs" in script.read_text()


def test_repro_says_why_when_there_is_nothing_to_replay(tmp_path):
    with pytest.raises(tl.errors.ReproError, match="on_nonfinite="):
        tl.record(tiny_gpt(), tokens()).repro(tmp_path)
    with pytest.raises(tl.errors.ReproError, match="no non-finite value"):
        tl.record(conv_net(), images(), on_nonfinite="track").repro(tmp_path)

    class FailsBetweenOps(nn.Module):
        def forward(self, x):
            raise ValueError("no torch call in flight")

    with pytest.raises(ValueError) as info:
        tl.record(FailsBetweenOps(), torch.ones(2))
    with pytest.raises(tl.errors.ReproError, match="between ops"):
        info.value.partial_trace.repro(tmp_path)
    torch.manual_seed(0)
    saved = tl.record(LogOfNegative(), torch.randn(3, 4), on_nonfinite="track").save(tmp_path / "run.tl",
                                                                                     max_repro_bytes=0)
    with pytest.raises(tl.errors.ReproError, match="were not kept: its inputs .* were over the 0-byte bound"):
        tl.load(saved).repro(tmp_path)


@pytest.mark.slow
def test_the_replay_must_raise_the_same_message_not_just_the_same_type(tmp_path):
    class WrongWidthInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).add_(torch.ones(5))  # in place, on an activation inside the graph

    with pytest.raises(RuntimeError) as info:
        tl.record(WrongWidthInPlace(), torch.randn(3, 4))
    script = info.value.partial_trace.repro(tmp_path)
    code, out = run_script(script)
    assert code == 0, out
    assert "must match the size of tensor b (5)" in out
    lines = script.read_text().splitlines(keepends=True)  # what the forward saw, made different
    script.write_text("".join(line.replace("(5)", "(6)") if line.startswith("EXPECTED") else line for line in lines))
    code, out = run_script(script)
    assert code == 1 and "did not reproduce" in out


def test_a_real_infinity_after_a_healthy_mask_keeps_its_own_inputs(tmp_path):
    class MaskThenLog(nn.Module):
        def forward(self, x):
            masked = x.masked_fill(x < -5, float("-inf"))  # a mask: -inf carried in by the scalar
            return masked.softmax(-1), torch.log(x - x.min())  # the log of 0 is a real -inf

    recording = tl.record(MaskThenLog(), torch.randn(2, 4), on_nonfinite="track")
    assert recording.first_nonfinite.op == "log"
    code, out = run_script(recording.repro(tmp_path))
    assert code == 0 and "-inf=1" in out, out


@pytest.mark.slow
def test_power_and_autocast_and_grad_mode_are_replayed(tmp_path):
    class Root(nn.Module):
        def forward(self, x):
            return (x - 1) ** 0.5  # a tensor's __pow__: NaN below 1

    recording = tl.record(Root(), torch.zeros(3), on_nonfinite="track")
    code, out = run_script(recording.repro(tmp_path / "pow"))
    assert code == 0 and "torch.Tensor.__pow__" in (tmp_path / "pow" / "repro.py").read_text(), out

    torch.manual_seed(0)
    wide = nn.Linear(64, 4)
    with torch.no_grad():
        wide.weight.fill_(300.0)
    with torch.autocast("cpu", dtype=torch.float16):  # 64 * 300 * 300 overflows float16, not float32
        recording = tl.record(wide, torch.full((1, 64), 300.0), on_nonfinite="track")
    assert recording.first_nonfinite is not None
    script = recording.repro(tmp_path / "autocast")
    code, out = run_script(script)
    assert code == 0 and "+inf=" in out, out
    assert "AUTOCAST = ('cpu', 'float16')" in script.read_text()


def test_a_compiled_graph_indexing_out_of_range_replays_through_operator(tmp_path):
    class Gather(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, i):
            return self.fc(x)[i]

    compiled = tl.compile(Gather(), compiler="eager")
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3, 4), torch.tensor([0, 7]))  # an index tensor: the graph raises as it runs
    script = info.value.partial_trace.repro(tmp_path)
    code, out = run_script(script)
    assert code == 0, out
    assert "import operator" in script.read_text()


def test_a_failed_pass_holds_no_activation_of_the_forward(tmp_path):
    import gc
    import weakref

    seen = []

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            seen.append(weakref.ref(h))
            return h @ torch.ones(5, 5)

    model = Fails()
    with pytest.raises(RuntimeError):
        with tl.recording.Recorder(model) as recorder:
            for _ in range(3):
                try:
                    model(torch.randn(2, 4))
                except RuntimeError:
                    pass
            model(torch.randn(2, 4))
    gc.collect()
    assert len(recorder.recordings) == 4 and all(ref() is None for ref in seen)
    code, out = run_script(recorder.recordings[0].repro(tmp_path))
    assert code == 0, out


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_nn_transformer_encoder_nan_saves_loads_pages_and_replays_under(mode, tmp_path):
    real_models = pytest.importorskip("real_models")
    model, args, padded = real_models.nn_transformer_encoder()
    with torch.no_grad():
        model.layers[1].linear1.weight[0, 0] = float("nan")
    with torch.inference_mode(), pytest.raises(tl.errors.ReproError, match="nested tensor"):
        tl.record(model, *args, **padded, on_nonfinite="track").repro(tmp_path / "nested")  # its fast path
    kwargs = {}  # without a padding mask the encoder runs on plain tensors
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        expected = model(*args, **kwargs)
        trace = tl.trace(model, *args, **kwargs, on_nonfinite="track", value_stats="exact")
    assert torch.equal(trace.output.nan_to_num(), expected.nan_to_num())  # narration changes nothing
    first = trace.first_nonfinite
    assert first.module.startswith("layers.1")
    loaded = tl.load(trace.save(tmp_path / "run.tl"))
    assert loaded.narrate() == trace.narrate() and loaded.first_nonfinite.ordinal == first.ordinal
    page = open(trace.to_html(tmp_path / "run.html"), encoding="utf-8").read()
    assert f'"i":{first.ordinal},' in page
    code, out = run_script(trace.repro(tmp_path / "repro"))
    assert code == 0 and "nan=1" in out, out


class OverflowThenNaN(nn.Module):
    """Two ops keep their inputs: `exp` (where +inf is born, absorbed by the `where`) and `sqrt`
    (where the NaN is born, the run's one finding)."""

    def forward(self, x):
        e = torch.exp(x * 1000)
        y = torch.where(torch.isinf(e), torch.zeros_like(e), e)
        return torch.sqrt(y - 2)


def test_the_repro_replays_the_op_of_the_first_finding_not_the_first_op_that_kept_its_inputs(tmp_path):
    recording = tl.record(OverflowThenNaN(), torch.tensor([[0.5, -1.0, 0.0001]]), on_nonfinite="track")
    assert [f.text for f in recording.findings] == ["NaN born at #8 sqrt (nan=3)"]
    assert len(recording.kept_calls) == 2  # the exp's inputs were kept too
    script = recording.repro(tmp_path)
    assert '"""Non-finite output of #8 sqrt' in script.read_text()
    code, out = run_script(script)
    assert code == 0, out
    assert "output: nan=3" in out and "reproduced" in out
