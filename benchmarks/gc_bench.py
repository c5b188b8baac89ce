"""Garbage-collector pressure of long tracked training runs.

A training loop under `Recorder(model, backward=True, on_nonfinite="track", keep=1)` runs many
steps; every container object (event, dict, tuple, closure) that is still alive when a young
collection runs is moved to an older generation, and once enough objects have reached the oldest,
CPython runs a full collection, which walks every object of the process (a large model's too).
This counts, over `--steps` tracked training steps of a narrow resnet18 (SGD with momentum):

- full (generation-2) collections, from `gc.callbacks`;
- objects promoted into generation 2 per step (what moves a full collection closer): in the loop
  as it runs (`promoted_in_loop_per_step`, from generation 2's size around each generation-1
  collection, in a second, untimed run), and alive at the end of a step (`promoted_per_step`,
  with automatic collections paused and the young generations collected after each step);
- the tracked step's time beside a plain step's: `step_ms`, the median of the medians of blocks of
  50 steps (what a step costs, collections aside), and `mean_step_ms` (the run's time over its
  steps: full collections included).

    python benchmarks/gc_bench.py                 # 1,000 tracked steps
    python benchmarks/gc_bench.py --quick         # 200 steps: proves it works
    python benchmarks/gc_bench.py --json gc.json

`promoted_per_step` does not depend on timing, only on what torchlens leaves alive between
collections: the test suite bounds it on a GPT-2 step (`tests/test_long_runs.py`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import torchlens as tl


class BasicBlock(nn.Module):
    """resnet18's block: two 3x3 convolutions with batch norm, a shortcut (projected when the
    shape changes)."""

    def __init__(self, inputs: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or inputs != channels:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(channels))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class SmallResNet(nn.Module):
    """resnet18's layout (a stem, four stages of two blocks, a linear head) at a quarter of its
    width, on 32x32 images: the same ops and autograd nodes per step (~70 and ~110), far fewer
    flops."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, inputs = [], width
        for i, channels in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(inputs, channels, stride), BasicBlock(channels, channels)))
            inputs = channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Collections:
    """Counts and times the collector's collections while installed (`gc.callbacks`): full ones
    (generation 2) and young ones; with `promotions`, also the objects each generation-1 collection
    moves into generation 2 (its size after less its size before: nothing leaves generation 2
    during a younger collection). Counting them walks generation 2 at every generation-1
    collection (outside the time taken), so a timed run does without."""

    def __init__(self, promotions: bool = False):
        self.full = self.young = 0
        self.full_s = self.young_s = 0.0
        self.promoted = 0
        self._promotions = promotions
        self._before = None
        self._started = 0.0

    def __call__(self, phase, info):
        counting = info["generation"] == 1 and self._promotions
        if phase == "start":
            if counting:
                self._before = len(gc.get_objects(generation=2))
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        if info["generation"] == 2:
            self.full, self.full_s = self.full + 1, self.full_s + elapsed
            return
        self.young, self.young_s = self.young + 1, self.young_s + elapsed
        if counting and self._before is not None:
            self.promoted += len(gc.get_objects(generation=2)) - self._before

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def promoted_per_step(step, steps: int) -> float:
    """Objects moved into generation 2 per call of `step`, over `steps` calls.

    Each step's survivors are made to take the path of a long run's: everything young is
    collected (generation 1, so what survives it is promoted to generation 2), and what the
    collection moved is counted as the growth of generation 2. Automatic collections are off
    meanwhile, so the count is the same on every run of the same code."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        total = 0
        for _ in range(steps):
            step()
            before = _oldest()
            gc.collect(1)
            total += _oldest() - before
        return total / steps
    finally:
        if enabled:
            gc.enable()


def _oldest() -> int:
    return len(gc.get_objects(generation=2))


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = SmallResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(2, 3, 32, 32)
    labels = torch.randint(0, 10, (2,))
    return model, optimizer, images, labels


def training_step(model, optimizer, images, labels):
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()


def run(steps: int, tracked: bool, promotions: bool = False) -> dict:
    """`steps` training steps (tracked: under one `Recorder` that keeps the last recording), with
    the collector running as it does by default."""
    model, optimizer, images, labels = build()
    recorder = tl.recording.Recorder(model, backward=True, on_nonfinite="track", keep=1) if tracked else None
    times = []
    gc.collect()
    with Collections(promotions) as collections:
        if recorder is not None:
            recorder.__enter__()
        try:
            for _ in range(steps):
                start = time.perf_counter()
                training_step(model, optimizer, images, labels)
                times.append(time.perf_counter() - start)
        finally:
            if recorder is not None:
                recorder.__exit__(None, None, None)
    blocks = [statistics.median(times[i:i + 50]) for i in range(0, len(times), 50)]
    return {"steps": steps, "full_collections": collections.full, "step_ms": 1000 * statistics.median(blocks),
            "mean_step_ms": 1000 * sum(times) / steps, "promoted_in_loop_per_step": collections.promoted / steps}


def promoted(steps: int, tracked: bool) -> float:
    model, optimizer, images, labels = build()
    recorder = tl.recording.Recorder(model, backward=True, on_nonfinite="track", keep=1) if tracked else None
    if recorder is not None:
        recorder.__enter__()
    try:
        training_step(model, optimizer, images, labels)  # warm: what the first step creates once
        return promoted_per_step(lambda: training_step(model, optimizer, images, labels), steps)
    finally:
        if recorder is not None:
            recorder.__exit__(None, None, None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="200 steps")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    steps = 200 if args.quick else args.steps
    torch.set_num_threads(1)
    report = {"steps": steps, "python": sys.version.split()[0], "torch": torch.__version__,
              "gc_threshold": list(gc.get_threshold())}
    report["oldest_generation_objects"] = len(gc.get_objects(generation=2))
    for name, tracked in (("plain", False), ("tracked", True)):
        result = run(steps, tracked)
        result["promoted_in_loop_per_step"] = run(steps, tracked, promotions=True)["promoted_in_loop_per_step"]
        result["promoted_per_step"] = promoted(min(steps, 100), tracked)
        report[name] = result
        print(f"{name:8s} {steps} steps: {result['full_collections']:3d} full collections, "
              f"{result['step_ms']:.2f} ms per step (mean {result['mean_step_ms']:.2f}); "
              f"objects promoted to generation 2 per step: "
              f"{result['promoted_in_loop_per_step']:.1f} in the loop, {result['promoted_per_step']:.1f} "
              f"alive at its end", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
