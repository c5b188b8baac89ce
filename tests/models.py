"""Small real models the tests narrate: the seed's Tiny, a GPT-style transformer, a conv net, and
modules that break on purpose."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x):
        return torch.relu(self.proj(x))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, tied-free head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, context: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ConvNet(nn.Module):
    """A small residual conv net in the resnet style (conv-bn-relu, a residual block, pooling, fc)."""

    def __init__(self, classes: int = 10, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.block = ResidualBlock(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = self.block(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


def tiny_gpt(seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kwargs).eval()


def conv_net(seed: int = 0, **kwargs) -> ConvNet:
    torch.manual_seed(seed)
    return ConvNet(**kwargs).eval()


def tokens(batch: int = 1, length: int = 8, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def images(batch: int = 1, size: int = 16, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=generator)


class Breaking(nn.Module):
    """A forward dynamo cannot capture whole: a print and a data-dependent branch break the graph."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        print("embedded", tuple(x.shape))
        if x.mean().item() > -100:
            x = torch.tanh(self.body(x))
        return self.head(x)


class LoopBreak(nn.Module):
    """A graph break inside a loop: dynamo runs this forward eagerly and compiles each block alone."""

    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, 4) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x) * 0.5
            if i == 0:
                print("after block 0")
        return self.norm(x)


class GlitchOnce(nn.Module):
    """Multiplies its input by 1000 at its `at`-th call only: a glitch no replay repeats (the
    hardware's, say); `at=0` never."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, h):
        self.calls += 1
        return h * 1000 if self.calls == self.at else h
