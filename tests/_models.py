"""Models and helpers shared by the tests (the example nets at test sizes, a training step)."""

from __future__ import annotations

import copy
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import pspnet  # noqa: E402
import unet  # noqa: E402


def small_unet() -> torch.nn.Module:
    return unet.UNet(in_channels=3, num_classes=3, base_channels=8, depth=3)


def small_pspnet() -> torch.nn.Module:
    return pspnet.PSPNet(num_classes=4, layers=(2, 2, 2, 2), base_width=8)


def with_grads(model: torch.nn.Module) -> torch.nn.Module:
    """Pre-allocate .grad so a measured step's peak is the activation peak."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return model


def loss_of(out: torch.Tensor) -> torch.Tensor:
    target = torch.zeros(out.shape[0], *out.shape[2:], dtype=torch.long, device=out.device)
    return F.cross_entropy(out, target)


def train_step(model, x, *, seed: int = 0) -> torch.Tensor:
    """One forward + backward with a fixed RNG seed (so dropout masks can be compared)."""
    torch.manual_seed(seed)
    out = model(x)
    loss_of(out).backward()
    return out.detach()


def pair(model: torch.nn.Module):
    """Two independent copies of ``model`` (one stays plain, one gets compiled)."""
    return copy.deepcopy(model), copy.deepcopy(model)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
        if p.grad is not None or q.grad is not None:
            assert torch.equal(p.grad, q.grad), f"gradient of {name} differs"
    for (name, x), y in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(x, y), f"buffer {name} differs"
