"""The public API stays small and explicit: every public module says what it exports."""

import importlib

import pytest
import torch
from torch import nn

import torchlens as tl

PUBLIC_MODULES = ["torchlens", "torchlens.options", "torchlens.errors", "torchlens.recording", "torchlens.debug"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_module_declares_what_it_exports(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name} has no __all__"
    missing = [item for item in exported if not hasattr(module, item)]
    assert missing == []


def test_star_imports_bring_no_implementation_details():
    namespace = {}
    exec("from torchlens.options import *", namespace)
    assert "os" not in namespace and "make_settings" not in namespace and "NarrationOptions" in namespace
    namespace = {}
    exec("from torchlens.errors import *", namespace)
    assert "suggest" not in namespace and "warnings" not in namespace and "NonFiniteError" in namespace


def test_compile_is_public_but_not_star_exported():
    assert callable(tl.compile) and "compile" not in tl.__all__


def test_a_compiled_model_offers_its_narration_not_its_runtime():
    import copy

    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    compiled = tl.compile(model, compiler="eager")
    torch._dynamo.reset()
    try:
        assert compiled.torchlens.last_recording is None and compiled.torchlens.forwards == 0
        compiled(torch.randn(2, 3))
        compiled(torch.randn(2, 3))
    finally:
        torch._dynamo.reset()
    handle = compiled.torchlens
    assert handle.forwards == 2 and isinstance(handle.last_recording, tl.Recording)
    assert repr(handle) == "CompiledNarration(forwards=2, last_recording=Recording)"
    assert not hasattr(handle, "config") and not hasattr(handle, "scopes")  # no runtime internals
    with pytest.raises(AttributeError):
        handle.last_recording = None
    assert getattr(copy.deepcopy(compiled), "torchlens", None) is None  # a copy carries no narration state


def test_every_entry_point_takes_exactly_the_keywords_of_the_one_keyword_table():
    """`tl.record`, `tl.trace`, `Recorder` and `tl.compile` take the keywords the table in
    `torchlens.options` lists for them, no more and no fewer, so a keyword added to one entry
    point without the table (and its check) fails here."""
    import inspect

    from torchlens.options import COMPILE, RECORD, RECORDER, TRACE, keywords_of

    def named_keywords(fn, skip=()):
        parameters = inspect.signature(fn).parameters.values()
        return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in skip}

    assert named_keywords(tl.record) == set(keywords_of(RECORD))
    assert named_keywords(tl.trace, skip=("compiled",)) == set(keywords_of(TRACE))
    assert named_keywords(tl.recording.Recorder.__init__) == set(keywords_of(RECORDER))
    assert named_keywords(tl.compile) == set(keywords_of(COMPILE))
    from torchlens.fx_backend.config import OPTION_KEYS

    assert set(OPTION_KEYS) == set(keywords_of(COMPILE))  # the string backend's options= keys


@pytest.mark.parametrize("keyword,bad", [("value_stats", "exakt"), ("on_nonfinite", "trak"), ("narrate", 3.5)])
def test_a_shared_keyword_is_checked_alike_by_every_entry_point(keyword, bad):
    model = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    messages = set()
    for call in (lambda: tl.record(model, x, **{keyword: bad}),
                 lambda: tl.trace(model, x, **{keyword: bad}),
                 lambda: tl.recording.Recorder(model, **{keyword: bad}),
                 lambda: tl.compile(model, **{keyword: bad})):
        with pytest.raises((tl.errors.OptionTypeError, tl.errors.OptionValueError)) as info:
            call()
        messages.add(str(info.value))
    assert len(messages) == 1, messages
