"""Model factories for the command-line tests: ``fxremat plan cli_models:small_unet ...`` run
with ``tests/`` as the current directory."""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import unet  # noqa: E402


def small_unet() -> torch.nn.Module:
    """The example U-Net at test size (8 base channels, depth 3)."""
    return unet.build_model("small")


def wide_unet() -> torch.nn.Module:
    """Same code as :func:`small_unet`, other widths: a different graph key."""
    return unet.UNet(base_channels=12, depth=3)


def not_a_module():
    return "not a module"
