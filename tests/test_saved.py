"""Saved traces: `recording.save(path)` and `tl.load(path)` give back what was recorded (byte-identical
narration, equal values, the failure and the backwards), across processes, and a file that is not
a saved trace is refused as data, never run."""

from __future__ import annotations

import collections
import copy
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from models import conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl

HERE = os.path.dirname(os.path.abspath(__file__))


def round_trip(recording, tmp_path, name="run.tl"):
    path = recording.save(tmp_path / name)
    return tl.load(path)


def assert_same(original, loaded):
    assert type(loaded) is type(original)
    assert loaded.narrate() == original.narrate()
    for last in (3, 20):
        assert loaded.narrate(last=last) == original.narrate(last=last)
    assert [f.text for f in loaded.findings] == [f.text for f in original.findings]
    first, again = original.first_nonfinite, loaded.first_nonfinite
    assert (first is None) == (again is None)
    if first is not None:
        assert (again.ordinal, again.op, again.module) == (first.ordinal, first.op, first.module)
    assert len(loaded.backward) == len(original.backward)
    for run, loaded_run in zip(original.backward, loaded.backward):
        assert loaded_run.narrate() == run.narrate()
        assert [f.text for f in loaded_run.findings] == [f.text for f in run.findings]


def assert_values_equal(original, loaded):
    assert sorted(loaded.values) == sorted(original.values)
    for ordinal, kept in original.values.items():
        for a, b in zip(kept, loaded.values[ordinal]):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())


def nan_gpt():
    model = tiny_gpt()
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[3, 5] = float("nan")
    return model


@pytest.mark.parametrize("entry", ["record", "trace"])
@pytest.mark.parametrize("build", ["gpt", "conv"])
def test_a_saved_run_loads_and_narrates_byte_identically_with_its_values(entry, build, tmp_path):
    model, x = (nan_gpt(), tokens()) if build == "gpt" else (conv_net(), images())
    run = getattr(tl, entry)(model, x, narrate=tl.options.NarrationOptions(sink=io.StringIO(), sites=True),
                             value_stats="exact", on_nonfinite="track")
    loaded = round_trip(run, tmp_path)
    assert_same(run, loaded)
    assert torch.equal(loaded.output.nan_to_num(), run.output.nan_to_num())
    if entry == "trace":
        assert_values_equal(run, loaded)
        assert len(loaded.values) == len(run.ops)
    if build == "gpt":
        assert loaded.first_nonfinite.module == "blocks.1.mlp.fc"
        assert "NaN in blocks.1.mlp.fc.weight (nan=1), first read by" in loaded.narrate()


def test_a_failed_forward_saves_its_tail_and_attempted_op(tmp_path):
    model = tiny_gpt()
    with pytest.raises(IndexError) as info:
        tl.record(model, torch.tensor([[1, 2, 99]]), narrate=tl.options.NarrationOptions(sink=io.StringIO()))
    partial = info.value.partial_trace
    loaded = round_trip(partial, tmp_path)
    assert_same(partial, loaded)
    assert (loaded.attempt.op, loaded.attempt.ordinal, loaded.attempt.module) == \
        (partial.attempt.op, partial.attempt.ordinal, partial.attempt.module)
    assert loaded.error == partial.error and "!! attempted" in loaded.narrate(last=5)


def test_a_training_step_saves_its_backward_with_gradients_and_a_failed_backward_its_node(tmp_path):
    model, x = tiny_gpt().train(), tokens()
    trace = tl.trace(model, x, value_stats="exact", on_nonfinite="track", backward=True)
    trace.output.sum().backward()
    loaded = round_trip(trace, tmp_path)
    assert_same(trace, loaded)
    [run], [again] = trace.backward, loaded.backward
    assert sorted(again.values) == sorted(run.values) and len(run.nodes) > 20
    for ordinal, grads in run.values.items():
        assert all(torch.equal(a, b) for a, b in zip(grads, again.values[ordinal]))
    report = tl.debug.compare(trace, loaded)
    assert report.first_divergence is None and report.gradients.first_divergence is None

    class SafeSqrt(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):  # finite, but where h == 0 the gradient of sqrt is infinite: a NaN below
            h = torch.relu(self.fc(x))
            return torch.where(h > 0, h.sqrt(), 0).sum()

    sqrt = SafeSqrt()
    with pytest.raises(tl.errors.NonFiniteError) as info:
        with tl.recording.Recorder(sqrt, backward=True, on_nonfinite="raise"):
            torch.manual_seed(0)
            sqrt(torch.randn(3, 4)).backward()
    partial = info.value.partial_trace
    loaded = round_trip(partial, tmp_path, "backward.tl")
    assert_same(partial, loaded)
    assert loaded.failed_backward is loaded.backward[-1]
    assert loaded.failed_backward.nodes[-1].op == "SqrtBackward0" == partial.failed_backward.nodes[-1].op
    assert "!! backward failed: NonFiniteError" in loaded.narrate()


def test_selections_are_saved_as_selectors_or_as_what_a_function_selected(tmp_path):
    model, x = tiny_gpt(), tokens()
    by_path = tl.record(model, x, narrate=tl.options.NarrationOptions(
        sink=io.StringIO(), select=tl.in_module("blocks.1") | tl.in_module("head"), depth=2))
    loaded = round_trip(by_path, tmp_path, "path.tl")
    assert loaded.narrate() == by_path.narrate()
    assert loaded.narrate(select=tl.in_module("blocks.0")) == by_path.narrate(select=tl.in_module("blocks.0"))
    by_function = tl.record(model, x, narrate=tl.options.NarrationOptions(
        sink=io.StringIO(), select=lambda event: event.op in ("linear", "softmax")))
    loaded = round_trip(by_function, tmp_path, "function.tl")
    assert loaded.narrate() == by_function.narrate()
    assert "softmax" in loaded.narrate() and "layer_norm" not in loaded.narrate()


def test_a_real_transformer_round_trips_its_output_and_narration(tmp_path):
    real_models = pytest.importorskip("real_models")
    model, args, kwargs = real_models.bart()
    trace = tl.trace(model, *args, **kwargs, value_stats="exact", on_nonfinite="track")
    loaded = round_trip(trace, tmp_path)
    assert_same(trace, loaded)
    assert_values_equal(trace, loaded)
    assert isinstance(loaded.output, dict)  # a ModelOutput comes back as the dict it is
    assert torch.equal(loaded.output["last_hidden_state"], trace.output.last_hidden_state)
    manifest = json.loads(zipfile.ZipFile(tmp_path / "run.tl").read("trace.json"))
    assert manifest["output"]["type"].endswith("Seq2SeqModelOutput")


SAVE_IN_A_PROCESS = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import torchlens as tl
    from models import tiny_gpt, tokens
    model = tiny_gpt()
    if sys.argv[2] == "perturbed":
        with torch.no_grad():
            model.blocks[1].attn.out.weight.mul_(1.01)
    tl.trace(model, tokens(), value_stats="exact").save(sys.argv[1])
""")


@pytest.mark.slow
def test_traces_saved_by_two_processes_compare_like_the_live_ones(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(SAVE_IN_A_PROCESS.format(tests=HERE))
    paths = []
    for variant in ("plain", "perturbed"):
        path = tmp_path / f"{variant}.tl"
        subprocess.run([sys.executable, str(script), str(path), variant], check=True, timeout=300)
        paths.append(path)
    report = tl.debug.compare(tl.load(paths[0]), tl.load(paths[1]))
    assert report.first_divergence is not None
    assert (report.first_divergence.module, report.first_divergence.op) == ("blocks.1.attn.out", "linear")
    live = tl.debug.compare(tl.trace(tiny_gpt(), tokens(), value_stats="exact"), tl.load(paths[0]))
    assert live.first_divergence is None and live.counts["within_tolerance"] == len(live.rows)


def test_a_saved_trace_is_readable_without_torchlens(tmp_path):
    path = tl.trace(tiny_gpt(), tokens(), value_stats="exact").save(tmp_path / "run.tl")
    reader = textwrap.dedent(f"""
        import json, sys, zipfile
        from safetensors.numpy import load
        archive = zipfile.ZipFile({str(path)!r})
        events = [json.loads(line) for line in archive.read("events.jsonl").splitlines()]
        ops = [e for e in events if e["kind"] == "op"]
        tensors = load(archive.read("tensors.safetensors"))
        assert "torchlens" not in sys.modules and "torch" not in sys.modules
        print(len(ops), ops[0]["op"], tensors["op/2/0"].shape)
    """)
    out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, check=True, timeout=120)
    trace = tl.load(path)
    first = trace.ops[1]
    assert out.stdout.split() == [str(sum(1 for e in trace.events if e.kind.value == "op")), first.op,
                                  str(tuple(trace.values[2][0].shape)).replace(" ", "")]


class Payload:
    """What a malicious pickle would run: it leaves a file behind if it is ever unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _zip(path, files: dict, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def test_a_crafted_file_is_refused_as_data_and_nothing_in_it_runs(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    good = tl.trace(tiny_gpt(), tokens()).save(tmp_path / "good.tl")
    parts = {name: zipfile.ZipFile(good).read(name) for name in zipfile.ZipFile(good).namelist()}

    pickled = tmp_path / "model.pt"
    torch.save({"weights": Payload(str(marker))}, pickled)  # a torch.save file: a zip with a pickle inside
    manifest = json.loads(parts["trace.json"])
    crafted = {
        "torch.save file": pickled,
        "a pickle as the tensor file": _zip(tmp_path / "a.tl", {**parts, "tensors.safetensors": pickle.dumps(
            Payload(str(marker)))}),
        "a dtype that is not one": _zip(tmp_path / "b.tl", {**parts, "events.jsonl": parts["events.jsonl"].replace(
            b'"int64"', b'"__class__"', 1)}),
        "a scope out of the table": _zip(tmp_path / "c.tl", {**parts, "events.jsonl": b'{"kind":"op","ordinal":1,'
                                                              b'"op":"x","scope":99,"outputs":[]}\n'}),
        "an unknown class": _zip(tmp_path / "d.tl", {**parts, "trace.json": json.dumps(
            {**manifest, "class": "os.system"}).encode()}),
        "not JSON": _zip(tmp_path / "e.tl", {**parts, "trace.json": b"\x80\x04cos\nsystem\n"}),
        "not a zip": tmp_path / "f.tl",
    }
    crafted["not a zip"].write_bytes(pickle.dumps(Payload(str(marker))))

    def refuse(*args, **kwargs):
        raise AssertionError("tl.load unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    for what, path in crafted.items():
        with pytest.raises(tl.errors.TraceFileError) as info:
            tl.load(path)
        assert isinstance(info.value, ValueError), what
    assert not marker.exists()
    tl.load(good)  # and a real one still loads with unpickling forbidden


def test_save_and_load_name_what_they_take():
    trace = tl.record(tiny_gpt(), tokens())
    with pytest.raises(tl.errors.OptionTypeError, match="file path"):
        trace.save(3)
    with pytest.raises(tl.errors.OptionTypeError, match="file path"):
        tl.load(None)


def test_an_output_that_is_not_data_is_left_out_and_said_so(tmp_path):
    class Returns(nn.Module):
        def forward(self, x):
            return {"y": x * 2, "n": 3, "big": float("inf"), "f": self.forward}

    trace = tl.trace(Returns(), torch.ones(2))
    loaded = round_trip(trace, tmp_path)
    assert loaded.output["n"] == 3 and loaded.output["big"] == float("inf") and loaded.output["f"] is None
    assert torch.equal(loaded.output["y"], torch.full((2,), 2.0))
    manifest = json.loads(zipfile.ZipFile(tmp_path / "run.tl").read("trace.json"))
    assert "not tensors, numbers" in manifest["output"]["dict"]["f"]["left_out"]


def _rewritten(good, path, member, change, compression=zipfile.ZIP_STORED):
    parts = {name: zipfile.ZipFile(good).read(name) for name in zipfile.ZipFile(good).namelist()}
    parts[member] = change(parts[member])
    return _zip(path, parts, compression)


def _edit_json(change):
    def edit(data):
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc).encode()
    return edit


def _edit_first_event(change):
    def edit(data):
        lines = data.splitlines()
        row = json.loads(lines[0])
        change(row)
        return b"\n".join([json.dumps(row).encode()] + lines[1:]) + b"\n"
    return edit


def test_damaged_and_malformed_files_are_trace_file_errors_never_other_exceptions(tmp_path):
    trace = tl.trace(nan_gpt(), tokens(), value_stats="exact", on_nonfinite="track")
    good = trace.save(tmp_path / "good.tl")
    cases = {
        "event kind a list": ("events.jsonl", _edit_first_event(lambda row: row.update(kind=["op"]))),
        "class a list": ("trace.json", _edit_json(lambda doc: doc.update({"class": ["Trace"]}))),
        "scope row too short": ("trace.json", _edit_json(lambda doc: doc["scopes"].__setitem__(0, ["", "X"]))),
        "meta of two fields": ("events.jsonl", _edit_first_event(lambda row: row.update(outputs=[[[1], "int64"]]))),
        "an input without label": ("events.jsonl", _edit_first_event(lambda row: row.pop("label"))),
        "a stats part null": ("events.jsonl", _edit_first_event(lambda row: row.update(stats=[None]))),
        "a finding at event True": ("trace.json", _edit_json(lambda doc: doc["findings"][0].update(event=True))),
        "nested JSON": ("trace.json", lambda data: b"[" * 100000 + b"]" * 100000),
        "an empty any": ("trace.json", _edit_json(lambda doc: doc["settings"].update(
            narration={"select": {"any": []}}))),
        "a wrong real view": ("trace.json", _edit_json(lambda doc: doc["tensors"].update(
            {"op/3/0": "view_as_real:torch.complex128"}))),
        "a superscript ordinal": ("trace.json", _edit_json(lambda doc: doc["tensors"].update(
            {"op/\u00b2/0": "left out: odd"}))),
    }
    for what, (member, change) in cases.items():
        path = _rewritten(good, tmp_path / "bad.tl", member, change)
        with pytest.raises(tl.errors.TraceFileError):
            tl.load(path)
            pytest.fail(f"{what}: loaded")
    data = bytearray((tmp_path / "good.tl").read_bytes())
    position = data.index(b"events.jsonl") + 60  # inside the deflated events
    data[position] ^= 0xFF
    (tmp_path / "flipped.tl").write_bytes(bytes(data))
    with pytest.raises(tl.errors.TraceFileError):
        tl.load(tmp_path / "flipped.tl")
    with pytest.raises(FileNotFoundError):  # a missing file is no damaged one
        tl.load(tmp_path / "missing.tl")


def test_files_of_previous_format_versions_load_and_a_later_one_is_refused_by_name(tmp_path):
    """Version 2 added a DTensor's placement and an engine op's engine, version 3 the call a repro
    replays, all optional: a version 1 or 2 file narrates as before (its `repro()` says the file
    kept no inputs: see test_saved_repro.py); a version this release does not know names the
    versions it reads."""
    trace = tl.trace(nan_gpt(), tokens(), value_stats="exact", on_nonfinite="track")
    good = trace.save(tmp_path / "good.tl")

    def as_version_1(doc):
        doc["version"] = 1
        del doc["settings"]["dtensor_stats"], doc["settings"]["narration"], doc["repro"]

    def as_version_2(doc):
        doc["version"] = 2
        del doc["repro"]

    for name, change in (("v1.tl", as_version_1), ("v2.tl", as_version_2)):
        old = tl.load(_rewritten(good, tmp_path / name, "trace.json", _edit_json(change)))
        assert old.narrate() == trace.narrate() and old.settings.dtensor_stats == "local"
    later = _rewritten(good, tmp_path / "v4.tl", "trace.json", _edit_json(lambda doc: doc.update(version=4)))
    with pytest.raises(tl.errors.TraceFileError, match="reads versions 1, 2, 3: load it with the torchlens release"):
        tl.load(later)


def test_a_tiny_archive_cannot_make_load_fill_memory(tmp_path):
    good = tl.record(tiny_gpt(), tokens()).save(tmp_path / "good.tl")
    row = zipfile.ZipFile(good).read("events.jsonl").splitlines()[2] + b"\n"
    for name, data in (("rows.tl", row * 400_000), ("empty.tl", b"{}\n" * 5_000_000)):
        path = _rewritten(good, tmp_path / name, "events.jsonl", lambda _, data=data: data, zipfile.ZIP_DEFLATED)
        assert path.stat().st_size < 1_000_000
        with pytest.raises(tl.errors.TraceFileError):
            tl.load(path)
    zeros = _rewritten(good, tmp_path / "zeros.tl", "tensors.safetensors", lambda _: b"\0" * (64 << 20),
                       zipfile.ZIP_DEFLATED)
    assert zeros.stat().st_size < 1_000_000
    with pytest.raises(tl.errors.TraceFileError, match="stored uncompressed"):
        tl.load(zeros)


def test_every_dtype_and_output_shape_comes_back_as_itself(tmp_path):
    class Odd(nn.Module):
        def forward(self, x):
            c = torch.complex(x, -x).to(torch.complex128)
            scale = x.to(torch.float8_e8m0fnu) if hasattr(torch, "float8_e8m0fnu") else x.to(torch.float16)
            point = collections.namedtuple("Point", "c scale")
            return point(c, scale), [x.to(torch.bfloat16)]

    trace = tl.trace(Odd(), torch.tensor([[1.0, 2.0]]))
    loaded = round_trip(trace, tmp_path)
    (c, scale), [half] = loaded.output
    assert c.dtype == torch.complex128 and torch.equal(c, trace.output[0].c)
    assert scale.dtype == trace.output[0].scale.dtype and torch.equal(scale.float(), trace.output[0].scale.float())
    assert half.dtype == torch.bfloat16
    assert_values_equal(trace, loaded)
    assert_same(trace, loaded)


FLOAT8 = [name for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
          if hasattr(torch, name)]


class Float8Scaled(nn.Module):
    """A linear layer fed through a per-tensor float8 scale, as float8 training computes one: the
    scale is a 0-dim tensor (here a float8 one), and the forward returns it with the output."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.dtype = dtype

    def forward(self, x):
        scale = (x.abs().amax() / 2).to(self.dtype)
        return self.fc(x / scale.float()), scale


@pytest.mark.parametrize("name", FLOAT8)
def test_a_0_dim_float8_value_loads_as_itself(name, tmp_path):
    """A dtype the tensor file has no name for (float8 e4m3fnuz, e5m2fnuz, e8m0fnu) is stored as
    its bytes and its shape, which for a 0-dim tensor (a scale) is the empty shape: loaded, the
    value is the same 0-dim tensor, bit for bit, as the kept value and as the output."""
    dtype = getattr(torch, name)
    trace = tl.trace(Float8Scaled(dtype), torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
    loaded = round_trip(trace, tmp_path)
    cast = next(event for event in trace.ops if event.outputs[0].dtype == dtype)
    [kept], [again] = trace.values[cast.ordinal], loaded.values[cast.ordinal]
    assert (again.dtype, again.shape) == (dtype, torch.Size([]))
    assert torch.equal(again.view(torch.uint8), kept.view(torch.uint8))
    scale = loaded.output[1]
    assert (scale.dtype, scale.shape) == (dtype, torch.Size([])) and scale.float() == trace.output[1].float()
    assert_values_equal(trace, loaded)
    assert_same(trace, loaded)


def test_a_failed_save_leaves_the_file_it_would_have_replaced(tmp_path, monkeypatch):
    path = tl.trace(tiny_gpt(), tokens()).save(tmp_path / "run.tl")
    before = path.read_bytes() if hasattr(path, "read_bytes") else open(path, "rb").read()
    from torchlens.archive import files

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(files, "_fresh_storage", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        tl.trace(conv_net(), images()).save(tmp_path / "run.tl")
    assert open(tmp_path / "run.tl", "rb").read() == before
    assert os.listdir(tmp_path) == ["run.tl"]


def test_a_loaded_trace_copies_pickles_and_compares_like_any_other(tmp_path):
    model, x = tiny_gpt(), tokens()
    trace = tl.trace(model, x, narrate=tl.options.NarrationOptions(
        sink=io.StringIO(), select=lambda event: event.op != "layer_norm"))
    loaded = round_trip(trace, tmp_path)
    for clone in (copy.deepcopy(loaded), pickle.loads(pickle.dumps(loaded))):
        assert clone.narrate() == trace.narrate()
    values = dict(loaded.values)
    values[5] = (None,)  # a value the file could not hold
    loaded._values = values
    report = tl.debug.compare(trace, loaded)
    row = next(row for row in report.rows if row.ordinal == 5)
    assert row.verdict == "unchecked" and report.first_divergence is None
