"""Backward narration (`Recorder(..., backward=True)`, `tl.compile(..., backward=True)`): every
autograd node of a training step narrated and tied to its forward op, gradients unchanged, the
first non-finite gradient named where it was born, failures in a backward with their tail, and no
hook left behind however the backward ends."""

from __future__ import annotations

import contextlib
import copy
import io
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import count_host_syncs
from models import conv_net, images, tiny_gpt, tokens
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchlens as tl

NODE_LINE = re.compile(r"^(?P<indent> *)~(?P<ordinal>\d+)\s+(?P<node>\S+)\s+(?P<rest>.*)$")


def node_lines(text: str):
    return [m for m in map(NODE_LINE.match, text.splitlines()) if m]


def reachable_nodes(root) -> list:
    """Every autograd node a backward from `root` runs, by walking the graph as autograd will."""
    seen, stack, nodes = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def gpt2(train: bool = True):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    return model.train() if train else model.eval()


def gpt2_step(model, ids, **recorder):
    """One training step (forward with labels, backward, SGD update) under a Recorder if asked."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    torch.manual_seed(1)  # the same dropout masks with and without narration
    if recorder:
        with tl.recording.Recorder(model, backward=True, **recorder) as rec:
            model(ids, labels=ids).loss.backward()
    else:
        rec = None
        model(ids, labels=ids).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return rec, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- every node, tied to its forward op; gradients unchanged -------------------------------------


@pytest.mark.parametrize("rung", ["off", "exact"])
def test_gpt2_training_step_narrates_every_node_and_leaves_gradients_and_weights_bitwise(rung):
    ids = tokens(2, 8, vocab=50)
    plain_model, narrated_model = gpt2(), gpt2()
    _, plain_grads, plain_weights = gpt2_step(plain_model, ids)
    out = io.StringIO()
    tracking = "track" if rung == "exact" else None
    rec, grads, weights = gpt2_step(narrated_model, ids, narrate=out, value_stats=rung, on_nonfinite=tracking)
    assert_bitwise(grads, plain_grads)
    assert_bitwise(weights, plain_weights)

    recording = rec.recordings[0]
    [backward] = recording.backward
    torch.manual_seed(1)
    expected = reachable_nodes(gpt2()(ids, labels=ids).loss.grad_fn)
    nodes = backward.nodes
    assert len(nodes) == len(expected) > 100
    assert sorted(e.op for e in nodes) == sorted(type(n).__name__ if type(n).__name__ == "AccumulateGrad"
                                                 else n.name() for n in expected)
    # every parameter that got a gradient has its AccumulateGrad line, by name
    leaves = [e.label for e in nodes if e.op == "AccumulateGrad"]
    assert sorted(leaves) == sorted(grads)
    # every other node names a forward op of this pass: its ordinal, op name and module
    ops = {e.ordinal: e for e in recording.ops}
    for event in nodes:
        if event.op == "AccumulateGrad":
            continue
        ordinal, op = re.match(r"#(\d+) (\S+)", event.forward).groups()
        forward = ops[int(ordinal)]
        assert forward.op == op and event.scope is forward.scope, event
    # the narration: one ~N line per node, numbered in order, after the forward's footer
    text = out.getvalue()
    assert text == recording.narrate()
    lines = node_lines(text)
    assert [int(m["ordinal"]) for m in lines] == list(range(1, len(nodes) + 1))
    forward_part, backward_part = text.split("-- backward of pass 1\n")
    assert not node_lines(forward_part) and "-- end: " in forward_part
    assert backward_part.splitlines()[-1].startswith(f"-- end: {len(nodes)} nodes, {len(leaves)} gradients")
    attention = [m for m in lines if re.search(r"@transformer\.h\.1\.attn( |$)", m["rest"])]
    assert attention and all(len(m["indent"]) == 2 * 3 for m in attention)  # the forward op's module depth
    if rung == "exact":
        assert "no non-finite gradients" in backward_part.splitlines()[-1]
        wte = next(e for e in nodes if e.label == "transformer.wte.weight")
        grad = grads["transformer.wte.weight"].double()
        # (the tied head's gradient arrives in two parts: the last is what this node accumulated)
        assert wte.stats.kind == "exact" and wte.stats.min is not None
        assert all(part.sd is not None for part in getattr(wte.stats, "parts", (wte.stats,)))
        assert grad.isfinite().all()


def test_conv_net_three_training_steps_in_train_mode_end_with_the_same_weights_bitwise():
    x, labels = images(2), torch.tensor([1, 2])
    torch.manual_seed(0)
    plain, narrated = conv_net().train(), conv_net().train()

    def train(model, steps=3):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), labels).backward()
            optimizer.step()

    train(plain)
    out = io.StringIO()
    with tl.recording.Recorder(narrated, narrate=out, backward=True, value_stats="exact") as rec:
        train(narrated)
    for (name, a), (_, b) in zip(plain.named_parameters(), narrated.named_parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad), name
    for (name, a), (_, b) in zip(plain.named_buffers(), narrated.named_buffers()):
        assert torch.equal(a, b), name  # running statistics updated alike
    assert [len(r.backward) for r in rec.recordings] == [1, 1, 1]
    [backward] = rec.recordings[0].backward
    names = {e.op for e in backward.nodes}
    assert {"ConvolutionBackward0", "NativeBatchNormBackward0", "AccumulateGrad"} <= names
    assert sorted(e.label for e in backward.nodes if e.label) == sorted(n for n, _ in narrated.named_parameters())
    # the loss was computed outside the model: its gradient arrives at the output, measured
    [arrived] = [e for e in backward.events if e.kind is tl.EventKind.GRAD]
    assert arrived.label == "out" and arrived.stats.kind == "exact"
    assert "<=    grad" in out.getvalue()
    conv = next(e for e in backward.nodes if e.op == "ConvolutionBackward0" and e.module == "block.conv2")
    assert conv.forward.endswith("conv2d @block.conv2") and conv.depth == 2


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_forward_that_builds_no_graph_hooks_nothing_and_narrates_no_backward(context):
    model = tiny_gpt()
    out = io.StringIO()
    guard = torch.no_grad() if context == "no_grad" else torch.inference_mode()
    with tl.recording.Recorder(model, narrate=out, backward=True) as rec:
        with guard:
            model(tokens())
    assert rec.recordings[0].backward == [] and "backward" not in out.getvalue()


def test_autocast_training_step_narrates_bf16_gradients_and_keeps_them_bitwise():
    x = tokens(1, 6)
    plain, narrated = tiny_gpt().train(), tiny_gpt().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x).float().square().mean().backward()
    with tl.recording.Recorder(narrated, backward=True, on_nonfinite="track") as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            narrated(x).float().square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), narrated.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    [backward] = rec.recordings[0].backward
    assert any(m.dtype == torch.bfloat16 for e in backward.nodes for m in e.outputs)
    assert backward.footer_extra[-1] == "no non-finite gradients"


# -- the first non-finite gradient ------------------------------------------------------------------


class SafeSqrt(nn.Module):
    """`where(h > 0, h.sqrt(), 0)`: a finite forward whose gradient is NaN where h == 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return torch.where(h > 0, h.sqrt(), torch.zeros_like(h)).sum()


class NormalizeByNorm(nn.Module):
    """`v / v.norm()` with v all zeros: NaN gradient at the division."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        v = self.fc(x) * 0
        return (v / v.norm()).sum()


def test_where_sqrt_finite_forward_nan_gradient_born_at_sqrt():
    torch.manual_seed(0)
    model, x = SafeSqrt(), torch.randn(3, 4)
    out = io.StringIO()
    with tl.recording.Recorder(model, narrate=out, backward=True, on_nonfinite="track") as rec:
        model(x).backward()
    recording = rec.recordings[0]
    assert recording.findings == () and "no non-finite values" in recording.footer_extra[-1]
    [backward] = recording.backward
    first = backward.first_nonfinite
    assert first.op == "SqrtBackward0" and re.fullmatch(r"#\d+ sqrt", first.forward)
    text = backward.findings[0].text
    assert text.startswith(f"NaN gradient born at ~{first.ordinal} SqrtBackward0, the backward of #")
    # the `!!` line follows the node's line; propagation after it makes no other finding
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"~{first.ordinal} "))
    assert lines[at + 1] == "!! " + text
    assert len(backward.findings) == 1
    # relu's backward keeps the NaN where relu was 0: the parameters' gradients are finite
    assert "reached" not in lines[-1] and model.fc.weight.grad.isfinite().all()


def test_norm_at_zero_nan_gradient_born_at_the_division():
    model = NormalizeByNorm()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        out = model(torch.randn(2, 4))
        out.backward()
    [backward] = rec.recordings[0].backward
    first = backward.first_nonfinite
    assert first.op == "DivBackward0" and re.fullmatch(r"#\d+ div", first.forward)


def test_nan_injected_into_a_loss_outside_the_forward_is_named_at_the_output_it_reached():
    model = tiny_gpt().train()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        logits = model(tokens())
        (logits.mean() * float("nan")).backward()
    [backward] = rec.recordings[0].backward
    first = backward.first_nonfinite
    assert first.kind is tl.EventKind.GRAD and first.label == "out"
    assert backward.findings[0].text.startswith("NaN in the gradient reaching the output out")
    assert len(backward.findings) == 1  # what follows is propagation


def test_nan_injected_into_a_loss_computed_inside_the_forward_is_named_at_its_op():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x, scale):
            loss = F.mse_loss(self.fc(x), torch.zeros(3, 2))
            return loss * scale  # a NaN scale: finite forward? no: the loss is NaN, and so its gradient

    model = WithLoss()
    scale = torch.tensor(float("nan"))
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.randn(3, 4), scale).backward()
    [backward] = rec.recordings[0].backward
    first = backward.first_nonfinite
    assert first.op == "MulBackward0" and re.fullmatch(r"#\d+ mul", first.forward)


def test_raise_stops_the_backward_at_the_first_nonfinite_gradient_with_the_partial_trace():
    torch.manual_seed(0)
    model, x = SafeSqrt(), torch.randn(3, 4)
    out = io.StringIO()
    with pytest.raises(tl.errors.NonFiniteError) as info:
        with tl.recording.Recorder(model, narrate=out, backward=True, on_nonfinite="raise"):
            model(x).backward()
    assert "NaN gradient born at" in str(info.value) and "SqrtBackward0" in str(info.value)
    partial = info.value.partial_trace
    assert partial.failed_backward is partial.backward[0]
    assert partial.failed_backward.nodes[-1].op == "SqrtBackward0"  # nothing ran after it
    assert model.fc.weight.grad is None  # stopped before the gradient reached the parameters
    assert partial.narrate().endswith(out.getvalue().split("-- pass 1\n", 1)[1][-200:])
    assert "!! backward failed: NonFiniteError" in out.getvalue()


def test_raise_on_an_accelerator_stops_at_the_birth_though_values_are_read_once_per_backward(deferred_reads):
    torch.manual_seed(0)
    model, x = SafeSqrt(), torch.randn(3, 4)
    with pytest.raises(tl.errors.NonFiniteError, match="NaN gradient born at ~3 SqrtBackward0"):
        with tl.recording.Recorder(model, backward=True, on_nonfinite="raise"):
            model(x).backward()
    assert model.fc.weight.grad is None


def test_tracking_reads_the_device_once_per_backward_and_metadata_narration_never(deferred_reads, monkeypatch):
    """Torch function modes do not reach autograd's engine, so host reads are counted at the
    dispatcher (scalar reads) and on `Tensor.tolist` itself (how statistics vectors are read)."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append("tolist") or tolist(self))
    model = tiny_gpt().train()
    x = tokens()
    with tl.recording.Recorder(model, backward=True) as rec:
        logits = model(x)
        with count_host_syncs() as syncs:
            logits.mean().backward()
    assert syncs == [] and reads == [] and len(rec.recordings[0].backward[0].nodes) > 50
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        logits = model(x)
        reads.clear()
        with count_host_syncs() as syncs:
            logits.mean().backward()
    assert syncs == [] and reads == ["tolist"]
    assert rec.recordings[0].backward[0].footer_extra[-1] == "no non-finite gradients"


# -- failures in a backward --------------------------------------------------------------------------


class Exploding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


class WithCustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(Exploding.apply(self.fc(x)).relu()).sum()


def test_a_custom_backward_that_raises_keeps_the_users_exception_and_names_the_attempted_node():
    model = WithCustomFunction()
    out = io.StringIO()
    with pytest.raises(ValueError) as info:
        with tl.recording.Recorder(model, narrate=out, backward=True):
            model(torch.randn(2, 4)).backward()
    assert str(info.value) == "boom in backward"
    assert info.value.__notes__[0].startswith("torchlens: attempted ~")
    partial = info.value.partial_trace
    attempt = partial.attempt
    assert isinstance(attempt, tl.events.BackwardAttempt)
    assert attempt.op == "ExplodingBackward" and attempt.forward.startswith("Exploding.apply (an autograd.Function)")
    tail = partial.narrate(last=5).splitlines()
    assert tail[0] == "!! backward failed: ValueError: boom in backward"
    assert tail[-1].startswith(f"!! attempted ~{attempt.ordinal} ExplodingBackward <- Exploding.apply")
    assert "received: [2,4] f32 cpu" in tail[-1]
    assert out.getvalue().endswith("\n".join(partial.narrate(last=None).splitlines()[-3:]) + "\n")


def test_a_backward_failure_caught_inside_the_block_is_reported_when_the_next_pass_begins():
    model = WithCustomFunction()
    with tl.recording.Recorder(model, backward=True) as rec:
        try:
            model(torch.randn(2, 4)).backward()
        except ValueError:
            pass
        model(torch.randn(2, 4))
    failed = rec.recordings[0].backward[0]
    assert failed.error.startswith("BackwardStopped") and not failed.finished
    assert failed.attempt.op == "ExplodingBackward" and failed.attempt.notes


def test_a_shape_error_in_a_gradient_hook_names_the_node_it_was_for():
    model = tiny_gpt().train()

    def bad_hook(grad):
        return grad[:, :1]  # the wrong shape: autograd refuses it

    with pytest.raises(RuntimeError) as info:
        with tl.recording.Recorder(model, backward=True):
            logits = model(tokens())
            logits.register_hook(bad_hook)
            logits.sum().backward()
    assert info.value.partial_trace.failed_backward is not None
    assert "backward failed: RuntimeError" in info.value.partial_trace.narrate(last=3)


# -- no residue however a backward runs ---------------------------------------------------------------


def _nothing_narrated_after_the_block(model, run):
    out = io.StringIO()
    with tl.recording.Recorder(model, narrate=out, backward=True) as rec:
        kept = run()
    before = out.getvalue()
    kept.backward()  # the graph outlives the block: its backward is not narrated any more
    assert out.getvalue() == before
    return rec


def test_hooks_are_removed_when_the_block_ends_even_while_the_graph_lives_on():
    model = tiny_gpt().train()
    x = tokens()
    rec = _nothing_narrated_after_the_block(model, lambda: model(x).sum())
    assert rec.recordings[0].backward == []


def test_retain_graph_narrates_each_backward_as_its_own_section():
    model = tiny_gpt().train()
    out = io.StringIO()
    with tl.recording.Recorder(model, narrate=out, backward=True) as rec:
        loss = model(tokens()).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    first, second = rec.recordings[0].backward
    assert (first.header, second.header) == ("backward of pass 1", "backward 2 of pass 1")
    assert [e.op for e in first.nodes] == [e.op for e in second.nodes]
    assert out.getvalue().count("-- end: ") == 3


def test_autograd_grad_is_narrated_without_accumulating_into_leaves():
    model = tiny_gpt().train()
    with tl.recording.Recorder(model, backward=True) as rec:
        loss = model(tokens()).sum()
        (grad,) = torch.autograd.grad(loss, [model.head.weight])
    [backward] = rec.recordings[0].backward
    assert not any(e.op == "AccumulateGrad" for e in backward.nodes)
    assert model.head.weight.grad is None and grad.shape == model.head.weight.shape
    assert backward.finished


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_narrates_the_recompute_neither_as_forward_nor_twice(reentrant):
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=reentrant)).sum()

    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(2, 4, requires_grad=reentrant)
    out = io.StringIO()
    with tl.recording.Recorder(model, narrate=out, backward=True) as rec:
        model(x).backward()
    recording = rec.recordings[0]
    assert len(rec.recordings) == 1 and out.getvalue().count("-- pass") == 1
    ops = [e.op for e in recording.ops if e.kind is tl.EventKind.OP]
    assert ops.count("linear") == 2  # the recompute ran in the backward, unnarrated
    nodes = recording.backward[0].nodes
    assert len({id(e) for e in nodes}) == len(nodes)
    assert len([e for e in nodes if e.label]) == (4 if not reentrant else 2) + (1 if reentrant else 0)


def test_gradient_accumulation_over_two_passes_narrates_both_graphs_in_one_backward():
    model = tiny_gpt().train()
    with tl.recording.Recorder(model, backward=True) as rec:
        loss = model(tokens(seed=1)).sum() + model(tokens(seed=2)).sum()
        loss.backward()
    first, second = rec.recordings
    assert first.backward == [] and len(second.backward) == 1
    nodes = second.backward[0].nodes
    assert any(e.forward and e.forward.endswith("of pass 1") for e in nodes)
    assert any(e.forward and not e.forward.endswith("of pass 1") for e in nodes if e.forward)
    # a parameter's accumulator is shared by both graphs: one line each
    assert len([e for e in nodes if e.label == "head.weight"]) == 1


# -- the grammar's rules hold for backward lines --------------------------------------------------------


def test_selectors_depth_max_lines_and_prefix_apply_to_backward_lines():
    model = tiny_gpt().train()
    x = tokens()
    options = tl.options.NarrationOptions(sink=io.StringIO(), select=tl.in_module("blocks.1"), prefix="[t] ")
    with tl.recording.Recorder(model, narrate=options, backward=True) as rec:
        model(x).sum().backward()
    text = options.sink.getvalue()
    backward_text = text.split("-- backward of pass 1\n")[1]
    assert all(line.startswith("[t] ") for line in text.splitlines())
    lines = node_lines(backward_text.replace("[t] ", ""))
    assert lines and all("@blocks.1" in m["rest"] or "blocks.1." in m["rest"] for m in lines)
    assert re.search(r"\d+ not selected", backward_text.splitlines()[-1])

    folded = tl.options.NarrationOptions(sink=io.StringIO(), depth=1, max_lines=1000)
    with tl.recording.Recorder(model, narrate=folded, backward=True) as rec:
        model(x).sum().backward()
    backward_text = folded.sink.getvalue().split("-- backward of pass 1\n")[1]
    assert all(len(m["indent"]) <= 2 for m in node_lines(backward_text))
    assert re.search(r"\d+ folded \(depth=1\)", backward_text.splitlines()[-1])
    assert rec.recordings[0].narrate() == folded.sink.getvalue()

    limited = tl.options.NarrationOptions(sink=io.StringIO(), max_lines=5)
    with tl.recording.Recorder(model, narrate=limited, backward=True):
        model(x).sum().backward()
    backward_text = limited.sink.getvalue().split("-- backward of pass 1\n")[1]
    lines = backward_text.splitlines()
    assert lines[0].startswith("<=    grad") and len(node_lines(backward_text)) == 4  # 5 lines in all
    assert lines[5].startswith("-- max_lines=5 reached")


def test_record_takes_backward_and_narrates_the_later_backward_to_its_sink_appended(tmp_path):
    model = tiny_gpt().train()
    log = tmp_path / "run.log"
    recording = tl.record(model, tokens(), narrate=str(log), backward=True, on_nonfinite="track")
    forward_text = log.read_text()
    assert "backward" not in forward_text
    recording.output.sum().backward()
    text = log.read_text()
    assert text.startswith(forward_text) and text[len(forward_text):].startswith("-- backward of the forward\n")
    assert recording.narrate() == text and recording.backward[0].footer_extra[-1] == "no non-finite gradients"
    with pytest.raises(tl.errors.OptionTypeError, match=r"backward=.*True or False"):
        tl.recording.Recorder(tiny_gpt(), backward="yes")


# -- compiled -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_backward_inductor_one_line_per_graph_call_with_parameter_gradients_bitwise():
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain, narrated = SafeSqrt(), copy.deepcopy(SafeSqrt())
    narrated.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    torch.compile(plain)(x).backward()
    out = io.StringIO()
    compiled = tl.compile(narrated, narrate=out, backward=True, on_nonfinite="track")
    compiled(x).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), narrated.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    recording = compiled.torchlens.last_recording
    [backward] = recording.backward
    graph_nodes = [e for e in backward.nodes if not e.label]
    assert [e.op for e in graph_nodes] == ["CompiledFunctionBackward"]
    assert re.fullmatch(r"the compiled graph of #2\.\.#\d+", graph_nodes[0].forward)
    assert sorted(e.label for e in backward.nodes if e.label) == ["fc.bias", "fc.weight"]
    assert out.getvalue().endswith(recording.narrate().split("-- end: ", 1)[1].split("\n", 1)[1])


def test_compiled_live_backward_names_the_forward_op_of_each_node_and_the_nan_at_sqrt():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = SafeSqrt(), torch.randn(3, 4)
    compiled = tl.compile(model, backward=True, on_nonfinite="track", live=True, compiler="eager")
    compiled(x).backward()
    [backward] = compiled.torchlens.last_recording.backward
    first = backward.first_nonfinite
    assert first.op == "SqrtBackward0" and re.fullmatch(r"#\d+ sqrt", first.forward)


def test_compiled_raise_stops_the_backward_at_the_op_that_made_the_nan_and_the_string_backend_takes_it():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = SafeSqrt(), torch.randn(3, 4)
    compiled = torch.compile(model, backend="torchlens",
                             options={"backward": True, "on_nonfinite": "raise", "live": True, "compiler": "eager"})
    with pytest.raises(tl.errors.NonFiniteError, match=r"NaN gradient born at ~\d+ SqrtBackward0, the backward of #\d+ sqrt"):
        compiled(x).backward()
    assert model.fc.weight.grad is None


def test_a_recording_with_its_backward_copies_and_pickles_and_narrates_the_same():
    import pickle

    model = tiny_gpt().train()
    with tl.recording.Recorder(model, backward=True, value_stats="exact", on_nonfinite="track") as rec:
        model(tokens()).sum().backward()
    recording = rec.recordings[0]
    text = recording.narrate()
    assert "-- backward of pass 1" in text
    assert copy.deepcopy(recording).narrate() == text
    assert pickle.loads(pickle.dumps(recording)).narrate() == text


def test_a_watched_graph_whose_backward_never_runs_is_freed_with_its_saved_activations():
    """A forward run with grad enabled inside the block but never backwarded (an evaluation without
    `no_grad`) must not have its graph, and the activations it saved, kept alive by torchlens."""
    import gc
    import weakref

    class Saves(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.saved = None

        def forward(self, x):
            h = self.fc(x)
            self.saved = weakref.ref(h)
            return (h * h).sum()  # the graph saves h for the backward

    model = Saves()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track", keep=0):
        out = model(torch.randn(2, 4))
        assert model.saved() is not None
        del out
        gc.collect()
        assert model.saved() is None


# -- verdicts on the graphs people build (each case once reported wrong) ---------------------------------


def _track(model, run, **recorder):
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track", **recorder) as rec:
        run()
    return rec


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)


def test_an_infinity_that_only_changes_sign_on_its_way_is_one_finding():
    class SignFlip(OneLinear):
        def forward(self, x):
            b = -self.fc(x)
            return (b - b.detach()).sqrt().sum()  # sqrt(0): +inf gradient, negated twice on the way back

    model = SignFlip()
    rec = _track(model, lambda: model(torch.randn(1, 3)).backward())
    [finding] = rec.recordings[0].backward[0].findings
    assert finding.text.startswith("+inf gradient born at ~2 SqrtBackward0")


def test_a_nan_from_a_loss_term_outside_the_model_is_first_seen_at_the_leaf_never_born_there():
    class Tanh(OneLinear):
        def forward(self, x):
            return torch.tanh(self.fc(x)).sum()

    model = Tanh()
    with torch.no_grad():
        model.fc.weight[0, 0] = 0.0

    def step():
        (model(torch.randn(2, 3)) + 1e-4 * model.fc.weight.pow(2).sqrt().sum()).backward()  # an L1 penalty

    [finding] = _track(model, step).recordings[0].backward[0].findings
    assert finding.text.startswith("NaN gradient first seen in the gradient of fc.weight at ~") and not finding.birth
    assert "no watched node sent it" in finding.text


def test_a_gradient_hook_that_writes_nan_is_first_seen_where_it_entered_on_cpu_and_accelerator(monkeypatch):
    import torchlens.measure.meter

    class Hooked(OneLinear):
        def forward(self, x):
            h = self.fc(x)
            h.register_hook(lambda grad: grad * float("nan"))
            return torch.tanh(h).sum()

    for read_now in ({"cpu"}, set()):  # the CPU's way, then an accelerator's (one read per backward)
        monkeypatch.setattr(torchlens.measure.meter, "READ_NOW", read_now)
        model = Hooked()
        [finding] = _track(model, lambda model=model: model(torch.randn(2, 3)).backward()).recordings[0].backward[0].findings
        assert finding.text.startswith("NaN gradient first seen entering ~") and not finding.birth, read_now
        assert "AddmmBackward0, the backward of #2 linear @fc" in finding.text


def test_a_custom_function_making_the_output_is_narrated_and_blamed_for_its_nan():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.sum(1)

        @staticmethod
        def backward(ctx, grad):
            return grad[:, None].expand(-1, 3) * float("nan")

    class Returns(OneLinear):
        def forward(self, x):
            return Bad.apply(self.fc(x))

    model = Returns()
    rec = _track(model, lambda: model(torch.randn(2, 3)).sum().backward())
    [backward] = rec.recordings[0].backward
    assert backward.nodes[0].op == "BadBackward"
    assert backward.nodes[0].forward == "Bad.apply (an autograd.Function), returning the output out"
    assert backward.findings[0].event is backward.nodes[0] and backward.findings[0].birth


def test_a_parameter_returned_as_is_gets_its_gradient_line_and_no_false_finding():
    class ReturnsScale(OneLinear):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return self.fc(x) * self.scale, self.scale

    model = ReturnsScale()

    def step():
        out, scale = model(torch.randn(2, 3))
        (out.sum() + (scale * float("nan")).sum()).backward()

    [backward] = _track(model, step).recordings[0].backward
    assert [f.text.split(" (")[0] for f in backward.findings] == ["NaN in the gradient reaching the output out[1]"]
    assert sorted(e.label for e in backward.nodes if e.label) == ["fc.bias", "fc.weight", "scale"]

    class OnlyReturnsScale(ReturnsScale):
        def forward(self, x):
            return self.fc(x), self.scale  # no op reads it: its accumulator is the graph's only link

    model = OnlyReturnsScale()
    [backward] = _track(model, step).recordings[0].backward
    assert sorted(e.label for e in backward.nodes if e.label) == ["fc.bias", "fc.weight", "scale"]


def test_leaves_show_the_gradient_they_received_not_what_grad_held_before_nor_after_a_hook_freed_it():
    class Tanh(OneLinear):
        def forward(self, x):
            return torch.tanh(self.fc(x)).sum()

    model = Tanh()
    model.fc.bias.grad = torch.full((3,), float("nan"))  # another step's gradient, never zeroed
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in [model.fc.weight]}

    def step_in_backward(p):  # the optimizer-in-backward pattern: step, then free the gradient
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    handle = model.fc.weight.register_post_accumulate_grad_hook(step_in_backward)
    try:
        rec = _track(model, lambda: model(torch.randn(2, 3)).backward(), value_stats="exact")
    finally:
        handle.remove()
    [backward] = rec.recordings[0].backward
    weight = next(e for e in backward.nodes if e.label == "fc.weight")
    bias = next(e for e in backward.nodes if e.label == "fc.bias")
    assert weight.outputs[0].shape == (3, 3) and weight.stats.kind == "exact"
    assert bias.stats.nan == 0 and model.fc.bias.grad.isnan().all()  # this backward's part was finite
    assert backward.footer_extra[-1] == "no non-finite gradients"


def test_a_nested_backward_inside_a_reentrant_checkpoint_is_no_failed_run():
    class Reused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(checkpoint(self.a, x, use_reentrant=True)).sum()

    model = Reused()
    x = torch.randn(2, 4, requires_grad=True)
    rec = _track(model, lambda: model(x).backward())
    [backward] = rec.recordings[0].backward
    assert backward.finished and backward.error is None


def test_a_backward_on_another_thread_while_this_one_runs_a_pass_is_not_cut_short():
    import threading
    import time

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(0.3)
            return grad

    class M(OneLinear):
        def forward(self, x):
            return Slow.apply(self.fc(x)).relu().sum()

    model = M()
    with tl.recording.Recorder(model, backward=True) as rec:
        loss = model(torch.randn(2, 3))
        worker = threading.Thread(target=loss.backward)
        worker.start()
        time.sleep(0.1)
        with torch.no_grad():
            model(torch.randn(2, 3))
        worker.join()
    [backward] = rec.recordings[0].backward
    assert backward.finished and backward.error is None and "SlowBackward" in [e.op for e in backward.nodes]


def test_a_checkpoint_recomputing_the_recorded_block_inside_the_backward_is_no_new_pass():
    class Block(OneLinear):
        def forward(self, x):
            return torch.tanh(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x.sum()

    net = Net()
    out = io.StringIO()
    with tl.recording.Recorder(net.blocks[1], narrate=out, backward=True) as rec:
        net(torch.randn(2, 3)).backward()
    assert len(rec.recordings) == 1 and out.getvalue().count("-- pass") == 1
    [backward] = rec.recordings[0].backward
    assert backward.finished and out.getvalue().rstrip().endswith("1 output gradient received")


def test_graphs_released_unbackwarded_past_the_limit_are_said_in_the_footer():
    class Tanh(OneLinear):
        def forward(self, x):
            return torch.tanh(self.fc(x)).sum()

    model = Tanh()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        loss = sum(model(torch.randn(2, 3)) for _ in range(10))  # ten micro-batches, one backward
        loss.backward()
    footer = rec.recordings[-1].backward[0].footer_extra[-1]
    assert "the graphs of 2 earlier passes were released before a backward reached them" in footer
    assert footer.startswith("no non-finite gradients in the")  # nothing claimed of them


def test_a_backward_without_tracking_still_says_what_it_left_unnarrated():
    """The forward's footer and the backward's say the same of a pass not wholly recorded, with or
    without tracking: here, graphs released before the backward reached them."""
    class Tanh(OneLinear):
        def forward(self, x):
            return torch.tanh(self.fc(x)).sum()

    model = Tanh()
    with tl.recording.Recorder(model, backward=True, value_stats="exact") as rec:
        loss = sum(model(torch.randn(2, 3)) for _ in range(10))
        loss.backward()
    extra = rec.recordings[-1].backward[0].footer_extra
    assert extra[0] == "value_stats=exact"
    assert extra[-1].startswith("not everything after the graphs of 2 earlier passes were released"), extra


# -- compare: gradients aligned too ------------------------------------------------------------------------


class HookedGradient(nn.Module):
    """A forward identical with and without `scale`, whose backward differs from relu's node on."""

    def __init__(self, scale=None):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)
        self.scale = scale

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.scale is not None:
            h.register_hook(lambda grad: grad * self.scale)
        return self.fc2(h).sum()


def test_compare_aligns_two_backwards_and_names_the_first_gradient_divergence():
    x = torch.randn(3, 4)
    a = tl.trace(HookedGradient(), x, backward=True)
    a.output.backward()
    b = tl.trace(HookedGradient(scale=1.5), x, backward=True)
    b.output.backward()
    report = tl.debug.compare(a, b)
    assert report.first_divergence is None  # the forwards are the same
    first = report.first_gradient_divergence
    assert first.op == "ReluBackward0" and (first.ordinal_a, first.ordinal_b) == (6, 6)
    assert report.gradients.counts["matched"] == len(a.backward[0].nodes) == len(b.backward[0].nodes)
    text = str(report)
    assert "first gradient divergence: ~6 ReluBackward0 (a ~6, b ~6)" in text
    assert "fc2.weight" in report.gradients.table(elide=False)
    # the gradients kept are the node's own, detached
    relu = next(e for e in b.backward[0].nodes if e.op == "ReluBackward0")
    assert b.backward[0].values[relu.ordinal][0].shape == (3, 8)

    same = tl.trace(HookedGradient(), x, backward=True)
    same.output.backward()
    assert tl.debug.compare(a, same).first_gradient_divergence is None
    plain = tl.trace(HookedGradient(), x)  # no backward kept: nothing to align
    assert tl.debug.compare(a, plain).gradients is None


def test_compare_pairs_every_parameter_gradient_of_eager_and_compiled_backwards_by_name():
    torch._dynamo.reset()
    model, x = tiny_gpt().train(), tokens()
    torch.manual_seed(3)
    eager = tl.trace(model, x, backward=True)
    eager.output.square().mean().backward()
    model.zero_grad()
    torch.manual_seed(3)
    compiled = tl.trace(model, x, backward=True, compiled=True)
    compiled.output.square().mean().backward()
    gradients = tl.debug.compare(eager, compiled).gradients
    leaves = [row for row in gradients.rows if row.op.startswith("AccumulateGrad ")]
    assert sorted(row.op.split()[1] for row in leaves) == sorted(n for n, _ in model.named_parameters())
    assert all(row.status == "both" and row.verdict == "within" for row in leaves)
    assert gradients.first_divergence is None


# -- one-forward entry points: every backward ends, and nothing stays behind -----------------------------


def test_a_record_whose_backward_fails_unseen_is_ended_when_the_next_forward_begins(tmp_path):
    model = WithCustomFunction()
    log = tmp_path / "run.log"
    recording = tl.record(model, torch.randn(2, 4), narrate=str(log), backward=True)
    with pytest.raises(ValueError):
        recording.output.backward()
    [backward] = recording.backward
    assert not backward.finished and backward.error is None  # nothing saw it fail yet
    tl.record(model, torch.randn(2, 4))  # any forward
    assert backward.error.startswith("BackwardStopped") and backward.attempt.op == "ExplodingBackward"
    assert "!! backward failed: BackwardStopped" in log.read_text()


def test_a_trace_whose_gradients_exceed_max_bytes_stops_its_backward_with_the_partial_trace():
    model = tiny_gpt().train()
    trace = tl.trace(model, tokens(), backward=True, max_bytes=200_000)  # 76 kB forward, 484 kB backward
    with pytest.raises(tl.errors.TraceBudgetError, match=r"tl.trace stopped at ~\d+ \S+ \(a backward node\)") as info:
        trace.output.sum().backward()
    assert info.value.partial_trace.failed_backward is trace.backward[0]
    assert trace.backward[0].error.startswith("TraceBudgetError")


def test_a_parameter_returned_as_is_by_a_recorded_forward_keeps_no_hook_after_its_backward():
    class ReturnsScale(OneLinear):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return self.fc(x), self.scale

    model, sink = ReturnsScale(), io.StringIO()
    recording = tl.record(model, torch.randn(2, 3), narrate=sink, backward=True)
    out, scale = recording.output
    (out.sum() + scale.sum()).backward()
    assert not model.scale._backward_hooks
    text = sink.getvalue()
    out, scale = model(torch.randn(2, 3))
    (out.sum() + scale.sum()).backward()  # a plain step afterwards: not narrated, not recorded
    assert sink.getvalue() == text and len(recording.backward) == 1


def test_a_compiled_trace_dropped_frees_the_gradients_it_kept():
    import gc
    import weakref

    torch._dynamo.reset()
    model = SafeSqrt()
    trace = tl.trace(model, torch.randn(3, 4), backward=True, compiled=True)
    trace.output.backward()
    kept = weakref.ref(next(iter(trace.backward[0].values.values()))[0])
    del trace
    gc.collect()
    assert kept() is None


def test_a_backward_on_a_worker_thread_during_the_next_forward_is_written_whole_after_it():
    """The backward of pass 1 runs on another thread while pass 2's forward is half done: made so,
    not left to the scheduler (a loaded machine could finish the backward before pass 2 begins)."""
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(20)])
    sink = io.StringIO()
    forward_begun, backward_begun, second = threading.Event(), threading.Event(), []

    def halfway(module, args):  # pass 2, at layer 10: let the backward start, and wait until it has
        if second:
            forward_begun.set()
            assert backward_begun.wait(30)

    def backward_when_forward_begun(loss):
        assert forward_begun.wait(30)
        loss.backward()

    model[10].register_forward_pre_hook(halfway)
    with tl.recording.Recorder(model, narrate=sink, backward=True) as rec:
        out = model(torch.randn(4, 16))
        out.register_hook(lambda grad: backward_begun.set())  # the backward's first node has run
        worker = threading.Thread(target=backward_when_forward_begun, args=(out.sum(),))
        worker.start()
        second.append(True)
        model(torch.randn(4, 16))  # pass 2's forward while pass 1's backward runs
        worker.join()
    notes = [line for line in sink.getvalue().splitlines() if line.startswith("-- ")]
    forward_footer = "-- end: 1 input, 40 ops, 60 module calls"
    assert notes[notes.index("-- pass 2") + 1] == forward_footer  # pass 2 narrated whole
    section = sink.getvalue().split("-- backward of pass 1\n")[1].splitlines()
    assert len(node_lines("\n".join(section))) == 100 and section[-1].startswith("-- end: 100 nodes")
    assert rec.recordings[0].backward[0].lines(rec.settings.narration) == \
        ["-- backward of pass 1"] + section


def test_compare_pairs_same_named_leaves_in_order_and_reads_sparse_gradients():
    class TwoLeaves(nn.Module):
        def __init__(self, scale=1.0):
            super().__init__()
            self.scale = scale

        def forward(self, u, v):
            return (u * 2).sum() + (v * self.scale).sum()

    u, v = torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)
    a = tl.trace(TwoLeaves(), u, v, backward=True)
    a.output.backward()
    b = tl.trace(TwoLeaves(3.0), u, v, backward=True)
    b.output.backward()
    gradients = tl.debug.compare(a, b).gradients
    leaves = [row for row in gradients.rows if row.op.startswith("AccumulateGrad")]
    assert [row.verdict for row in leaves].count("diverged") == 1 and len(leaves) == 2

    embed = nn.Embedding(10, 3, sparse=True)
    ids = torch.tensor([[1, 2, 3]])
    a = tl.trace(embed, ids, backward=True)
    a.output.sum().backward()
    b = tl.trace(embed, ids, backward=True)
    b.output.sum().backward()
    assert tl.debug.compare(a, b).first_gradient_divergence is None


def test_released_graphs_are_said_by_the_next_backward_only():
    class Tanh(OneLinear):
        def forward(self, x):
            return torch.tanh(self.fc(x)).sum()

    model = Tanh()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        for _ in range(9):
            model(torch.randn(2, 3))  # evaluations with grad on, never backwarded
        model(torch.randn(2, 3)).backward()
        model(torch.randn(2, 3)).backward()
    first, second = rec.recordings[-2].backward[0], rec.recordings[-1].backward[0]
    assert "released before a backward reached them" in first.footer_extra[-1]
    assert second.footer_extra[-1] == "no non-finite gradients"


class NormOfZeros(nn.Module):
    """`z / z.norm()` with z == 0 in value (`h - h.detach()`) but not in gradient: 0/0 in the
    forward and in the backward, whichever compiler runs it (a `* 0` inductor folds away)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        z = h - h.detach()
        return (z / z.norm()).sum()


class SqrtAtZero(nn.Module):
    """`sqrt(z)` with z == 0 in value but not in gradient: a finite forward whose backward divides
    by zero, whichever compiler runs it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.sqrt(h - h.detach()).sum()


@pytest.mark.parametrize("case", ["nan_in_the_loss", "norm_at_zero", "sqrt_at_zero"])
def test_compiled_inductor_backward_names_what_it_can_see(case):
    """Under inductor a graph's backward is one node: a NaN from the loss is named at the output it
    reached; one born inside the compiled backward is named at the graph's ops, and one made of the
    NaN the graph's forward made is said to be its consequence."""
    torch._dynamo.reset()
    model = {"norm_at_zero": NormOfZeros, "sqrt_at_zero": SqrtAtZero}.get(case, SafeSqrt)()
    compiled = tl.compile(model, backward=True, on_nonfinite="track")
    out = compiled(torch.randn(3, 4))
    (out * float("nan") if case == "nan_in_the_loss" else out).backward()
    recording = compiled.torchlens.last_recording
    first = recording.backward[0].findings[0]
    if case == "nan_in_the_loss":
        assert first.text.startswith("NaN in the gradient reaching the output out")
    elif case == "sqrt_at_zero":
        assert recording.findings == () and first.event.op == "CompiledFunctionBackward" and first.birth
        assert re.search(r"gradient born at ~\d+ CompiledFunctionBackward, the backward of the compiled "
                         r"graph of #2\.\.#\d+", first.text)
    else:
        [forward] = recording.findings
        assert forward.text.startswith("NaN born at #6 div")
        assert first.event.op == "CompiledFunctionBackward" and not first.birth
        assert re.search(r"NaN gradient at ~\d+ CompiledFunctionBackward, the backward of the compiled graph of "
                         r"#2\.\.#\d+ \(nan=\d+\), out of the forward's NaN: #6 div produced NaN$", first.text)


@pytest.mark.parametrize("rung", ["off", "exact"])
def test_measuring_a_training_forward_adds_no_node_to_autograd(rung):
    """Statistics and tracking reduce detached values: a forward with grad on makes exactly the
    autograd nodes it makes without torchlens (each extra node is work, and memory, per op)."""
    model, x = tiny_gpt().train(), tokens()
    counter = torch._C._autograd._get_sequence_nr
    torch.manual_seed(0)
    before = counter()
    model(x)
    plain = counter() - before
    torch.manual_seed(0)
    before = counter()
    tl.record(model, x, value_stats=rung, on_nonfinite="track", backward=True)
    assert counter() - before == plain > 50


def test_a_backward_attempt_on_cuda_tensors_says_kernel_errors_surface_later():
    from torchlens.events import BackwardAttempt, Scope, TensorMeta
    from torchlens.narration.grammar import render_attempt

    scope = Scope("fc", "Linear", Scope("", "Net", None))
    received = (TensorMeta((2, 4), torch.float32, torch.device("cuda", 0)),)
    lines = render_attempt(BackwardAttempt("AddmmBackward0", 3, scope, None, received, "#2 linear @fc"), True)
    assert lines[0] == "!! attempted ~3 AddmmBackward0 <- #2 linear @fc  received: [2,4] f32 cuda  (not proven culprit)"
    assert "earlier node" in lines[1] and "CUDA_LAUNCH_BLOCKING=1" in lines[1]
    on_cpu = (TensorMeta((2, 4), torch.float32, torch.device("cpu")),)
    assert len(render_attempt(BackwardAttempt("AddmmBackward0", 3, scope, None, on_cpu, "#2 linear @fc"), True)) == 1


# -- models we did not write ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["distilbert", "t5", "nn_transformer_encoder"])
def test_training_steps_of_real_architectures_narrate_every_node_with_gradients_bitwise(name):
    from real_models import TRAINING

    case = TRAINING[name]

    def step(recorder):
        model, args, kwargs = case.built()
        torch.manual_seed(5)  # the same dropout masks
        with (tl.recording.Recorder(model, backward=True, on_nonfinite="track") if recorder
              else contextlib.nullcontext()) as rec:
            output = model(*args, **kwargs)
            made = torch._C._autograd._get_sequence_nr()  # nodes made after this are the loss's
            loss = case.loss(output)
            expected = len([n for n in reachable_nodes(loss.grad_fn)
                            if type(n).__name__ == "AccumulateGrad" or n._sequence_nr() < made])
            loss.backward()
        return rec, expected, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    _, _, plain = step(False)
    rec, expected, narrated = step(True)
    assert_bitwise(narrated, plain)
    [backward] = rec.recordings[0].backward
    assert len(backward.nodes) == expected and backward.finished
    assert sorted(e.label for e in backward.nodes if e.label) == sorted(plain)
    assert backward.footer_extra[-1] == "no non-finite gradients"


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_real_model_under_no_grad_or_inference_mode_is_narrated_unchanged_and_watches_nothing(context):
    from real_models import qwen2

    model, args, kwargs = qwen2()
    guard = torch.no_grad if context == "no_grad" else torch.inference_mode
    with guard():
        plain = model(*args, **kwargs).logits
    sink = io.StringIO()
    with tl.recording.Recorder(model, narrate=sink, backward=True, on_nonfinite="track") as rec:
        with guard():
            narrated = model(*args, **kwargs).logits
    assert torch.equal(plain, narrated)
    assert rec.recordings[0].backward == [] and "-- backward" not in sink.getvalue()


def test_an_infinity_in_the_second_gradient_of_a_two_output_node_is_born_there():
    """`MulBackward0` sends a gradient to each factor; only the one multiplied by the large factor
    overflows. Every other node's gradients are finite: the tracker must look at every part."""

    class Product(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor([3e38]))
            self.b = nn.Parameter(torch.tensor([1.0]))

        def forward(self, x):
            return (self.a * self.b * x).sum()

    model = Product()
    with tl.recording.Recorder(model, backward=True, on_nonfinite="track") as rec:
        model(torch.ones(1)).backward(torch.tensor(4.0))
    [backward] = rec.recordings[0].backward
    first = backward.first_nonfinite
    assert first.op == "MulBackward0" and re.fullmatch(r"#\d+ mul", first.forward)
    assert backward.findings[0].text.startswith(f"+inf gradient born at ~{first.ordinal} MulBackward0")
    assert model.b.grad.isinf().all() and model.a.grad.isfinite().all()
