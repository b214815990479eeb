"""What a run that ran out of memory raises, and how an error is told to be one."""

from __future__ import annotations

import torch


class OutOfMemory(RuntimeError):
    """The run ran out of memory in `phase` at `step`; what it reached is in the meter."""

    def __init__(self, message: str, phase: str | None, step: int):
        super().__init__(message)
        self.phase, self.step = phase, step

    def __reduce__(self):  # picklable with its fields (submitit sends a job's error back)
        return type(self), (self.args[0], self.phase, self.step)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError (memory.budget's too), the CPU allocator's failure (a plain
    RuntimeError), or a run that ended on either (OutOfMemory)."""
    return isinstance(error, (torch.OutOfMemoryError, OutOfMemory)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))
