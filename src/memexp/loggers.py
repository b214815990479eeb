"""Loggers: where per-step metrics and the run summary go. `logger=none` is the null object.

A logger's failure never fails a run: training results are in result.json either way.
"""

from __future__ import annotations

import csv
import logging
import netrc
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from memexp import checkpoint, distributed, run_folder, trainer
from memexp.atomic import atomic_file
from memexp.report import COLUMNS, csv_record
from memexp.result import RECORD, finite, record_problem

log = logging.getLogger("memexp")
WANDB_ID = ".wandb_run_id"  # the run's wandb id, in its run folder, for a rerun to continue


def memexp_names() -> list[str]:
    """What memexp may keep in a run folder (files and folders), named where each is defined:
    a logger's own file must be none of them, nor inside one."""
    # wandb.init(dir=<run folder>) writes in its own `wandb` folder there
    return [RECORD, run_folder.LOCK, checkpoint.FOLDER, distributed.RANKS, trainer.SNAPSHOTS,
            WANDB_ID, "wandb"]


@dataclass
class RunInfo:
    run_dir: Path
    config: dict  # the resolved config, as plain containers
    techniques: dict[str, str | None]
    group: str  # the sweep's id (its folder name), or the run's for a single run
    resume: bool = False  # a rerun in this folder continues the same logger run


class Logger(Protocol):
    def start(self, run: RunInfo) -> dict:
        """Begin; returns what to record in result.json about this logger. The record keeps
        this very dict: a logger adds to it what goes wrong later (CsvLogger's `error`)."""

    def log(self, step: int, metrics: dict[str, float | None]) -> None: ...

    def finish(self, result: dict, exit_code: int) -> None: ...

    def report(self, sweep_dir: Path, report) -> None:
        """The end-of-sweep comparison (a memexp.report.Report)."""


class NoLogger:
    """Logs nothing; result.json and the sweep report are still written."""

    def start(self, run: RunInfo) -> dict:
        return {}

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        pass

    def finish(self, result: dict, exit_code: int) -> None:
        pass

    def report(self, sweep_dir: Path, report) -> None:
        pass


class CsvLogger(NoLogger):
    """Per-step metrics as rows of `<run dir>/<filename>`, a path inside the run folder.

    A resumed run keeps the rows of the steps before its first one, and appends; the rows of
    later steps are from the attempt that was cut short, and are run again. A write that fails
    (a full disk) stops this logger, not the run: result.json's `logger.error` says where."""

    def __init__(self, filename: str = "metrics.csv"):
        parts = Path(filename).parts
        if not parts or Path(filename).is_absolute() or ".." in parts:
            raise ValueError(f"logger.filename={filename!r}: must be a path inside the run "
                             "folder, such as metrics.csv or logs/metrics.csv (not absolute, "
                             "no '..')")
        taken = [name for name in memexp_names() if name.casefold() == parts[0].casefold()]
        if taken:  # casefold: on macOS's filesystem Result.json is result.json
            raise ValueError(f"logger.filename={filename!r}: {taken[0]} is memexp's own in the "
                             "run folder, and the logger's rows would be lost to it (or it to "
                             "them). Name another file, such as metrics.csv; memexp keeps "
                             f"{', '.join(memexp_names())}")
        self.filename = filename
        self._path: Path | None = None
        self._resume = False
        self._record: dict = {}
        self._file = None
        self._writer: csv.DictWriter | None = None

    def start(self, run: RunInfo) -> dict:
        self._path, self._resume = run.run_dir / self.filename, run.resume
        self._record = {"csv": str(self._path)}
        return self._record

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        if "error" in self._record:
            return
        row = {"step": step, **metrics}
        try:
            if self._writer is None:
                self._open(list(row), step)
            self._writer.writerow(row)
            self._file.flush()
        except OSError as error:
            self._record["error"] = f"stopped writing at step {step}: {error}"
            log.warning("logger=csv: %s: %s; the run goes on without it", self._path, error)
            self.finish({}, 1)

    def _open(self, columns: list[str], step: int) -> None:
        """Start the file with the rows of earlier steps (a resumed run's), then append."""
        earlier = []
        if self._resume and self._path.is_file():
            with open(self._path, newline="") as f:
                earlier = [r for r in csv.DictReader(f)
                           if (r.get("step") or "").isdigit() and int(r["step"]) < step]
        with atomic_file(self._path) as f:
            rewrite = csv.DictWriter(f, fieldnames=columns, restval="", extrasaction="ignore")
            rewrite.writeheader()
            rewrite.writerows(earlier)
        self._file = open(self._path, "a", newline="")  # noqa: SIM115 (closed in finish)
        self._writer = csv.DictWriter(self._file, fieldnames=columns)

    def finish(self, result: dict, exit_code: int) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:  # the flush of a full disk: already said, in log()
                pass


def wandb_host() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")


def logged_in_to_wandb() -> bool:
    """An API key in the environment, or in ~/.netrc where `wandb login` keeps it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(urlparse(wandb_host()).hostname or "") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def reachable(url: str, timeout: float) -> str | None:
    """None if the server answers at all (any HTTP status); otherwise why not."""
    try:
        urllib.request.urlopen(f"{url}/healthz", timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as error:
        return f"{url} unreachable ({getattr(error, 'reason', error)})"
    return None


def job_type(techniques: dict[str, str | None]) -> str:
    return "/".join(str(v) for v in techniques.values())


# What the report run's summary holds of each job (report.csv's columns)
REPORT_SUMMARY = ("base", "memory_x_base", "step_time_base", "step_time_x_base",
                  "step_time_doubt", "throughput", "eval_accuracy", "eval_accuracy_vs_base")


def summary_of(result: dict) -> dict:
    """The peak breakdown and the headline metrics, flat, for a run's summary; of a record whose
    figures disagree (memexp.result.record_problem, on the record as it is written), none of
    them: its status, and why (docs/result-json.md)."""
    problem = record_problem(finite(result))
    if problem:
        return {"status": result.get("status"), "record_problem": problem}
    memory, metrics = result.get("memory") or {}, result.get("metrics") or {}
    flat = {"status": result.get("status"), "peak_bytes": memory.get("peak_bytes"),
            "peak_phase": memory.get("peak_phase")}
    for category, nbytes in (memory.get("breakdown_at_peak") or {}).items():
        flat[f"peak/{category}_bytes"] = nbytes
    for key in ("eval_accuracy", "final_loss", "throughput", "step_time_s", "skipped_steps"):
        flat[key] = metrics.get(key)
    return {k: v for k, v in flat.items() if v is not None}


class WandbLogger:
    """One wandb run per job, grouped by sweep.

    mode=auto (the default) is offline unless you are logged in (WANDB_API_KEY, or `wandb
    login`), and WANDB_MODE, when set, wins. Before going online the server is probed with a
    short HTTP request, and online init gets `init_timeout` seconds: a server that refuses or
    never answers means an offline run, never a failed job, and result.json says why. Only
    rank 0 logs.
    """

    def __init__(self, project: str = "memexp", entity: str | None = None, mode: str = "auto",
                 init_timeout: float = 15.0, probe_timeout: float = 3.0):
        modes = ("auto", "offline", "online", "disabled")
        if mode not in modes:
            raise ValueError(f"logger.mode={mode}: choose one of {list(modes)}")
        self.project, self.entity, self.mode = project, entity, mode
        self.init_timeout, self.probe_timeout = init_timeout, probe_timeout
        self._run = None
        self._record: Path | None = None  # the run's result.json, named where it disagrees

    def resolve_mode(self) -> tuple[str, str]:
        """(mode, why) for this process."""
        mode, why = self.mode, f"logger.mode={self.mode}"
        if mode == "auto":
            env = os.environ.get("WANDB_MODE")
            if env:
                mode, why = ("offline" if env == "dryrun" else env), f"WANDB_MODE={env}"
            elif logged_in_to_wandb():
                mode, why = "online", "logged in"
            else:
                mode, why = "offline", "not logged in"
        if mode == "online":
            problem = reachable(wandb_host(), self.probe_timeout)
            if problem:
                mode, why = "offline", problem
        return mode, why

    def _init(self, mode: str, run: RunInfo, **extra):
        import wandb  # seconds to import: only where a wandb run starts

        # wandb's own analytics follow the process's settings, not the run's: an offline run in
        # a process where WANDB_MODE=online still has them post to the server at exit, waiting
        # 10 s on one that never answers. The process's mode is the run's.
        wandb.setup(settings=wandb.Settings(mode=mode))
        return wandb.init(
            project=self.project, entity=self.entity, mode=mode, group=run.group,
            config=run.config, dir=str(run.run_dir),
            settings=wandb.Settings(init_timeout=self.init_timeout, silent=True), **extra,
        )

    def start(self, run: RunInfo, **extra) -> dict:
        if int(os.environ.get("RANK", "0")) != 0:
            return {"wandb": {"mode": "disabled", "why": "only rank 0 logs"}}
        mode, why = self.resolve_mode()
        self._record = run.run_dir / RECORD
        if mode == "disabled":
            return {"wandb": {"mode": mode, "why": why}}
        extra = {"job_type": job_type(run.techniques),
                 "tags": [f"{k}={v}" for k, v in run.techniques.items()], **extra}
        # A requeued or rerun job continues the same wandb run.
        id_file = run.run_dir / WANDB_ID
        if run.resume and id_file.is_file():
            extra.update(id=id_file.read_text().strip(), resume="allow")
        try:
            self._run = self._init(mode, run, **extra)
        except Exception as error:  # a server problem must never fail the job
            if mode == "offline":
                log.warning("wandb: offline init failed (%s); logging nothing", error)
                return {"wandb": {"mode": "disabled", "why": f"offline init failed: {error}"}}
            mode, why = "offline", f"online init failed: {type(error).__name__}: {error}"
            self._run = self._init(mode, run, **extra)
        if run.resume:
            id_file.write_text(self._run.id)
        log.info("wandb: %s run %s (%s) in %s", mode, self._run.id, why, self._run.dir)
        return {"wandb": {"mode": mode, "why": why, "run_id": self._run.id,
                          "dir": str(self._run.dir)}}

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        if self._run is not None:
            self._run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def finish(self, result: dict, exit_code: int) -> None:
        if self._run is not None:
            summary = summary_of(result)
            if "record_problem" in summary:
                log.warning("wandb: %s: %s; its figures are left out of the run's summary",
                            self._record, summary["record_problem"])
            self._run.summary.update(summary)
            self._run.finish(exit_code=exit_code)
            self._run = None

    def report(self, sweep_dir: Path, report) -> None:
        """The comparison table as a wandb Table, in a `report` run of the sweep's group."""
        import wandb  # seconds to import: only where a wandb run starts

        self.start(RunInfo(sweep_dir, {}, {}, sweep_dir.name), job_type="report",
                   tags=["report"])
        if self._run is not None:
            records = [csv_record(row) for row in report.rows]
            table = wandb.Table(columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in records])
            self._run.log({"comparison": table})
            # each job's ratios and their base, as the table gives them, to read without it
            self._run.summary.update({f"job/{r['job']}/{key}": r[key] for r in records
                                      for key in REPORT_SUMMARY if r[key] is not None})
            self._run.finish()
            self._run = None
