"""AmoebaNet-D(L, F), the GPipe paper's image classifier, built from the published AmoebaNet-D genotype.

The network (Real et al., "Regularized Evolution for Image Classifier Architecture Search", and the
TensorFlow reference used by GPipe) is a stem, two reduction cells, then three stacks of normal cells
separated by reduction cells. A cell reads the outputs of the two cells before it, so every cell
carries a link over its neighbour: written here as a plain module with a two-argument cell forward,
which seqify.convert turns into skips.

``layers`` (GPipe's L) counts normal cells in all three stacks (L / 3 per stack) and ``filters``
(GPipe's F, "D" in some versions of the paper) is the width of the first stack. With the reference
implementation's concatenation of the normal cell ([0, 3, 4, 6]) the parameter counts match GPipe's
Table 1: AmoebaNet-D(18, 208) has 82 M parameters at 1000 classes.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AmoebaNetD", "Cell", "amoebanet", "NORMAL", "NORMAL_CONCAT", "REDUCTION", "REDUCTION_CONCAT"]

# The AmoebaNet-D genotype: pairs of (operation, hidden state it reads). Hidden states 0 and 1 are
# the cell's two inputs (0: the previous cell's output, 1: the one before it); every pair adds a new
# state, the sum of its two operations; the cell's output concatenates the listed states.
NORMAL: tuple[tuple[str, int], ...] = (
    ("conv_1x1", 1), ("max_pool_3x3", 1),
    ("none", 1), ("conv_1x7_7x1", 0),
    ("conv_1x1", 0), ("conv_1x7_7x1", 0),
    ("max_pool_3x3", 2), ("none", 2),
    ("avg_pool_3x3", 1), ("conv_1x1", 5),
)  # fmt: skip
NORMAL_CONCAT = (0, 3, 4, 6)
REDUCTION: tuple[tuple[str, int], ...] = (
    ("max_pool_2x2", 0), ("max_pool_3x3", 0),
    ("none", 2), ("conv_3x3", 1),
    ("conv_1x7_7x1", 2), ("max_pool_3x3", 2),
    ("none", 3), ("max_pool_2x2", 1),
    ("avg_pool_3x3", 2), ("conv_1x1", 3),
)  # fmt: skip
REDUCTION_CONCAT = (4, 5, 6)


def _relu_conv_bn(cin: int, cout: int, kernel: int | tuple[int, int] = 1, stride: int | tuple[int, int] = 1,
                  padding: int | tuple[int, int] = 0) -> list[nn.Module]:
    return [nn.ReLU(), nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout)]


class FactorizedReduce(nn.Module):
    """Halve the resolution without losing every other pixel: two strided 1x1 convs, one shifted by a pixel."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        if cout % 2:
            raise ValueError(f"FactorizedReduce needs an even number of output channels, got {cout}")
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(cin, cout // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(cin, cout // 2, 1, stride=2, bias=False)
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        shifted = self.pad(x[:, :, 1:, 1:])
        return self.bn(torch.cat([self.conv1(x), self.conv2(shifted)], dim=1))


def _operation(name: str, c: int, stride: int) -> nn.Module:
    """One genotype operation on ``c`` channels; the convolutions bottleneck to ``c // 4`` inside."""
    if name == "none":
        return nn.Identity() if stride == 1 else FactorizedReduce(c, c)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if name == "max_pool_2x2":
        return nn.MaxPool2d(2, stride=stride)
    if name == "conv_1x1":
        return nn.Sequential(*_relu_conv_bn(c, c, 1, stride))
    if name == "conv_3x3":
        return nn.Sequential(
            *_relu_conv_bn(c, c // 4, 1),
            *_relu_conv_bn(c // 4, c // 4, 3, stride, 1),
            *_relu_conv_bn(c // 4, c, 1),
        )
    if name == "conv_1x7_7x1":
        return nn.Sequential(
            *_relu_conv_bn(c, c // 4, 1),
            *_relu_conv_bn(c // 4, c // 4, (1, 7), (1, stride), (0, 3)),
            *_relu_conv_bn(c // 4, c // 4, (7, 1), (stride, 1), (3, 0)),
            *_relu_conv_bn(c // 4, c, 1),
        )
    raise ValueError(f"unknown AmoebaNet operation {name!r}")


class Cell(nn.Module):
    """A normal or reduction cell: reads the two previous cells' outputs, returns ``len(concat) * channels``
    channels (at half the resolution for a reduction cell)."""

    def __init__(self, c_prev_prev: int, c_prev: int, channels: int, reduction: bool, reduction_prev: bool) -> None:
        super().__init__()
        # Bring both inputs to ``channels`` channels and the same resolution.
        self.prep_prev = nn.Sequential(*_relu_conv_bn(c_prev, channels))
        self.prep_prev_prev: nn.Module
        if reduction_prev:
            self.prep_prev_prev = FactorizedReduce(c_prev_prev, channels)
        elif c_prev_prev != channels:
            self.prep_prev_prev = nn.Sequential(*_relu_conv_bn(c_prev_prev, channels))
        else:
            self.prep_prev_prev = nn.Identity()
        genotype = REDUCTION if reduction else NORMAL
        self.reduction = reduction
        self.inputs = tuple(i for _, i in genotype)
        self.concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        # In a reduction cell, operations on the cell's inputs (states 0 and 1) have stride 2.
        self.ops = nn.ModuleList(
            _operation(name, channels, 2 if reduction and i < 2 else 1) for name, i in genotype
        )
        self.out_channels = channels * len(self.concat)

    def forward(self, prev: torch.Tensor, prev_prev: torch.Tensor) -> torch.Tensor:
        states = [self.prep_prev(prev), self.prep_prev_prev(prev_prev)]
        for k in range(0, len(self.ops), 2):
            left = self.ops[k](states[self.inputs[k]])
            right = self.ops[k + 1](states[self.inputs[k + 1]])
            states.append(left + right)
        return torch.cat([states[i] for i in self.concat], dim=1)


class AmoebaNetD(nn.Module):
    """AmoebaNet-D(L=layers, F=filters) for ``3 x H x W`` images (H and W divisible by 32)."""

    def __init__(self, layers: int = 18, filters: int = 256, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        if layers < 3 or layers % 3:
            raise ValueError(f"layers={layers}: AmoebaNet-D has three stacks of normal cells; use a multiple of 3")
        if filters % 8:
            raise ValueError(f"filters={filters}: use a multiple of 8 (cells halve and quarter the width)")
        per_stack = layers // 3
        channels = filters // 4
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(channels)
        )
        cells: list[Cell] = []
        c_prev_prev = c_prev = channels
        reduction_prev = False

        def add(reduction: bool) -> None:
            nonlocal c_prev_prev, c_prev, reduction_prev
            cell = Cell(c_prev_prev, c_prev, channels, reduction, reduction_prev)
            cells.append(cell)
            c_prev_prev, c_prev, reduction_prev = c_prev, cell.out_channels, reduction

        channels *= 2
        add(True)  # stem reduction 1
        channels *= 2
        add(True)  # stem reduction 2
        for stack in range(3):
            if stack:
                channels *= 2
                add(True)
            for _ in range(per_stack):
                add(False)
        self.cells = nn.ModuleList(cells)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        prev = prev_prev = x
        for cell in self.cells:
            prev, prev_prev = cell(prev, prev_prev), prev
        x = self.pool(self.relu(prev))
        return self.fc(torch.flatten(x, 1))


def amoebanet(layers: int = 18, filters: int = 256, num_classes: int = 1000, in_channels: int = 3) -> AmoebaNetD:
    """AmoebaNet-D(L=layers, F=filters): ``layers`` normal cells in all (``layers // 3`` per stack)."""
    return AmoebaNetD(layers, filters, num_classes, in_channels)
