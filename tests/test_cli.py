"""The command line (`python -m torchlens`, the `torchlens` script): each command run in a fresh
process on traces saved from a transformers GPT-2 prints what the same Python call gives, the exit
status of `compare` says whether two runs diverge, and every mistake is one line on stderr that
says what to do, with exit status 2 and no traceback."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tomllib
import torch
from torch import nn

import torchlens as tl
import torchlens.cli

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m torchlens ARGS` in a fresh process that imports this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "torchlens", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def cli_all(commands: dict) -> dict:
    """Several command lines at once (each is a fresh process that spends most of its time importing torch)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        running = {key: pool.submit(cli, *args) for key, args in commands.items()}
        return {key: future.result() for key, future in running.items()}


def gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    return transformers.GPT2LMHeadModel(config).eval()


def ids():
    return torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Traces of a transformers GPT-2 saved as files, and files that are not traces."""
    folder = tmp_path_factory.mktemp("traces")
    model = gpt2()
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.transformer.h[1].mlp.c_fc.weight[0, 0] += 0.5
    nan = copy.deepcopy(model)
    with torch.no_grad():
        nan.transformer.h[0].attn.c_attn.weight[0, 0] = float("nan")
    broken = copy.deepcopy(model)
    broken.transformer.h[1].mlp.c_proj.weight = nn.Parameter(torch.randn(7, 32))  # [8,128] @ [7,32]: no fit
    files = {
        "trace": tl.trace(model, ids(), value_stats="exact").save(folder / "run.tl"),
        "same": tl.trace(model, ids(), value_stats="exact").save(folder / "same.tl"),
        "perturbed": tl.trace(perturbed, ids(), value_stats="exact").save(folder / "perturbed.tl"),
        "recorded": tl.record(model, ids()).save(folder / "recorded.tl"),
        "nan": tl.trace(nan, ids(), on_nonfinite="track").save(folder / "nan.tl"),
    }
    with pytest.raises(RuntimeError) as caught:
        tl.record(broken, ids(), value_stats="exact")
    files["failed"] = caught.value.partial_trace.save(folder / "failed.tl")
    data = pathlib.Path(files["trace"]).read_bytes()
    (folder / "truncated.tl").write_bytes(data[: len(data) // 2])  # a download cut short
    damaged = bytearray(data)
    damaged[len(data) * 2 // 5:len(data) * 2 // 5 + 16] = bytes(16)  # its table of contents intact
    (folder / "damaged.tl").write_bytes(bytes(damaged))
    torch.save({"weight": torch.ones(2)}, folder / "checkpoint.pt")
    files.update(truncated=folder / "truncated.tl", damaged=folder / "damaged.tl",
                 checkpoint=folder / "checkpoint.pt", folder=folder)
    return {key: pathlib.Path(value) for key, value in files.items()}


# -- the commands --------------------------------------------------------------------------------


def test_narrate_prints_the_narration_a_loaded_trace_gives(saved, capsys):
    selected = ("transformer.h.1.mlp", "lm_head")
    runs = cli_all({"whole": ("narrate", saved["trace"]), "tail": ("narrate", saved["failed"], "--last", "6")})
    runs["select"] = run_main(["narrate", str(saved["trace"]), "--select", selected[0], "--select", selected[1]],
                              capsys)
    assert all(run.returncode == 0 and run.stderr == "" for run in runs.values()), runs
    loaded = tl.load(saved["trace"])
    assert runs["whole"].stdout == loaded.narrate()
    tail = tl.load(saved["failed"]).narrate(last=6)
    assert runs["tail"].stdout == tail and tail.lines[0].startswith("!! forward failed") and "!! attempted #" in tail
    assert runs["select"].stdout == loaded.narrate(select=tl.in_module(*selected))
    ops = [line for line in runs["select"].stdout.splitlines() if line.lstrip().startswith("#")]
    assert ops and all(re.search(r"@(transformer\.h\.1\.mlp|lm_head)\b", line) for line in ops)
    assert any("@lm_head" in line for line in ops) and "transformer.h.0" not in runs["select"].stdout


def test_html_writes_the_page_beside_the_trace_or_where_asked_and_prints_its_path(saved, tmp_path, capsys):
    asked = tmp_path / "pages" / "gpt2.html"
    asked.parent.mkdir()
    runs = {"beside": cli("html", saved["trace"]),
            "asked": run_main(["html", str(saved["trace"]), "-o", str(asked)], capsys)}
    beside = saved["trace"].with_suffix(".html")
    assert runs["beside"].returncode == 0 and runs["beside"].stdout == f"{beside}\n"
    assert runs["asked"].returncode == 0 and runs["asked"].stdout == f"{asked}\n"
    expected = page_data(tl.load(saved["trace"]).to_html(tmp_path / "api.html"))
    assert expected["sections"][0]["tree"]["n"] == len(tl.load(saved["trace"]).ops)
    for path in (beside, asked):
        assert page_data(path) == expected  # the page to_html writes


def page_data(path) -> dict:
    page = pathlib.Path(path).read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="torchlens-data"[^>]*>(.*?)</script>', page,
                                re.S).group(1))


def test_compare_exits_0_when_two_traces_agree_and_1_when_they_diverge(saved, tmp_path, capsys):
    page = tmp_path / "compare.html"
    runs = cli_all({
        "same": ("compare", saved["trace"], saved["same"], "--html", page),
        "perturbed": ("compare", saved["trace"], saved["perturbed"], "--all"),
    })
    runs["tolerant"] = run_main(["compare", str(saved["trace"]), str(saved["perturbed"]), "--rtol", "10", "--atol",
                                 "10"], capsys)
    same = runs["same"]
    assert same.returncode == 0 and same.stdout.startswith("no divergence: ") and same.stderr == ""
    assert same.stdout.splitlines()[-1] == str(page) and "torchlens-data" in page.read_text(encoding="utf-8")

    report = tl.debug.compare(tl.load(saved["trace"]), tl.load(saved["perturbed"]))
    perturbed = runs["perturbed"]
    assert perturbed.returncode == 1 and perturbed.stderr == ""
    assert perturbed.stdout == report.table(elide=False, max_rows=None)
    assert perturbed.stdout.splitlines()[0] == report.summary() and "transformer.h.1.mlp.c_fc" in report.summary()
    assert len(perturbed.stdout.splitlines()) == 3 + len(report.rows)  # --all: a line for every row

    tolerant = runs["tolerant"]  # the tolerances reach the comparison
    assert tolerant.returncode == 0 and tolerant.stdout.startswith("no divergence: ")


def _scaled_gradient(module):
    """A backward hook on `module`'s output that scales the gradient through it by 1.5 (the forward
    is untouched): a gradient-scaling bug that only the backward shows."""

    def hook(module, inputs, output):
        output.register_hook(lambda grad: grad * 1.5)

    module.register_forward_hook(hook)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Traces of GPT-2 with their backward (`backward=True`, then the loss's `.backward()`) saved as
    files: a run, the same run again, and a run whose forward is the same and whose gradients are not."""
    folder = tmp_path_factory.mktemp("backwards")
    model = gpt2()
    scaled = copy.deepcopy(model)
    _scaled_gradient(scaled.transformer.h[1].mlp)
    files = {}
    for name, net in (("run", model), ("same", model), ("scaled", scaled)):
        trace = tl.trace(net, ids(), backward=True)
        trace.output.logits.sum().backward()
        net.zero_grad()
        files[name] = pathlib.Path(trace.save(folder / f"{name}.tl"))
    return files


def test_compare_exits_1_when_only_the_gradients_diverge(trained, capsys):
    """A CI job gating on `torchlens compare` must fail on diverged gradients even where every
    forward op agrees; two runs whose gradients agree too still exit 0."""
    runs = {"scaled": cli("compare", trained["run"], trained["scaled"]),
            "same": run_main(["compare", str(trained["run"]), str(trained["same"])], capsys)}
    report = tl.debug.compare(tl.load(trained["run"]), tl.load(trained["scaled"]))
    assert report.first_divergence is None and report.first_gradient_divergence is not None
    scaled = runs["scaled"]
    assert scaled.returncode == 1 and scaled.stderr == "", scaled
    assert scaled.stdout == report.table()
    assert scaled.stdout.startswith("no divergence: ")  # the forward agrees ...
    assert "\nfirst gradient divergence: " in scaled.stdout and "transformer.h.1.mlp" in scaled.stdout  # ... its backward not
    same = runs["same"]
    assert same.returncode == 0 and same.stderr == "", same
    assert same.stdout.startswith("no divergence: ") and "\nno gradient divergence: " in same.stdout


def test_repro_does_what_a_loaded_trace_s_repro_does(saved, tmp_path, capsys):
    runs = {"nan": cli("repro", saved["nan"], tmp_path / "nan"),
            "untracked": run_main(["repro", str(saved["trace"]), str(tmp_path / "untracked")], capsys)}
    try:
        expected = tl.load(saved["nan"]).repro(tmp_path / "api")
    except tl.errors.ReproError as exc:  # a loaded trace keeps no op's inputs: the command says why
        assert runs["nan"].returncode == 2 and runs["nan"].stdout == ""
        assert runs["nan"].stderr == f"torchlens repro: error: {saved['nan']}: no repro: {exc}\n"
        assert not (tmp_path / "nan" / "repro.py").exists()
    else:
        assert runs["nan"].returncode == 0
        assert runs["nan"].stdout == f"{tmp_path / 'nan' / pathlib.Path(expected).name}\n"
    untracked = runs["untracked"]  # recorded without tracking: no op to replay, whatever a loaded trace keeps
    assert untracked.returncode == 2 and untracked.stderr.count("\n") == 1
    assert "on_nonfinite='track'" in untracked.stderr


# -- mistakes: one line, the fix, exit status 2 --------------------------------------------------

# name: (arguments, what the line must say, whether to run it in a fresh process). Each process
# spends two seconds importing torch: the rest run `main`, which is all `python -m torchlens` runs.
MISTAKES = {
    "missing file": (("narrate", "{folder}/nowhere.tl"), ["nowhere.tl: no such file", "trace.save(path)"], True),
    "a directory": (("html", "{folder}"), ["is a directory", "trace.save(path)"], False),
    "a checkpoint": (("narrate", "{checkpoint}"), ["not a trace torchlens saved", "trace.save(path)"], False),
    "a truncated file": (("narrate", "{truncated}"), ["is not a zip archive", "trace.save(path)"], False),
    "a damaged file": (("compare", "{trace}", "{damaged}"), ["damaged", "save it again"], True),
    "an unknown module": (("narrate", "{trace}", "--select", "transformer.h.9"), ["did you mean"], False),
    "a recording without values": (("compare", "{recorded}", "{trace}"), ["keeps no values", "tl.trace"], False),
    "an unwritable page": (("html", "{trace}", "-o", "{folder}/no/such/dir/page.html"), ["cannot write", "-o"],
                           False),
    "an unwritable comparison page": (("compare", "{trace}", "{same}", "--html", "{folder}/no/such/dir/c.html"),
                                      ["cannot write", "--html"], False),
    "a count that is no number": (("narrate", "{trace}", "--last", "x"), ["--last", "--help"], False),
    "a negative count": (("narrate", "{trace}", "--last", "-1"), ["--last", ">= 0", "--help"], False),
    "a negative tolerance": (("compare", "{trace}", "{same}", "--rtol", "-1"), ["--rtol", ">= 0"], False),
    "an unknown option": (("narrate", "{trace}", "--lats", "3"), ["unrecognized arguments: --lats 3",
                                                                  "torchlens narrate --help"], True),
    "a missing argument": (("compare", "{trace}"), ["required: trace_b", "--help"], False),
    "an unknown command": (("narate", "{trace}"), ["invalid choice: 'narate'", "torchlens --help"], False),
    "no command": ((), ["required", "torchlens --help"], False),
}


def _arguments(name: str, saved: dict) -> list:
    paths = {key: str(value) for key, value in saved.items()}
    return [arg.format(**paths) for arg in MISTAKES[name][0]]


@pytest.fixture(scope="module")
def in_processes(saved) -> dict:
    """The mistakes run in a fresh process, all side by side."""
    return cli_all({name: _arguments(name, saved) for name, (_, _, fresh) in MISTAKES.items() if fresh})


def run_main(args, capsys) -> subprocess.CompletedProcess:
    """`main(args)` here, as `python -m torchlens ARGS` runs it: its exit status and output."""
    try:
        status = torchlens.cli.main(list(args))
    except SystemExit as done:  # (a usage error: argparse exits)
        status = done.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out.out, out.err)


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_mistake_is_one_line_naming_the_fix_with_exit_status_2(name, saved, in_processes, capsys):
    args, says, fresh = MISTAKES[name]
    run = in_processes[name] if fresh else run_main(_arguments(name, saved), capsys)
    assert run.returncode == 2, run
    assert run.stdout == "" and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.endswith("\n"), run.stderr
    command = args[0] if args and args[0] in ("narrate", "html", "compare", "repro") else None
    assert run.stderr.startswith(f"torchlens {command}: error: " if command else "torchlens: error: ")
    for words in says:
        assert words in run.stderr, run.stderr


def test_an_unreadable_file_and_a_failure_of_torchlens_itself_exit_2(saved, monkeypatch, capsys):
    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(tl.api, "load", denied)  # (as root, which this may run as, no file is unreadable)
    assert torchlens.cli.main(["narrate", str(saved["trace"])]) == 2
    assert capsys.readouterr().err == f"torchlens narrate: error: {saved['trace']}: permission denied (make the file " \
                                      f"readable to this user)\n"

    def broken(path):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(tl.api, "load", broken)
    assert torchlens.cli.main(["compare", str(saved["trace"]), str(saved["same"])]) == 2  # never read as "diverged"
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a bug" in err  # a bug keeps its traceback, to be reported
    assert err.endswith("torchlens compare: error: torchlens failed (the traceback above says where)\n")


# -- help and the console script ------------------------------------------------------------------


def test_help_lists_the_commands_and_each_command_its_options(capsys):
    top = cli("--help")
    assert top.returncode == 0 and top.stderr == ""
    for command in ("narrate", "html", "compare", "repro"):
        assert re.search(rf"^\s+{command}\s+\S", top.stdout, re.M), top.stdout
    assert "1 compare found a divergence" in " ".join(top.stdout.split())
    options = {"narrate": ["--last N", "--select MODULE"], "html": ["-o PAGE"],
               "compare": ["--rtol", "--atol", "--html PAGE", "--all", "trace_a", "trace_b"], "repro": ["DIR"]}
    for command, names in options.items():
        with pytest.raises(SystemExit) as done:
            torchlens.cli.main([command, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: torchlens {command} ") and all(name in text for name in names), text


def test_the_console_script_runs_the_same_main(saved, capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["torchlens"].partition(":")
    main = getattr(__import__(module, fromlist=[function]), function)
    assert main is torchlens.cli.main
    assert main(["narrate", str(saved["trace"]), "--last", "1"]) == 0
    assert capsys.readouterr().out == tl.load(saved["trace"]).narrate(last=1)
