"""Progress off a terminal: a line on the first step, then at least every `every` seconds, on a
fake clock (no sleeps, no timing)."""

from __future__ import annotations

import io
import logging
import sys

from memexp.progress import NoProgress, ProgressLines, progress_lines


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_on_the_first_step_then_one_every_interval_with_the_time_left():
    clock, lines = FakeClock(), []
    progress = ProgressLines(total=100, every=20.0, clock=clock, write=lines.append)
    written_at = []
    for step in range(1, 101):
        clock.now += 3.0  # a 3 s step
        before = len(lines)
        progress.step(step, loss=2.0 / step)
        if len(lines) > before:
            written_at.append(clock.now)
    assert lines[0] == "step 1/100, loss 2.0000 (a progress line every 20 s)"
    gaps = [b - a for a, b in zip(written_at, written_at[1:], strict=False)]
    assert gaps and all(20.0 <= gap <= 20.0 + 3.0 for gap in gaps)  # never more than one step late
    # step 8 is the first 20 s after step 1: 7 steps of 3 s, 92 left
    assert lines[1] == "step 8/100 (8%), loss 0.2500, 3 s/step, about 4 min 36 s left"


def test_lines_only_off_a_terminal_and_when_asked_for():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_lines(10, True, (io.StringIO(), Terminal())), ProgressLines)
    assert isinstance(progress_lines(10, True, (Terminal(), Terminal())), NoProgress)
    assert isinstance(progress_lines(10, False, (io.StringIO(), io.StringIO())), NoProgress)


def test_a_run_whose_output_is_a_file_logs_its_first_step(monkeypatch, caplog):
    from conftest import train

    monkeypatch.setattr(sys, "stdout", io.StringIO())  # as when piped to a file
    with caplog.at_level(logging.INFO, logger="memexp"):
        train("model=mlp", "model.hidden=16", "data.batch_size=8", "data.num_train=64",
              "data.num_eval=16", "trainer.progress=true", steps=2)
    assert "step 1/2, loss " in caplog.text
