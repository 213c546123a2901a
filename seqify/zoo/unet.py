"""U-Net with depth, blocks (B) and width (C), the pipeline benchmark model of the GPipe literature."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["UNet", "unet"]


def _convs(blocks: int, cin: int, cout: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(blocks):
        layers += [
            nn.Conv2d(cin if i == 0 else cout, cout, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        ]
    return nn.Sequential(*layers)


class UNet(nn.Module):
    """An encoder-decoder with one long skip per level.

    Level ``i`` has ``blocks`` conv-BN-ReLU units of ``channels * 2**i`` channels; the decoder upsamples
    with a transposed convolution and concatenates the encoder's output of the same level.
    """

    def __init__(
        self,
        depth: int = 4,
        blocks: int = 2,
        channels: int = 64,
        in_channels: int = 3,
        out_channels: int = 1,
    ) -> None:
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = in_channels
        for w in widths[:-1]:
            self.down.append(_convs(blocks, cin, w))
            cin = w
        self.pool = nn.MaxPool2d(2)
        self.bottom = _convs(blocks, widths[-2], widths[-1])
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], kernel_size=2, stride=2) for i in reversed(range(depth))
        )
        self.merge = nn.ModuleList(_convs(blocks, 2 * widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        links = []
        for down in self.down:
            x = down(x)
            links.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, merge, link in zip(self.up, self.merge, reversed(links)):
            x = merge(torch.cat([up(x), link], dim=1))
        return self.head(x)


def unet(depth: int = 4, blocks: int = 2, channels: int = 64, in_channels: int = 3, out_channels: int = 1) -> UNet:
    """U-Net(B=blocks, C=channels) with ``depth`` levels; inputs need sides divisible by ``2**depth``."""
    return UNet(depth, blocks, channels, in_channels, out_channels)
