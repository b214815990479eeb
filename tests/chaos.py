"""A model that fails on purpose, for sweeps that must survive their jobs' failures.

`model=custom model._target_=chaos.Chaos +model.mode=<mode>` with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import Tensor, nn


class Chaos(nn.Module):
    """A linear classifier on flattened images whose training forward does `mode`:
    ok (nothing), raise (a Python exception), kill (SIGKILL to its own process), oom (a real
    CPU allocation failure, after the logits exist), diverge (NaN logits, so a NaN loss; not
    "nan", which Hydra reads as a float)."""

    def __init__(self, mode: str = "ok", num_classes: int = 10, in_features: int = 3 * 32 * 32):
        super().__init__()
        self.mode = mode
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.mode == "raise":
            raise RuntimeError("chaos: this job raises")
        if self.training and self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        logits = self.linear(x.flatten(1))
        if self.training and self.mode == "oom":
            torch.empty(2**48, dtype=torch.uint8)  # 256 TiB: the CPU allocator refuses
        if self.training and self.mode == "diverge":
            return logits * float("nan")
        return logits
