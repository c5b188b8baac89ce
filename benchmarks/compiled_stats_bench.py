"""Where statistics in compiled graphs spend their time, and how far that is from the limit.

    python benchmarks/compiled_stats_bench.py                      # resnet18 b1 and b8, GPT-2 6 and 12 layers
    python benchmarks/compiled_stats_bench.py --stable-allocator   # the same, glibc keeping freed memory
    python benchmarks/compiled_stats_bench.py --cold               # also each mode's first call, empty cache
    python benchmarks/compiled_stats_bench.py --cold --cold-rounds 5  # first calls in 5 interleaved rounds
    python benchmarks/compiled_stats_bench.py --quick              # small models, a few minutes
    python benchmarks/compiled_stats_bench.py --steady-calls 400   # longer runs after the rounds (0: none)
    python benchmarks/compiled_stats_bench.py --frozen             # and once more after gc.freeze()
    python benchmarks/compiled_stats_bench.py --alone              # instead: each mode alone in fresh processes
    python benchmarks/compiled_stats_bench.py --alone --preload /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

For each model, in a process of its own: plain eager, eager with `value_stats="exact"` and with
`on_nonfinite="track"`, plain `torch.compile` (inductor) and `tl.compile` with the same two options
(no narration on either side, so only the statistics differ), and tracking once more with its
graphs kept from being screened (`compiled_track_after_call`: the outputs returned and measured
after the call, the way a graph that cannot be screened measures). Every mode runs as a block of calls
after a warm-up, rounds interleaved; a multiplier is the median of per-round ratios against plain
eager or plain `torch.compile`. Each compiled statistics mode is split into its parts:

- `graph +`: the compiled graph's own call, its measured outputs returned, less plain
  `torch.compile`'s whole call: what instrumenting the graph costs (outputs it must now store,
  copies of those written later in the graph; a screened graph's sums);
- `measure`: reading the returned outputs after the call (the meter's recipes: a sum each for
  tracking, three reductions for exact statistics), of which `reduce` is the float outputs'
  reductions and their one read to the host, the rest the meter's bookkeeping (which statistics
  each tensor shares, the `Stats` it fills) and the few integer, bool and half-precision outputs,
  each measured on its own;
- `narrate`: the rest of recording the graph's ops after the call (events, verdicts, provenance);
- `pass`: the rest, outside the graph: the pass's start and end, dynamo's guards and wrapper.
All in milliseconds per forward. From the compiler's own output (the wrapper code inductor wrote
for the graphs, caught on each mode's first call), each compiled mode's kernel calls and the
bytes its freshly allocated buffers hold per call: what instrumenting adds to plain
`torch.compile`'s (outputs that must now be stored, copies of those written later).

Beside them, the limit: the bytes the statistics must read in one call (each measured output once;
for a screened graph, those its after-call variant returns)
and what reading them costs on this machine, timed here on tensors of the same sizes (one sum
each, the screen's own kernel; and one pass over a single buffer of all those bytes, the bandwidth
floor). For exact statistics, whose digits must stay eager's, the floor is what eager's own recipe
costs: the graph storing its outputs (`graph +`), then the recipe run on the values one call measured
(its input and the outputs its graphs returned, copied once after the rounds, each in its own
layout) with nothing around them, read from memory as after a call (`exact's recipe alone`): a
contiguous copy of an output that is not, the reductions, their one read, the sums read into
statistics and the second pass some values need (an sd the sums cannot give, a non-finite value);
`floor x` is plain plus both, over plain. Values drawn at random would leave out the second
passes (GPT-2's GELU holds one output a layer whose mean is large against its spread) and copies.
After the rounds, each mode runs once more in long blocks of calls (`--steady-calls` calls a mode,
in 4 blocks, the modes interleaved), after one collection and none between blocks: its mean call
against its median, and what the garbage collector took of it,
counted and timed by `gc.callbacks`. A round of a few calls seldom holds a full collection, which
walks every object of the process, so the rounds' medians leave out what a long run pays for the
objects each call leaves alive for a while (a recording's events and statistics, the outputs it
measures); the long run's mean does not. With `--frozen` each long run is repeated after
`gc.freeze()` (undone after it), which takes the objects the process holds by then (torch's,
the model's, the compiler's) out of every later collection: what a user who freezes after the
warm-up pays.
Minor page faults per call are counted for every mode: on this kind of machine the
allocator's handling of memory freed between calls (glibc returning it to the system, then
faulting it in again) can cost more than the statistics, and which modes it hits depends on the
process's history. `--stable-allocator` runs each model with glibc told to keep freed memory
(`MALLOC_TRIM_THRESHOLD_` and friends, for the child processes only), which separates that cost from
the measuring's own. `--alone` asks what a process running one mode pays instead, the
allocator's state its own: each mode alone in a fresh process (`--alone-rounds` times, the modes
interleaved), its calls' median, faults per call, and per-round ratios against plain and against
eager with the same statistics; `--preload` runs the children with another malloc (`LD_PRELOAD`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch

import torchlens as tl
from torchlens.events import Stats
from torchlens.fx_backend import compiled_pass, stats_pass
from torchlens.fx_backend.graph import CompiledGraph
from torchlens.measure import meter, recipes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gc_bench import Collections  # noqa: E402  (a sibling script, not a package)

MODELS = {  # name -> (what it is, batch)
    "resnet18-b1": ("torchvision resnet18, 224x224", 1),
    "resnet18-b8": ("torchvision resnet18, 224x224", 8),
    "gpt2-6": ("GPT-2 width 768, 6 layers, 32 tokens", 1),
    "gpt2-12": ("GPT-2 width 768, 12 layers, 32 tokens", 1),
    "small-resnet-b1": ("a resnet layout at width 8, 32x32", 1),
    "small-gpt2": ("GPT-2 width 64, 1 layer, 16 tokens", 1),
}
QUICK = ["small-resnet-b1", "small-gpt2"]
FULL = ["resnet18-b1", "resnet18-b8", "gpt2-6", "gpt2-12"]
STATS = {"exact": dict(value_stats="exact"), "track": dict(on_nonfinite="track")}
EVICTING_BYTES = 256 << 20  # written between timings of what must be read from memory: more than the caches hold
STABLE_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
                    "MALLOC_TOP_PAD_": str(256 << 20)}


def build(name: str):
    """(model in eval mode, input) for a name of MODELS, random weights."""
    torch.manual_seed(0)
    if name.startswith("small-resnet"):
        from snoop_echo_bench import SmallResNet

        return SmallResNet().eval(), torch.randn(1, 3, 32, 32)
    if name.startswith("resnet18"):
        import torchvision

        return torchvision.models.resnet18(weights=None).eval(), torch.randn(MODELS[name][1], 3, 224, 224)
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "small-gpt2":
        config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        return transformers.GPT2Model(config).eval(), torch.randint(0, 512, (1, 16))
    config = transformers.GPT2Config(n_layer=int(name.split("-")[1]))
    return transformers.GPT2Model(config).eval(), torch.randint(0, config.vocab_size, (1, 32))


class Parts:
    """Where a compiled pass's time goes, summed over a block: the compiled graphs' own calls
    (from `CompiledGraph._prepare` returning to `_split_outputs` being handed their outputs), the
    whole of `CompiledPass.add_plan` after each, the measuring within it (`measure_returned`, or
    for a tracked call its one read: `all_finite` of the outputs returned, or a screened graph's
    screens, all of it `reduce`), and the tensors measured by the last forward that measured any
    (every graph's of it); with `keep`, a copy of their values."""

    def __init__(self):
        self.graph = self.after = self.measure = self.reduce = 0.0
        self.sizes: List[tuple] = []  # (numel, dtype) of each tensor measured, by every graph of one forward
        self._forward: List[tuple] = []  # the same, of the forward running now
        self.keep = False  # whether the measured tensors are copied into `values`
        self.values: List[torch.Tensor] = []
        self._called = 0.0
        plan, measured = compiled_pass.CompiledPass.add_plan, compiled_pass.measure_returned
        prepare, split = CompiledGraph._prepare, CompiledGraph._split_outputs
        begin = compiled_pass.CompiledPass.begin

        def begin_forward(*args, **kwargs):
            self._forward = []
            return begin(*args, **kwargs)

        def add_plan(*args, **kwargs):
            start = time.perf_counter()
            try:
                return plan(*args, **kwargs)
            finally:
                self.after += time.perf_counter() - start

        def measure_returned(slots, tensors, measurer, numels):
            start = time.perf_counter()
            try:
                return measured(slots, tensors, measurer, numels)
            finally:
                self.measure += time.perf_counter() - start
                self._forward.extend((t.numel(), t.dtype) for t in tensors)
                self.sizes = self._forward
                if self.keep:
                    self.values.extend(copied(t) for t in tensors)

        def timed_prepare(graph, *args):
            try:
                return prepare(graph, *args)
            finally:
                self._called = time.perf_counter()

        def timed_split(graph, out):
            self.graph += time.perf_counter() - self._called
            return split(graph, out)

        def timed_reductions(real):
            def reductions(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self.reduce += time.perf_counter() - start
            return reductions

        def timed_finite(real):
            def finite(*args):
                start = time.perf_counter()
                try:
                    return real(*args)
                finally:
                    elapsed = time.perf_counter() - start
                    self.measure += elapsed
                    self.reduce += elapsed
            return finite

        meter.summed_together = timed_reductions(meter.summed_together)
        meter.screened_together = timed_reductions(meter.screened_together)
        compiled_pass.all_finite = timed_finite(compiled_pass.all_finite)
        compiled_pass.screens_finite = timed_finite(compiled_pass.screens_finite)  # (a screened graph's)
        compiled_pass.CompiledPass.add_plan = add_plan
        compiled_pass.CompiledPass.begin = begin_forward  # type: ignore[method-assign]
        compiled_pass.measure_returned = measure_returned
        CompiledGraph._prepare, CompiledGraph._split_outputs = timed_prepare, timed_split

    def reset(self) -> None:
        self.graph = self.after = self.measure = self.reduce = 0.0


def copied(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in its own layout: its storage copied, with the same offset, sizes and
    strides (`clone` makes a view that is not dense contiguous, which the meter would copy first)."""
    storage = tensor.detach().untyped_storage().clone()
    return torch.empty(0, dtype=tensor.dtype).set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


_KERNEL_CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(", re.M)
_ALLOCATION = re.compile(r"empty_strided_cpu\(\(([\d, ]*)\), \(([\d, ]*)\), torch\.(\w+)\)")


def first_call_code(run: Callable[[], object]) -> Dict[str, int]:
    """Call `run` once (its first call: it compiles, or loads from inductor's cache) and count, in the
    wrapper code inductor writes for its graphs, the kernel calls and the buffers allocated per call
    (static sizes); an empty dict where no code was caught."""
    from torch._inductor.graph import GraphLowering

    codes: List[str] = []
    before = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append
    try:
        run()
    finally:
        GraphLowering.save_output_code = before
    if not codes:
        return {}
    kernels = allocations = allocated = 0
    for code in codes:
        body = code.split("\ndef call(", 1)[-1].split("\ndef ", 1)[0]
        kernels += len(_KERNEL_CALL.findall(body))
        for sizes, strides, dtype in _ALLOCATION.findall(body):
            numbers = [int(v) for v in sizes.split(",") if v.strip()], [int(v) for v in strides.split(",") if v.strip()]
            elements = 1 + sum((size - 1) * stride for size, stride in zip(*numbers)) if all(numbers[0]) else 0
            allocations += 1
            allocated += elements * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return {"graphs": len(codes), "kernels": kernels, "allocations": allocations, "allocated_bytes": allocated}


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def read_limit(sizes: List[tuple], values=(), repeats: int = 20) -> Dict[str, float]:
    """Bytes of `sizes` and the milliseconds reading them once takes here: one sum per tensor, and
    one sum over a single buffer holding as many bytes. Beside them, with `values` (what a call
    measured, copied: its input and its graphs' returned outputs, in their own layouts), what exact
    statistics' own recipe costs with nothing around it: eager's recipe of each float tensor as
    `summed_together` runs it (a contiguous copy of one that is not; `recipes.sum_parts`: min and
    max, sum, sum of squares; read to the host in one transfer; the sums read into statistics, with
    a second pass where they cannot give them), each time from memory, as after a graph call
    (whose weights and later outputs have pushed the first outputs out of the caches): a buffer
    larger than this machine's caches is written before each timing, which is not counted."""
    tensors = [torch.randn(numel).to(dtype) if dtype.is_floating_point else torch.zeros(numel, dtype=dtype)
               for numel, dtype in sizes]
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.randn(max(1, total // 4))

    def timed(fn: Callable[[], object], evict: Callable[[], object] = lambda: None) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            evict()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    per_tensor = timed(lambda: [t.sum() for t in tensors]) if tensors else 0.0
    limit = {"bytes": total, "sum_each_ms": per_tensor, "one_pass_ms": timed(flat.sum)}
    floats = [t for t in values if t.dtype in (torch.float32, torch.float64) and t.numel()]
    if floats:
        elsewhere = torch.zeros(EVICTING_BYTES, dtype=torch.uint8)
        limit["recipe_each_ms"] = timed(
            lambda: recipes.summed_together([(Stats("exact", t.numel()), t) for t in floats], False),
            lambda: elsewhere.add_(1))
    return limit


STEADY_ROUNDS = 4  # a long run is cut into this many blocks per mode, the modes interleaved


def steady_runs(modes: Dict[str, Callable[[], object]], calls: int, frozen: bool = False) -> Dict[str, Dict]:
    """`calls` calls of each mode, in `STEADY_ROUNDS` long blocks per mode, the modes interleaved
    (this machine drifts over minutes), after one collection and none between blocks (and with
    `frozen`, after `gc.freeze()`, undone after): each mode's mean and median call, the median of
    its blocks' means over those of `base` (plain eager or plain `torch.compile`), and the
    collector's share (see the module docstring)."""
    each = max(calls // STEADY_ROUNDS, 1)
    seconds: Dict[str, List[float]] = {mode: [] for mode in modes}
    blocks: Dict[str, List[float]] = {mode: [] for mode in modes}
    collectors = {mode: Collections() for mode in modes}
    gc.collect()
    if frozen:
        gc.freeze()
    try:
        for _ in range(STEADY_ROUNDS):
            for mode, run in modes.items():
                with collectors[mode]:
                    for _ in range(each):
                        start = time.perf_counter()
                        run()
                        seconds[mode].append(time.perf_counter() - start)
                blocks[mode].append(statistics.mean(seconds[mode][-each:]))
    finally:
        if frozen:
            gc.unfreeze()
    report = {}
    for mode, collector in collectors.items():
        base = "compiled" if mode.startswith("compiled") and "compiled" in modes else "eager"
        done, against = len(seconds[mode]), blocks.get(base, blocks[mode])
        report[mode] = {"calls": done, "mean_ms": statistics.mean(seconds[mode]) * 1e3,
                        "median_ms": statistics.median(seconds[mode]) * 1e3,
                        "mean_x": statistics.median(a / b for a, b in zip(blocks[mode], against)),
                        "young_per_call": collector.young / done, "young_ms_per_call": collector.young_s / done * 1e3,
                        "full": collector.full, "full_ms_per_call": collector.full_s / done * 1e3}
    return report


def calls_of(model, x) -> Dict[str, Callable[[], object]]:
    """One call of `model` on `x` in each mode (nothing compiles until its first call)."""
    plain = torch.compile(model)
    modes: Dict[str, Callable[[], object]] = {"eager": lambda: model(x), "compiled": lambda: plain(x)}
    for stat, keywords in STATS.items():
        modes[f"eager_{stat}"] = (lambda kw: lambda: tl.record(model, x, **kw))(keywords)
        modes[f"compiled_{stat}"] = (lambda c: lambda: c(x))(tl.compile(model, **keywords))
    modes["compiled_track_after_call"] = unscreened(tl.compile(model, **STATS["track"]), x)
    return modes


def run_model(name: str, rounds: int, calls: int, steady_calls: int = 0, frozen: bool = False) -> Dict:
    """All modes of one model, in this process: times, faults and the compiled modes' parts."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, x = build(name)
    parts = Parts()
    modes = calls_of(model, x)
    times: Dict[str, List[float]] = {mode: [] for mode in modes}
    fault_counts: Dict[str, List[float]] = {mode: [] for mode in modes}
    graph: Dict[str, List[float]] = {mode: [] for mode in modes}
    after: Dict[str, List[float]] = {mode: [] for mode in modes}
    measuring: Dict[str, List[float]] = {mode: [] for mode in modes}
    reducing: Dict[str, List[float]] = {mode: [] for mode in modes}
    sizes: Dict[str, List[tuple]] = {}
    code: Dict[str, Dict[str, int]] = {}
    with torch.no_grad():
        for mode, run in modes.items():
            if mode.startswith("compiled"):
                code[mode] = first_call_code(run)
            for _ in range(3):
                run()
        for _ in range(rounds):
            for mode, run in modes.items():
                parts.reset()
                before, start = faults(), time.perf_counter()
                for _ in range(calls):
                    run()
                times[mode].append((time.perf_counter() - start) / calls * 1e3)
                fault_counts[mode].append((faults() - before) / calls)
                graph[mode].append(parts.graph / calls * 1e3)
                after[mode].append(parts.after / calls * 1e3)
                measuring[mode].append(parts.measure / calls * 1e3)
                reducing[mode].append(parts.reduce / calls * 1e3)
                if parts.sizes:
                    sizes[mode] = parts.sizes
        parts.keep, parts.values = True, []  # (one more call, untimed: what exact statistics measure, for their floor)
        modes["compiled_exact"]()
        parts.keep = False
        # the input is measured too; no outputs returned (a graph that fuses its statistics): no floor
        values = [x, *parts.values] if parts.values else []
        steady = steady_runs(modes, steady_calls) if steady_calls else {}
        thawed = steady_runs(modes, steady_calls, frozen=True) if frozen and steady_calls else {}
    rows = {}
    for mode in modes:
        base = "compiled" if mode.startswith("compiled") else "eager"
        row = {"ms": statistics.median(times[mode]),
               "x": statistics.median(a / b for a, b in zip(times[mode], times[base])),
               "faults_per_call": statistics.median(fault_counts[mode])}
        if mode in code:
            row["code"] = code[mode]
        if steady:
            row["steady"] = steady[mode]
        if thawed:
            row["frozen"] = thawed[mode]
        if mode.startswith("compiled_"):
            row.update(graph_ms=statistics.median(graph[mode]),
                       graph_extra_ms=statistics.median(g - c for g, c in zip(graph[mode], times["compiled"])),
                       measure_ms=statistics.median(measuring[mode]),
                       reduce_ms=statistics.median(reducing[mode]),
                       narrate_ms=statistics.median(a - m for a, m in zip(after[mode], measuring[mode])),
                       pass_ms=statistics.median(t - g - a for t, g, a in zip(times[mode], graph[mode], after[mode])),
                       limit=read_limit(sizes.get(mode) or sizes.get("compiled_track_after_call", []),
                                        values if mode == "compiled_exact" else ()))
        if mode == "compiled_exact" and "recipe_each_ms" in row["limit"]:  # storing the outputs, then eager's recipe
            plain = statistics.median(times["compiled"])
            row["floor_x"] = (plain + max(row["graph_extra_ms"], 0.0) + row["limit"]["recipe_each_ms"]) / plain
        rows[mode] = row
    return {"model": name, "what": MODELS[name][0], "modes": rows}


def unscreened(compiled, x) -> Callable[[], object]:
    """A call of a tracked compiled model whose graphs are compiled unscreened (`stats_pass`)."""
    def run():
        screenable = stats_pass._screenable
        stats_pass._screenable = lambda *args: False
        try:
            return compiled(x)
        finally:
            stats_pass._screenable = screenable
    return run


def cold_first_call(name: str, mode: str) -> float:
    """Seconds of one mode's first call, in this process (started with an empty inductor cache)."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, x = build(name)
    compiled = torch.compile(model) if mode == "compiled" else tl.compile(model, **STATS[mode.split("_")[1]])
    with torch.no_grad():
        start = time.perf_counter()
        compiled(x)
    return time.perf_counter() - start


COLD_MODES = ("compiled", "compiled_exact", "compiled_track")


def cold_rounds(name: str, rounds: int, env: Dict[str, str]):
    """Each mode's first call in a fresh process with an empty inductor cache, `rounds` times,
    the modes interleaved (a cold compile moves by about 15% from one process to the next):
    ({mode: median seconds or None}, {mode: median of per-round ratios against plain}). A mode
    that fails in any round counts as failed."""
    seconds: Dict[str, List[float]] = {mode: [] for mode in COLD_MODES}
    failed = set()
    for _ in range(rounds):
        for mode in COLD_MODES:
            with tempfile.TemporaryDirectory() as cache:
                cold = child(["--models", name, "--child-cold", mode], dict(env, TORCHINDUCTOR_CACHE_DIR=cache))
            if cold.get("seconds") is None:
                failed.add(mode)
            seconds[mode].append(cold.get("seconds") or 0.0)
    plain = seconds["compiled"]
    medians = {mode: None if mode in failed else statistics.median(s) for mode, s in seconds.items()}
    ratios = {mode: None if mode in failed or "compiled" in failed else
              statistics.median(a / b for a, b in zip(s, plain)) for mode, s in seconds.items()}
    return medians, ratios


ALONE_MODES = ("eager", "compiled", "eager_exact", "compiled_exact", "eager_track", "compiled_track")


def alone_calls(name: str, mode: str, blocks: int, calls: int) -> Dict[str, float]:
    """One mode alone in this process, as a user's process runs it: after a warm-up, `blocks`
    blocks of `calls` calls; the median block's ms per call and minor page faults per call."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, x = build(name)
    run = calls_of(model, x)[mode]
    times, counts = [], []
    with torch.no_grad():
        for _ in range(3):
            run()
        for _ in range(blocks):
            before, start = faults(), time.perf_counter()
            for _ in range(calls):
                run()
            times.append((time.perf_counter() - start) / calls * 1e3)
            counts.append((faults() - before) / calls)
    return {"ms": statistics.median(times), "faults_per_call": statistics.median(counts)}


def alone_rounds(name: str, rounds: int, blocks: int, calls: int, env: Dict[str, str]) -> Dict:
    """Each mode alone in a fresh process, `rounds` times, the modes interleaved. In one process
    the modes share the allocator's state: under glibc's defaults, memory one mode holds at its
    peak is given back to the system and faulted in again by the modes beside it, so the
    side-by-side rounds cannot tell what a process running one mode pays. Per mode: median ms and
    faults per call, the median of per-round ratios against plain eager or plain `torch.compile`
    (`x`), and for a compiled statistics mode against eager with the same statistics
    (`x_eager`). A mode that fails in any round counts as failed."""
    ms: Dict[str, List[float]] = {mode: [] for mode in ALONE_MODES}
    counts: Dict[str, List[float]] = {mode: [] for mode in ALONE_MODES}
    failed: Dict[str, str] = {}  # mode -> the first failure's last line
    for _ in range(rounds):
        for mode in ALONE_MODES:
            result = child(["--models", name, "--child-alone", mode, "--rounds", str(blocks), "--calls", str(calls)],
                           env)
            if "error" in result:
                failed.setdefault(mode, result["error"])
            ms[mode].append(result.get("ms", 0.0))
            counts[mode].append(result.get("faults_per_call", 0.0))

    def ratio(mode: str, base: str) -> Optional[float]:
        if mode in failed or base in failed:
            return None
        return statistics.median(a / b for a, b in zip(ms[mode], ms[base]))

    report = {}
    for mode in ALONE_MODES:
        if mode in failed:
            report[mode] = {"error": failed[mode]}
            continue
        row = {"ms": statistics.median(ms[mode]), "faults_per_call": statistics.median(counts[mode]),
               "x": ratio(mode, "compiled" if mode.startswith("compiled") else "eager")}
        if mode.startswith("compiled_"):
            row["x_eager"] = ratio(mode, mode.replace("compiled", "eager"))
        report[mode] = row
    return report


def alone_table(results: List[Dict]) -> str:
    lines = ["| model | mode | ms | x plain | x eager, same statistics | faults/call |",
             "|---|---|---:|---:|---:|---:|"]
    for result in results:
        for mode, row in result.get("alone", {}).items():
            if "error" in row:
                lines.append(f"| {result['model']} | {mode} | failed: {row['error']} | | | |")
                continue
            plain, eager = (f"{row[key]:.2f}" if row.get(key) is not None else "" for key in ("x", "x_eager"))
            lines.append(f"| {result['model']} | {mode} | {row['ms']:.1f} | {plain} | {eager} | "
                         f"{row['faults_per_call']:.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def child(arguments: List[str], env: Dict[str, str]) -> Dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, os.path.abspath(__file__), *arguments, "--child-json", out.name]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=7200)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
        return json.loads(open(out.name).read())


def table(results: List[Dict]) -> str:
    lines = ["| model | mode | ms | x | faults/call | kernels, MiB allocated | graph + | measure (reduce) | narrate | "
             "pass | bytes read | read once: sum each / one pass | limit x | exact's recipe alone | floor x |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['model']} | failed: {result['error']} |")
            continue
        plain = result["modes"]["compiled"]["ms"]
        for mode, row in result["modes"].items():
            cells = [result["model"], mode, f"{row['ms']:.1f}", f"{row['x']:.2f}", f"{row['faults_per_call']:.0f}"]
            code = row.get("code")
            cells.append(f"{code['kernels']}, {code['allocated_bytes'] / 2 ** 20:.1f}" if code else "")
            if "graph_ms" in row:
                limit = row["limit"]
                cells += [f"{row['graph_extra_ms']:+.2f}", f"{row['measure_ms']:.2f} ({row['reduce_ms']:.2f})",
                          f"{row['narrate_ms']:.2f}", f"{row['pass_ms']:.2f}", f"{limit['bytes'] / 2 ** 20:.1f} MiB",
                          f"{limit['sum_each_ms']:.2f} / {limit['one_pass_ms']:.2f}",
                          f"{(plain + limit['sum_each_ms']) / plain:.2f}"]
                cells += [f"{limit['recipe_each_ms']:.2f}", f"{row['floor_x']:.2f}"] if "floor_x" in row else ["", ""]
            else:
                cells += [""] * 9
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def steady_table(results: List[Dict], key: str = "steady") -> str:
    """The long runs (`steady_runs`, or with `key="frozen"` those after `gc.freeze()`): mean against
    median, and the collector's part of the mean."""
    lines = ["| model | mode | mean ms (x, median of blocks) | median ms | young collections a call, ms a call | "
             "full collections, ms a call |", "|---|---|---:|---:|---:|---:|"]
    for result in results:
        for mode, row in result.get("modes", {}).items():
            if key in row:
                run = row[key]
                lines.append(f"| {result['model']} | {mode} | {run['mean_ms']:.1f} ({run['mean_x']:.2f}x) | "
                             f"{run['median_ms']:.1f} | {run['young_per_call']:.1f}, {run['young_ms_per_call']:.2f} | "
                             f"{run['full']}, {run['full_ms_per_call']:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--quick", action="store_true", help="small models, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds side by side; with --alone, blocks a process")
    parser.add_argument("--calls", type=int, default=5, help="calls per block")
    parser.add_argument("--steady-calls", type=int, default=None,
                        help="calls of each mode in long blocks after the rounds (default 200, --quick 60; 0: none)")
    parser.add_argument("--frozen", action="store_true", help="repeat each long run after gc.freeze()")
    parser.add_argument("--stable-allocator", action="store_true", help="children keep freed memory (glibc)")
    parser.add_argument("--cold", action="store_true", help="also time each mode's first call, empty cache")
    parser.add_argument("--cold-rounds", type=int, default=3, help="fresh processes per mode for --cold")
    parser.add_argument("--alone", action="store_true",
                        help="instead of side by side, each mode alone in fresh processes (its allocator to itself)")
    parser.add_argument("--alone-rounds", type=int, default=None, help="fresh processes per mode for --alone (3)")
    parser.add_argument("--preload", default=None, help="a malloc library the children preload (LD_PRELOAD)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-cold", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-alone", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.alone and (args.cold or args.frozen or args.steady_calls is not None):
        parser.error("--alone times each mode alone in fresh processes; --cold, --frozen and --steady-calls "
                     "belong to the side-by-side run: run them without --alone")
    if args.alone_rounds is not None and (args.alone_rounds < 1 or not args.alone):
        parser.error("--alone-rounds is a count of 1 or more, for --alone")
    rounds_alone = args.alone_rounds or 3
    if args.preload and (args.stable_allocator or not os.path.isfile(args.preload)):
        parser.error(f"--preload {args.preload}: give a malloc library that exists, and not with --stable-allocator "
                     "(whose settings are glibc's)")
    names = args.models.split(",") if args.models else (QUICK if args.quick else FULL)
    rounds = args.rounds or (3 if args.quick else 9)
    steady_calls = args.steady_calls if args.steady_calls is not None else (60 if args.quick else 200)
    if args.child_json:
        if args.child_cold:
            report: Dict = {"seconds": cold_first_call(names[0], args.child_cold)}
        elif args.child_alone:
            report = alone_calls(names[0], args.child_alone, rounds, args.calls)
        else:
            report = run_model(names[0], rounds, args.calls, steady_calls, args.frozen)
        with open(args.child_json, "w") as out:
            json.dump(report, out)
        return 0
    env = dict(os.environ, **(STABLE_ALLOCATOR if args.stable_allocator else {}))
    if args.preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [os.path.abspath(args.preload), env.get("LD_PRELOAD")]))
    allocator = "glibc, kept" if args.stable_allocator else args.preload or "glibc"
    passed = ["--rounds", str(rounds), "--calls", str(args.calls), "--steady-calls", str(steady_calls)]
    passed += ["--frozen"] if args.frozen and steady_calls else []
    results = []
    for name in names:
        if args.alone:
            results.append({"model": name, "alone": alone_rounds(name, rounds_alone, rounds, args.calls, env)})
            print(f"{name}: done", file=sys.stderr, flush=True)
            continue
        result = child(["--models", name, *passed], env)
        result.setdefault("model", name)
        if args.cold and "error" not in result:
            result["cold_s"], result["cold_x"] = cold_rounds(name, args.cold_rounds, env)
        results.append(result)
        print(f"{name}: done", file=sys.stderr, flush=True)
    if args.alone:
        print(f"Each mode alone in a fresh process ({allocator}), medians of {rounds_alone} rounds:")
        print(alone_table(results))
    else:
        print(table(results))
    if steady_calls and not args.alone:
        print(f"\nLong runs: {steady_calls} calls per mode in {STEADY_ROUNDS} interleaved blocks:")
        print(steady_table(results))
        if args.frozen:
            print("\nThe same after gc.freeze():")
            print(steady_table(results, "frozen"))
    for result in results:
        if result.get("cold_s"):
            print(f"{result['model']} cold first call, median s (x plain): " + ", ".join(
                f"{mode} {s:.1f}" + (f" ({result['cold_x'][mode]:.2f}x)" if result["cold_x"][mode] else "")
                if s else f"{mode} failed"
                for mode, s in result["cold_s"].items()))
    report = {"threads": int(os.environ.get("BENCH_THREADS", "2")), "stable_allocator": args.stable_allocator,
              "allocator": allocator,
              "torch": torch.__version__, "results": results}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    failed = [result for result in results
              if "error" in result or any("error" in row for row in result.get("alone", {}).values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
