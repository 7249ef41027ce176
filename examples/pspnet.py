"""PSPNet (Pyramid Scene Parsing Network), written as a plain ``nn.Module`` for fxremat.

Reference: H. Zhao, J. Shi, X. Qi, X. Wang, J. Jia, "Pyramid Scene Parsing Network",
CVPR 2017 (arXiv:1612.01105).

A dilated ResNet of Bottleneck blocks (layer3 and layer4 keep stride 1 and use dilation
2 and 4, so the feature map is 1/8 of the input) feeds the pyramid pooling module: for
bins 1, 2, 3 and 6 the features are average-pooled to ``bin x bin``, reduced by a 1x1
conv, upsampled bilinearly back and concatenated with the features. A 3x3 conv, dropout
and a 1x1 classifier follow, and the logits are upsampled to the input size.

Simplifications: a single 7x7 stem conv (as in torchvision's ResNet) instead of the
paper's three 3x3 convs, and no auxiliary loss branch. ``layers=(3, 4, 23, 3)`` gives the
ResNet-101 backbone the paper uses for its best results.

Run ``python examples/pspnet.py --help`` for the fxremat training demo.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

PAPER_INPUT = (2, 3, 713, 713)  # Kusumoto et al. (NeurIPS 2019), Table 1
SMALL_INPUT = (2, 3, 64, 64)
DEMO_INPUT = (4, 3, 128, 128)

EXPANSION = 4  # Bottleneck output channels = EXPANSION * planes


def conv_bn_relu(in_channels, out_channels, kernel_size, padding=0):
    """Conv (no bias) -> BatchNorm -> ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def upsample(x, size):
    """Bilinear resize of ``x`` to spatial ``size`` (taken from a tensor's ``.shape``)."""
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class Bottleneck(nn.Module):
    """ResNet bottleneck: 1x1 reduce, 3x3 (strided or dilated), 1x1 expand, residual add."""

    def __init__(self, in_channels, planes, stride=1, dilation=1):
        super().__init__()
        out_channels = planes * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=dilation, dilation=dilation, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


def make_layer(in_channels, planes, blocks, stride=1, dilation=1):
    """A ResNet stage of ``blocks`` bottlenecks; only the first one may stride."""
    layers = [Bottleneck(in_channels, planes, stride, dilation)]
    layers += [Bottleneck(planes * EXPANSION, planes, 1, dilation) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class DilatedResNet(nn.Module):
    """ResNet backbone with output stride 8 (layer3/layer4 dilated instead of strided)."""

    def __init__(self, layers=(3, 4, 6, 3), base_width=64):
        super().__init__()
        w = base_width
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        self.layer1 = make_layer(w, w, layers[0])
        self.layer2 = make_layer(4 * w, 2 * w, layers[1], stride=2)
        self.layer3 = make_layer(8 * w, 4 * w, layers[2], dilation=2)
        self.layer4 = make_layer(16 * w, 8 * w, layers[3], dilation=4)
        self.out_channels = 32 * w

    def forward(self, x):
        x = self.stem(x)
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class PyramidPooling(nn.Module):
    """Pool to each bin size, 1x1 conv, upsample back and concatenate with the input."""

    def __init__(self, in_channels, bins=(1, 2, 3, 6)):
        super().__init__()
        branch_channels = in_channels // len(bins)
        self.branches = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(b), conv_bn_relu(in_channels, branch_channels, 1)) for b in bins
        )
        self.out_channels = in_channels + branch_channels * len(bins)

    def forward(self, x):
        size = x.shape[2:]
        pooled = [upsample(branch(x), size) for branch in self.branches]
        return torch.cat([x] + pooled, dim=1)


class PSPNet(nn.Module):
    """PSPNet; ``base_width`` scales all channels (64 gives ResNet-50/101 widths)."""

    def __init__(self, num_classes=21, layers=(3, 4, 6, 3), base_width=64):
        super().__init__()
        self.backbone = DilatedResNet(layers, base_width)
        self.ppm = PyramidPooling(self.backbone.out_channels)
        hidden = self.backbone.out_channels // 4
        self.classifier = nn.Sequential(
            conv_bn_relu(self.ppm.out_channels, hidden, 3, padding=1),
            nn.Dropout2d(0.1),
            nn.Conv2d(hidden, num_classes, 1),
        )

    def forward(self, x):
        size = x.shape[2:]
        logits = self.classifier(self.ppm(self.backbone(x)))
        return upsample(logits, size)


def build_model(size="small"):
    """A narrow PSPNet (``"small"``, ResNet-50 depth at width 8) or the ResNet-50 one (``"paper"``)."""
    if size == "small":
        return PSPNet(layers=(3, 4, 6, 3), base_width=8)  # ResNet-50 depth, narrow
    if size == "paper":
        return PSPNet(layers=(3, 4, 6, 3), base_width=64)
    raise ValueError(f"size must be 'small' or 'paper', got {size!r}")


def main(argv=None):
    """Train PSPNet with and without fxremat and compare memory, time and results."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _demo

    args = _demo.parse_args("PSPNet fxremat demo", argv)
    _demo.run(build_model, {"small": DEMO_INPUT, "paper": PAPER_INPUT}, args)


if __name__ == "__main__":
    main()
