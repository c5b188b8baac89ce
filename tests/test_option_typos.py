"""A misspelt torchlens option is never swallowed by a forward that takes **kwargs."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import torchlens as tl


class TakesAnything(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.seen = {}

    def forward(self, x, **kwargs):
        self.seen = dict(kwargs)
        return self.fc(x)


@pytest.mark.parametrize("entry", [tl.record, tl.trace])
@pytest.mark.parametrize("typo, meant", [("value_stat", "value_stats"), ("narate", "narrate"),
                                         ("on_nonfinit", "on_nonfinite"), ("valuestats", "value_stats")])
def test_a_near_miss_of_an_option_is_refused_when_the_forward_takes_kwargs(entry, typo, meant):
    model = TakesAnything()
    with pytest.raises(tl.errors.OptionTypeError, match=rf"got '{typo}': did you mean the torchlens option '{meant}'"):
        entry(model, torch.ones(1, 2), **{typo: "exact"})
    assert model.seen == {}  # refused before the forward ran


def test_ordinary_forward_keywords_still_pass_through():
    model = TakesAnything()
    tl.record(model, torch.ones(1, 2), attention_mask=None, output_hidden_states=True, value_stats="exact")
    assert model.seen == {"attention_mask": None, "output_hidden_states": True}


def test_a_forward_that_names_the_keyword_gets_it():
    class Named(nn.Module):
        def forward(self, x, value_stat=None):
            return x * (2 if value_stat == "double" else 1)

    assert torch.equal(tl.record(Named(), torch.ones(2), value_stat="double").output, torch.full((2,), 2.0))


def test_the_documented_way_through_for_a_forward_that_really_wants_it():
    model = TakesAnything()
    sink = io.StringIO()
    with tl.recording.Recorder(model, narrate=tl.options.NarrationOptions(sink=sink), value_stats="exact"):
        model(torch.ones(1, 2), value_stat="mine")
    assert model.seen == {"value_stat": "mine"} and " linear " in sink.getvalue()


def test_a_real_transformers_model_refuses_a_typo():
    pytest.importorskip("transformers")
    from real_models import REAL_MODELS

    model, args, kwargs = REAL_MODELS["qwen2"].build()
    with pytest.raises(tl.errors.OptionTypeError, match="'value_stats'"):
        tl.record(model, *args, value_stat="exact", **kwargs)
