"""What narration costs: every torchlens mode against plain eager and plain `torch.compile`.

    python benchmarks/snoop_echo_bench.py                # resnet18 and GPT-2, batch 1 and 8
    python benchmarks/snoop_echo_bench.py --quick        # small models, 3 rounds, no cold compiles: ~3 min

All modes of one model and batch run in one process, interleaved round by round after a warm-up, and
each figure is the median over rounds, so load on the machine hits every mode alike. Multipliers
are reported against plain eager (eager modes) and plain `torch.compile` (compiled modes); the
per-line cost is the extra time divided by the lines narrated per forward. A mode that fails is
reported as failed, with its error, never as a number. The full run needs torchvision and
transformers (`pip install -e ".[bench]"`, see docs/performance.md for the torch/torchvision
pairing); `--quick` needs neither torchvision nor network access.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import torchlens as tl

EAGER_MODES = [
    # name, description, keyword arguments of tl.record / tl.trace (None: plain eager)
    ("eager", "plain eager (baseline)", None),
    ("record", "tl.record, no narration", dict()),
    ("narrate", "narration to a file, metadata only", dict(narrate="FILE")),
    ("track", "on_nonfinite='track', no narration", dict(on_nonfinite="track")),
    ("reuse", "narration + track + value_stats='reuse'",
     dict(narrate="FILE", on_nonfinite="track", value_stats="reuse")),
    ("sampled", "narration + value_stats='sampled'", dict(narrate="FILE", value_stats="sampled")),
    ("exact", "narration + value_stats='exact'", dict(narrate="FILE", value_stats="exact")),
    ("trace", "tl.trace (keeps every op's output)", dict(trace=True)),
]

COMPILED_MODES = [
    # name, description, keyword arguments of tl.compile (None: plain torch.compile), baseline
    ("compiled", "plain torch.compile (baseline)", None, None),
    ("fused", "backend='torchlens' fused, narration to a file", dict(narrate="FILE"), "compiled"),
    ("fused_quiet", "backend='torchlens' fused, no narration", dict(), "compiled"),
    ("live", "live=True, narration to a file", dict(narrate="FILE", live=True), "compiled"),
    ("compiled_dynamic", "plain torch.compile, dynamic=True (baseline)", dict(plain=True, dynamic=True), None),
    ("fused_dynamic", "fused narration, dynamic=True", dict(narrate="FILE", dynamic=True), "compiled_dynamic"),
    ("fused_exact", "fused narration + value_stats='exact'", dict(narrate="FILE", value_stats="exact"), "compiled"),
    ("fused_track", "fused + on_nonfinite='track', no narration", dict(on_nonfinite="track"), "compiled"),
    ("fused_exact_modules", "exact stats on module outputs only", dict(narrate="FILE", value_stats="exact",
                                                                        stats_on="module_outputs"), "compiled"),
]


# -- models ---------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, width: int, stride: int = 1):
        super().__init__()
        inp = width // stride if stride > 1 else width
        self.conv1 = nn.Conv2d(inp, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.down = (nn.Sequential(nn.Conv2d(inp, width, 1, stride, bias=False), nn.BatchNorm2d(width))
                     if stride > 1 else None)

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class SmallResNet(nn.Module):
    """The resnet layout (stem, residual stages, pooled head) at a fraction of resnet18's width."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(BasicBlock(width))
        self.layer2 = nn.Sequential(BasicBlock(width * 2, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 2, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer2(self.layer1(self.stem(x)))), 1))


def build_models(quick: bool):
    """(name, model factory, input factory(batch)) for each benchmarked model."""
    import transformers

    transformers.logging.set_verbosity_error()
    if quick:
        gpt_config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64,
                                             bos_token_id=0, eos_token_id=0)
        return [
            ("small-resnet", lambda: SmallResNet(), lambda b: torch.randn(b, 3, 32, 32)),
            ("small-gpt2", lambda: transformers.GPT2Model(gpt_config), lambda b: torch.randint(0, 512, (b, 16))),
        ]
    import torchvision

    gpt_config = transformers.GPT2Config()  # the 124M configuration, random weights
    return [
        ("resnet18", lambda: torchvision.models.resnet18(weights=None), lambda b: torch.randn(b, 3, 224, 224)),
        ("gpt2", lambda: transformers.GPT2Model(gpt_config),
         lambda b: torch.randint(0, gpt_config.vocab_size, (b, 64))),
    ]


# -- measuring -----------------------------------------------------------------------------------


class Mode:
    """One way of running the forward: a callable, the lines it narrates, or why it failed."""

    def __init__(self, name: str, description: str, baseline: Optional[str]):
        self.name = name
        self.description = description
        self.baseline = baseline
        self.run: Optional[Callable[[], object]] = None
        self.log: Optional[str] = None
        self.times: List[float] = []
        self.error: Optional[str] = None
        self.lines = 0
        self.inner = 1
        self.retaken = 0
        self.first_call_s: Optional[float] = None
        self.peak_bytes: Optional[int] = None

    def fail(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        self.run = None


def eager_mode(name, description, kwargs, model, x, log_dir) -> Mode:
    mode = Mode(name, description, None if kwargs is None else "eager")
    if kwargs is None:
        mode.run = lambda: model(x)
        return mode
    kwargs = dict(kwargs)
    entry = tl.trace if kwargs.pop("trace", False) else tl.record
    if kwargs.get("narrate") == "FILE":
        mode.log = kwargs["narrate"] = os.path.join(log_dir, f"{name}.log")
    if entry is tl.trace:
        kwargs["max_bytes"] = None
    mode.run = lambda: entry(model, x, **kwargs)
    return mode


def compiled_mode(name, description, kwargs, baseline, model, x, log_dir) -> Mode:
    mode = Mode(name, description, baseline)
    kwargs = dict(kwargs or {})
    plain = kwargs.pop("plain", False) or name == "compiled"
    if kwargs.get("narrate") == "FILE":
        mode.log = kwargs["narrate"] = os.path.join(log_dir, f"{name}.log")
    compiled = torch.compile(model, **kwargs) if plain else tl.compile(model, **kwargs)
    start = time.perf_counter()
    compiled(x)
    mode.first_call_s = time.perf_counter() - start
    mode.run = lambda: compiled(x)
    return mode


# What a cold compile is timed for: plain torch.compile, or tl.compile with these keywords.
COLD_KINDS = {
    "plain": None,
    "torchlens": dict(narrate=os.devnull),
    "exact": dict(narrate=os.devnull, value_stats="exact"),
    "exact_modules": dict(narrate=os.devnull, value_stats="exact", stats_on="module_outputs"),
    "track": dict(on_nonfinite="track"),
}


def cold_compile(model_name: str, batch: int, device: str, kind: str) -> Optional[float]:
    """Seconds for the first call of a freshly compiled model, in a new process with an empty
    inductor cache: what a user waits for. `kind` is a key of COLD_KINDS."""
    import subprocess

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        command = [sys.executable, __file__, "--cold", kind, "--models", model_name, "--batches", str(batch),
                   "--device", device]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return None
    return float(done.stdout.strip().splitlines()[-1])


def _cold_child(args, models) -> int:
    name, make_model, make_input = models[0]
    torch.manual_seed(0)
    model = make_model().eval().to(args.device)
    x = make_input(int(args.batches)).to(args.device)
    keywords = COLD_KINDS[args.cold]
    compiled = torch.compile(model) if keywords is None else tl.compile(model, **keywords)
    with torch.no_grad():
        start = time.perf_counter()
        compiled(x)
    print(time.perf_counter() - start)
    return 0


def count_lines(mode: Mode) -> None:
    """Lines one forward narrates: the file's size after a single run."""
    if mode.log is None or mode.run is None:
        return
    open(mode.log, "w").close()
    mode.run()
    with open(mode.log) as f:
        mode.lines = sum(1 for _ in f)


def measure(modes: List[Mode], warmup: int, rounds: int) -> None:
    """Take one sample of every mode per round, in an order rotated each round.

    A sample is the mean time of enough consecutive calls to last about 20 ms. On a shared machine
    a sample during which other processes kept a core busy is taken again (after a pause): with
    torch's threads spinning on every core, a neighbour slows a forward by an order of magnitude,
    and a median over such samples would measure the neighbour.
    """
    live = [m for m in modes if m.run is not None]
    for _ in range(warmup):
        for mode in live:
            _sample(mode, 1)
    for mode in live:
        mode.inner = _inner_count(mode)
    for index in range(rounds):
        order = live[index % len(live):] + live[:index % len(live)] if live else []
        for mode in order:
            if mode.run is not None:
                mode.times.append(_guarded_sample(mode))
            if mode.log is not None:
                open(mode.log, "w").close()  # keep files small; truncating is outside the timing


def _inner_count(mode: Mode, target_s: float = 0.02) -> int:
    if mode.run is None:
        return 1
    elapsed = _sample(mode, 1) or target_s
    return max(1, min(50, int(target_s / elapsed)))


def _guarded_sample(mode: Mode, tries: int = 6) -> Optional[float]:
    for attempt in range(tries):
        busy, own = _busy_seconds(), _own_seconds()
        start = time.perf_counter()
        elapsed = _sample(mode, mode.inner)
        wall = time.perf_counter() - start
        foreign = (_busy_seconds() - busy) - (_own_seconds() - own)
        if elapsed is None or foreign <= max(0.3 * wall, 0.03) or attempt == tries - 1:
            return elapsed
        mode.retaken += 1
        time.sleep(0.3 * (attempt + 1))
    return None


def _sample(mode: Mode, calls: int) -> Optional[float]:
    """Mean seconds per call over `calls` calls; None (and the mode marked failed) if it raised."""
    try:
        start = time.perf_counter()
        for _ in range(calls):
            mode.run()
        return (time.perf_counter() - start) / calls
    except Exception as exc:  # a mode that fails is reported as failed
        mode.fail(exc)
        return None


def _busy_seconds() -> float:
    """CPU seconds every process has spent busy since boot (all cores; /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


@contextlib.contextmanager
def peak_rss():
    """Track the process's peak resident memory above what it held on entry (CPU runs)."""
    result = {"peak": 0}
    stop = threading.Event()
    base = _rss()

    def sample():
        while not stop.is_set():
            result["peak"] = max(result["peak"], _rss() - base)
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def measure_memory(modes: List[Mode], device: str) -> None:
    """Peak memory above the model's own, one mode at a time (CUDA allocator, or process RSS)."""
    for mode in modes:
        if mode.run is None:
            continue
        gc.collect()
        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                mode.run()
                torch.cuda.synchronize()
                mode.peak_bytes = torch.cuda.max_memory_allocated() - base
            else:
                with peak_rss() as peak:
                    for _ in range(3):
                        mode.run()
                mode.peak_bytes = peak["peak"]
        except Exception as exc:
            mode.fail(exc)


# -- one model ------------------------------------------------------------------------------------


def bench_model(name, make_model, make_input, batch, device, warmup, rounds, compiled: bool) -> Dict:
    torch.manual_seed(0)
    model = make_model().eval().to(device)
    x = make_input(batch).to(device)
    log_dir = tempfile.mkdtemp(prefix="torchlens-bench-")
    results = {"model": name, "batch": batch, "device": device, "modes": []}
    with torch.no_grad():
        groups = [[eager_mode(n, d, k, model, x, log_dir) for n, d, k in EAGER_MODES]]
        if compiled:
            group = []
            for n, d, k, base in COMPILED_MODES:
                try:
                    group.append(compiled_mode(n, d, k, base, model, x, log_dir))
                except Exception as exc:
                    mode = Mode(n, d, base)
                    mode.fail(exc)
                    group.append(mode)
            groups.append(group)
        for modes in groups:
            for mode in modes:
                count_lines(mode)
            measure(modes, warmup, rounds)
            measure_memory(modes, device)
            results["modes"].extend(summarise(modes))
    return results


def summarise(modes: List[Mode]) -> List[Dict]:
    by_name = {m.name: m for m in modes}
    rows = []
    for mode in modes:
        ok = mode.error is None and mode.times and None not in mode.times
        median = statistics.median(mode.times) if ok else None
        base = by_name.get(mode.baseline) if mode.baseline else None
        base_ok = base is not None and base.error is None and base.times and None not in base.times
        base_median = statistics.median(base.times) if base_ok else None
        multiplier = None
        if median is not None and base_median is not None:
            # the median of per-round ratios: each round's pair ran close together, so drift cancels
            multiplier = statistics.median(a / b for a, b in zip(mode.times, base.times))
        row = {
            "mode": mode.name,
            "description": mode.description,
            "baseline": mode.baseline,
            "median_ms": None if median is None else median * 1e3,
            "multiplier": multiplier,
            "ratio_of_medians": None if multiplier is None else median / base_median,
            "lines": mode.lines,
            "us_per_line": None,
            "first_call_s": mode.first_call_s,
            "peak_mb": None if mode.peak_bytes is None else mode.peak_bytes / 2**20,
            "rounds": len(mode.times),
            "calls_per_sample": mode.inner,
            "samples_retaken": mode.retaken,
            "error": mode.error,
        }
        if multiplier is not None and mode.lines:
            row["us_per_line"] = (multiplier - 1) * base_median / mode.lines * 1e6
        rows.append(row)
    return rows


# -- report ---------------------------------------------------------------------------------------


def table(results: List[Dict]) -> str:
    lines = []
    for result in results:
        lines.append(f"\n{result['model']}  batch {result['batch']}  {result['device']}")
        cold = result.get("cold_compile_s")
        if cold:
            shown = ", ".join(f"{kind} {'failed' if value is None else f'{value:.1f} s'}"
                              for kind, value in cold.items())
            lines.append(f"  cold compile (fresh process and cache): {shown}")
        lines.append(f"  {'mode':22s} {'median ms':>10s} {'x base':>8s} {'lines':>6s} {'us/line':>8s} "
                     f"{'1st call s':>10s} {'peak MB':>8s}  vs")
        for row in result["modes"]:
            if row["error"]:
                lines.append(f"  {row['mode']:22s} FAILED: {row['error']}")
                continue
            lines.append(
                f"  {row['mode']:22s} {_f(row['median_ms'], 10, 3)} {_f(row['multiplier'], 8, 3)} "
                f"{row['lines'] or '':>6} {_f(row['us_per_line'], 8, 2)} {_f(row['first_call_s'], 10, 1)} "
                f"{_f(row['peak_mb'], 8, 1)}  {row['baseline'] or ''}"
            )
    return "\n".join(lines)


def _f(value, width, digits) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else " " * width


def environment() -> Dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchlens": tl.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few rounds: proves the script works")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8; quick: 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per mode (default 30; quick: 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile modes")
    parser.add_argument("--models", default=None, help="comma-separated subset of the model names")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--cold-kinds", default="plain,torchlens",
                        help=f"cold compiles to time, from {','.join(COLD_KINDS)} (full runs only)")
    parser.add_argument("--cold", choices=tuple(COLD_KINDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    unknown = set(args.cold_kinds.split(",")) - set(COLD_KINDS)
    if unknown:
        parser.error(f"unknown --cold-kinds {sorted(unknown)}; choose from {', '.join(COLD_KINDS)}")
    models = build_models(args.quick)
    if args.models:
        wanted = args.models.split(",")
        models = [m for m in models if m[0] in wanted]
    if args.cold:
        return _cold_child(args, models)
    torch._dynamo.config.recompile_limit = 64  # every compiled mode compiles the same forward
    batches = [int(b) for b in (args.batches or ("1" if args.quick else "1,8")).split(",")]
    rounds = args.rounds or (3 if args.quick else 30)
    results = []
    for name, make_model, make_input in models:
        for batch in batches:
            print(f"benchmarking {name} batch {batch} on {args.device} ...", file=sys.stderr, flush=True)
            result = bench_model(name, make_model, make_input, batch, args.device, args.warmup, rounds,
                                 compiled=not args.no_compile)
            if not (args.no_compile or args.quick) and batch == batches[0]:
                result["cold_compile_s"] = {kind: cold_compile(name, batch, args.device, kind)
                                            for kind in args.cold_kinds.split(",")}
            results.append(result)
    report = {"environment": environment(), "quick": args.quick, "rounds": rounds, "results": results}
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
