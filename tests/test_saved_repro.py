"""A saved trace keeps its repro: `tl.load(path).repro(directory)` writes the script the live
recording's `repro()` writes, from the inputs saved with the trace (within `max_repro_bytes`), and
run alone it reproduces the NaN or the exception; past the bound, or from a file saved before, the
loaded trace's `repro()` says why it cannot, and a crafted call is refused as data."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import torchlens as tl

transformers = pytest.importorskip("transformers")


def gpt2(nan_weight: bool = False):
    """A transformers GPT-2 from a small config (nothing downloads), with a NaN in one MLP weight."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    if nan_weight:
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight[3, 5] = float("nan")
    return model


IDS = torch.tensor([[5, 17, 42, 8, 99, 3]])


def run(command, cwd):
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=cwd)
    return done.returncode, done.stdout + done.stderr


def nan_run():
    return tl.record(gpt2(nan_weight=True), IDS, on_nonfinite="track")


def crashed_run():
    with pytest.raises(IndexError) as info:
        tl.record(gpt2(), torch.tensor([[5, 17, 100]]))  # a token id past the vocabulary
    return info.value.partial_trace


class Roots(torch.nn.Module):
    """A square root of a transposed view, its exponent by keyword: a NaN born from an input
    whose strides are not its shape's."""

    def forward(self, x):
        return torch.pow(x.t(), exponent=0.5) * 2


def strided_run():
    return tl.record(Roots(), torch.tensor([[1.0, -4.0, 9.0], [16.0, 25.0, -36.0]]), on_nonfinite="track")


@pytest.mark.parametrize("make", [nan_run, crashed_run, strided_run], ids=["nan", "crash", "strided"])
def test_the_loaded_trace_writes_the_live_repro(make, tmp_path):
    """The same script, byte for byte, and the same inputs: the function, the arguments, each
    tensor's values, device, strides and place in the graph, the grad mode, the expectation."""
    live = make()
    loaded = tl.load(live.save(tmp_path / "run.tl"))
    mine, theirs = live.repro(tmp_path / "live"), loaded.repro(tmp_path / "loaded")
    assert theirs.read_text() == mine.read_text()
    expected = torch.load(mine.parent / "inputs.pt", weights_only=True)
    got = torch.load(theirs.parent / "inputs.pt", weights_only=True)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].nan_to_num(), tensor.nan_to_num())
        assert torch.equal(got[name].isnan(), tensor.isnan())


LOAD_AND_WRITE = textwrap.dedent('''
    import sys
    import torchlens as tl
    print(tl.load(sys.argv[1]).repro(sys.argv[2]))
''')


@pytest.mark.slow
@pytest.mark.parametrize("make, shows", [(nan_run, "output: nan="), (crashed_run, "raised: IndexError")],
                         ids=["nan", "crash"])
def test_a_trace_loaded_in_another_process_writes_a_repro_that_reproduces(make, shows, tmp_path):
    path = make().save(tmp_path / "run.tl")
    (tmp_path / "load.py").write_text(LOAD_AND_WRITE)
    code, out = run([sys.executable, "load.py", str(path), str(tmp_path / "repro")], tmp_path)
    assert code == 0, out
    code, out = run([sys.executable, "repro.py"], tmp_path / "repro")  # plain torch, alone
    assert code == 0, out
    assert shows in out and "reproduced" in out


def test_inputs_over_the_bound_are_left_out_and_the_loaded_repro_says_how_to_keep_them(tmp_path):
    live = nan_run()
    first = live.first_nonfinite
    size = sum(t.numel() * t.element_size() for t in live.kept_calls[first.ordinal].tensors())
    loaded = tl.load(live.save(tmp_path / "small.tl", max_repro_bytes=size - 1))
    with pytest.raises(tl.errors.ReproError, match=rf"over the {size - 1}-byte bound .*max_repro_bytes={size}"):
        loaded.repro(tmp_path / "repro")
    assert "repro/0" not in _members(tmp_path / "small.tl")["tensors"]
    again = tl.load(live.save(tmp_path / "whole.tl", max_repro_bytes=size))
    assert again.repro(tmp_path / "whole").exists()
    with pytest.raises(tl.errors.OptionTypeError, match="max_repro_bytes"):
        live.save(tmp_path / "bad.tl", max_repro_bytes="64MB")


def test_a_crashed_run_over_the_bound_says_so_too(tmp_path):
    loaded = tl.load(crashed_run().save(tmp_path / "run.tl", max_repro_bytes=0))
    with pytest.raises(tl.errors.ReproError, match="max_repro_bytes="):
        loaded.repro(tmp_path / "repro")


def _members(path) -> dict:
    """The tensor file's names and the manifest of a saved trace."""
    archive = zipfile.ZipFile(path)
    header_size = int.from_bytes(archive.read("tensors.safetensors")[:8], "little")
    header = json.loads(archive.read("tensors.safetensors")[8:8 + header_size])
    return {"tensors": set(header) - {"__metadata__"}, "manifest": json.loads(archive.read("trace.json"))}


def _rewritten(good, path, change):
    parts = {name: zipfile.ZipFile(good).read(name) for name in zipfile.ZipFile(good).namelist()}
    doc = json.loads(parts["trace.json"])
    change(doc)
    parts["trace.json"] = json.dumps(doc).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in parts.items():
            archive.writestr(name, data)
    return path


def test_a_trace_saved_before_repros_were_kept_says_so(tmp_path):
    good = nan_run().save(tmp_path / "good.tl")

    def as_version_2(doc):
        doc["version"] = 2
        del doc["repro"]

    old = tl.load(_rewritten(good, tmp_path / "v2.tl", as_version_2))
    with pytest.raises(tl.errors.ReproError, match="format version 2, which kept no inputs"):
        old.repro(tmp_path / "repro")


@pytest.mark.parametrize("change, what", [
    (lambda call: call.update(function="os.system"), "not a torch function"),
    (lambda call: call.update(function="torch.nn.functional.linear; import os"), "not a torch function"),
    (lambda call: call["args"]["tuple"].append({"pickle": "x"}), "argument"),
    (lambda call: call["args"]["tuple"].append({"tensor": 99}), "argument"),
    (lambda call: call["tensors"][0].update(stride="[1]"), "strides"),
    (lambda call: call["context"].update(autocast=["cuda", "not_a_dtype"]), "autocast"),
    (lambda call: call.update(ordinal=9999, **{"for": "attempt"}), "attempted op"),
], ids=["module", "code", "kind", "index", "stride", "autocast", "ordinal"])
def test_a_crafted_repro_call_is_refused_as_data(change, what, tmp_path):
    good = nan_run().save(tmp_path / "good.tl")
    crafted = _rewritten(good, tmp_path / "crafted.tl", lambda doc: change(doc["repro"]))
    with pytest.raises(tl.errors.TraceFileError, match=what):
        tl.load(crafted)
