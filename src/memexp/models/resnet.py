"""A CIFAR-style ResNet: a 3x3 stem, four stages of Conv-BN-ReLU residual blocks, a linear head."""

from __future__ import annotations

from torch import Tensor, nn


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU(inplace=inplace)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            # Safe: BatchNorm's backward needs its input, not this output.
            out += self.shortcut(x)
        else:
            out = out + self.shortcut(x)
        return self.relu2(out)


class ResNet(nn.Module):
    """`blocks_per_stage=[2,2,2,2]` with `width=64` is the CIFAR ResNet-18 (11.2M parameters)."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        width: int = 64,
        blocks_per_stage: list[int] = (2, 2, 2, 2),
        inplace: bool = False,
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=inplace),
        )
        blocks, channels = [], width
        for stage, count in enumerate(blocks_per_stage):
            out_channels = width * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, out_channels, stride, inplace))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        x = self.blocks(x)
        return self.head(self.pool(x).flatten(1))
