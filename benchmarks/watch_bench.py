"""What `tl.watch` costs a training step, side by side with what people leave on today.

    python benchmarks/watch_bench.py            # resnet18 and GPT-2 (124M), batch 1
    python benchmarks/watch_bench.py --quick    # small models, few rounds: proves the script works
    python benchmarks/watch_bench.py --models gpt2 --modes plain,watch   # one model, two modes

One step is the whole of a training step: `zero_grad`, forward, loss, backward and an AdamW
update. The modes: plain (the baseline); `tl.watch(check="outputs")`; `tl.watch` (outputs,
gradients and updates, the default, with spikes judged from a block's second step:
`spike=SpikeRule(warmup=1)`, since each block makes its own watch); `tl.watch(on_spike=None)`
(the same without the spike check); `torch.autograd.detect_anomaly()`; transformers' `DebugUnderflowOverflow`
(forward hooks on every module); and `tl.recording.Recorder(backward=True, on_nonfinite="track")`,
what the watch replays a faulty step under. All modes of a model run in one process on the same
model and optimizer: after a warm-up, each mode runs a block of steps in turn (its watch, Recorder
or hooks on for the block only), round after round with the order turning from round to round, and
each multiplier is the median over rounds of the mode's block time over plain's in the same round.
Beside it: the fastest block of each mode over plain's fastest, and for the watch what it held at
the step's end (`Watch.held_bytes`, before the update: references, not copies, count nothing).
The full run needs torchvision and transformers (docs/performance.md says which torch pairs with
torchvision).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl

MODES = [
    # name, description
    ("plain", "plain training step (baseline)"),
    ("watch_outputs", "tl.watch(check='outputs')"),
    ("watch", "tl.watch() (outputs, gradients, updates, spikes)"),
    ("watch_no_spikes", "tl.watch(on_spike=None)"),
    ("anomaly", "torch.autograd.detect_anomaly()"),
    ("underflow_overflow", "transformers DebugUnderflowOverflow"),
    ("track", "Recorder(backward=True, on_nonfinite='track')"),
]


class SmallConvNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


def build(quick: bool, only=None):
    """(name, model, step inputs, step keywords, loss of the model's output) per model: each one
    named in `only` (all when None), built only then (resnet18 needs torchvision)."""
    import transformers

    transformers.logging.set_verbosity_error()
    models = []
    conv_name, gpt_name = ("small-convnet", "small-gpt2") if quick else ("resnet18", "gpt2")
    if only is None or conv_name in only:
        torch.manual_seed(0)
        if quick:
            conv, image = SmallConvNet(), torch.randn(1, 3, 32, 32)
        else:
            import torchvision

            conv, image = torchvision.models.resnet18(weights=None), torch.randn(1, 3, 224, 224)
        label = torch.tensor([1])
        models.append((conv_name, conv.train(), (image,), {}, lambda out: F.cross_entropy(out, label)))
    if only is None or gpt_name in only:
        torch.manual_seed(0)
        gpt_config = (transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
                      if quick else transformers.GPT2Config())  # the 124M configuration, random weights
        gpt = transformers.GPT2LMHeadModel(gpt_config)
        ids = torch.randint(0, gpt_config.vocab_size, (1, 64))
        models.append((gpt_name, gpt.train(), (ids,), {"labels": ids}, lambda out: out.loss))
    return models


class UnderflowOverflowHooks:
    """transformers' `DebugUnderflowOverflow`, its hooks kept so that a block can take them off
    again (the class registers one forward hook per module and keeps no handle)."""

    def __init__(self, model: nn.Module):
        from transformers.debug_utils import DebugUnderflowOverflow

        handles = []

        class Removable(DebugUnderflowOverflow):
            def _register_forward_hook(self, module):
                handles.append(module.register_forward_hook(self.forward_hook))

        self.debug = Removable(model)
        self.handles = handles

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def make_step(model: nn.Module, optimizer, args, kwargs, loss_of) -> Callable:
    def step(probe: Optional[Callable[[], None]] = None):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        if probe is not None:
            probe()  # what the step holds once its backward is done, before the update
        optimizer.step()
    return step


def mode_context(mode: str, model: nn.Module, optimizer, out: str):
    if mode == "watch_outputs":
        return tl.watch(model, optimizer, check="outputs", out=out, narrate=None)
    if mode == "watch":
        return tl.watch(model, optimizer, out=out, narrate=None, spike=tl.watching.SpikeRule(warmup=1))
    if mode == "watch_no_spikes":
        return tl.watch(model, optimizer, out=out, narrate=None, on_spike=None)
    if mode == "anomaly":
        return torch.autograd.detect_anomaly()
    if mode == "underflow_overflow":
        return UnderflowOverflowHooks(model)
    if mode == "track":
        return tl.recording.Recorder(model, backward=True, on_nonfinite="track", keep=0)
    return contextlib.nullcontext()


def bench_model(name, model, args, kwargs, loss_of, rounds: int, block: int, warmup: int, modes=None) -> Dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = make_step(model, optimizer, args, kwargs, loss_of)
    out = tempfile.mkdtemp(prefix="torchlens-watch-bench-")
    chosen = [(mode, description) for mode, description in MODES if modes is None or mode in modes]
    times: Dict[str, List[float]] = {mode: [] for mode, _ in chosen}
    held: Dict[str, int] = {}
    faults: Dict[str, int] = {}

    def run(mode: str, n: int) -> float:
        """`n` steps of `mode`, its watch or hooks on for the block: seconds in all."""
        with mode_context(mode, model, optimizer, out) as context:
            probe = None
            if isinstance(context, tl.watching.Watch):
                def probe():
                    held[mode] = max(held.get(mode, 0), context.held_bytes)
            start = time.perf_counter()
            for _ in range(n):
                step(probe)
            seconds = time.perf_counter() - start
            if isinstance(context, tl.watching.Watch):
                # (what would make a block not a healthy step's cost: a fault, a false alarm, a spike)
                faults[mode] = faults.get(mode, 0) + len(context.faults) + context.false_alarms + len(context.spikes)
        return seconds

    for mode, _ in chosen:
        run(mode, warmup)
    for turn in range(rounds):
        # the order turns each round: a mode that allocates a lot slows whichever runs after it
        for mode, _ in chosen[turn % len(chosen):] + chosen[:turn % len(chosen)]:
            times[mode].append(run(mode, block) / block)
    plain = times["plain"]
    rows = []
    for mode, description in chosen:
        rows.append({"mode": mode, "description": description,
                     "median_ms": statistics.median(times[mode]) * 1e3,
                     "multiplier": statistics.median(a / b for a, b in zip(times[mode], plain)),
                     "min_ms": min(times[mode]) * 1e3, "min_multiplier": min(times[mode]) / min(plain),
                     "held_bytes": held.get(mode), "faults": faults.get(mode)})
    return {"model": name, "rounds": rounds, "block": block, "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in model.parameters()), "modes": rows}


def table(results: List[Dict]) -> str:
    out = []
    for result in results:
        out.append(f"\n{result['model']}  batch 1  training step, AdamW  ({result['rounds']} rounds of "
                   f"{result['block']} steps, {result['threads']} threads)")
        out.append(f"  {'mode':19s} {'median ms':>10s} {'x plain':>8s} {'min ms':>8s} {'x plain':>8s} "
                   f"{'held':>8s} {'faults':>7s}")
        for row in result["modes"]:
            held = "" if row["held_bytes"] is None else f"{row['held_bytes']}B"
            faults = "" if row["faults"] is None else str(row["faults"])
            out.append(f"  {row['mode']:19s} {row['median_ms']:10.2f} {row['multiplier']:8.3f} {row['min_ms']:8.2f} "
                       f"{row['min_multiplier']:8.3f} {held:>8s} {faults:>7s}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--block", type=int, default=None, help="steps per mode per round")
    parser.add_argument("--models", default=None, help="comma-separated: resnet18, gpt2 (small-convnet, "
                        "small-gpt2 with --quick)")
    parser.add_argument("--modes", default=None, help="comma-separated modes to time (plain always): "
                        + ", ".join(mode for mode, _ in MODES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 9)
    block = args.block or (2 if args.quick else 5)
    only = args.models.split(",") if args.models else None
    modes = {"plain", *args.modes.split(",")} if args.modes else None
    unknown = (modes or set()) - {mode for mode, _ in MODES}
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    results = []
    for name, model, inputs, kwargs, loss_of in build(args.quick, only):
        results.append(bench_model(name, model, inputs, kwargs, loss_of, rounds, block, warmup=2, modes=modes))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
