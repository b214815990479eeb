"""Progress lines for a run whose output is not a terminal (a log file, a pipe, a batch job).

tqdm's bar shows only on a terminal; piped to a file, a run would say nothing until its summary.
There `ProgressLines` logs one line on the first step and then one at least every `every`
seconds: the step, the loss, the time per step and an estimate of the time left. The trainer
calls `step()` once per optimizer step; `NoProgress` stands in where no lines are wanted.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("memexp")
# At most 30 s between lines, even when one step takes 15 s.
EVERY_S = 15.0


class NoProgress:
    def step(self, step: int, loss: float) -> None:
        pass


class ProgressLines:
    """`clock` and `write` are the wall clock and the logger, or a test's stand-ins."""

    def __init__(self, total: int, every: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 write: Callable[[str], None] = log.info):
        self.total, self.every, self.clock, self.write = total, every, clock, write
        self.first: tuple[float, int] | None = None  # (time, step) of the first step seen
        self.last_line = 0.0

    def step(self, step: int, loss: float) -> None:
        now = self.clock()
        if self.first is None:
            self.first, self.last_line = (now, step), now
            self.write(f"step {step}/{self.total}, loss {loss:.4f} (a progress line every "
                       f"{self.every:.0f} s)")
            return
        if now - self.last_line < self.every:
            return
        self.last_line = now
        started, first_step = self.first
        per_step = (now - started) / (step - first_step)
        self.write(f"step {step}/{self.total} ({100 * step / self.total:.0f}%), loss {loss:.4f}, "
                   f"{per_step:.3g} s/step, about {duration((self.total - step) * per_step)} "
                   "left")


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def progress_lines(total: int, enabled: bool,
                   streams: tuple[TextIO, ...] | None = None) -> ProgressLines | NoProgress:
    """Lines when `enabled` (trainer.progress) and the output (stdout and stderr, unless
    `streams` are given) is not all terminals: on a terminal, tqdm's bar does the job."""
    streams = (sys.stdout, sys.stderr) if streams is None else streams
    if enabled and not all(stream.isatty() for stream in streams):
        return ProgressLines(total)
    return NoProgress()
