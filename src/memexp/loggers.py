"""Loggers: where per-step metrics and the run summary go. `logger=none` is the null object."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Protocol


class Logger(Protocol):
    def start(self, run_dir: Path, config: dict, techniques: dict[str, str]) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, summary: dict, exit_code: int) -> None: ...


class NoLogger:
    """Logs nothing; result.json is still written."""

    def start(self, run_dir: Path, config: dict, techniques: dict[str, str]) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def finish(self, summary: dict, exit_code: int) -> None:
        pass


class CsvLogger:
    """Per-step metrics as rows of `<run dir>/<filename>`."""

    def __init__(self, filename: str = "metrics.csv"):
        self.filename = filename
        self._file = None
        self._writer: csv.DictWriter | None = None

    def start(self, run_dir: Path, config: dict, techniques: dict[str, str]) -> None:
        self._file = open(run_dir / self.filename, "w", newline="")  # noqa: SIM115

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **metrics}
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def finish(self, summary: dict, exit_code: int) -> None:
        if self._file is not None:
            self._file.close()
