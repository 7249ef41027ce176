"""Benchmark nets beyond the examples: a ResNet-style chain (an ``nn.Sequential`` of residual
blocks, so ``checkpoint_sequential`` applies to it)."""

from __future__ import annotations

import torch.nn as nn


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
