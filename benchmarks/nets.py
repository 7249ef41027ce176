"""Benchmark nets: the examples' U-Net and PSPNet (:func:`cpu_nets`, the CPU trade-off set) and
nets beyond them, all ``nn.Sequential`` chains so that ``checkpoint_sequential`` applies to them: a
ResNet-style chain of identical residual blocks, a ResNet-50-style chain of bottleneck stages whose
activations shrink stage by stage (a heterogeneous chain, as real ResNets are), and a transformer
stack."""

from __future__ import annotations

import sys

import torch.nn as nn

from .harness import ROOT

sys.path.insert(0, str(ROOT / "examples"))

import pspnet  # noqa: E402
import unet  # noqa: E402


class Block(nn.Module):
    """Pre-activation residual block."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        )

    def forward(self, x):
        return x + self.body(x)


def resnet_chain(depth: int = 12, channels: int = 32, num_classes: int = 10) -> nn.Sequential:
    """stem, ``depth`` residual blocks, head: a chain of ``depth + 2`` stages."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()),
        *[Block(channels) for _ in range(depth)],
        nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, num_classes, 1)),
    )


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck block (1x1, 3x3, 1x1 convolutions), with a projection shortcut when
    it changes the stride or the width."""

    def __init__(self, inp: int, width: int, stride: int = 1):
        super().__init__()
        out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out),
        )
        self.shortcut = (nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
                         if stride != 1 or inp != out else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


def resnet_stages(layers=(3, 4, 6, 3), width: int = 16, num_classes: int = 10) -> nn.Sequential:
    """ResNet-50's layout (``layers`` bottlenecks per stage, stride 2 and twice the width at each
    new stage) as a flat chain: stem, one entry per bottleneck, head."""
    blocks, inp = [], width
    for stage, count in enumerate(layers):
        w = width * 2**stage
        for i in range(count):
            blocks.append(Bottleneck(inp, w, stride=2 if i == 0 and stage > 0 else 1))
            inp = 4 * w
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                      nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1)),
        *blocks,
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, num_classes)),
    )


class SelfAttention(nn.Module):
    """Multi-head self-attention written out (q, k, v projections, softmax, output projection)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).softmax(dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def transformer_stack(depth: int = 8, dim: int = 64, heads: int = 4) -> nn.Sequential:
    """``depth`` transformer blocks and a final norm over (batch, tokens, dim) inputs."""
    return nn.Sequential(*[TransformerBlock(dim, heads) for _ in range(depth)], nn.LayerNorm(dim))


def cpu_nets(full: bool):
    """``(name, build(size), input shape, is a chain)`` for the CPU trade-off table."""
    scale = 2 if full else 1
    return [
        ("unet", unet.build_model, (4, 3, 128 * scale, 128 * scale), False),
        ("pspnet", pspnet.build_model, (4, 3, 96 * scale, 96 * scale), False),
        ("resnet_chain", lambda size="small": resnet_chain(depth=12 * scale), (8, 3, 64, 64), True),
    ]
