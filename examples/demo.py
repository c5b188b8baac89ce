"""torchlens demo: narrate a small GPT-style transformer eagerly, compiled, through a crash, and
hunting a NaN.

    python examples/demo.py

Everything is built here with random weights; nothing is downloaded.
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

import torchlens as tl


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.fc, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=100, dim=32, heads=4, layers=2, context=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def banner(title):
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def main():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    idx = torch.randint(0, 100, (1, 8))
    out = sys.stdout

    banner("eager: the whole forward, modules folded below depth 2")
    tl.record(model, idx, narrate=tl.options.NarrationOptions(sink=out, depth=2))

    banner("eager: one block in full, with call sites")
    tl.record(model, idx, narrate=tl.options.NarrationOptions(sink=out, sites=True, select=tl.in_module("blocks.1")))

    banner("compiled: inductor runs the graph, torchlens narrates its plan (first compile takes a while)")
    compiled = tl.compile(model, narrate=tl.options.NarrationOptions(sink=out, select=tl.in_module("blocks.1.attn")))
    with torch.no_grad():
        same = torch.allclose(compiled(idx), model(idx), atol=1e-5)
    print(f"compiled output matches eager: {same}")

    banner("a crash: the tail rendered after the fact from exc.partial_trace")
    too_long = torch.randint(0, 100, (1, 20))  # longer than the 16 positions the model knows
    try:
        tl.record(model, too_long)
    except IndexError as exc:
        print(f"caught {type(exc).__name__}: {exc}")
        print(exc.partial_trace.narrate(last=6), end="")

    banner("the NaN recipe: track non-finite values, print the counts tracking measured anyway")
    print("healthy: the causal mask's -inf is carried in by masked_fill and absorbed by softmax")
    healthy = tl.record(model, idx, on_nonfinite="track")
    print("  " + healthy.verdict)
    with torch.no_grad():
        model.blocks[1].fc.weight[3, 5] = float("nan")  # one bad weight
    recipe = tl.options.NarrationOptions(sink=out, select=tl.in_module("blocks.1.fc"))
    found = tl.record(model, idx, narrate=recipe, on_nonfinite="track", value_stats="reuse")
    print(f"first finding at: #{found.first_nonfinite.ordinal} {found.first_nonfinite.op} "
          f"@{found.first_nonfinite.module}")

    banner("look and reproduce: the run as an HTML page, the NaN's op alone as a script")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="torchlens-demo-"))
    print(f"HTML view (open it in a browser): {found.to_html(folder / 'nan-run.html')}")
    script = found.repro(folder / "nan-repro")
    replay = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    print(f"one-op repro: {script}")
    print("".join("  " + line + "\n" for line in replay.stdout.splitlines()), end="")


if __name__ == "__main__":
    main()
