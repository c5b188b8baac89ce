"""Eager narration through the public API: grammar, structure, sinks, options, transcripts."""

from __future__ import annotations

import copy
import io
import logging
import os
import re

import pytest
import torch
from helpers import OP_LINE, check_nesting, op_lines, ordinals
from models import Tiny, conv_net, images, tiny_gpt, tokens

import torchlens as tl
from torchlens.narration.sinks import NEW_RUN

NarrationOptions = tl.options.NarrationOptions


def narrate_to_string(model, *args, **options):
    sink = io.StringIO()
    recording = tl.record(model, *args, narrate=NarrationOptions(sink=sink, **options))
    return sink.getvalue(), recording


def test_tiny_narrates_input_linear_relu_with_sites():
    text, _ = narrate_to_string(Tiny(), torch.tensor([[2.0, 3.0]]), sites=True)
    ops = op_lines(text)
    assert [OP_LINE.match(line).group("op") for line in ops] == ["input", "linear", "relu"]
    this_file = os.path.basename(__file__)
    assert all(this_file not in line for line in ops[:1]), "input sources have no site"
    # the linear line's site is the model's forward line that called self.proj (in models.py)
    assert re.search(r"models\.py:\d+$", ops[1]) and re.search(r"models\.py:\d+$", ops[2])
    assert "> proj (Linear)" in text and "< proj" in text


def test_transformer_and_conv_net_nest_module_lines_by_module_depth():
    text, rec = narrate_to_string(tiny_gpt(), tokens())
    # blocks.0 (1) calls attn (2) calls qkv (3): the ModuleList `blocks` is never called itself
    assert check_nesting(text) == 3
    assert "> blocks.0 (Block)" in text.splitlines() and "    > blocks.0.attn.qkv (Linear)" in text
    text, _ = narrate_to_string(conv_net(), images())
    assert check_nesting(text) == 2
    assert "  > block.conv1 (Conv2d)" in text


def test_ordinals_count_every_op_line_once_in_order():
    text, rec = narrate_to_string(tiny_gpt(), tokens())
    assert ordinals(text) == list(range(1, len(op_lines(text)) + 1))
    assert [e.ordinal for e in rec.ops] == ordinals(text)


def test_events_carry_module_depth_meta_and_kind():
    rec = tl.record(tiny_gpt(), tokens(2, 5))
    kinds = {e.kind for e in rec.events}
    assert kinds == set(tl.EventKind) - {tl.EventKind.NODE, tl.EventKind.GRAD}  # those are a backward's
    qkv = next(e for e in rec.events if e.module == "blocks.1.attn.qkv" and e.kind is tl.EventKind.OP)
    assert qkv.op == "linear" and qkv.depth == 3
    assert qkv.outputs[0] == tl.TensorMeta((2, 5, 96), torch.float32, torch.device("cpu"))
    first = rec.events[0]
    assert first.kind is tl.EventKind.INPUT and first.label == "idx" and first.ordinal == 1
    assert rec.events[-1].kind is tl.EventKind.OUTPUT and rec.events[-1].label == "out"


def test_multi_output_ops_list_every_tensor():
    text, _ = narrate_to_string(tiny_gpt(), tokens())
    split = next(line for line in op_lines(text) if " split " in line)
    assert split.count("f32 cpu") == 3


@pytest.mark.parametrize("make", [tiny_gpt, conv_net])
def test_narration_never_changes_outputs_or_gradients(make, tmp_path):
    model = make()
    model.train()  # batch norm statistics and dropout-free models: deterministic in train mode too
    twin = copy.deepcopy(model)
    x = tokens(2, 6) if make is tiny_gpt else images(2)
    plain = twin(x)
    plain.float().pow(2).mean().backward()
    rec = tl.record(model, x, narrate=str(tmp_path / "n.log"))
    rec.output.float().pow(2).mean().backward()
    assert torch.equal(plain, rec.output)
    for (name, p), (_, q) in zip(twin.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), (_, c) in zip(twin.named_buffers(), model.named_buffers()):
        assert torch.equal(b, c), name


def test_grad_modes_autocast_and_train_eval_behave_as_without_narration():
    model, x = tiny_gpt(), tokens()
    sink = io.StringIO()
    with torch.no_grad():
        out = tl.record(model, x, narrate=sink).output
    assert not out.requires_grad
    with torch.inference_mode():
        out = tl.record(model, x, narrate=sink).output
    assert out.is_inference()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        rec = tl.record(model, x, narrate=sink)
    assert rec.output.dtype == expected.dtype == torch.bfloat16 and torch.equal(rec.output, expected)
    assert any(e.outputs and e.outputs[0].dtype == torch.bfloat16 for e in rec.ops)
    model.train()
    tl.record(model, x)
    assert model.training and all(m.training for m in model.modules())


def test_metadata_narration_works_on_the_meta_device():
    model = tiny_gpt().to("meta")
    idx = torch.zeros(1, 8, dtype=torch.long, device="meta")
    text, rec = narrate_to_string(model, idx, sites=True)
    assert rec.output.device.type == "meta"
    assert "[1,8,64] f32 meta" in text and check_nesting(text)


def test_same_run_twice_gives_the_same_bytes_in_a_file(tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    for path in (first, second):
        torch.manual_seed(0)
        tl.record(tiny_gpt(), tokens(), narrate=NarrationOptions(sink=str(path), sites=True))
    assert first.read_bytes() == second.read_bytes() and first.stat().st_size > 0


def test_recording_renders_the_live_bytes_after_the_fact(tmp_path):
    path = tmp_path / "live.log"
    options = NarrationOptions(sink=path, sites=True, prefix="[t] ", max_lines=30, select=~tl.in_module("blocks.0.mlp"))
    rec = tl.record(tiny_gpt(), tokens(), narrate=options)
    assert rec.narrate() == path.read_text()
    assert rec.narrate(last=5) == "".join(line + "\n" for line in path.read_text().splitlines()[-5:])


# -- sinks ---------------------------------------------------------------------------------------


def test_path_sink_appends_and_flushes_every_line_during_the_forward(tmp_path):
    path = tmp_path / "run.log"
    path.write_text("earlier content\n")
    seen_mid_forward = []
    model = Tiny()
    model.proj.register_forward_hook(lambda m, a, o: seen_mid_forward.append(path.read_text()))
    tl.record(model, torch.randn(1, 2), narrate=path)
    mid = seen_mid_forward[0]
    assert mid.startswith("earlier content\n") and "#2    linear" in mid, "lines must be on disk as they happen"
    assert path.read_text().startswith(f"earlier content\n{NEW_RUN}\n#1")


def _runs(path) -> list:
    return path.read_text().split(NEW_RUN + "\n")


def test_runs_appended_to_one_file_stay_apart_and_one_run_s_file_is_its_transcript_byte_for_byte(tmp_path):
    """Re-running a script that narrates to a file stacks its runs: each run after the first
    begins with one `-- new run` note, so the file still splits into the runs' transcripts."""
    path, model = tmp_path / "run.log", Tiny()
    first = tl.record(model, torch.ones(1, 2), narrate=path)
    assert path.read_text() == first.narrate()
    second = tl.record(model, torch.full((1, 2), 2.0), narrate=path)
    assert _runs(path) == [first.narrate(), second.narrate()]


@pytest.mark.parametrize("entry", ["record", "recorder", "compiled"])
def test_overwrite_starts_the_file_afresh_once_per_use_of_the_options(tmp_path, entry):
    """`overwrite=True` (PySnooper's word): the file holds this use's lines only, all its passes
    (a Recorder block's, a compiled model's calls) and never an earlier run's."""
    path, model, x = tmp_path / "run.log", Tiny(), torch.ones(1, 2)
    path.write_text("a stale run\n")
    options = NarrationOptions(sink=path, overwrite=True)
    if entry == "record":
        recording = tl.record(model, x, narrate=options)
        assert path.read_text() == recording.narrate()
        return
    if entry == "recorder":
        with tl.recording.Recorder(model, narrate=options) as recorder:
            model(x)
            model(x)
        expected = "".join(r.narrate() for r in recorder.recordings)
    else:
        compiled = tl.compile(model, narrate=options, compiler="eager")
        compiled(x)
        compiled(x)
        expected = None
    text = path.read_text()
    assert "a stale run" not in text and NEW_RUN not in text
    assert text.count("-- end:") == 2 and (expected is None or text == expected)


def test_overwrite_of_one_file_every_rank_writes_is_refused(monkeypatch, tmp_path):
    import torchlens.narration.ranks

    monkeypatch.setattr(torchlens.narration.ranks, "_initialized_group_size", lambda: 2)
    monkeypatch.setattr(torchlens.narration.ranks, "rank_and_world_size", lambda: (0, 2))
    with pytest.raises(tl.errors.OptionValueError, match=r"name a file per rank \('run-\{rank\}.log'\)"):
        tl.record(Tiny(), torch.ones(1, 2), narrate=NarrationOptions(sink=tmp_path / "run.log", overwrite=True))
    tl.record(Tiny(), torch.ones(1, 2), narrate=NarrationOptions(sink=tmp_path / "run-{rank}.log", overwrite=True))
    assert (tmp_path / "run-0.log").exists()


def test_stream_sink_is_flushed_per_line_and_left_open():
    class Counting(io.StringIO):
        flushes = 0

        def flush(self):
            Counting.flushes += 1
            super().flush()

    stream = Counting()
    tl.record(Tiny(), torch.randn(1, 2), narrate=stream)
    assert not stream.closed
    assert Counting.flushes >= len(stream.getvalue().splitlines())


def test_callable_and_logger_sinks_get_lines_without_newlines(caplog):
    lines = []
    tl.record(Tiny(), torch.randn(1, 2), narrate=lines.append)
    assert len(lines) == 7 and not any("\n" in line for line in lines)
    logger = logging.getLogger("torchlens.test")
    with caplog.at_level(logging.INFO, logger="torchlens.test"):
        tl.record(Tiny(), torch.randn(1, 2), narrate=logger)
        tl.record(Tiny(), torch.randn(1, 2), narrate=logger.warning)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:7] == lines and messages[7:] == lines
    assert [r.levelno for r in caplog.records][-1] == logging.WARNING


def test_narrate_true_writes_to_stderr_and_a_selector_alone_narrates_to_stderr(capsys):
    tl.record(Tiny(), torch.randn(1, 2), narrate=True)
    err = capsys.readouterr().err
    assert "#2    linear" in err
    tl.record(tiny_gpt(), tokens(), narrate=tl.in_module("blocks.1.mlp"))
    err = capsys.readouterr().err
    assert "> blocks.1.mlp (MLP)" in err and "blocks.0" not in err


def test_no_environment_variable_turns_narration_on(monkeypatch, capsys):
    for name in ("TORCHLENS_NARRATE", "TORCHLENS", "TL_NARRATE", "TORCHLENS_ECHO"):
        monkeypatch.setenv(name, "1")
    tl.record(Tiny(), torch.randn(1, 2))
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_a_failing_sink_turns_narration_off_with_one_warning_and_the_run_goes_on():
    calls = []

    def broken(line):
        calls.append(line)
        raise OSError("disk full")

    model, x = tiny_gpt(), tokens()
    with pytest.warns(tl.errors.NarrationWarning, match="disk full") as warned:
        rec = tl.record(model, x, narrate=broken)
    assert len(warned) == 1 and len(calls) == 1
    assert torch.equal(rec.output, model(x)) and len(rec.ops) > 50


def test_the_users_exception_wins_over_a_failing_sink():
    class Boom(torch.nn.Module):
        def forward(self, x):
            raise KeyError("user bug")

    def broken(line):
        raise OSError("sink bug")

    with pytest.warns(tl.errors.NarrationWarning):
        with pytest.raises(KeyError, match="user bug"):
            tl.record(Boom(), torch.randn(1), narrate=broken)


# -- options -------------------------------------------------------------------------------------


def test_normalize_strips_directories_and_device_indices():
    text, _ = narrate_to_string(Tiny(), torch.randn(1, 2), sites=True, normalize=True)
    linear = op_lines(text)[1]
    assert re.search(r"  models\.py:\d+$", linear) and "/" not in linear
    from torchlens.narration import grammar

    assert grammar.device_name(torch.device("cuda", 3), normalize=True) == "cuda"
    assert grammar.device_name(torch.device("cuda", 3)) == "cuda:3"


def test_prefix_is_on_every_line():
    text, _ = narrate_to_string(tiny_gpt(), tokens(), prefix="[rank0] ")
    assert all(line.startswith("[rank0] ") for line in text.splitlines())


def test_max_lines_stops_with_one_note_and_the_footer_counts_the_rest():
    full, _ = narrate_to_string(tiny_gpt(), tokens())
    text, _ = narrate_to_string(tiny_gpt(), tokens(), max_lines=10)
    lines = text.splitlines()
    assert lines[:10] == full.splitlines()[:10]
    assert lines[10] == "-- max_lines=10 reached: narration stops here; the run goes on"
    total = len(full.splitlines()) - 1  # every line but the footer
    assert f"{total - 10} lines not printed (max_lines=10)" in lines[-1]
    assert len(lines) == 12


def test_depth_folds_deeper_ops_into_their_ancestor():
    full, rec = narrate_to_string(tiny_gpt(), tokens())
    text, _ = narrate_to_string(tiny_gpt(), tokens(), depth=2)
    assert "> blocks.0.attn (Attention)" in text and "blocks.0.attn.qkv" not in text
    folded_attn = len([e for e in rec.ops if e.module.startswith("blocks.0.attn.")])
    attn_exit = next(line for line in text.splitlines() if line.strip().startswith("< blocks.0.attn"))
    assert attn_exit.endswith(f"[{folded_attn} ops folded]")
    deeper = len([e for e in rec.ops if e.depth > 2])
    assert f"{deeper} folded (depth=2)" in text.splitlines()[-1]
    # ordinals stay global: the ops still shown keep their full-transcript numbers
    assert set(ordinals(text)) <= set(ordinals(full))
    assert check_nesting(text)


def test_depth_zero_shows_only_root_level_ops():
    text, rec = narrate_to_string(tiny_gpt(), tokens(), depth=0)
    assert ">" not in "".join(line[:1] for line in text.splitlines())
    assert [int(n) for n in ordinals(text)] == [e.ordinal for e in rec.ops if e.depth == 0]


def test_in_module_narrates_one_subtree_with_its_enter_line_and_global_ordinals():
    full, rec = narrate_to_string(tiny_gpt(), tokens())
    text, _ = narrate_to_string(tiny_gpt(), tokens(), select=tl.in_module("blocks.1.attn"))
    body = text.splitlines()[:-1]
    assert body[0] == "  > blocks.1.attn (Attention)" and body[-1] == "  < blocks.1.attn"
    expected = [e.ordinal for e in rec.ops if e.module.startswith("blocks.1.attn")]
    assert ordinals(text) == expected and expected[0] > 20
    full_lines = {OP_LINE.match(line).group("ordinal"): line for line in op_lines(full)}
    assert all(full_lines[str(n)] == line for n, line in zip(ordinals(text), op_lines(text)))


def test_selectors_compose_and_plain_predicates_work():
    sel = tl.in_module("blocks.0.mlp") | tl.in_module("head")
    text, _ = narrate_to_string(tiny_gpt(), tokens(), select=sel)
    assert "> blocks.0.mlp (MLP)" in text and "> head (Linear)" in text and "blocks.1" not in text
    text, _ = narrate_to_string(tiny_gpt(), tokens(), select=tl.in_module("blocks.0") & ~tl.in_module("blocks.0.attn"))
    assert "blocks.0.mlp" in text and "blocks.0.attn" not in text
    text, rec = narrate_to_string(tiny_gpt(), tokens(), select=lambda e: e.op == "linear")
    assert {OP_LINE.match(line).group("op") for line in op_lines(text)} == {"linear"}
    assert len(op_lines(text)) == sum(1 for e in rec.ops if e.op == "linear")
    assert f"{len(rec.ops) - len(op_lines(text))} not selected" in text.splitlines()[-1]


def test_narrate_select_after_the_fact():
    rec = tl.record(tiny_gpt(), tokens())
    text = rec.narrate(select=tl.in_module("blocks.1.mlp"))
    assert text.splitlines()[0] == "  > blocks.1.mlp (MLP)"
    assert repr(text) == str(text)  # prints as the transcript at a prompt


# -- Recorder ------------------------------------------------------------------------------------


def test_recorder_narrates_every_pass_with_pass_numbers(tmp_path):
    path = tmp_path / "passes.log"
    model = tiny_gpt()
    with tl.recording.Recorder(model, narrate=path) as rec:
        model(tokens(1, 4))
        model(tokens(2, 6))
    assert rec.passes == 2
    text = path.read_text()
    assert text.splitlines()[0] == "-- pass 1" and "-- pass 2" in text.splitlines()
    assert rec.recordings[1].events[0].outputs[0].shape == (2, 6)
    assert "".join(r.narrate() for r in rec.recordings) == text
    model(tokens())  # after the block: not recorded
    assert rec.passes == 2


def test_recorder_records_a_failed_pass_and_keeps_going(tmp_path):
    model = Tiny()
    with tl.recording.Recorder(model) as rec:
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(1, 3))
        model(torch.randn(1, 2))
    assert isinstance(rec.recordings[0], tl.PartialTrace) and info.value.partial_trace is rec.recordings[0]
    assert not isinstance(rec.recordings[1], tl.PartialTrace)
    assert len(model._forward_hooks) == 0 and len(model._forward_pre_hooks) == 0


# -- trace ---------------------------------------------------------------------------------------


def test_trace_keeps_detached_copies_that_later_in_place_ops_do_not_change():
    model, x = conv_net(), images()
    x.requires_grad_(True)
    tr = tl.trace(model, x)
    bn1 = next(e for e in tr.ops if e.module == "block.bn1")
    kept = tr.value(bn1.ordinal)
    assert not kept.requires_grad and kept.grad_fn is None
    assert (kept < 0).any(), "the in-place relu after bn1 must not have changed the kept copy"
    relu = next(e for e in tr.ops if e.module == "block.relu")
    assert torch.equal(tr.value(relu.ordinal), kept.clamp_min(0))
    assert torch.equal(tr.value(tr.ops[-1].ordinal), tr.output.detach())
    assert torch.equal(tr.value(1), x.detach())


def test_trace_budget_is_a_typed_error_that_names_the_fix():
    model, x = tiny_gpt(), tokens()
    with pytest.raises(tl.errors.TraceBudgetError, match=r"max_bytes=4096.*keep_on_cpu=True") as info:
        tl.trace(model, x, max_bytes=4096)
    assert isinstance(info.value, MemoryError)
    assert info.value.partial_trace.events, "the partial trace says how far the run got"
    assert tl.trace(model, x, max_bytes=None, keep_on_cpu=True).values


# -- bad input -----------------------------------------------------------------------------------


def test_bad_input_gets_typed_errors_naming_the_argument():
    model, x = Tiny(), torch.randn(1, 2)
    with pytest.raises(tl.errors.OptionTypeError, match=r"narrate= takes True.*got 42") as info:
        tl.record(model, x, narrate=42)
    assert isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match=r"unknown option 'site'.*did you mean 'sites'"):
        NarrationOptions(site=True)
    with pytest.raises(ValueError, match=r"max_lines=-1"):
        NarrationOptions(max_lines=-1)
    with pytest.raises(TypeError, match=r"depth=.*whole number"):
        NarrationOptions(depth=1.5)
    with pytest.raises(tl.errors.ModelTypeError, match="nn.Module"):
        tl.record(lambda t: t, x)
    with pytest.raises(ValueError, match=r"value_stats='exactt' \(did you mean 'exact'\?\)"):
        tl.record(model, x, value_stats="exactt")
    with pytest.raises(ValueError, match=r"on_nonfinite='trak'"):
        tl.record(model, x, on_nonfinite="trak")
    with pytest.raises(TypeError, match=r"'narate'.*did you mean 'narrate'"):
        tl.record(model, x, narate=True)
    with pytest.raises(TypeError, match="sink="):
        NarrationOptions(sink=3.5)
    with pytest.raises(tl.errors.OptionTypeError, match=r"'stats_on', an option of compiled runs only.*tl.compile"):
        tl.record(model, x, value_stats="exact", stats_on="module_outputs")


def test_an_unknown_module_path_names_the_nearest_paths():
    model, x = tiny_gpt(), tokens()
    with pytest.raises(tl.errors.UnknownModuleError, match=r"'blocks.1.atn'.*did you mean 'blocks.1.attn'") as info:
        tl.record(model, x, narrate=tl.in_module("blocks.1.atn"))
    assert isinstance(info.value, LookupError) and isinstance(info.value, ValueError)
    with pytest.raises(tl.errors.UnknownModuleError, match=r"modules under 'blocks.1': blocks.1.attn, blocks.1.ln1"):
        tl.record(model, x, narrate=tl.in_module("blocks.1.feedforward.up"))
    with pytest.raises(tl.errors.UnknownModuleError):
        tl.recording.Recorder(model, narrate=tl.in_module("nope"))


def test_forward_keyword_arguments_pass_through():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    rec = tl.record(Scaled(), torch.ones(2), scale=3.0)
    assert torch.equal(rec.output, torch.full((2,), 3.0))


def test_module_names_follow_a_model_changed_between_forwards():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    x = torch.randn(1, 2)
    tl.record(model, x)
    model[1] = torch.nn.ReLU()                      # replaced since the first forward
    model.add_module("extra", torch.nn.Softplus())  # added since
    rec = tl.record(model, x, narrate=tl.in_module("extra"))  # a valid selection now
    assert [(e.op, e.scope.path, e.scope.type_name) for e in rec.ops[1:]] == [
        ("linear", "0", "Linear"), ("relu", "1", "ReLU"), ("softplus", "extra", "Softplus")]


def test_module_names_follow_a_submodule_moved_to_another_parent_between_forwards():
    """The same modules under other names (a layer moved from one block to its sibling) must be
    narrated under the new names: the table of names is read again, not reused."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Sequential()
            self.b = torch.nn.Sequential()
            self.a.add_module("y", torch.nn.Linear(2, 2))

        def forward(self, x):
            return self.b(self.a(x))

    model, x = Model(), torch.randn(1, 2)
    assert tl.record(model, x).ops[1].scope.path == "a.y"
    layer = model.a.y
    del model.a.y
    model.b.add_module("y", layer)
    rec = tl.record(model, x, narrate=tl.in_module("b.y"))  # a valid selection now
    assert [(e.op, e.scope.path) for e in rec.ops[1:]] == [("linear", "b.y")]


def test_module_names_of_a_model_whose_tree_has_a_cycle_are_read_once():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].back = model  # a reference cycle through `_modules` (named_modules stops at it)
    x = torch.randn(1, 2)
    assert [e.scope.path for e in tl.record(model, x).ops[1:]] == ["0"]
    assert [e.scope.path for e in tl.record(model, x).ops[1:]] == ["0"]


class Splits(torch.nn.Module):
    def forward(self, x):
        return torch.split(x, 1)


@pytest.mark.parametrize("rows, shown", [(4, "[1,2] f32 cpu, [1,2] f32 cpu, [1,2] f32 cpu, [1,2] f32 cpu"),
                                         (5, "[1,2] f32 cpu, [1,2] f32 cpu, [1,2] f32 cpu, [1,2] f32 cpu, "
                                             "... (+1 more)")])
def test_an_op_line_shows_four_outputs_and_counts_the_rest(rows, shown):
    text, _ = narrate_to_string(Splits(), torch.zeros(rows, 2))
    [split] = [line for line in op_lines(text) if " split " in line]
    assert re.search(r"split\s+" + re.escape(shown) + r"(\s|$)", split), split
