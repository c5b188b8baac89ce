"""What narrating a training step's backward costs, against plain and `torch.autograd.detect_anomaly`.

    python benchmarks/backward_bench.py            # resnet18 and GPT-2 (124M), batch 1
    python benchmarks/backward_bench.py --quick    # small models, few rounds: proves the script works
    python benchmarks/backward_bench.py --stack-depth 40   # each step 40 frames deep, as in a trainer

One step is `zero_grad`, forward, loss, backward (no optimizer update, so every step does the same
work). The narrated modes run inside one `tl.recording.Recorder(model, backward=True, keep=0)`
entered once, as a training loop would. All modes of a model run in one process: after a warm-up,
each mode runs a block of steps in turn, round after round (the order turning from round to round),
and each multiplier is the median over rounds of the mode's block time over plain's block time in
the same round. Beside it: the fastest block of each mode over plain's fastest (what noise from
the rest of the machine only ever adds to), each half of the step (forward and loss, backward) in
its fastest block, and in how many rounds a mode's block was cheaper than anomaly mode's. The full
run needs torchvision and transformers (docs/performance.md says which torch pairs with
torchvision).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl

MODES = [
    # name, description, Recorder keywords (None: no Recorder), under detect_anomaly
    ("plain", "plain forward + backward (baseline)", None, False),
    ("anomaly", "torch.autograd.detect_anomaly()", None, True),
    ("narrate", "Recorder(backward=True), narration to a file, metadata only", dict(narrate="FILE"), False),
    ("track", "Recorder(backward=True, on_nonfinite='track'), no narration", dict(on_nonfinite="track"), False),
    ("narrate_track", "narration to a file + on_nonfinite='track'", dict(narrate="FILE", on_nonfinite="track"), False),
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


def build(quick: bool):
    """(name, model, step inputs, loss of the model's output) per benchmarked model."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if quick:
        gpt_config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        conv, image = SmallConvNet(), torch.randn(1, 3, 32, 32)
    else:
        import torchvision

        gpt_config = transformers.GPT2Config()  # the 124M configuration, random weights
        conv, image = torchvision.models.resnet18(weights=None), torch.randn(1, 3, 224, 224)
    gpt = transformers.GPT2LMHeadModel(gpt_config)
    ids = torch.randint(0, gpt_config.vocab_size, (1, 64))
    label = torch.tensor([1])
    return [
        ("resnet18" if not quick else "small-convnet", conv.train(), (image,), {},
         lambda out: F.cross_entropy(out, label)),
        ("gpt2" if not quick else "small-gpt2", gpt.train(), (ids,), {"labels": ids}, lambda out: out.loss),
    ]


def make_step(model: nn.Module, args, kwargs, loss_of) -> Callable[[], tuple]:
    def step():
        """One step; (seconds of its forward and loss, seconds of its backward)."""
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = loss_of(model(*args, **kwargs))
        middle = time.perf_counter()
        loss.backward()
        return middle - start, time.perf_counter() - middle
    return step


def called_from_depth(function: Callable, depth: int) -> Callable:
    """`function`, called `depth` Python frames below where it is called: a training step inside a
    framework's loop (a trainer, callbacks, a launcher) runs that deep, and anomaly mode records the
    stack at every op."""
    def nested(remaining: int):
        return function() if remaining <= 0 else nested(remaining - 1)
    return lambda: nested(depth)


def bench_model(name, model, args, kwargs, loss_of, rounds: int, block: int, warmup: int,
                stack_depth: int = 0) -> Dict:
    step = called_from_depth(make_step(model, args, kwargs, loss_of), stack_depth)
    log_dir = tempfile.mkdtemp(prefix="torchlens-backward-bench-")
    times: Dict[str, List[float]] = {mode: [] for mode, *_ in MODES}  # per round: seconds a step
    halves: Dict[str, List[tuple]] = {mode: [] for mode, *_ in MODES}  # per round: (forward, backward)
    lines: Dict[str, int] = {}
    recorders, logs = {}, {}
    for mode, _, recorder, _ in MODES:
        if recorder is not None:
            recorder = dict(recorder)
            if recorder.get("narrate") == "FILE":
                recorder["narrate"] = logs[mode] = os.path.join(log_dir, f"{name}-{mode}.log")
            recorders[mode] = tl.recording.Recorder(model, backward=True, keep=0, **recorder)

    def run(mode: str, anomaly: bool, n: int) -> tuple:
        """`n` steps of `mode` (its Recorder's block holds all of them): seconds in all, and the
        seconds of their forwards and of their backwards."""
        with contextlib.ExitStack() as block_context:
            if mode in recorders:
                block_context.enter_context(recorders[mode])
            if anomaly:
                block_context.enter_context(torch.autograd.detect_anomaly())
            forward = backward = 0.0
            start = time.perf_counter()
            for _ in range(n):
                f, b = step()
                forward += f
                backward += b
            return time.perf_counter() - start, forward, backward

    for mode, _, _, anomaly in MODES:
        run(mode, anomaly, warmup)
    for mode, log in logs.items():
        with open(log) as f:
            last = f.read().rsplit("-- pass ", 1)[-1]  # the last step: its forward and backward
        lines[mode] = sum(1 for line in last.splitlines() if not line.startswith("-- "))
    for turn in range(rounds):
        # the order turns each round: a mode that allocates a lot (anomaly mode keeps a traceback
        # per node) slows whichever runs after it, and that must not always be the same one
        for mode, _, _, anomaly in MODES[turn % len(MODES):] + MODES[:turn % len(MODES)]:
            total, forward, backward = run(mode, anomaly, block)
            times[mode].append(total / block)
            halves[mode].append((forward / block, backward / block))
    plain = times["plain"]
    rows = []
    for mode, description, _, _ in MODES:
        ratio = statistics.median(a / b for a, b in zip(times[mode], plain))
        forward = [f for f, _ in halves[mode]]
        backward = [b for _, b in halves[mode]]
        rows.append({"mode": mode, "description": description, "median_ms": statistics.median(times[mode]) * 1e3,
                     "multiplier": ratio, "min_ms": min(times[mode]) * 1e3,
                     "min_multiplier": min(times[mode]) / min(plain),
                     "forward_ms": statistics.median(forward) * 1e3, "forward_min_ms": min(forward) * 1e3,
                     "backward_ms": statistics.median(backward) * 1e3, "backward_min_ms": min(backward) * 1e3,
                     # rounds in which this mode's block was cheaper than anomaly mode's
                     "cheaper_than_anomaly": sum(a < b for a, b in zip(times[mode], times["anomaly"])),
                     "lines_per_step": lines.get(mode)})
    return {"model": name, "rounds": rounds, "block": block, "threads": torch.get_num_threads(),
            "stack_depth": stack_depth, "modes": rows}


def table(results: List[Dict]) -> str:
    out = []
    for result in results:
        depth = f", {result['stack_depth']} frames deeper" if result["stack_depth"] else ""
        out.append(f"\n{result['model']}  batch 1  forward+backward  ({result['rounds']} rounds of "
                   f"{result['block']} steps, {result['threads']} threads{depth})")
        out.append(f"  {'mode':14s} {'median ms':>10s} {'x plain':>8s} {'min ms':>8s} {'x plain':>8s} "
                   f"{'fwd min':>8s} {'bwd min':>8s} {'< anomaly':>10s} {'lines':>6s}")
        for row in result["modes"]:
            versus = "" if row["mode"] in ("plain", "anomaly") else f"{row['cheaper_than_anomaly']}/{result['rounds']}"
            out.append(f"  {row['mode']:14s} {row['median_ms']:10.2f} {row['multiplier']:8.3f} {row['min_ms']:8.2f} "
                       f"{row['min_multiplier']:8.3f} {row['forward_min_ms']:8.2f} {row['backward_min_ms']:8.2f} "
                       f"{versus:>10s} {row['lines_per_step'] or '':>6}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--block", type=int, default=None, help="steps per mode per round")
    parser.add_argument("--models", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--stack-depth", type=int, default=0,
                        help="run each step this many Python frames deeper, as inside a training framework")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 7)
    block = args.block or (2 if args.quick else 5)
    results = []
    for name, model, inputs, kwargs, loss_of in build(args.quick):
        if args.models and name not in args.models.split(","):
            continue
        results.append(bench_model(name, model, inputs, kwargs, loss_of, rounds, block, warmup=2,
                                   stack_depth=args.stack_depth))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
