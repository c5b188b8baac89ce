"""The facts about a tensor's memory (`torchlens.measure.memory`), each answered by one function that eager
and compiled narration both ask, so the two agree on what an op read, wrote and shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens.measure import memory


def test_views_share_a_storage_key_and_copies_do_not():
    x = torch.randn(4, 4)
    assert memory.storage_key(x) == memory.storage_key(x.t()) == memory.storage_key(x[1:])
    assert memory.storage_key(x) != memory.storage_key(x.clone())
    assert memory.storage_ref(x).cdata == memory.storage_key(x)


def test_a_version_is_none_where_torch_keeps_no_counter():
    x = torch.zeros(2)
    before = memory.version(x)
    x.add_(1)
    assert memory.version(x) == before + 1
    with torch.inference_mode():
        assert memory.version(torch.zeros(2)) is None
    assert memory.version(None) is None


def test_versions_tell_which_tensors_were_written_since():
    a, b = torch.zeros(2), torch.zeros(2)
    versions = memory.Versions([a, b])
    b.view(2).mul_(2)  # through a view: the counter is shared
    assert versions.written() == (b,)


def test_the_tensors_of_a_value_in_order_however_nested():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert memory.tensors_of(a) == [a]
    found = memory.tensors_of(([a, [b]], {"out": c}, 1.0, None))
    assert len(found) == 3 and all(x is y for x, y in zip(found, (a, b, c)))


def test_the_elements_identity_changes_with_a_write_and_not_with_a_view():
    y = torch.randn(2, 3)
    before = memory.elements_identity(y)[1]
    assert memory.elements_identity(y.view(6))[1] == before
    y.add_(1)
    assert memory.elements_identity(y.view(6))[1] != before


class PositionalInplace(nn.Module):
    """`F.relu(h, True)`: the compiled graph records the flag positionally, a function mode gets
    `inplace=True`; both are the same write into `h`, so the second `log` reads what relu left."""

    def forward(self, x):
        h = x.log()  # -inf where x is 0
        F.relu(h, True)  # the -inf is gone: zeros
        return h.log()  # -inf born here, from relu's zeros (not carried from the first log)


def _findings(text: str) -> str:
    return text.splitlines()[-1].split("first non-finite:")[1]


def test_a_positional_inplace_flag_is_a_write_eagerly_and_compiled():
    x = torch.tensor([0.0, 0.5, 2.0, 3.0])
    options = dict(on_nonfinite="track", value_stats="exact")
    eager = tl.record(PositionalInplace(), x, **options).narrate()
    lines: list = []
    torch._dynamo.reset()
    tl.compile(PositionalInplace(), narrate=lines.append, compiler="eager", **options)(x)
    assert "born at #4 log" in _findings(eager)
    assert _findings("\n".join(lines)) == _findings(eager)
    assert [line for line in lines if line.startswith("#")] == [line for line in eager.splitlines()
                                                                 if line.startswith("#")]
