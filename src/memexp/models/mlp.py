"""A small MLP on flattened images: an input layer, `depth` hidden Linear-ReLU blocks, a head."""

from __future__ import annotations

from torch import Tensor, nn


class MLP(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        hidden: int = 256,
        depth: int = 4,
        inplace: bool = False,
    ):
        super().__init__()
        self.input = nn.Sequential(
            nn.Flatten(), nn.Linear(in_channels * image_size**2, hidden), nn.ReLU(inplace)
        )
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(inplace)) for _ in range(depth))
        )
        self.head = nn.Linear(hidden, num_classes)
        # He initialisation: with PyTorch's default Linear init the signal fades through the
        # ReLU stack and plain SGD barely moves.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.input(x)))
