"""What the emitted code calls at run time: :func:`recompute`.

``recompute(segment, *inputs)`` runs a segment under non-reentrant
``torch.utils.checkpoint.checkpoint``: its interior is dropped after the forward and recomputed
just before its backward, with the RNG state (dropout masks) and autocast state of the original
forward. Buffers the segment mutates (BatchNorm running statistics, ``num_batches_tracked``)
are restored after the recomputation, so they are updated exactly once per step.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute", "MUTATED_BUFFERS_ATTR"]

# Attribute of a segment GraphModule listing the qualified names of the buffers it mutates.
MUTATED_BUFFERS_ATTR = "_fxremat_mutated_buffers"


@contextlib.contextmanager
def _restore_buffers(segment: torch.nn.Module):
    names = getattr(segment, MUTATED_BUFFERS_ATTR, ())
    buffers = [segment.get_buffer(name) for name in names]
    with torch.no_grad():
        saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, old in zip(buffers, saved):
                b.copy_(old)


def _contexts(segment: torch.nn.Module):
    return contextlib.nullcontext(), _restore_buffers(segment)


def recompute(segment: torch.nn.Module, *inputs):
    """Run ``segment(*inputs)``, keeping only its inputs and outputs for the backward."""
    return checkpoint(segment, *inputs, use_reentrant=False, context_fn=lambda: _contexts(segment))
