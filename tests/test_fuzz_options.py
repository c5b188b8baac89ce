"""Fuzzed options: every public entry point fed wrong types, wrong values and valid ones.

An oracle in this file (the `judge_*` functions) says, for each drawn value, whether it is valid
and, when it is not, what the user must get: a `tl.errors.TorchlensError` that is also the builtin
they would naturally catch (`TypeError`, `ValueError`, `LookupError`), whose message names the
argument and what it accepts. Nothing invalid may be accepted silently; every valid combination
must run and give a recording; and after either outcome no hook, mode or per-thread state is left.

Compiled entry points compile with `compiler="eager"` only, and dynamo's caches are reset before
each compiled example so that many small compiles never reach its recompile limit.
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import pathlib
import shutil
import tempfile
from typing import NamedTuple, Tuple

import pytest
import torch
from helpers import leftover_state, module_hook_counts
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from models import Tiny

import torchlens as tl

EAGER_FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COMPILED_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TINY_MODULES = ("", "proj")  # `Tiny`'s module paths: the root and its Linear
TINY_OPS = ["input", "linear", "relu"]
VALUE_STATS = ("off", "reuse", "sampled", "exact")
ON_NONFINITE = (None, "track", "raise")
NARRATION_FIELDS = ("sink", "sites", "select", "max_lines", "prefix", "depth", "normalize", "tail_on_error",
                    "on_error_only", "symbolic_shapes")
TRACE_KEYWORDS = ("narrate", "value_stats", "on_nonfinite", "keep_on_cpu", "max_bytes")
COMPILE_MODES = ("default", "lite", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")

_LOGS = tempfile.mkdtemp(prefix="torchlens-fuzz-")
LOG_PATHS = (os.path.join(_LOGS, "str.log"), pathlib.Path(_LOGS, "path.log"))


@pytest.fixture(scope="module", autouse=True)
def _remove_logs():
    yield
    shutil.rmtree(_LOGS, ignore_errors=True)


class Lines(list):
    """A callable sink that keeps what it was given: `narrate=Lines()`."""

    def __call__(self, line: str) -> None:
        self.append(line)


# -- the oracle -----------------------------------------------------------------------------------


class Bad(NamedTuple):
    """One thing wrong with a call: the builtin its error must also be, and text its message must hold."""

    builtin: type
    fragments: Tuple[str, ...]


def judge_selector(selector) -> list:
    """A selector is checked against the model's modules when a run (or a compile) starts."""
    if selector is None or not hasattr(selector, "module_paths"):
        return []
    return [Bad(LookupError, (f"in_module({path!r})", "proj")) for path in selector.module_paths()
            if path not in TINY_MODULES]


def judge_narrate(value) -> list:
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, tl.options.NarrationOptions):
        return judge_selector(value.select)
    if hasattr(value, "module_paths"):
        return judge_selector(value)
    if isinstance(value, (str, os.PathLike, io.StringIO, logging.Logger)) or callable(value):
        return []
    return [Bad(TypeError, ("narrate=", "tl.in_module", "NarrationOptions"))]


def judge_choice(name: str, value, choices) -> list:
    if (value is None or isinstance(value, str)) and value in choices:
        return []
    example = repr(next(c for c in choices if c is not None))
    return [Bad(ValueError if isinstance(value, str) else TypeError, (f"{name}=", example))]


def judge_capture(narrate, value_stats, on_nonfinite) -> list:
    """The three keywords every entry point shares, and the one rule that ties two of them."""
    problems = judge_narrate(narrate) + judge_choice("value_stats", value_stats, VALUE_STATS)
    problems += judge_choice("on_nonfinite", on_nonfinite, ON_NONFINITE)
    if value_stats == "reuse" and on_nonfinite is None:
        problems.append(Bad(ValueError, ("value_stats='reuse'", "on_nonfinite=")))
    return problems


def judge_bool(name: str, value) -> list:
    return [] if isinstance(value, bool) else [Bad(TypeError, (f"{name}=", "True or False"))]


def judge_count(name: str, value, *, minimum: int = 0, none_ok: bool = True) -> list:
    if value is None and none_ok:
        return []
    if isinstance(value, bool) or not isinstance(value, int):
        return [Bad(TypeError, (f"{name}=", f">= {minimum}"))]
    return [] if value >= minimum else [Bad(ValueError, (f"{name}=", f">= {minimum}"))]


def judge_prefix(value) -> list:
    if not isinstance(value, str):
        return [Bad(TypeError, ("prefix=", "string"))]
    if len(("x" + value + "x").splitlines()) > 1:
        return [Bad(ValueError, ("prefix=", "line break"))]
    return []


def judge_sink(value) -> list:
    if value is None or value is True or isinstance(value, (str, os.PathLike, io.StringIO, logging.Logger)):
        return []
    if callable(value) and not hasattr(value, "module_paths"):
        return []
    return [Bad(TypeError, ("sink=", "a path", "callable"))]


def judge_select(value) -> list:
    if value is None or hasattr(value, "module_paths"):
        return []  # an unknown path is found when the options are used on a model
    if callable(value):
        return []
    return [Bad(TypeError, ("select=", "tl.in_module"))]


def judge_narration_field(name: str, value) -> list:
    if name == "sink":
        return judge_sink(value)
    if name == "select":
        return judge_select(value)
    if name == "prefix":
        return judge_prefix(value)
    if name in ("max_lines", "depth"):
        return judge_count(name, value)
    if name == "tail_on_error":
        return judge_count(name, value, none_ok=False)
    if name in NARRATION_FIELDS:
        return judge_bool(name, value)
    return [Bad(TypeError, (repr(name), "accepted: sink"))]


def registered_backends() -> set:
    return set(torch._dynamo.list_backends(exclude_tags=())) | {"eager", "torchlens"}


def judge_compiler(value) -> list:
    if value == "torchlens":
        return [Bad(ValueError, ("compiler='torchlens'", "inductor"))]
    if callable(value) or (isinstance(value, str) and value in registered_backends()):
        return []
    if isinstance(value, str):
        return [Bad(ValueError, (f"compiler={value!r}", "eager"))]
    return [Bad(TypeError, ("compiler=", "'inductor'"))]


def judge_compiled_option(key: str, value) -> list:
    """The options only a compiled run has (`live`, `compiler`, `stats_on`)."""
    if key == "live":
        return judge_bool("live", value)
    if key == "compiler":
        return judge_compiler(value)
    if value in ("ops", "module_outputs") and isinstance(value, str):
        return []
    return [Bad(ValueError if isinstance(value, str) else TypeError, ("stats_on=", "'module_outputs'"))]


def judge_torch_compile_keyword(key: str, value) -> list:
    if key in ("fullgraph", "disable"):
        return judge_bool(key, value)
    if key == "dynamic":
        return [] if value is None or isinstance(value, bool) else [Bad(TypeError, ("dynamic=", "None"))]
    if value is None or (isinstance(value, str) and value in COMPILE_MODES):
        return []
    return [Bad(ValueError if isinstance(value, str) else TypeError, ("mode=", "'max-autotune'"))]


def judge_compile_keywords(options: dict) -> list:
    """`tl.compile`'s keywords (and a `compiled=` dict's), apart from the three shared capture ones."""
    problems = []
    for key, value in options.items():
        if key in ("live", "compiler", "stats_on"):
            problems += judge_compiled_option(key, value)
        elif key in ("fullgraph", "dynamic", "mode", "disable"):
            problems += judge_torch_compile_keyword(key, value)
        elif key == "backend":
            problems.append(Bad(TypeError, ("backend", "compiler=")))
        elif key == "options":
            problems.append(Bad(TypeError, ("options=", "narrate")))
        elif key in NARRATION_FIELDS:  # a torchlens option in the wrong place: where it goes
            problems.append(Bad(TypeError, (repr(key), "narrate=tl.options.NarrationOptions(")))
        elif key in OTHER_ENTRIES_KEYWORDS:
            problems.append(Bad(TypeError, (repr(key), "not of tl.compile")))
        else:
            problems.append(Bad(TypeError, (repr(key), "narrate", "fullgraph")))
    return problems


NARRATION_FIELDS = set(inspect.signature(tl.options.NarrationOptions).parameters) - {"unknown"}
OTHER_ENTRIES_KEYWORDS = {"keep_on_cpu", "max_bytes", "keep", "tail", "dtensor_stats"}


def judge_compiled(value) -> list:
    """`tl.trace(compiled=...)`: False, True or a dict of `tl.compile` keywords."""
    if isinstance(value, bool):
        return []
    if not isinstance(value, dict):
        return [Bad(TypeError, ("compiled=", "dict"))]
    problems = [Bad(TypeError, (repr(key), "keyword of tl.trace itself")) for key in value if key in TRACE_KEYWORDS]
    return problems + judge_compile_keywords({k: v for k, v in value.items() if k not in TRACE_KEYWORDS})


def judge_backend_options(options) -> list:
    """`torch.compile(..., backend="torchlens", options=...)`: a dict of the compiled options."""
    if not isinstance(options, dict):
        return [Bad(TypeError, ("backend 'torchlens'", "as a dict", "narrate"))]
    problems = judge_capture(options.get("narrate"), options.get("value_stats", "off"), options.get("on_nonfinite"))
    for key, value in options.items():
        if key in ("live", "compiler", "stats_on"):
            problems += judge_compiled_option(key, value)
        elif key in NARRATION_FIELDS:
            problems.append(Bad(TypeError, (repr(key), "narrate=tl.options.NarrationOptions(")))
        elif key in OTHER_ENTRIES_KEYWORDS:
            problems.append(Bad(TypeError, (repr(key), "not of tl.compile")))
        elif key not in ("narrate", "value_stats", "on_nonfinite"):
            problems.append(Bad(TypeError, (repr(key), "accepted: narrate")))
    return problems


# -- running a call against the oracle ------------------------------------------------------------


def check_error(error: BaseException, problems: list) -> None:
    assert isinstance(error, tl.errors.TorchlensError), f"untyped {type(error).__name__}: {error}"
    assert any(isinstance(error, bad.builtin) and all(text in str(error) for text in bad.fragments)
               for bad in problems), f"{type(error).__name__}: {error}\n does not match any of {problems}"


def expect(problems: list, call, model):
    """Run `call`. With problems it must raise one of them; without, it must return its result.
    Either way it must leave no hook on `model`, no global hook or mode, no active compiled run."""
    hooks, state = module_hook_counts(model), leftover_state()
    if problems:
        event("invalid")
        with pytest.raises(Exception) as raised:
            call()
        check_error(raised.value, problems)
        result = None
    else:
        event("valid")
        result = call()
    assert module_hook_counts(model) == hooks and leftover_state() == state, "capture left state behind"
    return result


def check_recording(recording, model, x) -> None:
    assert isinstance(recording, tl.Recording)
    assert [e.op for e in recording.ops] == TINY_OPS
    assert torch.equal(recording.output, model(x))


# -- strategies: each argument's valid values and its wrong ones -----------------------------------


class Arg(NamedTuple):
    valid: st.SearchStrategy
    wrong: st.SearchStrategy


def half_valid(**arguments: Arg) -> st.SearchStrategy:
    """Keyword arguments for a call: half the draws take every argument from its valid values (so the
    valid path is exercised as much as the error paths), the other half from valid and wrong alike."""
    valid = st.fixed_dictionaries({name: arg.valid for name, arg in arguments.items()})
    mixed = st.fixed_dictionaries({name: st.one_of(arg.valid, arg.wrong) for name, arg in arguments.items()})
    return st.one_of(valid, mixed)


wrong_kinds = st.one_of(
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    st.binary(max_size=2),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.sampled_from("ab"), st.integers(0, 2), max_size=1),
    st.builds(object),
)
strings = st.text(max_size=8)
unknown_paths = st.text(alphabet="abjopr.", min_size=1, max_size=7).filter(lambda p: p not in TINY_MODULES)
module_paths = st.one_of(st.just("proj"), unknown_paths)


def selectors_over(paths: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(paths, min_size=1, max_size=2).map(lambda names: tl.in_module(*names)),
        st.tuples(paths, paths).map(lambda ab: tl.in_module(ab[0]) | tl.in_module(ab[1])),
        paths.map(lambda path: ~tl.in_module(path)),
    )


known_selectors = selectors_over(st.just("proj"))
selectors = selectors_over(module_paths)  # an unknown path is an error only once a model is known
predicates = st.just(lambda e: e.op != "relu")
sinks = st.one_of(st.none(), st.just(True), st.builds(Lines), st.builds(io.StringIO), st.sampled_from(LOG_PATHS),
                  st.just(logging.getLogger("torchlens.fuzz")))
NARRATE = Arg(
    st.one_of(sinks, st.just(False), known_selectors,
              st.builds(lambda select: tl.options.NarrationOptions(sink=Lines(), select=select),
                        st.none() | known_selectors)),
    st.one_of(selectors, wrong_kinds,
              selectors.map(lambda select: tl.options.NarrationOptions(sink=io.StringIO(), select=select))),
)
VALUE_STATS_ARG = Arg(st.sampled_from(VALUE_STATS), st.one_of(strings, wrong_kinds, st.none()))
ON_NONFINITE_ARG = Arg(st.sampled_from(ON_NONFINITE), st.one_of(strings, wrong_kinds, st.just(False)))
CAPTURE = dict(narrate=NARRATE, value_stats=VALUE_STATS_ARG, on_nonfinite=ON_NONFINITE_ARG)
BOOL = Arg(st.booleans(), st.one_of(st.none(), st.integers(0, 1), strings))
COUNT = Arg(st.one_of(st.none(), st.integers(0, 50)),
            st.one_of(st.integers(-3, -1), st.booleans(), st.floats(0, 9), strings))
PREFIX = Arg(st.text(alphabet="ab|: #", max_size=4),
             st.one_of(st.sampled_from(["\n", "a\r", "\u2028", "\x0b"]), wrong_kinds))
unregistered = st.text(alphabet="abceginort_", min_size=1, max_size=8).filter(lambda s: s not in registered_backends())
COMPILER = Arg(st.one_of(st.just("eager"), st.just(lambda gm, example_inputs: gm.forward)),
               st.one_of(st.just("torchlens"), unregistered, st.integers(0, 3), st.none()))
COMPILED_ONLY = dict(  # the options a compiled entry point adds
    live=BOOL,
    stats_on=Arg(st.sampled_from(["ops", "module_outputs"]), st.one_of(strings, wrong_kinds)),
)
TORCH_COMPILE = dict(
    fullgraph=BOOL,
    dynamic=Arg(st.one_of(st.none(), st.booleans()), st.one_of(strings, st.integers(0, 1))),
    mode=Arg(st.one_of(st.none(), st.sampled_from(COMPILE_MODES)), st.one_of(strings, wrong_kinds)),
    disable=Arg(st.just(False), st.one_of(strings, st.integers(0, 1), st.none())),  # True: nothing to narrate
)
STRAY = Arg(st.just({}), st.dictionaries(
    st.sampled_from(["backend", "options", "narate", "keep_on_cpu", "max_bytes", "stats", "compile"]),
    st.just("eager"), min_size=1, max_size=1))


def some_of(arguments: dict) -> st.SearchStrategy:
    """A dict holding any subset of `arguments`, each valid or wrong."""
    return st.fixed_dictionaries({}, optional={name: st.one_of(arg.valid, arg.wrong) for name, arg in arguments.items()})


def valid_some_of(arguments: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={name: arg.valid for name, arg in arguments.items()})


def run_compiled(compiled, model, x):
    """Call a compiled model after clearing dynamo's caches (each example compiles afresh)."""
    torch._dynamo.reset()
    out = compiled(x)
    assert torch.equal(out, model(x))
    return out


# -- the entry points -----------------------------------------------------------------------------


@EAGER_FUZZ
@given(kwargs=half_valid(**CAPTURE))
def test_record_checks_its_options(kwargs):
    model, x = Tiny(), torch.randn(1, 2)
    problems = judge_capture(**kwargs)
    recording = expect(problems, lambda: tl.record(model, x, **kwargs), model)
    if recording is not None:
        check_recording(recording, model, x)
        if isinstance(kwargs["narrate"], Lines):
            assert "\n".join(kwargs["narrate"]) + "\n" == recording.narrate(), "live narration is the recording's"


COMPILED = Arg(
    st.one_of(st.just(False), st.fixed_dictionaries({"compiler": COMPILER.valid}, optional={
        **{name: arg.valid for name, arg in {**COMPILED_ONLY, **TORCH_COMPILE}.items()}})),
    st.one_of(
        st.fixed_dictionaries({"compiler": st.one_of(COMPILER.valid, COMPILER.wrong)},
                              optional={name: st.one_of(arg.valid, arg.wrong)
                                        for name, arg in {**COMPILED_ONLY, **TORCH_COMPILE}.items()}),
        st.dictionaries(st.sampled_from(TRACE_KEYWORDS), st.none(), min_size=1, max_size=1),
        st.just(None), st.integers(0, 2), strings, st.lists(st.just("compiler"), max_size=1),
    ),
)
MAX_BYTES = Arg(st.one_of(st.none(), st.integers(4096, 1 << 40)),  # budgets Tiny fits in: a stop is tested elsewhere
                st.one_of(st.integers(-5, -1), st.floats(0, 9), strings, st.booleans()))


@COMPILED_FUZZ
@given(kwargs=half_valid(**CAPTURE, keep_on_cpu=BOOL, max_bytes=MAX_BYTES, compiled=COMPILED))
def test_trace_checks_its_options(kwargs):
    model, x = Tiny(), torch.randn(1, 2)
    problems = judge_capture(kwargs["narrate"], kwargs["value_stats"], kwargs["on_nonfinite"])
    problems += judge_bool("keep_on_cpu", kwargs["keep_on_cpu"]) + judge_count("max_bytes", kwargs["max_bytes"])
    problems += judge_compiled(kwargs["compiled"])
    if not problems and kwargs["compiled"] is not False:
        torch._dynamo.reset()
        event("valid, compiled")
    trace = expect(problems, lambda: tl.trace(model, x, **kwargs), model)
    if trace is not None:
        check_recording(trace, model, x)
        assert isinstance(trace, tl.Trace) and sorted(trace.values) == [e.ordinal for e in trace.ops]
        assert torch.equal(trace.value(trace.ops[-1].ordinal), model(x))


@EAGER_FUZZ
@given(kwargs=half_valid(**CAPTURE, keep=COUNT))
def test_recorder_checks_its_options(kwargs):
    model, first, second = Tiny(), torch.randn(1, 2), torch.randn(1, 2)
    problems = judge_capture(kwargs["narrate"], kwargs["value_stats"], kwargs["on_nonfinite"])
    problems += judge_count("keep", kwargs["keep"])

    def record_two_passes():
        with tl.recording.Recorder(model, **kwargs) as recorder:
            model(first)
            model(second)
        return recorder

    recorder = expect(problems, record_two_passes, model)
    if recorder is not None:
        keep = kwargs["keep"]
        assert recorder.passes == 2 and len(recorder.recordings) == min(2, 2 if keep is None else keep)
        if keep != 0:
            check_recording(recorder.recordings[-1], model, second)


NARRATION_FIELD_ARGS = dict(
    sink=Arg(sinks, st.one_of(st.just(False), selectors, wrong_kinds)),
    select=Arg(st.one_of(st.none(), selectors, predicates), st.one_of(strings, wrong_kinds)),
    max_lines=COUNT,
    depth=COUNT,
    tail_on_error=Arg(st.integers(0, 50), st.one_of(COUNT.wrong, st.none())),
    prefix=PREFIX,
    **{name: BOOL for name in ("sites", "normalize", "on_error_only", "symbolic_shapes")},
)
misspelt_fields = st.dictionaries(
    st.text(alphabet="abcdeilmnopst_", min_size=1, max_size=9).filter(lambda n: n not in NARRATION_FIELDS),
    st.integers(0, 1), min_size=1, max_size=1)


@EAGER_FUZZ
@given(fields=st.one_of(valid_some_of(NARRATION_FIELD_ARGS), some_of(NARRATION_FIELD_ARGS),
                        st.tuples(some_of(NARRATION_FIELD_ARGS), misspelt_fields).map(lambda ab: {**ab[0], **ab[1]})))
def test_narration_options_check_every_field(fields):
    model, x = Tiny(), torch.randn(1, 2)
    problems = [bad for name, value in fields.items() for bad in judge_narration_field(name, value)]
    options = expect(problems, lambda: tl.options.NarrationOptions(**fields), model)
    if options is None:
        return
    assert options == tl.options.NarrationOptions(**fields) and options.replace() == options
    recording = expect(judge_selector(options.select), lambda: tl.record(model, x, narrate=options), model)
    if recording is not None:
        check_recording(recording, model, x)
        if isinstance(options.sink, Lines) and not options.on_error_only:
            assert "\n".join(options.sink) + "\n" == recording.narrate()


def failed_forward(model):
    try:
        tl.record(model, torch.randn(1, 3))
    except RuntimeError as exc:
        return exc.partial_trace
    raise AssertionError("the forward was meant to fail")


@EAGER_FUZZ
@given(kind=st.sampled_from(["recording", "trace", "partial"]),
       kwargs=half_valid(last=Arg(st.one_of(st.none(), st.integers(0, 12)), COUNT.wrong),
                         select=Arg(st.one_of(st.none(), known_selectors, predicates),
                                    st.one_of(selectors, strings, wrong_kinds)),
                         normalize=Arg(st.one_of(st.none(), st.booleans()), st.one_of(st.integers(0, 1), strings)),
                         prefix=Arg(st.one_of(st.none(), PREFIX.valid), PREFIX.wrong)))
def test_narrating_after_the_fact_checks_its_arguments(kind, kwargs):
    model, x = Tiny(), torch.randn(1, 2)
    recording = {"recording": tl.record, "trace": tl.trace}.get(kind, lambda m, _: failed_forward(m))(model, x)
    last, select, normalize, prefix = kwargs["last"], kwargs["select"], kwargs["normalize"], kwargs["prefix"]
    problems = judge_count("last", last) + judge_select(select) + judge_selector(select)
    problems += [] if normalize is None else judge_bool("normalize", normalize)
    problems += [] if prefix is None else judge_prefix(prefix)
    text = expect(problems, lambda: recording.narrate(**kwargs), model)
    if text is None:
        return
    assert all(line.startswith(prefix or "") for line in text.lines)
    if kind != "partial":
        everything = recording.narrate(select=select, normalize=normalize, prefix=prefix).lines
        assert text.lines == (everything if last is None else everything[max(0, len(everything) - last):])
    else:
        assert "!! forward failed: RuntimeError" in text


@EAGER_FUZZ
@given(paths=st.one_of(st.lists(module_paths, min_size=1, max_size=3),
                       st.lists(st.one_of(module_paths, st.just(""), wrong_kinds, st.none()), max_size=3)),
       used_as=st.sampled_from(["narrate", "NarrationOptions", "Recorder", "tl.compile"]))
def test_selectors_check_their_paths(paths, used_as):
    model, x = Tiny(), torch.randn(1, 2)
    problems = [Bad(ValueError, ("in_module()", "module path"))] if not paths else []
    for path in paths:
        if not isinstance(path, str):
            problems.append(Bad(TypeError, ("in_module()", "strings")))
        elif not path:
            problems.append(Bad(ValueError, ("in_module('')", "submodule path")))
    selector = expect(problems, lambda: tl.in_module(*paths), model)
    if selector is None:
        return
    problems = judge_selector(selector)
    if used_as == "tl.compile":  # checked when compiled, before the first call (which is not made)
        expect(problems, lambda: tl.compile(model, narrate=selector, compiler="eager"), model)
    elif used_as == "Recorder":
        expect(problems, lambda: tl.recording.Recorder(model, narrate=selector), model)
    else:
        narrate = selector if used_as == "narrate" else tl.options.NarrationOptions(sink=Lines(), select=selector)
        recording = expect(problems, lambda: tl.record(model, x, narrate=narrate), model)
        if recording is not None:
            check_recording(recording, model, x)


@COMPILED_FUZZ
@given(capture=st.one_of(valid_some_of(CAPTURE), some_of(CAPTURE)),
       kwargs=half_valid(compiler=COMPILER, others=Arg(valid_some_of({**COMPILED_ONLY, **TORCH_COMPILE}),
                                                        some_of({**COMPILED_ONLY, **TORCH_COMPILE})),
                         stray=STRAY))
def test_tl_compile_checks_its_options_before_the_first_call(capture, kwargs):
    model, x = Tiny(), torch.randn(1, 2)
    keywords = {**capture, "compiler": kwargs["compiler"], **kwargs["others"], **kwargs["stray"]}
    problems = judge_capture(capture.get("narrate"), capture.get("value_stats", "off"), capture.get("on_nonfinite"))
    problems += judge_compile_keywords({k: v for k, v in keywords.items() if k not in capture})
    compiled = expect(problems, lambda: tl.compile(model, **keywords), model)
    if compiled is not None:
        hooks, state = module_hook_counts(model), leftover_state()
        run_compiled(compiled, model, x)
        check_recording(compiled.torchlens.last_recording, model, x)
        assert module_hook_counts(model) == hooks and leftover_state() == state


BACKEND_OPTIONS = Arg(
    st.fixed_dictionaries({"compiler": COMPILER.valid, "narrate": st.builds(Lines)},
                          optional={"value_stats": VALUE_STATS_ARG.valid, "on_nonfinite": ON_NONFINITE_ARG.valid,
                                    **{name: arg.valid for name, arg in COMPILED_ONLY.items()}}),
    st.one_of(
        st.fixed_dictionaries({"compiler": st.one_of(COMPILER.valid, COMPILER.wrong)},
                              optional={name: st.one_of(arg.valid, arg.wrong)
                                        for name, arg in {**CAPTURE, **COMPILED_ONLY}.items()}),
        st.fixed_dictionaries({"compiler": st.just("eager")},
                              optional={"dynamic": st.booleans(), "narate": st.just(True), "max_bytes": st.just(1)}),
        st.just([("compiler", "eager")]), st.just("narrate"), st.integers(1, 3),  # truthy: torch drops falsy ones
    ),
)


@pytest.mark.slow
@COMPILED_FUZZ
@given(kwargs=half_valid(options=BACKEND_OPTIONS))
def test_string_backend_checks_its_options_at_the_first_call(kwargs):
    """`torch.compile` hands `options=` to the backend only when it compiles, at the first call; dynamo
    then wraps the backend's error in `BackendCompilerFailed`, whose `inner_exception` is torchlens's."""
    model, x, options = Tiny(), torch.randn(1, 2), kwargs["options"]
    problems = judge_backend_options(options)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="torchlens", options=options)  # nothing is checked yet
    hooks, state = module_hook_counts(model), leftover_state()
    if problems:
        event("invalid")
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
            compiled(x)
        check_error(raised.value.inner_exception, problems)
    else:
        event("valid")
        run_compiled(compiled, model, x)
        narrate = options.get("narrate")
        if isinstance(narrate, Lines):
            assert [line.split()[1] for line in narrate if line.lstrip().startswith("#")] == TINY_OPS
    assert module_hook_counts(model) == hooks and leftover_state() == state
