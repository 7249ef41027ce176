"""U-Net for image segmentation, written as a plain ``nn.Module`` for fxremat.

Reference: O. Ronneberger, P. Fischer, T. Brox, "U-Net: Convolutional Networks for
Biomedical Image Segmentation", MICCAI 2015 (arXiv:1505.04597).

The contracting path repeats (two 3x3 conv -> BatchNorm -> ReLU, then a 2x2 max-pool)
``depth`` times; the bottleneck is one more conv pair followed by dropout (the paper's
"drop-out layers at the end of the contracting path"); the expansive path upsamples with
a 2x2 transposed conv, concatenates the skip feature map and applies another conv pair;
a 1x1 conv maps to ``num_classes``. BatchNorm is a modern addition not in the paper.

With ``valid_padding=True`` the convs are unpadded as in the paper (572x572 in,
388x388 out) and skip tensors are center-cropped before concatenation; otherwise the
convs use padding 1 and any input size divisible by ``2**depth`` keeps its size.

Run ``python examples/unet.py --help`` for the fxremat training demo.
"""

import os
import sys

import torch
from torch import nn

PAPER_INPUT = (8, 3, 572, 572)  # Kusumoto et al. (NeurIPS 2019), Table 1
SMALL_INPUT = (2, 3, 64, 64)
DEMO_INPUT = (4, 3, 128, 128)


def conv_pair(in_channels, out_channels, padding):
    """Two (3x3 conv -> BatchNorm -> ReLU) layers."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def center_crop(skip, like):
    """Crop the spatial dims of ``skip`` to those of ``like``, keeping the center.

    Only tensor-size arithmetic is used, so ``torch.fx.symbolic_trace`` records it.
    """
    height, width = like.size(2), like.size(3)
    top = (skip.size(2) - height) // 2
    left = (skip.size(3) - width) // 2
    return skip.narrow(2, top, height).narrow(3, left, width)


class UpBlock(nn.Module):
    """Expansive-path level: 2x2 up-conv, concat with the skip map, conv pair."""

    def __init__(self, in_channels, out_channels, padding, crop):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = conv_pair(2 * out_channels, out_channels, padding)
        self.crop = crop

    def forward(self, x, skip):
        x = self.up(x)
        if self.crop:
            skip = center_crop(skip, x)
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    """U-Net with ``depth`` down/up levels; level ``i`` has ``base_channels * 2**i`` channels."""

    def __init__(self, in_channels=3, num_classes=2, base_channels=64, depth=4, valid_padding=False):
        super().__init__()
        padding = 0 if valid_padding else 1
        widths = [base_channels * 2**i for i in range(depth + 1)]
        inputs = [in_channels] + widths[: depth - 1]
        self.down = nn.ModuleList(conv_pair(c_in, c_out, padding) for c_in, c_out in zip(inputs, widths))
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = nn.Sequential(conv_pair(widths[depth - 1], widths[depth], padding), nn.Dropout(p=0.5))
        self.up = nn.ModuleList(
            UpBlock(widths[i + 1], widths[i], padding, crop=valid_padding) for i in reversed(range(depth))
        )
        self.head = nn.Conv2d(widths[0], num_classes, kernel_size=1)

    def forward(self, x):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)


def build_model(size="small"):
    """A tiny U-Net for tests (``"small"``) or the paper's configuration (``"paper"``)."""
    if size == "small":
        return UNet(base_channels=8, depth=3)
    if size == "paper":
        return UNet(base_channels=64, depth=4, valid_padding=True)
    raise ValueError(f"size must be 'small' or 'paper', got {size!r}")


def main(argv=None):
    """Train U-Net with and without fxremat and compare memory, time and results."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _demo

    args = _demo.parse_args("U-Net fxremat demo", argv)
    _demo.run(build_model, {"small": DEMO_INPUT, "paper": PAPER_INPUT}, args)


if __name__ == "__main__":
    main()
