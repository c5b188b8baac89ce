"""A backward NaN made of a forward NaN is that NaN's consequence, never a birth: a node that
received finite gradients but computes with what its forward op read or produced (what autograd
saved for it) is named with the forward's value, in its finding, the footer and the page; a
gradient reaching an output that held NaN is the output's. A node whose forward read and produced
finite values is still where its NaN was born."""

from __future__ import annotations

import io
import json
import re
import tempfile

import pytest
import torch
import torch.nn.functional as F
from real_models import _transformers
from torch import nn

import torchlens as tl

K = tl.FindingKind
VOCAB = 99
IDS = torch.tensor([[5, 17, 23, 42, 8, 61]])


def llama():
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def qwen2():
    t = _transformers()
    return t.Qwen2ForCausalLM(t.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def bert():
    t = _transformers()
    return t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=64))


def gpt2():
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4))


def with_nan_embedding(build):
    """The model `build` makes (seeded), a NaN in row 17 of its input embedding: every token 17 reads it."""
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[17, 3] = float("nan")
    return model, model.get_input_embeddings()


def embedding_name(model, embedding) -> str:
    return next(name for name, p in model.named_parameters() if p is embedding.weight)


@pytest.mark.parametrize("build", [llama, qwen2, bert], ids=lambda b: b.__name__)
def test_a_nan_embeddings_loss_gradient_is_its_consequence_not_a_birth(build):
    """The model's own loss (`labels=`): its cross_entropy read the NaN, and its backward, given a
    finite gradient, multiplies by the NaN it saved."""
    pytest.importorskip("transformers")
    model, embedding = with_nan_embedding(build)
    weight = embedding_name(model, embedding)
    sink = io.StringIO()
    with tl.recording.Recorder(model, narrate=sink, backward=True, on_nonfinite="track") as rec:
        model(IDS, labels=IDS).loss.backward()
    [recording] = rec.recordings
    assert [f.kind for f in recording.findings] == [K.NONFINITE_SOURCE]
    assert recording.findings[0].text.startswith(f"NaN in {weight} (nan=1), first read by ")
    [backward] = recording.backward
    [finding] = backward.findings
    assert finding.kind is K.GRADIENT_FROM_FORWARD and not finding.birth and finding.consequence
    loss = finding.event.forward  # `#153 cross_entropy`, with its module where the model has one
    assert loss.startswith("#") and loss.split()[1] == "cross_entropy"
    assert re.fullmatch(rf"NaN gradient at ~\d+ \w+Backward0, the backward of {re.escape(loss)} \(nan=\d+\), out of "
                        rf"the forward's NaN: {re.escape(loss)} read NaN from {re.escape(weight)}", finding.text), \
        finding.text
    assert backward.footer_extra[-1].startswith(f"first non-finite gradient: {finding.text}; non-finite gradients "
                                                f"reached ")
    transcript = sink.getvalue().split("-- backward of pass 1\n")[1]
    assert f"!! {finding.text}\n" in transcript and " born " not in transcript


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_loss_computed_outside_from_nan_logits_sends_a_gradient_the_output_explains(compiled):
    """The gradient reaching an output that held NaN is the output's, not the loss's own."""
    pytest.importorskip("transformers")
    model, embedding = with_nan_embedding(gpt2)
    weight = embedding_name(model, embedding)
    if compiled:
        run = tl.compile(model, compiler="eager", backward=True, on_nonfinite="track")
        F.cross_entropy(run(IDS).logits[0], IDS[0]).backward()
        recording = run.torchlens.last_recording
    else:
        with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
            F.cross_entropy(model(IDS).logits[0], IDS[0]).backward()
        [recording] = rec.recordings
    [finding] = recording.backward[0].findings
    assert finding.kind is K.GRADIENT_FROM_FORWARD and not finding.birth
    assert re.fullmatch(rf"NaN in the gradient reaching the output out\['logits'\] \(nan=\d+\), out of the "
                        rf"forward's NaN: the output held NaN from {re.escape(weight)}", finding.text), finding.text


def test_a_nan_in_the_loss_of_finite_outputs_still_came_from_outside():
    model = nn.Linear(3, 3)
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        (model(torch.randn(2, 3)).sum() * float("nan")).backward()
    [finding] = rec.recordings[0].backward[0].findings
    assert finding.kind is K.GRADIENT_FROM_OUTSIDE and finding.birth


class GuardedExp(nn.Module):
    """`where(x < 80, exp(x), 0)`: the forward's overflow is absorbed, but exp's backward multiplies
    the zero gradient where() sends it by the +inf it saved."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x) * 1000
        return torch.where(h < 80, h.exp(), torch.zeros_like(h)).sum()


def test_a_nan_gradient_made_of_an_infinity_the_forward_absorbed_names_that_infinity():
    torch.manual_seed(0)
    model = GuardedExp()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(3, 4)).backward()
    [recording] = rec.recordings
    assert recording.findings == () and "absorbed by later ops" in recording.footer_extra[-1]
    [finding] = recording.backward[0].findings
    assert finding.kind is K.GRADIENT_FROM_FORWARD
    assert re.fullmatch(r"NaN gradient at ~\d+ ExpBackward0, the backward of #(\d+) exp \(nan=\d+\), out of the "
                        r"forward's \+inf: #\1 exp produced \+inf", finding.text), finding.text


class SqrtHead(nn.Module):
    """A causal encoder layer (its float mask holds -inf, absorbed by the softmax), then
    `sqrt(h - h.detach())`: finite in the forward, 1/0 in its backward."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask):
        h = self.fc(self.layer(x, src_mask=mask))
        return torch.sqrt(h - h.detach()).sum()


class WritesNaN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class NaNInBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return WritesNaN.apply(self.fc(x)).relu().sum()


def test_a_birth_in_the_backward_is_still_a_birth_after_a_healthy_infinity_and_in_a_custom_function():
    torch.manual_seed(0)
    model = SqrtHead()
    mask = nn.Transformer.generate_square_subsequent_mask(5)  # -inf above the diagonal
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(2, 5, 8), mask).backward()
    [finding] = rec.recordings[0].backward[0].findings
    assert finding.kind is K.GRADIENT_BORN and finding.text.startswith("+inf gradient born at ~"), finding.text
    assert " SqrtBackward0, the backward of #" in finding.text
    model = NaNInBackward()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(2, 4)).backward()
    [finding] = rec.recordings[0].backward[0].findings
    assert finding.kind is K.GRADIENT_BORN and "WritesNaNBackward" in finding.text, finding.text


def test_the_watchs_replay_page_heads_with_the_forwards_nan_alone():
    """A step whose embedding row turned NaN: its replay page has one red headline, the weight's,
    and the loss's backward NaN under it as what it is."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with tl.watch(model, optimizer, out=tempfile.mkdtemp(), on_fault="skip", narrate=None) as watch:
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.model.embed_tokens.weight[17, 3] = float("nan")
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
    [fault] = watch.faults
    assert fault.finding.startswith("NaN in model.embed_tokens.weight (nan=1), first read by ")
    with open(fault.html, encoding="utf-8") as page:
        data = json.loads(re.search(r'<script type="application/json"[^>]*>(.*?)</script>', page.read(), re.S)[1])
    lines = [line for section in data["sections"] for line in section["lines"] if line["text"].startswith("!! ")]
    assert [line["cls"] for line in lines] == ["bad", "warn"], lines
    assert "out of the forward's NaN" in lines[1]["text"] and "born" not in lines[1]["text"]
