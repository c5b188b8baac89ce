"""Backward verdicts at their edges: one finding per origin however many ways a non-finite gradient
arrives, counts of the right kind, a footer that names every leaf and counts what it measured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl


def backward_of(model, run):
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        run()
    [backward] = rec.recordings[0].backward
    return backward


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(3, 3)
        self.fc2 = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc1(x), self.fc2(x)


OUTSIDE = ("NaN in the gradient reaching the output out[1] (nan=6): no node of the narrated forward sent it; "
           "it came from outside, such as the loss")


def test_nan_loss_terms_on_two_outputs_are_one_finding():
    model = TwoHeads()

    def step():
        a, b = model(torch.randn(2, 3))
        (a.sum() * float("nan") + b.sum() * float("nan")).backward()

    backward = backward_of(model, step)
    assert [f.text for f in backward.findings] == [OUTSIDE]


def test_the_footer_names_three_leaves_and_counts_the_fourth():
    model = TwoHeads()

    def step():
        a, b = model(torch.randn(2, 3))
        (a.sum() * float("nan") + b.sum() * float("nan")).backward()

    footer = backward_of(model, step).footer_extra[-1]
    assert footer.endswith("; non-finite gradients reached 4 leaves (fc2.bias, fc2.weight, fc1.bias and 1 more)")


def test_a_later_nan_from_outside_the_forward_is_taken_as_part_of_the_first_finding():
    model = TwoHeads()
    with torch.no_grad():
        model.fc1.weight[0, 0] = 0.0

    def step():  # a NaN loss on the second head, and an L1 penalty whose sqrt(0) makes fc1.weight's gradient NaN
        a, b = model(torch.randn(2, 3))
        (a.sum() + b.sum() * float("nan") + 1e-4 * model.fc1.weight.pow(2).sqrt().sum()).backward()

    backward = backward_of(model, step)
    assert [f.text for f in backward.findings] == [OUTSIDE]
    assert backward.footer_extra[-1].endswith("non-finite gradients reached 3 leaves (fc2.bias, fc2.weight, fc1.weight)")


class SignFlip(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        b = -self.fc(x)
        return (b - b.detach()).sqrt().sum()  # sqrt(0): an infinite gradient


def test_a_positive_infinite_gradient_born_at_a_node_is_counted_as_such():
    model = SignFlip()
    backward = backward_of(model, lambda: model(torch.randn(1, 3)).backward())
    [finding] = backward.findings
    assert finding.text == "+inf gradient born at ~2 SqrtBackward0, the backward of #6 sqrt (+inf=3)"


class SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.fc = nn.Linear(3, 3)

    def forward(self, ids):
        return torch.tanh(self.fc(self.emb(ids))).sum()


def test_sparse_gradients_are_counted_as_not_measured_and_the_rest_as_measured():
    model = SparseEmbedding()
    backward = backward_of(model, lambda: model(torch.tensor([1, 2])).backward())
    assert backward.findings == ()
    # 8 nodes and 1 output gradient; the embedding's backward and its leaf hold sparse gradients
    assert backward.footer_extra[-1] == "no non-finite gradients in the 7 measured; 2 not measured (2 sparse_coo)"


class Tanh(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return torch.tanh(self.fc(x)).sum()


def test_a_backward_over_released_graphs_counts_every_node_it_measured():
    model = Tanh()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        loss = sum(model(torch.randn(2, 3)) for _ in range(10))
        loss.backward()
    [backward] = rec.recordings[-1].backward
    assert len(backward.nodes) == 34  # eight passes' nodes and the two leaves; and 8 output gradients
    assert backward.footer_extra[-1].startswith("no non-finite gradients in the 42 measured; the graphs of 2 "
                                                "earlier passes were released")


class _OverwritesItsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(float("nan"))  # writes NaN into the very gradient it received


class OverwritingNode(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return (_OverwritesItsGradient.apply(self.fc(x)) ** 2).sum()


def test_a_node_that_overwrites_what_it_received_is_said_to_have_done_so():
    """What the node received was finite when it arrived; measured after the node ran, it would
    read the node's own NaN and blame a gradient hook or a node outside the forward."""
    model = OverwritingNode()
    backward = backward_of(model, lambda: model(torch.randn(2, 3)).backward())
    [finding] = backward.findings
    assert finding.text.startswith("NaN gradient first seen at ~3 _OverwritesItsGradientBackward"), finding.text
    assert finding.text.endswith("no watched node sent it: it may have received it: it overwrote what it "
                                 "received in place before that could be measured"), finding.text
    assert "gradient hook" not in finding.text


def _at_the_backwards_end(write):
    """A post-accumulate-grad hook that queues `write(p)` to run when the backward ends, as DDP
    and FSDP2 queue their gradient reductions."""
    def hook(p):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: write(p))
    return hook


def test_a_gradient_written_non_finite_after_the_graph_added_it_finite_is_found():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].weight.register_post_accumulate_grad_hook(_at_the_backwards_end(lambda p: p.grad.mul_(float("nan"))))
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(2, 4)).sum().backward()
    [backward] = rec.recordings[0].backward
    [finding] = backward.findings
    accumulate = next(e for e in backward.events if e.op == "AccumulateGrad" and e.label == "0.weight")
    assert finding.text == (f"NaN in the gradient of 0.weight after the backward: ~{accumulate.ordinal} added it "
                            f"finite, then something outside the graph wrote it (a callback a hook queued to run "
                            f"at the backward's end)")
    assert finding.kind.name == "CARRIED_IN" and finding.event is accumulate
    assert backward.footer_extra[-1].startswith("first non-finite gradient: NaN in the gradient of 0.weight after")
    assert not torch.isfinite(model[0].weight.grad).all()


def _replaced_non_finite(p):
    p.grad = p.grad * float("nan")  # another tensor: the one the graph added keeps its values and its version


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_a_gradient_a_callback_replaced_with_a_non_finite_tensor_is_found(name):
    """`p.grad = p.grad * nan` at the backward's end leaves the gradient the graph added as it was,
    version included, and puts a new tensor in `.grad`: a look that told a written `.grad` by its
    version alone would read nothing and say the gradients are finite."""
    torch.manual_seed(0)
    if name == "gpt2":
        t = pytest.importorskip("transformers")
        model = t.GPT2Model(t.GPT2Config(vocab_size=99, n_positions=16, n_embd=32, n_layer=2, n_head=4))
        args, weight = (torch.tensor([[5, 17, 23, 42]]),), "h.1.mlp.c_fc.weight"
    else:
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        args, weight = (torch.randn(2, 4),), "0.weight"
    model.get_parameter(weight).register_post_accumulate_grad_hook(_at_the_backwards_end(_replaced_non_finite))
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(*args)[0].float().sum().backward()
    [backward] = rec.recordings[0].backward
    [finding] = backward.findings
    assert finding.text.startswith(f"NaN in the gradient of {weight} after the backward: ~"), finding.text
    assert finding.text.endswith("then something outside the graph wrote it (a callback a hook queued to run at the "
                                 "backward's end)")
    assert backward.footer_extra[-1].startswith(f"first non-finite gradient: {finding.text}")
    assert not torch.isfinite(model.get_parameter(weight).grad).all()


def test_a_gradient_rewritten_finite_after_the_backward_is_no_finding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].weight.register_post_accumulate_grad_hook(_at_the_backwards_end(lambda p: p.grad.clamp_(-0.1, 0.1)))
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(2, 4)).sum().backward()
    [backward] = rec.recordings[0].backward
    assert backward.findings == () and backward.footer_extra == ["no non-finite gradients"]


@pytest.mark.parametrize("name", ["qwen2", "bart"])
def test_a_real_models_gradient_written_after_its_backward_is_found_and_an_untouched_one_reads_clean(name):
    pytest.importorskip("transformers")
    from real_models import REAL_MODELS

    entry = REAL_MODELS[name]
    model, args, kwargs = entry.build()
    weight = model.get_parameter(entry.weight)
    for poisoned in (False, True):
        model.zero_grad()
        handle = weight.register_post_accumulate_grad_hook(
            _at_the_backwards_end(lambda p, poisoned=poisoned: p.grad.mul_(float("nan")) if poisoned else None))
        with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
            model(*args, **kwargs)[0].float().sum().backward()
        handle.remove()
        [backward] = rec.recordings[0].backward
        if not poisoned:
            assert backward.findings == () and backward.footer_extra[-1].startswith("no non-finite gradients")
            continue
        [finding] = backward.findings
        assert finding.text.startswith(f"NaN in the gradient of {entry.weight} after the backward: ~"), finding.text
        assert finding.kind.name == "CARRIED_IN"
