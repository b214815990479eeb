"""parallel: how the model and its states are placed across ranks."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor, nn


class Parallel(Protocol):
    rank: int
    world_size: int

    def apply(self, model: nn.Module) -> nn.Module: ...

    def accumulating(self, active: bool) -> AbstractContextManager:
        """Around forward and backward of a micro-batch that is not the last of its step."""

    def all_reduce_sum(self, value: Tensor) -> Tensor: ...


@dataclass
class NoParallel:
    """One process holds the whole model."""

    rank: int = 0
    world_size: int = 1

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def accumulating(self, active: bool) -> AbstractContextManager:
        return nullcontext()

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        return value
