"""What users do today, for comparison: hand-placed per-block checkpoints and
``torch.utils.checkpoint.checkpoint_sequential``."""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

__all__ = ["BLOCK_CLASSES", "checkpoint_blocks", "SequentialCheckpoint"]

# Classes a person would wrap in torch.utils.checkpoint by hand: one residual / dense /
# inception block, one U-Net level.
BLOCK_CLASSES = (
    "Bottleneck", "BasicBlock", "_DenseLayer", "Inception", "InceptionA", "InceptionB", "InceptionC",
    "InceptionD", "InceptionE", "UpBlock", "PyramidPooling", "Block", "EncoderBlock",
)


def _wrap(module: torch.nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def checkpoint_blocks(model: torch.nn.Module, extra=()) -> int:
    """Wrap every outermost submodule whose class is a block (or named in ``extra``) in a
    non-reentrant checkpoint, in place; return how many were wrapped."""
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(w + ".") for w in wrapped):
            continue
        if type(module).__name__ in BLOCK_CLASSES or name in extra:
            _wrap(module)
            wrapped.append(name)
    return len(wrapped)


class SequentialCheckpoint(torch.nn.Module):
    """``checkpoint_sequential(model, segments, x)`` for an ``nn.Sequential`` model."""

    def __init__(self, model: torch.nn.Sequential, segments: int):
        super().__init__()
        self.model, self.segments = model, segments

    def forward(self, x):
        return checkpoint_sequential(self.model, self.segments, x, use_reentrant=False)

    @staticmethod
    def segment_counts(length: int) -> list[int]:
        """Every segment count from 2 to 2√L, as Beaumont et al. sweep it."""
        return list(range(2, max(3, int(2 * math.sqrt(length)) + 1)))
