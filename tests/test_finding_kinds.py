"""Each finding says which verdict rule made it (`finding.kind`), so that the footer, saved traces
and tools built on recordings never read a finding's text back to tell what it is."""

from __future__ import annotations

import json
import re
import zipfile

import pytest
import torch
from torch import nn

import torchlens as tl

K = tl.FindingKind


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fn(self, x)


CASES = {
    "NaN born": (lambda m, x: torch.log(x - 5), [K.NAN_BORN]),
    "NaN written by a scalar": (lambda m, x: x * float("nan"), [K.NAN_WRITTEN]),
    "infinity born, then NaN": (lambda m, x: torch.exp(x * 1000) - torch.exp(x * 1000), [K.INF_BORN, K.NAN_BORN]),
    "infinity reaching the output": (lambda m, x: torch.exp(x * 1000), [K.INF_BORN, K.REACHES_OUTPUT]),
    "a NaN weight": (lambda m, x: m.fc(x), [K.NONFINITE_SOURCE]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_forward_rule_names_its_kind(name):
    fn, kinds = CASES[name]
    model = Lambda(fn)
    if name == "a NaN weight":
        with torch.no_grad():
            model.fc.weight[0, 0] = float("nan")
    recording = tl.record(model, torch.rand(2, 3) + 0.5, on_nonfinite="track")
    assert [f.kind for f in recording.findings] == kinds, [f.text for f in recording.findings]
    assert [f.birth for f in recording.findings] == [k.birth for k in kinds]


def test_a_nan_input_and_a_nan_first_seen_after_unmeasured_ops_have_their_kinds():
    recording = tl.record(Lambda(lambda m, x: x + 1), torch.tensor([float("nan"), 1.0, 2.0]), on_nonfinite="track")
    assert [f.kind for f in recording.findings] == [K.NONFINITE_INPUT]
    sparse = tl.record(Lambda(lambda m, x: (x.to_sparse() * float("nan")).to_dense()), torch.ones(3),
                       on_nonfinite="track")  # sparse ops are not measured
    assert [f.kind for f in sparse.findings] == [K.FIRST_SEEN], [f.text for f in sparse.findings]


def test_the_footer_names_the_nan_birth_by_its_kind_after_an_earlier_finding():
    """`first non-finite: <first>; then <the NaN birth>`: the birth is found by kind, whatever its
    text begins with."""
    def fn(m, x):
        y = x * float("nan")  # NaN written by a scalar (a birth of another kind)
        return y, torch.log(x - 5)  # and a NaN born, later

    lines = []
    recording = tl.record(Lambda(fn), torch.rand(2, 3), on_nonfinite="track", narrate=lines.append)
    assert [f.kind for f in recording.findings] == [K.NAN_WRITTEN, K.NAN_BORN]
    assert lines[-1].endswith(f"first non-finite: {recording.findings[0].text}; then {recording.findings[1].text}")
    recording.findings[1].text = "reworded: " + recording.findings[1].text
    from torchlens.measure.tracking import Tracker

    tracker = Tracker(dict)
    tracker.findings = list(recording.findings)
    assert "; then reworded: NaN born" in tracker.summary()


def test_backward_rules_name_their_kinds():
    model = nn.Linear(3, 3)
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        (model(torch.randn(2, 3)).sum() * float("nan")).backward()
    [backward] = rec.recordings[0].backward
    assert [f.kind for f in backward.findings] == [K.GRADIENT_FROM_OUTSIDE]

    class SqrtOfZero(nn.Module):
        def forward(self, x):
            return torch.sqrt(x * 0).sum()

    model = SqrtOfZero()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(2, 3, requires_grad=True)).backward()
    [backward] = rec.recordings[0].backward
    assert [f.kind for f in backward.findings] == [K.GRADIENT_BORN], [f.text for f in backward.findings]


def test_a_saved_trace_keeps_each_findings_kind_and_an_older_file_loads_without_one(tmp_path):
    fn, kinds = CASES["infinity born, then NaN"]
    trace = tl.trace(Lambda(fn), torch.rand(2, 3) + 0.5, on_nonfinite="track")
    path = tmp_path / "run.tl"
    trace.save(path)
    assert [f.kind for f in tl.load(path).findings] == kinds
    older = tmp_path / "older.tl"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(older, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.endswith(".json"):
                doc = json.loads(data)
                for row in _finding_rows(doc):
                    row.pop("kind")
                data = json.dumps(doc).encode()
            target.writestr(item, data)
    loaded = tl.load(older).findings
    assert [f.kind for f in loaded] == [None, None] and [f.birth for f in loaded] == [True, True]


def _finding_rows(doc):
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "findings" and isinstance(value, list):
                yield from value
            else:
                yield from _finding_rows(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from _finding_rows(value)


def _llama_with_a_nan_embedding_row():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[7, :3] = float("nan")
    return model, torch.tensor([[3, 7, 9]])


def test_a_finding_names_its_op_module_and_source_as_fields_and_a_recording_its_verdict(tmp_path):
    """Scripts read a finding by its fields, not by parsing `.text`; the recording's verdict is a
    named attribute (the demo read it as `footer_extra[-1]`), and both survive save and load."""
    model, ids = _llama_with_a_nan_embedding_row()
    recording = tl.record(model, ids, on_nonfinite="track")
    first = recording.findings[0]
    assert (first.kind, first.op, first.module, first.source) == (
        K.NONFINITE_SOURCE, "embedding", "model.embed_tokens", "model.embed_tokens.weight")
    assert first.ordinal == recording.first_nonfinite.ordinal
    assert recording.verdict.startswith("first non-finite: NaN in model.embed_tokens.weight (nan=3)")
    assert repr(recording).startswith("<Recording: ") and f"1 finding, the first: {first.text}" in repr(recording)
    healthy = tl.record(model, torch.tensor([[3, 9]]), on_nonfinite="track")
    assert healthy.verdict == "no non-finite values" and healthy.findings == ()
    assert tl.record(model, ids).verdict is None  # no tracking, no verdict
    loaded = tl.load(recording.save(tmp_path / "run.tl"))
    assert loaded.verdict == recording.verdict
    assert [(f.kind, f.op, f.module, f.source) for f in loaded.findings] == [
        (f.kind, f.op, f.module, f.source) for f in recording.findings]


def test_a_nan_input_is_the_findings_source():
    recording = tl.record(nn.Linear(3, 3), torch.tensor([[1.0, float("nan"), 0.0]]), on_nonfinite="track")
    assert [(f.kind, f.source) for f in recording.findings] == [(K.NONFINITE_INPUT, "input")]


def test_reprs_say_what_a_run_did_at_a_glance():
    model, ids = _llama_with_a_nan_embedding_row()
    assert re.fullmatch(r"<Trace: 1 input, \d+ ops, \d+ module calls; values kept: [\d.]+ KiB>", repr(tl.trace(model, ids)))
    with pytest.raises(IndexError) as raised:
        tl.record(model, torch.tensor([[3, 200]]))
    assert repr(raised.value.partial_trace).startswith(
        "<PartialTrace: failed in #2 embedding @model.embed_tokens (IndexError: index out of range in self); ")


def test_a_backward_finding_reads_as_its_node_and_a_run_counts_as_its_footer_does():
    class SqrtAtZero(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x).relu().sqrt().sum()

    model = SqrtAtZero()
    with torch.no_grad():
        model.fc.bias.fill_(-10.0)
    recording = tl.record(model, torch.zeros(1, 3), on_nonfinite="track", backward=True)
    recording.output.backward()
    [finding] = recording.backward[0].findings
    assert repr(finding).startswith(f"<Finding GRADIENT_BORN at ~{finding.ordinal} ")
    assert repr(recording).startswith("<Recording: 1 input, 4 ops, 1 module call; ")
