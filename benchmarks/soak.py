"""Soak: many forwards under one `Recorder` narrating to a file, with bounded memory.

A long training or evaluation loop narrated to a file must not grow the process: the recorder
keeps `--keep` passes and a tail of `--tail` events, the file gets every line. This runs
`--forwards` passes of a small transformer, samples the resident set size (RSS) after a warm-up and
at ten points after it, and checks the file and the tail buffer at the end.

    python benchmarks/soak.py                      # 10,000 forwards
    python benchmarks/soak.py --forwards 1500 --json soak.json

Prints one line per sample and a summary; `--json` writes the figures. Exit status 1 when the file
is incomplete or the tail holds the wrong events (memory growth is reported, not judged: see the
test that runs a short soak).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time

import torch
from torch import nn

import torchlens as tl


class SmallTransformer(nn.Module):
    """Two pre-norm blocks of attention and MLP over a 32-wide embedding: ~60 ops per forward."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def rss_bytes() -> int:
    """Resident set size now (Linux /proc), or the peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def soak(forwards: int, keep: int, tail: int, log_path: str) -> dict:
    torch.manual_seed(0)
    model = SmallTransformer().train()  # train mode: the layers run op by op, not one fused kernel
    tokens = torch.randint(0, 64, (1, 16))
    lines_per_pass = len(tl.record(model, tokens, narrate=os.devnull).narrate().splitlines()) + 1  # + header
    warmup = max(1, forwards // 10)
    samples = []
    start = time.perf_counter()
    with tl.recording.Recorder(model, narrate=log_path, keep=keep, tail=tail) as recorder:
        for step in range(1, forwards + 1):
            with torch.no_grad():
                model(tokens)
            if step >= warmup and (step - warmup) % max(1, (forwards - warmup) // 10) == 0:
                gc.collect()
                samples.append({"forward": step, "rss_mb": rss_bytes() / 2**20})
                print(f"forward {step:6d}  rss {samples[-1]['rss_mb']:.1f} MB", flush=True)
    elapsed = time.perf_counter() - start
    with open(log_path) as log:
        lines = log.read().splitlines()
    last_pass = tl.record(model, tokens).events  # what each pass records (the forward is deterministic)
    return {
        "forwards": forwards,
        "keep": keep,
        "tail": tail,
        "seconds": elapsed,
        "ms_per_forward": 1000 * elapsed / forwards,
        "samples": samples,
        "rss_growth_mb": samples[-1]["rss_mb"] - samples[0]["rss_mb"],
        "file_lines": len(lines),
        "expected_lines": forwards * lines_per_pass,
        "headers": sum(line.startswith("-- pass ") for line in lines),
        "footers": sum(line.startswith("-- end:") for line in lines),
        "recordings_kept": len(recorder.recordings),
        "tail_events": len(recorder.tail),
        # the last pass is the tail's end (a tail longer than a pass reaches into the passes before)
        "tail_is_the_last_events": len(recorder.tail) == min(tail, forwards * len(last_pass))
        and _signature(recorder.tail[-len(last_pass):]) == _signature(last_pass[-tail:]),
        "passes": recorder.passes,
    }


def _signature(events) -> list:
    """What identifies an event across two recordings of the same forward."""
    return [(event.kind, event.ordinal, event.op, event.scope.path, event.outputs) for event in events]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forwards", type=int, default=10_000)
    parser.add_argument("--keep", type=lambda text: None if text == "all" else int(text), default=1,
                        help="passes the recorder keeps ('all': unbounded, to see what a leak looks like)")
    parser.add_argument("--tail", type=int, default=200, help="events the tail buffer keeps")
    parser.add_argument("--log", help="narration file (default: a temporary file, removed after)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        report = soak(args.forwards, args.keep, args.tail, args.log or os.path.join(scratch, "narration.log"))
    print(f"{report['forwards']} forwards in {report['seconds']:.1f} s ({report['ms_per_forward']:.2f} ms each); "
          f"RSS {report['samples'][0]['rss_mb']:.1f} -> {report['samples'][-1]['rss_mb']:.1f} MB "
          f"({report['rss_growth_mb']:+.2f} MB); file {report['file_lines']} lines of {report['expected_lines']}; "
          f"tail {report['tail_events']} events; {report['recordings_kept']} recordings kept")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    complete = (report["file_lines"] == report["expected_lines"] and report["headers"] == report["footers"]
                == report["forwards"] == report["passes"])
    return 0 if complete and report["tail_is_the_last_events"] else 1


if __name__ == "__main__":
    sys.exit(main())
