"""checkpointing: which activations are kept for backward, recomputed, or moved off the device."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from torch import nn


class Checkpointing(Protocol):
    def apply(self, model: nn.Module) -> nn.Module: ...

    def context(self) -> AbstractContextManager:
        """Around the forward pass."""


@dataclass
class NoCheckpointing:
    """Keep every activation autograd saves: the baseline."""

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()
