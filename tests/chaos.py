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
    ok (nothing), raise (a Python exception), kill (SIGKILL to its own process), term (SIGTERM
    to its own process), oom (a real CPU allocation failure, after the logits exist), diverge
    (NaN logits, so a NaN loss; not "nan", which Hydra reads as a float), leak (adds a penalty
    computed from each step's logits to a running total that is never detached nor
    backpropagated: the source's `total_loss += loss`, whose history keeps every step's graph,
    and the logits it saved, alive). With `rank`, only that rank of a multi-rank run (its RANK)
    does it; the others train normally."""

    def __init__(self, mode: str = "ok", num_classes: int = 10, in_features: int = 3 * 32 * 32,
                 rank: int | None = None):
        super().__init__()
        chosen = rank is None or int(os.environ.get("RANK", 0)) == rank
        self.mode = mode if chosen else "ok"
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.mode == "raise":
            raise RuntimeError("chaos: this job raises")
        if self.training and self.mode in ("kill", "term"):
            os.kill(os.getpid(), signal.SIGKILL if self.mode == "kill" else signal.SIGTERM)
        logits = self.linear(x.flatten(1))
        if self.training and self.mode == "oom":
            torch.empty(2**48, dtype=torch.uint8)  # 256 TiB: the CPU allocator refuses
        if self.training and self.mode == "diverge":
            return logits * float("nan")
        if self.training and self.mode == "leak":
            self.total_loss = getattr(self, "total_loss", 0) + logits.square().mean()
        return logits
