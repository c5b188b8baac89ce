"""What a capture leaves the process: plain forwards before any capture and after captures.

While a global module hook is registered, `Module._call_impl` takes its slow path for every module
call of every model in the process. A capture must leave none behind, however it ends. In one
process with dynamo loaded (as in any process that compiled something), this times a plain
forward of a 12-block `Linear+GELU` model (8 x 64):

- `before`: blocks of plain forwards before any capture;
- then captures that end every way: `tl.record` returned, raised, interrupted (KeyboardInterrupt),
  `tl.trace`, a `Recorder` block, each with a compiled submodule inside;
- `after`: the same blocks of plain forwards;
- `idle_hooks`: what a leftover would cost, for scale: blocks with an idle pair of global hooks
  registered, interleaved with plain blocks (median of per-round ratios).

`after / before` is the figure that matters (1.00 when nothing is left). A process is changed for
good by its first capture, so each of several fresh processes measures before and after once, and
the report gives the median of their ratios; `hooks_left` counts the global forward hooks still
registered afterwards (the most any process had).

    python benchmarks/residue_bench.py             # 9 processes, 20 blocks of 200 forwards each side
    python benchmarks/residue_bench.py --quick     # 3 processes, 4 blocks of 50: proves it works
    python benchmarks/residue_bench.py --json residue.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (loaded, as in any process that has compiled something)
from torch import nn

import torchlens as tl

_MODULE = torch.nn.modules.module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(12)]).eval()


def _block_ms(model, x, calls: int) -> float:
    """The mean time of one forward over a block of `calls` (after a warm-up call)."""
    with torch.no_grad():
        model(x)
        started = time.perf_counter()
        for _ in range(calls):
            model(x)
        return (time.perf_counter() - started) / calls * 1e3


class _Ending(nn.Module):
    """The model with a compiled submodule, ending as asked: returned, raised or interrupted."""

    def __init__(self):
        super().__init__()
        self.body = _model()
        self.head = torch.compile(nn.Linear(64, 64), backend="eager")
        self.ending = None

    def forward(self, x):
        out = self.head(self.body(x))
        if self.ending is not None:
            raise self.ending
        return out


def _captures(x) -> None:
    """One capture ending each way."""
    model = _Ending()
    tl.record(model, x, narrate=io.StringIO())
    tl.trace(model, x, value_stats="exact")
    with tl.recording.Recorder(model, narrate=io.StringIO(), on_nonfinite="track"):
        model(x)
    for ending in (RuntimeError("raised"), KeyboardInterrupt()):
        model.ending = ending
        try:
            tl.record(model, x, narrate=io.StringIO())
        except (RuntimeError, KeyboardInterrupt):
            pass
    model.ending = None


def _idle_hooks_ratio(model, x, blocks: int, calls: int) -> float:
    ratios = []
    for _ in range(blocks):
        plain = _block_ms(model, x, calls)
        handles = (_MODULE.register_module_forward_pre_hook(lambda module, args: None),
                   _MODULE.register_module_forward_hook(lambda module, args, out: None))
        try:
            hooked = _block_ms(model, x, calls)
        finally:
            for handle in handles:
                handle.remove()
        ratios.append(hooked / plain)
    return statistics.median(ratios)


def measure(blocks: int, calls: int) -> dict:
    """One process's figures: plain forwards before any capture, the captures, plain forwards after."""
    torch.set_num_threads(2)
    model, x = _model(), torch.randn(8, 64)
    before = [_block_ms(model, x, calls) for _ in range(blocks)]
    _captures(x)
    after = [_block_ms(model, x, calls) for _ in range(blocks)]
    return {"before_us": statistics.median(before) * 1e3, "after_us": statistics.median(after) * 1e3,
            "hooks_left": len(_MODULE._global_forward_hooks) + len(_MODULE._global_forward_pre_hooks),
            "idle_hooks": _idle_hooks_ratio(model, x, blocks, calls)}


def run(rounds: int, blocks: int, calls: int) -> dict:
    """`rounds` fresh processes, each measuring before and after once (a process is changed for
    good by its first capture, so before and after cannot be interleaved within one): the median
    of their ratios."""
    children = []
    for _ in range(rounds):
        done = subprocess.run([sys.executable, __file__, "--child", str(blocks), str(calls)], capture_output=True,
                              text=True, check=True)
        children.append(json.loads(done.stdout.splitlines()[-1]))
    return {
        "rounds": rounds, "blocks": blocks, "calls": calls,
        "before_us": statistics.median(child["before_us"] for child in children),
        "after_us": statistics.median(child["after_us"] for child in children),
        "after_over_before": statistics.median(child["after_us"] / child["before_us"] for child in children),
        "hooks_left": max(child["hooks_left"] for child in children),
        "idle_hooks": statistics.median(child["idle_hooks"] for child in children),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 processes of 4 blocks of 50 forwards: proves it works")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    report = run(*((3, 4, 50) if args.quick else (9, 20, 200)))
    print(f"plain forward before any capture {report['before_us']:.0f} us, after captures ending every way "
          f"{report['after_us']:.0f} us: {report['after_over_before']:.2f}x (median of {report['rounds']} processes); "
          f"global hooks left: {report['hooks_left']}")
    print(f"for scale, an idle pair of global hooks left registered: {report['idle_hooks']:.2f}x")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
