"""A compiled transcript reads like the eager one, line for line, on models we did not write.

For every model of the zoo, the op and module lines of `tl.trace(..., compiled=...)` equal those of
`tl.record(...)` (ordinals aside). The legitimate differences, and how the test handles each:

- **Library code that branches on compiling.** transformers checks `is_torchdynamo_compiling()`
  (e.g. it skips `padding_mask.all()` shortcuts under compile) and so runs other ops. The eager run
  here is given the compile path (transformers' check answers True), so both run the same code.
  torch's own `nn.TransformerEncoder` leaves its nested-tensor fast path when compiling; it is
  left out, with that reason.
- **Results nothing reads.** Dynamo removes an op whose result no later op reads (reading only
  its shape does not count: dynamo knows shapes) and the forward does not return (masking code computes `cache_position[None, None, None, None]` and drops it)
  before any backend sees the graph. Such ops may be missing from the compiled transcript, and
  only such ops: each is checked to be unread in a plain run of the model.
"""

import contextlib
import difflib
import io
import re
import sys

import pytest
import torch
from real_models import REAL_MODELS
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import torchlens as tl

pytest.importorskip("transformers")

# torch takes another path under compile (no nested-tensor fast path): compiled and eager differ
# without torchlens.
LEFT_OUT = {"nn_transformer_encoder"}
NAMES = [name for name in REAL_MODELS if name not in LEFT_OUT]
_ORDINAL = re.compile(r"#\d+\s*")


@contextlib.contextmanager
def transformers_compile_path():
    """transformers' `is_torchdynamo_compiling()` answers True: eager runs the compiled code path.
    (The kernel hub's function wrappers still dispatch to a private copy of themselves eagerly and
    call their function when compiling: narration names both one scope.)"""
    try:
        import transformers.utils.import_utils as import_utils
    except ImportError:
        yield
        return
    yield from _transformers_compiling(import_utils)


def _transformers_compiling(import_utils):
    original = import_utils.is_torchdynamo_compiling
    patched = [module for module in list(sys.modules.values())
               if getattr(module, "__name__", "").startswith("transformers")
               and getattr(module, "is_torchdynamo_compiling", None) is original]
    for module in patched:
        module.is_torchdynamo_compiling = lambda: True
    try:
        yield
    finally:
        for module in patched:
            module.is_torchdynamo_compiling = original


class UnreadResults(TorchFunctionMode):
    """Which ops of a plain forward produce results that nothing reads and that are not returned."""

    def __init__(self):
        super().__init__()
        self.produced = []  # (op name, output shape, id of the output tensor)
        self.kept = []  # the outputs themselves, so that their ids stay unique
        self.read = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(value, torch.Tensor) for value in tree_flatten(out)[0]):
            # read by an op that computes a tensor (`x.shape` reads no values: dynamo knows it)
            self.read.update(id(value) for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor))
        if isinstance(out, torch.Tensor):
            name = getattr(func, "__name__", "").strip("_")
            self.produced.append((name, list(out.shape), id(out)))
            self.kept.append(out)
        return out

    def unread(self, returned) -> set:
        returned_ids = {id(value) for value in tree_flatten(returned)[0] if isinstance(value, torch.Tensor)}
        return {(name, str(shape).replace(" ", "")) for name, shape, ident in self.produced
                if ident not in self.read and ident not in returned_ids}


def _lines(text):
    return [_ORDINAL.sub("", line) for line in text.splitlines() if not line.startswith("--")]


def _op_and_shape(line):
    fields = line.split()
    return fields[0], fields[1]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", NAMES)
def test_compiled_transcript_equals_the_eager_one_line_for_line(name, mode):
    model, args, kwargs = REAL_MODELS[name].build()
    eager, compiled = io.StringIO(), io.StringIO()
    with mode(), transformers_compile_path():
        tl.record(model, *args, narrate=eager, **kwargs)
        probe = UnreadResults()
        with probe:
            returned = model(*args, **kwargs)
    torch._dynamo.reset()
    try:
        with mode():
            tl.trace(model, *args, narrate=compiled, compiled={"compiler": "eager"}, **kwargs)
    finally:
        torch._dynamo.reset()
    eager_lines, compiled_lines = _lines(eager.getvalue()), _lines(compiled.getvalue())
    unread = probe.unread(returned)
    matcher = difflib.SequenceMatcher(a=eager_lines, b=compiled_lines, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        assert tag == "delete", (f"{name}: compiled differs from eager:\n"
                                 + "\n".join(["- " + line for line in eager_lines[a0:a1]]
                                             + ["+ " + line for line in compiled_lines[b0:b1]]))
        for line in eager_lines[a0:a1]:
            assert _op_and_shape(line) in unread, f"{name}: only eager narrates {line.strip()!r}, whose result is read"
    assert len(compiled_lines) >= len(eager_lines) - 4  # at most a few dropped results


class Scaled(torch.nn.Module):
    """A float attribute and a float argument: dynamo wraps both into tensors for the graph when
    shapes are dynamic, or once a changing float (a temperature) made it recompile."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.scale = 0.5

    def forward(self, x, temperature):
        return torch.softmax(self.proj(x) * self.scale / temperature, dim=-1)


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "recompiled"])
def test_floats_dynamo_wraps_for_the_graph_are_not_narrated_as_ops(dynamic):
    model, x = Scaled(), torch.randn(2, 8)
    eager = _lines(tl.record(model, x, 0.7, narrate=io.StringIO()).narrate())
    torch._dynamo.reset()
    sink = io.StringIO()
    try:
        compiled = tl.compile(model, narrate=sink, compiler="eager", dynamic=dynamic)
        outputs = [compiled(x, temperature) for temperature in (0.7, 0.9, 1.3)]
    finally:
        torch._dynamo.reset()
    passes = sink.getvalue().split("-- pass ")[1:]
    assert len(passes) == 3
    for text in passes:
        assert _lines(text)[1:] == eager  # (the first line is the rest of the pass header)
        assert "between graphs" not in text and "as_tensor" not in text
    assert torch.equal(outputs[2], model(x, 1.3))


def test_a_real_model_compiled_with_dynamic_shapes_narrates_what_eager_narrates():
    model, args, kwargs = REAL_MODELS["mistral"].build()
    with torch.no_grad(), transformers_compile_path():
        eager = [(e.op, e.scope.path) for e in tl.record(model, *args, **kwargs).ops]
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            trace = tl.trace(model, *args, compiled={"compiler": "eager", "dynamic": True}, **kwargs)
    finally:
        torch._dynamo.reset()
    compiled = [(e.op, e.scope.path) for e in trace.ops]
    assert "between graphs" not in trace.narrate()
    assert [op for op in compiled if op not in eager] == []
    assert len(eager) - 4 <= len(compiled) <= len(eager)


def test_a_function_wrapper_outside_the_model_is_named_after_its_function_eager_and_compiled():
    """transformers' kernel hub replaces `apply_rotary_pos_emb` by a module of a factory-made
    class `Func`, kept in a global: not part of the model. Its calls are named after the function
    the user knows, with where it lives, alike in both substrates, and compare pairs them."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model, ids = transformers.LlamaForCausalLM(config).eval(), torch.tensor([[1, 2, 3, 4]])
    lines = []
    eager = tl.trace(model, ids, narrate=lines.append)
    compiled = tl.trace(model, ids, compiled={"compiler": "eager"})
    path = "model.layers.0.self_attn.<apply_rotary_pos_emb>"
    enter = [line.strip() for line in lines if line.lstrip().startswith(f"> {path}")]
    assert enter == [f"> {path} (transformers.models.llama.modeling_llama.apply_rotary_pos_emb)"]
    for trace in (eager, compiled):
        assert {event.scope.path for event in trace.ops if "<" in event.scope.path} == {path}
    counts = tl.debug.compare(eager, compiled).counts
    assert counts["only_a"] == counts["only_b"] == 0 and counts["matched"] == len(eager.ops)


def test_a_module_made_on_the_fly_outside_the_model_keeps_its_class_name():
    class OnTheFly(nn.Module):
        def forward(self, x):
            return nn.Linear(2, 2)(x)

    events = tl.record(OnTheFly(), torch.ones(1, 2)).events
    assert [(event.scope.path, event.scope.type_name) for event in events if event.kind.value == "enter"] == \
        [("<Linear>", "Linear")]
