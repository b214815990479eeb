"""optim: the optimizer, and when it steps (gradient accumulation)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(kw_only=True)
class OptimizerChoice:
    """Keys every optim option has. `accumulate=k` steps every k micro-batches of
    data.batch_size samples, with the loss scaled by 1/k (MMEngine's accumulative_counts)."""

    lr: float
    accumulate: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr}: the learning rate must be positive")
        if self.accumulate < 1:
            raise ValueError(
                f"optim.accumulate={self.accumulate}: must be >= 1 (1 means no accumulation)"
            )

    def build(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        raise NotImplementedError


@dataclass(kw_only=True)
class SGD(OptimizerChoice):
    """SGD; momentum 0 keeps no state, momentum > 0 keeps one buffer per parameter."""

    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0

    def build(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )


@dataclass(kw_only=True)
class AdamW(OptimizerChoice):
    """AdamW: two state tensors per parameter (8 bytes per fp32 parameter)."""

    lr: float = 1e-3
    betas: list[float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def build(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
            weight_decay=self.weight_decay,
        )
