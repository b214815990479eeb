"""A model that fails on purpose, for sweeps that must survive their jobs' failures.

`model=custom model._target_=chaos.Chaos +model.mode=<mode>` with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import Tensor, nn


class Chaos(nn.Module):
    """A linear classifier on flattened images whose training forward does `mode`:
    ok (nothing), raise (a Python exception), kill (SIGKILL to its own process), term (SIGTERM
    to its own process), oom (a real CPU allocation failure, after the logits exist; with
`oom_above`, only for batches larger than that: a batch that does not fit), diverge
    (NaN logits, so a NaN loss; not "nan", which Hydra reads as a float), leak (adds a penalty
    computed from each step's logits to a running total that is never detached nor
    backpropagated: the source's `total_loss += loss`, whose history keeps every step's graph,
    and the logits it saved, alive), hold (at the `hold_at`-th training forward of this process,
    writes `<hold_dir>/<pid>.json` and sleeps until a signal's handler raises: a job that waits
    for its time-out signal instead of racing it; a requeued run that resumes past that step has
    fewer forwards to go and does not hold again). With `rank`, only that rank of a multi-rank
    run (its RANK) does it; the others train normally. Every mode computes the same logits as
    `ok` where it returns."""

    def __init__(self, mode: str = "ok", num_classes: int = 10, in_features: int = 3 * 32 * 32,
                 rank: int | None = None, hold_at: int = 4, hold_dir: str | None = None,
                 hold_s: float = 600, oom_above: int = 0):
        super().__init__()
        chosen = rank is None or int(os.environ.get("RANK", 0)) == rank
        self.mode = mode if chosen else "ok"
        self.linear = nn.Linear(in_features, num_classes)
        self.hold_at, self.hold_dir, self.hold_s = hold_at, hold_dir, hold_s
        self.oom_above = oom_above
        self.forwards = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.mode == "raise":
            raise RuntimeError("chaos: this job raises")
        if self.training and self.mode in ("kill", "term"):
            os.kill(os.getpid(), signal.SIGKILL if self.mode == "kill" else signal.SIGTERM)
        if self.training:
            self.forwards += 1
            if self.mode == "hold" and self.forwards == self.hold_at:
                self.hold()
        logits = self.linear(x.flatten(1))
        if self.training and self.mode == "oom" and len(x) > self.oom_above:
            torch.empty(2**48, dtype=torch.uint8)  # 256 TiB: the CPU allocator refuses
        if self.training and self.mode == "diverge":
            return logits * float("nan")
        if self.training and self.mode == "leak":
            self.total_loss = getattr(self, "total_loss", 0) + logits.square().mean()
        return logits

    def hold(self) -> None:
        folder = Path(self.hold_dir)
        folder.mkdir(parents=True, exist_ok=True)
        slurm = {k: v for k, v in os.environ.items() if k.startswith("SLURM_ARRAY_")}
        written = folder / f".{os.getpid()}.tmp"  # renamed whole: a reader never sees half
        written.write_text(json.dumps({"pid": os.getpid(), **slurm}))
        written.rename(folder / f"{os.getpid()}.json")
        deadline = time.monotonic() + self.hold_s
        while time.monotonic() < deadline:
            time.sleep(0.5)  # a signal's handler runs here, and raises out of the run
        raise RuntimeError(f"chaos: held {self.hold_s} s at forward {self.hold_at}; no signal came")


def holding(hold_dir: Path) -> list[dict]:
    """What the processes holding in `hold_dir` wrote (pid, and SLURM_ARRAY_* in a SLURM job),
    oldest first."""
    files = sorted(hold_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text()) for p in files]
