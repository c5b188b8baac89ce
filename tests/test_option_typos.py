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


@pytest.mark.parametrize("name, value, fix", [
    ("sites", True, "narrate=tl.options.NarrationOptions(sites=True)"),
    ("depth", 1, "narrate=tl.options.NarrationOptions(depth=1)"),
    ("max_lines", 5, "narrate=tl.options.NarrationOptions(max_lines=5)"),
    ("select", tl.in_module("model.layers.0"), "narrate=tl.options.NarrationOptions(select="),
    ("keep_on_cpu", True, "tl.trace(..., keep_on_cpu=True)"),
    ("tail", 10, "tl.recording.Recorder(..., tail=10)"),
])
def test_a_torchlens_option_in_the_wrong_place_is_refused_with_its_fix_not_handed_to_llama(name, value, fix):
    """A correct option name in the wrong place is the likelier mistake than a misspelling, and a
    Llama's forward takes **kwargs: before, it received `sites=True` and narrated no site."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config).eval()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(tl.errors.OptionTypeError) as raised:
        tl.record(model, torch.tensor([[1, 2, 3]]), narrate=io.StringIO(), **{name: value})
    assert fix in str(raised.value) and "LlamaForCausalLM.forward takes **kwargs" in str(raised.value)
    assert calls == []  # refused before the forward ran


def test_a_trace_keyword_given_to_record_names_trace_even_when_the_forward_takes_no_kwargs():
    with pytest.raises(tl.errors.OptionTypeError, match=r"an option of tl\.trace, not of tl\.record"):
        tl.record(nn.Linear(2, 2), torch.ones(1, 2), max_bytes=1024)


@pytest.mark.parametrize("compile_it", [
    lambda model: tl.compile(model, sites=True, compiler="eager"),
    lambda model: torch.compile(model, backend="torchlens", options={"sites": True})(torch.ones(1, 2)),
])
def test_a_narration_option_given_to_a_compiled_entry_names_its_place(compile_it):
    with pytest.raises(Exception) as raised:
        compile_it(nn.Linear(2, 2))
    assert "narrate=tl.options.NarrationOptions(sites=True)" in str(raised.value)
