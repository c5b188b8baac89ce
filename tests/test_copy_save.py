"""torchlens never changes what a user can do with their model: copy it, save it, load it, after
it was compiled with the torchlens backend or traced; and recordings copy and pickle themselves."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from models import tiny_gpt, tokens

import torchlens as tl


def saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_model_compiled_with_torchlens_copies_and_saves_as_before():
    model, x = tiny_gpt(), tokens()
    compiled = tl.compile(model, compiler="eager", value_stats="exact", on_nonfinite="track")
    with torch.no_grad():
        out = compiled(x)
    assert compiled.torchlens.last_recording is not None
    assert "torchlens" not in vars(model)  # nothing of ours on the user's module
    for clone in (copy.deepcopy(model), saved_and_loaded(model)):
        with torch.no_grad():
            assert torch.equal(clone(x), out)
    copy.deepcopy(compiled)
    saved_and_loaded(compiled)


def test_a_model_traced_compiled_copies_and_saves():
    model, x = tiny_gpt(), tokens()
    tl.trace(model, x, compiled={"compiler": "eager"})
    assert not [name for name in vars(model) if "torchlens" in name]
    copy.deepcopy(model)
    saved_and_loaded(model)


@pytest.mark.parametrize("kind", ["record", "trace", "partial"])
def test_recordings_deep_copy_and_pickle_and_narrate_the_same(kind):
    model, x = tiny_gpt(), tokens()
    options = dict(value_stats="exact", on_nonfinite="track")
    if kind == "record":
        recording = tl.record(model, x, **options)  # its output is part of an autograd graph
    elif kind == "trace":
        recording = tl.trace(model, x, **options)
    else:
        with pytest.raises(IndexError) as info:
            tl.record(model, torch.full((1, 40), 3), **options)  # longer than the model's context
        recording = info.value.partial_trace
    text = recording.narrate()
    for clone in (copy.deepcopy(recording), pickle.loads(pickle.dumps(recording))):
        assert type(clone) is type(recording)
        assert clone.narrate() == text
        assert [f.text for f in clone.findings] == [f.text for f in recording.findings]
    if kind == "trace":
        assert torch.equal(copy.deepcopy(recording).value(2), recording.value(2))


def test_a_real_model_compiled_copies_and_saves():
    pytest.importorskip("transformers")
    from real_models import REAL_MODELS

    model, args, kwargs = REAL_MODELS["distilbert"].build()
    with torch.no_grad():
        tl.compile(model, compiler="eager")(*args, **kwargs)
        expected = model(*args, **kwargs)
        for clone in (copy.deepcopy(model), saved_and_loaded(model)):
            assert torch.equal(clone(*args, **kwargs)[0], expected[0])
