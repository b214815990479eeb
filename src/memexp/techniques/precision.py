"""precision: the dtype of parameters and activations, and how backward and the step are done."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn


class Precision(Protocol):
    def apply(self, model: nn.Module) -> nn.Module: ...

    def autocast(self) -> AbstractContextManager:
        """Around the forward pass and the loss."""

    def cast_inputs(self, inputs: Tensor) -> Tensor: ...

    def parameters(self, model: nn.Module) -> Iterable[Tensor]:
        """What the optimizer updates: the model's parameters, or fp32 master copies."""

    def backward(self, loss: Tensor) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """One optimizer step; False when it was skipped (non-finite gradients)."""


@dataclass
class FP32:
    """Full precision: the baseline the other options are compared with."""

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self) -> AbstractContextManager:
        return nullcontext()

    def cast_inputs(self, inputs: Tensor) -> Tensor:
        return inputs

    def parameters(self, model: nn.Module) -> Iterable[Tensor]:
        return model.parameters()

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True
