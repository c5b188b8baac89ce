"""An integer input of a failed call shows what it held: a token id past the embedding, labels that
are all the ignored index. Read only once the forward has failed (a healthy or recovered run reads
nothing), never where torch may still be writing it, and a read that fails says so without
touching the user's exception: in the crash tail, the exception's note, `exc.partial_trace`, the
HTML page, a saved trace and the one-op repro's printout, eager and compiled."""

from __future__ import annotations

import io
import json
import runpy

import pytest
import torch
import torch.distributed as dist
from helpers import count_host_syncs
from real_models import _transformers
from torch import nn

import torchlens as tl
from torchlens.measure.integer_values import Values

VOCAB = 99


def tiny_llama():
    t = _transformers()
    torch.manual_seed(0)
    config = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return t.LlamaForCausalLM(config).eval()


def tiny_gpt2():
    t = _transformers()
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()


def failed(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


IDS = torch.tensor([[5, 17, 200]])  # 200: past the 99-row embedding
SHOWN = "inputs: [1,3] i64 cpu (min=5 max=200), [99,32] f32 cpu  (not proven culprit)"


def test_a_token_id_past_a_llamas_embedding_is_shown_in_the_tail_the_note_and_the_partial_trace():
    pytest.importorskip("transformers")
    model, sink = tiny_llama(), io.StringIO()
    exc = failed(lambda: tl.record(model, IDS, narrate=sink))
    assert isinstance(exc, IndexError) and str(exc) == "index out of range in self"
    attempted = sink.getvalue().splitlines()[-1]
    assert attempted.startswith("!! attempted #2 embedding @model.embed_tokens") and attempted.endswith(SHOWN)
    assert exc.__notes__[0].splitlines()[0].endswith(SHOWN)
    partial = exc.partial_trace
    assert partial.attempt.values == (Values(5, 200), None)
    assert partial.narrate(last=1).splitlines()[-1] == attempted


def test_the_html_page_and_a_saved_trace_of_the_failure_keep_the_values(tmp_path):
    pytest.importorskip("transformers")
    partial = failed(lambda: tl.record(tiny_gpt2(), IDS)).partial_trace
    page = open(partial.to_html(tmp_path / "page.html"), encoding="utf-8").read()
    assert json.dumps("inputs [1,3] i64 cpu (min=5 max=200), [99,32] f32 cpu")[1:-1] in page
    loaded = tl.load(partial.save(tmp_path / "failed.tl"))
    assert loaded.attempt.values == partial.attempt.values == (Values(5, 200), None)
    assert loaded.narrate() == partial.narrate() and "(min=5 max=200)" in loaded.narrate()


@pytest.mark.parametrize("live", [False, True], ids=["replayed", "live"])
def test_a_compiled_failure_shows_the_ids_its_located_op_was_given(live):
    """Located by replaying the graph, the values are the replay's inputs to the op; live, the
    graph frame's own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 4))
    compiled = tl.compile(model, compiler="eager", live=live)
    compiled(torch.tensor([[1, 2, 3]]))
    exc = failed(lambda: compiled(IDS))
    attempted = exc.partial_trace.narrate(last=1).splitlines()[-1]
    assert attempted.startswith("!! attempted #2 embedding @0") and attempted.endswith(SHOWN), attempted


def test_labels_that_are_all_ignored_are_shown_by_the_repro_of_the_nan_they_make(tmp_path, capsys):
    """GPT-2's loss over labels that are all -100 is 0/0: the repro of that NaN prints the labels."""
    pytest.importorskip("transformers")
    recording = tl.record(tiny_gpt2(), torch.tensor([[5, 6, 7, 8]]), labels=torch.full((1, 4), -100),
                          on_nonfinite="track")
    assert recording.findings[0].text.startswith("NaN born at ") and recording.first_nonfinite.op == "cross_entropy"
    script = runpy.run_path(str(recording.repro(tmp_path)), run_name="repro")
    assert script["main"]() == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "inputs: t0 [4, 99] torch.float32 finite, t1 [4] torch.int64 min=-100 max=-100"


class CatchesAndFallsBack(nn.Module):
    """Looks ids up, and on an out-of-range one falls back to a zero embedding: a forward that goes on."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)

    def forward(self, ids):
        try:
            return self.embed(ids)
        except IndexError:
            return torch.zeros(*ids.shape, 8)


def test_a_failed_call_the_model_recovers_from_reads_nothing(monkeypatch):
    """Values are read by `Tensor.tolist` (counted here, as torchlens's own work is invisible to
    torch function modes); a forward that fails reads them, one that recovers does not."""
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _read=original, _name=name: reads.append(_name) or
                            _read(self))
    with count_host_syncs() as counted:
        tl.record(CatchesAndFallsBack(), IDS, narrate=lambda line: None)
    assert counted == [] and reads == []
    failed(lambda: tl.record(nn.Embedding(VOCAB, 8), IDS, narrate=lambda line: None))
    assert reads, "the failure's values were read some other way: this test would not see a read"


def test_a_read_that_fails_says_so_and_leaves_the_users_exception_as_it_was(monkeypatch):
    """As on a device that cannot run one more kernel after a fault."""
    model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 4))
    plain = failed(lambda: model(IDS))

    def unreadable(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "aminmax", unreadable)
    exc = failed(lambda: tl.record(model, IDS))
    assert type(exc) is type(plain) and str(exc) == str(plain)
    assert "inputs: [1,3] i64 cpu (values not read: RuntimeError reading them), [99,32] f32 cpu" in exc.__notes__[0]


class ReducesThenLooksUp(nn.Module):
    """Sums ids across ranks asynchronously and looks them up without waiting on the reduction."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)

    def forward(self, ids):
        ids = ids.clone()
        dist.all_reduce(ids, async_op=True)
        return self.embed(ids)


@pytest.mark.parametrize("options", [{}, {"on_nonfinite": "track"}], ids=["metadata", "tracked"])
def test_an_asynchronous_collectives_output_is_not_read(group_of_one, options):
    exc = failed(lambda: tl.record(ReducesThenLooksUp(), IDS, **options))
    assert ("inputs: [1,3] i64 cpu (values not read: an asynchronous collective's output, perhaps still in "
            "flight), [99,8] f32 cpu") in exc.__notes__[0]


class Adds(nn.Module):
    def forward(self, a, b):
        return torch.add(a, b)


def test_values_are_the_exact_integers_at_any_width():
    """A uint64 past 2**63 and an int8: shapes that do not broadcast, and what each held."""
    big = torch.tensor([2**63 + 5, 7], dtype=torch.uint64)
    small = torch.tensor([-3, 100, 4], dtype=torch.int8)
    exc = failed(lambda: tl.record(Adds(), big, small))
    assert exc.partial_trace.attempt.values == (Values(7, 2**63 + 5), Values(-3, 100))
    assert "inputs: [2] u64 cpu (min=7 max=9223372036854775813), [3] i8 cpu (min=-3 max=100)" in exc.__notes__[0]


class SelectsWithUnwrittenIndices(nn.Module):
    """Indices from `torch.empty`, never written: index_select refuses their shape."""

    def forward(self, x):
        return torch.index_select(x, 0, torch.empty(2, 2, dtype=torch.long))


def test_memory_that_holds_no_values_yet_is_not_read_where_the_pass_follows_it():
    exc = failed(lambda: tl.record(SelectsWithUnwrittenIndices(), torch.zeros(3, 2), on_nonfinite="track"))
    assert "inputs: [3,2] f32 cpu, [2,2] i64 cpu (values not read: uninitialized)  (not proven culprit)" in \
        exc.__notes__[0]
