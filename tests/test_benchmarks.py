"""The benchmark scripts keep working: the quick run of the side-by-side benchmark completes, every
mode gets a number, and the JSON report says what was measured. No timings are asserted here."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark script in a fresh process

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def quick_run(script: str, tmp_path, timeout: int, env=None):
    """Run `benchmarks/<script> --quick --json ...` in a fresh process; (its JSON report, the process)."""
    report_path = tmp_path / (Path(script).stem + ".json")
    command = [sys.executable, str(BENCHMARKS / script), "--quick", "--json", str(report_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report_path.read_text()), done


def test_quick_side_by_side_benchmark_measures_every_mode_and_plots(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    report, done = quick_run("snoop_echo_bench.py", tmp_path, 900, env=env)
    report_path = tmp_path / "snoop_echo_bench.json"
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import snoop_echo_bench as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    every_mode = {m[0] for m in bench.EAGER_MODES} | {m[0] for m in bench.COMPILED_MODES}
    assert [r["model"] for r in report["results"]] == ["small-resnet", "small-gpt2"]
    for result in report["results"]:
        rows = {row["mode"]: row for row in result["modes"]}
        assert set(rows) == every_mode
        for name, row in rows.items():
            assert row["error"] is None, (result["model"], name, row["error"])
            assert row["median_ms"] > 0 and row["rounds"] == report["rounds"], row
            if row["baseline"]:
                assert row["multiplier"] > 0, row
        assert rows["fused"]["lines"] >= rows["narrate"]["lines"] > 20  # the compiled footer may add a line
        assert f"{result['model']}  batch 1" in done.stdout
    assert "FAILED" not in done.stdout

    plot_path = tmp_path / "multipliers.png"
    plotted = subprocess.run([sys.executable, str(BENCHMARKS / "plot_multipliers.py"), str(report_path), str(plot_path)],
                             capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_compiled_statistics_benchmark_splits_each_mode_and_states_its_limit(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    report, done = quick_run("compiled_stats_bench.py", tmp_path, 900, env=env)
    assert [r["model"] for r in report["results"]] == ["small-resnet-b1", "small-gpt2"]
    for result in report["results"]:
        rows = result["modes"]
        assert set(rows) == {"eager", "compiled", "eager_exact", "compiled_exact", "eager_track", "compiled_track",
                             "compiled_track_after_call"}
        assert all(row["ms"] > 0 and row["x"] > 0 and row["faults_per_call"] >= 0 for row in rows.values())
        for mode in ("compiled_exact", "compiled_track", "compiled_track_after_call"):
            row = rows[mode]
            # the graph's own call, then the measuring and the rest of the recording after it
            assert 0 < row["graph_ms"] < row["ms"] and row["measure_ms"] > 0 and row["narrate_ms"] > 0, row
            assert row["pass_ms"] > 0, row  # the rest of the call: each part lies inside it
            # of the measuring, the reductions and their one read; the rest is bookkeeping
            assert 0 < row["reduce_ms"] <= row["measure_ms"], row
            # the limit: every measured output's bytes, read once here
            assert row["limit"]["bytes"] > 0 and row["limit"]["sum_each_ms"] > 0, row
            # from inductor's own code: the outputs returned to be measured are buffers of their own
            plain, instrumented = rows["compiled"]["code"], row["code"]
            assert plain["kernels"] > 0 and instrumented["kernels"] >= plain["kernels"], (plain, instrumented)
            if mode != "compiled_track":
                assert instrumented["allocated_bytes"] > plain["allocated_bytes"] > 0, (plain, instrumented)
        # a screened graph keeps no output for its statistics: less than the outputs it would return
        screened, returned = rows["compiled_track"]["code"], rows["compiled_track_after_call"]["code"]
        assert screened["allocated_bytes"] < returned["allocated_bytes"], (screened, returned)
        # tracking reads the floating-point outputs, exact statistics integers and booleans too
        assert rows["compiled_exact"]["limit"]["bytes"] >= rows["compiled_track"]["limit"]["bytes"]
        # exact statistics' floor: eager's recipe alone (three reductions) costs more than one sum,
        # and plain plus it is more than plain, and no more than the measured mode
        exact = rows["compiled_exact"]
        assert exact["limit"]["recipe_each_ms"] > exact["limit"]["sum_each_ms"] > 0, exact["limit"]
        assert 1 < exact["floor_x"], exact
        assert "floor_x" not in rows["compiled_track"]
        assert f"| {result['model']} | compiled_track |" in done.stdout
        # the long run of each mode: its mean beside its median, and the collector's share counted
        for mode, row in rows.items():
            run = row["steady"]
            assert run["calls"] == 60 and run["mean_ms"] > 0 and run["median_ms"] > 0 and run["mean_x"] > 0, (mode, run)
            assert run["full_ms_per_call"] < run["mean_ms"] and run["young_ms_per_call"] < run["mean_ms"], (mode, run)
        assert f"| {result['model']} | compiled_exact | {rows['compiled_exact']['steady']['mean_ms']:.1f}" in done.stdout


def _compiled_stats_bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import compiled_stats_bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    return compiled_stats_bench


def test_exact_statistics_floor_is_eager_recipe_on_the_values_a_call_measured_second_passes_included(monkeypatch):
    """The floor times the recipe on a call's own values: a value whose sums cannot give its sd
    (a large mean against a small spread, as GPT-2's GELU makes) costs a second pass there too."""
    import torch

    from torchlens.measure import recipes

    bench = _compiled_stats_bench()
    passes: list = []
    about_the_mean = recipes.about_the_mean
    monkeypatch.setattr(recipes, "about_the_mean", lambda *args: passes.append(args[0].numel()) or about_the_mean(*args))
    layouts: list = []
    summed_together = recipes.summed_together
    monkeypatch.setattr(recipes, "summed_together",
                        lambda pairs, *args: layouts.append([t.is_contiguous() for _, t in pairs]) or
                        summed_together(pairs, *args))
    values = [torch.randn(4096), 1000 + 1e-3 * torch.randn(4096), torch.arange(10), torch.randn(64, 64).t()]
    sizes = [(t.numel(), t.dtype) for t in values]
    limit = bench.read_limit(sizes, values, repeats=2)
    assert limit["recipe_each_ms"] > 0 and limit["bytes"] == 3 * 4096 * 4 + 10 * 8, limit
    assert passes and set(passes) == {4096}, passes  # the large-mean value, measured again about its mean
    assert layouts and all(seen == [True, True, False] for seen in layouts), layouts  # (its copy is timed too)
    assert "recipe_each_ms" not in bench.read_limit(sizes), "no values, no floor: sizes alone leave out second passes"
    narrow = torch.randn(4, 6)[:, :3]  # (a view `clone` would make contiguous: the meter copies it first)
    copy = bench.copied(narrow)
    assert torch.equal(copy, narrow) and copy.stride() == narrow.stride() and not copy.is_contiguous()
    assert copy.untyped_storage().data_ptr() != narrow.untyped_storage().data_ptr()


def test_the_sizes_and_values_a_forward_measured_are_every_graph_s(tmp_path):
    """A forward split by a graph break measures in two graph calls; the limit's sizes and the
    floor's values are both graphs' (a process of its own: `Parts` wraps torchlens's classes)."""
    script = tmp_path / "two_graphs.py"
    script.write_text(f"""
import sys, torch
sys.path.insert(0, {str(BENCHMARKS)!r})
import torchlens as tl
from compiled_stats_bench import Parts

class TwoGraphs(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x * 2)
        torch._dynamo.graph_break()
        return torch.tanh(y + 1).sum(0)

parts = Parts()
compiled = tl.compile(TwoGraphs(), value_stats="exact", compiler="eager")
x = torch.randn(3, 4)
with torch.no_grad():
    compiled(x)
    parts.keep = True
    compiled(x)
print(len(parts.sizes), len(parts.values))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent)))
    assert done.returncode == 0, done.stderr
    sizes, values = map(int, done.stdout.split())
    assert sizes == values >= 4, done.stdout  # (mul and relu, then add, tanh and sum: not the last graph's 3)


def test_a_long_run_counts_the_collections_its_calls_cause_and_leaves_the_collector_as_it_was():
    bench = _compiled_stats_bench()
    callbacks = list(gc.callbacks)

    def cycles():  # objects in reference cycles, as a recording's are until it is freed
        for _ in range(2000):
            pair: list = []
            pair.append(pair)

    runs = bench.steady_runs({"eager": lambda: None, "eager_cycles": cycles}, 20)
    run, quiet = runs["eager_cycles"], runs["eager"]
    assert run["calls"] == quiet["calls"] == 20 and run["mean_x"] > 0 and quiet["mean_x"] == 1, runs
    assert run["young_per_call"] >= 1 and run["young_ms_per_call"] > 0, run
    assert run["full"] == 0 or run["full_ms_per_call"] > 0, run
    assert quiet["young_per_call"] < 1 and quiet["full"] == 0, quiet  # (the collections counted are its own)
    assert gc.callbacks == callbacks  # (its counters are taken out again)
    frozen = gc.get_freeze_count()
    seen: list = []
    bench.steady_runs({"eager": lambda: seen.append(gc.get_freeze_count())}, 4, frozen=True)
    assert min(seen) > frozen and gc.get_freeze_count() == frozen  # frozen while it ran, thawed after


def test_each_mode_alone_is_timed_in_processes_of_its_own_against_plain_and_eager_per_round(monkeypatch, tmp_path):
    """`--alone`: one fresh process per mode and round, each with its own allocator state; the
    ratios are per round (this machine drifts between processes), against plain and against eager
    with the same statistics; a failed mode says so and fails the run; `--preload` reaches the children."""
    bench = _compiled_stats_bench()
    speed = {"eager": 10.0, "compiled": 8.0, "eager_exact": 14.0, "compiled_exact": 11.0, "eager_track": 12.0,
             "compiled_track": 9.0}
    calls: list = []

    def child(arguments, env):  # round 2 on a machine twice as slow (plain eager's process 3x), round 3 3x
        mode = arguments[arguments.index("--child-alone") + 1]
        calls.append((mode, env.get("LD_PRELOAD")))
        blocks = arguments[arguments.index("--rounds") + 1], arguments[arguments.index("--calls") + 1]
        assert blocks == ("2", "1"), arguments  # (blocks a process, calls a block: alone_rounds' own)
        slow = 1 + (len(calls) - 1) // len(bench.ALONE_MODES)
        return {"ms": speed[mode] * slow * (1.5 if slow == 2 and mode == "eager" else 1.0), "faults_per_call": 3.0}

    monkeypatch.setattr(bench, "child", child)
    report = bench.alone_rounds("small-gpt2", 3, 2, 1, {})
    assert [mode for mode, _ in calls] == list(bench.ALONE_MODES) * 3  # the modes interleaved, round by round
    assert report["compiled_exact"]["x"] == 11 / 8 and report["compiled_exact"]["x_eager"] == 11 / 14
    assert report["compiled_track"]["x_eager"] == 9 / 12 and report["compiled"]["x"] == 1.0
    assert report["eager_exact"]["x"] == 14 / 10  # (the median round's ratio, not the medians' 28 / 30)
    assert "x_eager" not in report["eager_track"] and report["eager"]["faults_per_call"] == 3.0

    for broken in ("compiled_track", "compiled"):  # a mode that fails, and a base that does
        monkeypatch.setattr(bench, "child", lambda arguments, env, broken=broken: (
            {"error": "OSError: boom"} if arguments[3] == broken else {"ms": 1.0, "faults_per_call": 0.0}))
        failed = bench.alone_rounds("small-gpt2", 1, 2, 1, {})
        assert failed[broken] == {"error": "OSError: boom"}, failed
        shown = bench.alone_table([{"model": "small-gpt2", "alone": failed}])
        assert f"| small-gpt2 | {broken} | failed: OSError: boom |" in shown
    assert failed["compiled_exact"]["x"] is None and failed["compiled_exact"]["x_eager"] == 1.0
    assert "| small-gpt2 | compiled_exact | 1.0 |  | 1.00 | 0 |" in shown  # (no ratio against a failed base)

    calls.clear()
    monkeypatch.setattr(bench, "child", child)
    library = tmp_path / "libfast.so"
    library.write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "libearlier.so")
    assert bench.main(["--alone", "--alone-rounds", "1", "--models", "small-gpt2", "--preload", str(library),
                       "--rounds", "2", "--calls", "1", "--json", str(tmp_path / "alone.json")]) == 0
    assert {preload for _, preload in calls} == {f"{library} libearlier.so"}  # (first, the user's kept after it)
    saved = json.loads((tmp_path / "alone.json").read_text())
    assert saved["allocator"] == str(library) and saved["results"][0]["alone"]["compiled_exact"]["x"] == 11 / 8
    monkeypatch.setattr(bench, "child", lambda arguments, env: {"error": "boom"})
    assert bench.main(["--alone", "--alone-rounds", "1", "--models", "small-gpt2"]) == 1
    refused = (["--alone", "--cold"], ["--alone", "--frozen"], ["--alone", "--steady-calls", "50"],
               ["--alone", "--alone-rounds", "0"], ["--alone-rounds", "2"], ["--preload", str(tmp_path / "nowhere.so")],
               ["--preload", str(library), "--stable-allocator"])
    for arguments in refused:  # refused with a usage error, not swallowed
        with pytest.raises(SystemExit):
            bench.main(["--models", "small-gpt2", *arguments])


def test_a_mode_alone_runs_its_warm_up_then_the_blocks_it_is_given(monkeypatch, tmp_path):
    """The child's side of `--alone`: `--rounds` blocks of `--calls` calls after a warm-up of 3, the
    faults counted per call, the report written where the parent reads it."""
    bench = _compiled_stats_bench()
    ran: list = []
    monkeypatch.setattr(bench, "build", lambda name: (None, None))
    monkeypatch.setattr(bench, "calls_of", lambda model, x: {"eager_exact": lambda: ran.append(1)})
    out = tmp_path / "child.json"
    assert bench.main(["--models", "small-gpt2", "--child-alone", "eager_exact", "--rounds", "4", "--calls", "2",
                       "--child-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(ran) == 3 + 4 * 2 and report["ms"] > 0 and report["faults_per_call"] >= 0, (len(ran), report)




def test_quick_backward_benchmark_measures_every_mode_and_counts_forward_and_backward_lines(tmp_path):
    report, _ = quick_run("backward_bench.py", tmp_path, 600)
    assert [r["model"] for r in report] == ["small-convnet", "small-gpt2"]
    for result in report:
        rows = {row["mode"]: row for row in result["modes"]}
        assert set(rows) == {"plain", "anomaly", "narrate", "track", "narrate_track"}
        assert all(row["median_ms"] > 0 and row["multiplier"] > 0 for row in rows.values())
        for row in rows.values():
            # the halves are parts of the step: each fastest half fits in the fastest step
            assert 0 < row["forward_min_ms"] < row["min_ms"] and 0 < row["backward_min_ms"] < row["min_ms"]
            assert row["min_ms"] <= row["median_ms"]
            assert 0 <= row["cheaper_than_anomaly"] <= result["rounds"]
        assert rows["anomaly"]["cheaper_than_anomaly"] == 0
        # one step's lines: its forward and its backward (a node line per autograd node)
        assert rows["narrate"]["lines_per_step"] == rows["narrate_track"]["lines_per_step"] > 40


def test_quick_distributed_benchmark_times_fsdp2_steps_and_across_ranks_on_2_4_8_ranks(tmp_path):
    # (a rank that leaves a collective unwaited, a timing that stopped before it landed, exits non-zero)
    report, _ = quick_run("distributed_bench.py", tmp_path, 900)
    results = report["results"]
    assert [r["world_size"] for r in results] == [2, 4, 8]
    assert all(r["across_ranks_ms"] > 0 for r in results)
    for name, rows in [*results[0]["fsdp_step"].items(), ("tp", results[0]["tp_forward"])]:
        assert set(rows) == {"plain", "narrate", "track"}, name
        assert rows["plain"]["multiplier"] == 1.0 and all(row["ms"] > 0 for row in rows.values())


def test_quick_watch_benchmark_times_every_mode_and_the_watch_holds_no_copy(tmp_path):
    report, _ = quick_run("watch_bench.py", tmp_path, 600)
    assert [r["model"] for r in report] == ["small-convnet", "small-gpt2"]
    for result in report:
        rows = {row["mode"]: row for row in result["modes"]}
        assert set(rows) == {"plain", "watch_outputs", "watch", "watch_no_spikes", "anomaly", "underflow_overflow",
                             "track"}
        assert all(0 < row["min_ms"] <= row["median_ms"] and row["multiplier"] > 0 for row in rows.values())
        for mode in ("watch_outputs", "watch", "watch_no_spikes"):
            # healthy steps: no fault, no false alarm, no spike, and what a step holds is the
            # generators' states and the loss's scalar gradient, not a copy of the activations
            # (judging spikes, the previous step's too, and its batch counted whole: the small conv
            # net's 12 KB image; the activations would be hundreds of KB)
            assert rows[mode]["faults"] == 0, rows[mode]
            assert 0 < rows[mode]["held_bytes"] < 32 * 1024, rows[mode]
        assert rows["watch_no_spikes"]["held_bytes"] < rows["watch"]["held_bytes"], "no previous step without spikes"
        assert rows["plain"]["held_bytes"] is None and rows["plain"]["multiplier"] == 1.0


def test_quick_bisect_benchmark_names_the_planted_addmm_on_a_transformers_gpt2(tmp_path):
    pytest.importorskip("transformers")
    report, _ = quick_run("bisect_bench.py", tmp_path, 900)
    rounding, planted = report["results"]
    assert rounding["verdict"] == "rounding" and rounding["runs"] == 0, rounding
    assert (planted["verdict"], planted["backend"], planted["subsystem"]) == \
        ("compiler", "aot_eager_decomp_partition", "decomposition"), planted
    assert (planted["op"], planted["module"]) == ("addmm", "transformer.h.0.mlp.c_fc"), planted
    assert "(aten.addmm.default)" in planted["report"] and planted["seconds"] > 0


def test_quick_gc_benchmark_counts_full_collections_and_promotions(tmp_path):
    report, done = quick_run("gc_bench.py", tmp_path, 600)
    assert report["steps"] == 200
    for mode in ("plain", "tracked"):
        row = report[mode]
        assert row["steps"] == 200 and row["step_ms"] > 0 and row["full_collections"] >= 0, row
        assert row["promoted_per_step"] >= 0 and row["promoted_in_loop_per_step"] >= 0, row
    # a tracked step leaves its recording (keep=1) and its graph's hooks alive: more than a plain one
    assert report["tracked"]["promoted_per_step"] > report["plain"]["promoted_per_step"]
    assert "tracked  200 steps" in done.stdout


def test_quick_residue_benchmark_times_plain_forwards_around_captures_and_finds_no_hook_left(tmp_path):
    report, done = quick_run("residue_bench.py", tmp_path, 600)
    assert report["rounds"] == 3 and report["before_us"] > 0 and report["after_us"] > 0
    assert report["hooks_left"] == 0, "a capture left a global module hook registered"
    assert report["idle_hooks"] > 0 and "global hooks left: 0" in done.stdout
