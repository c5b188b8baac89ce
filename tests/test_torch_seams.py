"""Every private torch internal torchlens relies on is in one table (`torchlens.torch_seams`): this
test fails when a torch upgrade moved one, and a seam that stops applying at run time warns once,
saying what the user loses, instead of narrating a wrong transcript in silence."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens import torch_seams


def test_every_seam_applies_on_the_installed_torch():
    broken = {name: why for name, why in torch_seams.check().items() if why is not None}
    assert broken == {}, f"torch {torch.__version__} moved what these rely on: {broken}"


def test_each_row_says_what_is_patched_where_and_what_is_lost():
    names = [seam.name for seam in torch_seams.SEAMS]
    assert len(names) == len(set(names))
    for seam in torch_seams.SEAMS:
        assert seam.relies_on and seam.where and seam.lost, seam


def test_the_dynamo_rules_are_applied_once_a_capture_meets_dynamo():
    """Applies is not enough: the patches must be in place after a capture ran around compiled code."""
    from torch._dynamo import output_graph, utils
    from torch._dynamo.variables import torch_function
    from torch._dynamo.variables.tensor import TensorVariable

    inner = torch.compile(nn.Linear(2, 2), backend="eager")
    tl.record(nn.Sequential(inner), torch.randn(1, 2))
    tl.compile(nn.Linear(2, 2), compiler="eager")(torch.randn(1, 2))
    assert getattr(torch_function.SymbolicTorchFunctionState.__init__, "torchlens_rule", False)
    assert getattr(utils.set_torch_function_mode_stack, "torchlens_rule", False)
    assert getattr(output_graph.OutputGraph.call_user_compiler, "torchlens_rule", False)
    assert TensorVariable.__dict__["call_method"].__name__ == "marking"


def test_a_probe_notices_a_moved_internal(monkeypatch):
    from torch._dynamo.variables import torch as torch_variables

    monkeypatch.delattr(torch_variables.TorchInGraphFunctionVariable, "_get_handlers")
    assert torch_seams.check()["fast-path handlers"] == "TorchInGraphFunctionVariable has no _get_handlers"


def test_a_seam_that_stops_applying_warns_once_with_what_is_lost(monkeypatch):
    """The fast-path handlers dynamo keeps cannot be read: narration goes on, and says once what is lost."""
    from torch._dynamo.variables import torch as torch_variables

    monkeypatch.setattr(torch_seams, "_warned", set())

    def moved(*args, **kwargs):
        raise AttributeError("moved in this torch")

    monkeypatch.setattr(torch_variables.TorchInGraphFunctionVariable, "_get_handlers", moved)
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).eval()
    x = torch.randn(1, 3, 8)
    with pytest.warns(tl.errors.NarrationWarning) as caught:
        with torch.no_grad():
            recording = tl.record(model, x)
    messages = [str(w.message) for w in caught if "not shaped as this torchlens expects" in str(w.message)]
    assert len(messages) == 1, messages
    assert "_get_handlers" in messages[0] and "breaks its graph at every fast-path check" in messages[0]
    with torch.no_grad():
        assert torch.equal(recording.output, model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tl.errors.NarrationWarning)
        with torch.no_grad():
            tl.record(model, x)  # said once per process
