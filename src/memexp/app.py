"""The Hydra application behind `train.py`: one run, recorded in result.json whatever happens."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from memexp import distributed, errors, import_from_working_directory, run_folder
from memexp.build import build
from memexp.checkpoint import ResumeRefused
from memexp.config import config_dir
from memexp.device import device_name
from memexp.find_batch import find_batch_size, set_batch_size
from memexp.loggers import NoLogger, RunInfo
from memexp.out_of_memory import OutOfMemory, is_out_of_memory
from memexp.result import (
    HALF_ON_CPU,
    RECORD,
    RunRecord,
    TimedOut,
    half_precision_on_cpu,
    record_killed,
    summary,
    write_json_atomic,
)
from memexp.trainer import NonFiniteLoss, Trainer

log = logging.getLogger("memexp")


class Terminated(BaseException):
    """SIGTERM (kill, scancel, a launcher stopping its ranks), raised where the run is, so that
    it records `terminated` before it ends. A BaseException: no `except Exception` swallows it."""


def status_of(error: BaseException) -> str:
    """How a run that raised ended: out of memory, diverged, timed out, stopped, or failed."""
    if is_out_of_memory(error):
        return "oom"
    statuses = {NonFiniteLoss: "nan", TimedOut: "timeout", Terminated: "terminated",
                KeyboardInterrupt: "interrupted"}
    return next((s for kind, s in statuses.items() if isinstance(error, kind)), "failed")


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises Terminated (and a second one ends the process), on
    any run of one rank or several. Only where SIGTERM still has its default action: a handler
    that someone else installed is theirs (submitit's, in sweep jobs, logs SIGTERM and waits
    for its own timeout signal to checkpoint and requeue), and is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def terminated(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if distributed.env_world_size() == 1:
            raise Terminated("the run was stopped by SIGTERM")
        raise Terminated(f"rank {distributed.env_rank()} was stopped by SIGTERM (its launcher "
                         "stops every rank when one fails)")

    signal.signal(signal.SIGTERM, terminated)
    try:
        with raised_again_where_lost(signal.SIGTERM, terminated, Terminated):
            yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def interrupted_once() -> Iterator[None]:
    """While the block runs, the first SIGINT raises KeyboardInterrupt and later ones are
    ignored, so that the run's `interrupted` record is written whatever comes after. A Ctrl-C on
    a local sweep reaches its job twice or three times: from the terminal, to the whole process
    group; from submitit's controller, which passes its own on to its task; and from the
    preloaded client, which passes its own on to the job it stands in for. Only the job knows
    that it has been interrupted already: neither of those can tell a terminal's signal from
    one meant for the job alone (LocalJob.cancel), so each must pass its own on. As
    sigterm_raises: only where SIGINT has Python's own handler (a shell's background job
    ignores it)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return

    def interrupted(signum, frame) -> None:
        # a handler that does nothing, not SIG_IGN: a signal that came before this line runs
        # it, instead of Python's "Signal 2 ignored due to race condition"
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    try:
        with raised_again_where_lost(signal.SIGINT, interrupted, KeyboardInterrupt):
            yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def raised_again_where_lost(signum: int, handler, raised: type[BaseException]) -> Iterator[None]:
    """A signal handler's exception (`raised`, by `handler`, which then stops raising) that
    lands in a finalizer is lost: Python only prints an exception raised in a weakref callback
    or a __del__, and goes on. The memory tracker frees every storage in one, so a run on the
    CPU trained on after such a Ctrl-C, deaf to every later one (a local sweep's job was killed
    30 s later, its figures lost). Here the handler is armed again, and the signal sent again
    from another thread, 10 ms later: by then the finalizer has returned."""
    previous = sys.unraisablehook

    def lost(unraisable) -> None:
        if not isinstance(unraisable.exc_value, raised):
            previous(unraisable)
            return
        signal.signal(signum, handler)
        again = threading.Timer(0.01, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()

    sys.unraisablehook = lost
    try:
        yield
    finally:
        sys.unraisablehook = previous


def run_config(cfg: DictConfig, run_dir: Path, choices: dict[str, str], overrides: list[str],
               group: str) -> dict:
    """Build, train and record this rank's part of one run in `run_dir`; raises after recording
    a failure. Rank 0 writes result.json and logs; in a run of several ranks, a rank that fails
    leaves its traceback in `<run_dir>/ranks/` first, and rank 0's record names the rank that
    failed first, with its traceback."""
    with sigterm_raises(), interrupted_once():
        return record_run(cfg, run_dir, choices, overrides, group)


def record_run(cfg: DictConfig, run_dir: Path, choices: dict[str, str], overrides: list[str],
               group: str) -> dict:
    rank, world_size = distributed.env_rank(), distributed.env_world_size()
    record = RunRecord(run_dir / RECORD if rank == 0 else None,
                       config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                       choices=choices, overrides=overrides)
    logger, trainer = NoLogger(), None  # until built, inside the record's try
    try:
        if rank == 0:  # only rank 0 logs
            logger = build(cfg.logger)
        if cfg.data.batch_size == "auto":  # the largest batch that fits, found by trying
            search = find_batch_size(cfg)
            set_batch_size(cfg, search.batch_size)
            record.payload["batch_search"] = search.as_dict()
            record.payload["config"] = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        trainer = Trainer(cfg, run_dir)
        # Built, with the checkpoint it continues loaded: the run starts only now, so that a
        # rerun refused while it is built (ResumeRefused) leaves the folder's record and its
        # logger's run (the same wandb run) as they were.
        record.payload["logger"] = logger.start(RunInfo(
            run_dir, record.payload["config"], record.payload["techniques"], group,
            resume=cfg.trainer.resume == "auto"))
        record.start()
        record.payload["env"]["device_name"] = device_name(trainer.device)
        if rank == 0 and half_precision_on_cpu(record.payload):
            log.info(f"note: {HALF_ON_CPU}")
        if trainer.blocks:  # what block-level techniques found (memexp.models.blocks)
            record.payload["techniques"]["blocks"] = trainer.blocks
        if trainer.model_load:  # the tensors model.pretrained did and did not fill
            record.payload["model_load"] = trainer.model_load
        trainer.fit(logger)
        record.finish("ok", memory=ranks_memory(trainer), metrics=trainer.summary_metrics())
    except ResumeRefused:
        raise  # nothing was written; the refusal is the whole report (errors.Refused)
    except BaseException as error:
        status, cause = status_of(error), error
        memory = trainer.meter.report() if trainer is not None else None
        if memory is not None and isinstance(error, OutOfMemory):
            memory["oom"] = {"phase": error.phase, "step": error.step}
        if world_size > 1:
            distributed.record_failure(run_dir, rank, status, error)
            first = distributed.first_failure(run_dir)
            record.payload["failed_rank"] = first["rank"]
            status, cause = first["status"], first["error"]
        metrics = trainer.summary_metrics() if trainer is not None else None
        record.finish(status, memory=memory, metrics=metrics, error=cause)
        logger.finish(record.payload, exit_code=1)
        if rank == 0:
            log.error(summary(record.payload, run_dir))
        raise
    finally:
        trainer = None  # its DDP wrapper holds the process group (see destroy_process_group)
        distributed.destroy_process_group()
    logger.finish(record.payload, exit_code=0)
    if rank == 0:
        log.info("\n" + summary(record.payload, run_dir))
    return record.payload


def ranks_memory(trainer: Trainer) -> dict:
    """The `memory` section: one process's report; across ranks, the report of the rank with the
    highest peak, its number, and every rank's report in `per_rank` (a collective)."""
    reports = trainer.parallel.gather(trainer.meter.report())
    if len(reports) == 1:
        return reports[0]
    top = max(range(len(reports)), key=lambda r: reports[r]["peak_bytes"] or 0)
    return {**reports[top], "rank": top, "per_rank": reports}


@dataclass
class Job:
    """One run, resolved once (plain, picklable data): what each of its ranks needs."""

    config: dict
    run_dir: Path
    choices: dict[str, str]
    overrides: list[str]
    group: str

    def run(self) -> dict:
        return run_config(OmegaConf.create(self.config), self.run_dir, self.choices,
                          self.overrides, self.group)


def run_ranks(job: Job, nproc: int) -> dict:
    """trainer.nproc=N: this process spawns N local ranks and waits for all of them; rank 0
    writes result.json, and this process logs its summary."""
    failed = distributed.spawn(job.run, (), nproc)
    path = job.run_dir / RECORD
    codes = ", ".join(f"rank {rank} exit code {code}" for rank, code in failed.items())
    # Rank 0 records every failure it lives to see. A rank killed outright (SIGKILL, the OOM
    # killer) records nothing, and is the cause: the others only lost their connection to it.
    killed = [rank for rank in failed if not distributed.failure_recorded(job.run_dir, rank)]
    if killed:
        record_killed(path, job.overrides, f"trainer.nproc={nproc}: {codes}")
        result = json.loads(path.read_text())
        result.update(status="killed", failed_rank=killed[0],
                      error=f"rank {killed[0]} was killed (exit code {failed[killed[0]]}) "
                            f"before it could record an error; {codes}\n{result['error']}")
        write_json_atomic(path, result)
    result = json.loads(path.read_text())
    if failed:
        log.error(summary(result, job.run_dir))
        raise RuntimeError(f"trainer.nproc={nproc}: {codes}; see {path}")
    log.info("\n" + summary(result, job.run_dir))
    return result


def run(cfg: DictConfig) -> dict:
    """The Hydra task function: importable, so submitit can pickle it by reference."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # A sweep's jobs share a group: the sweep folder's name.
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    group = Path(hydra_cfg.sweep.dir).name if multirun else run_dir.name
    nproc, launched = cfg.trainer.nproc, distributed.env_world_size()
    if nproc > 1 and launched > 1:
        raise ValueError(f"trainer.nproc={nproc} in a run that its launcher (torchrun or "
                         f"hydra.launcher.tasks_per_node) already started as {launched} "
                         "processes; use one or the other.")
    job = Job(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), run_dir,
              dict(hydra_cfg.runtime.choices), list(hydra_cfg.overrides.task), group)
    if distributed.env_rank() > 0:  # another task of a submitit job: rank 0 holds the folder
        return job.run()
    if nproc > 1 or multirun:
        return run_job(job, nproc)
    with errors.summarized_bad_input():
        return run_job(job, nproc)


def run_job(job: Job, nproc: int = 1) -> dict:
    """The whole job, from the process that owns its run folder: hold the folder (another
    process in it is refused), see what a rerun finds there (run_folder.finished_run), then
    train with one process or trainer.nproc ranks. A rerun of a run that finished is a no-op
    that returns the folder's record, untouched."""
    with run_folder.hold(job.run_dir):
        finished = run_folder.finished_run(job.run_dir, job.config)
        if finished is not None:
            log.info(f"memexp: {job.run_dir} already holds this run, finished: nothing to train; "
                     f"its result.json is kept as it is\n" + summary(finished, job.run_dir))
            return finished
        if distributed.under_torchrun():  # only rank 0 runs Hydra; the others wait for its job
            distributed.share_job(job)
        return run_ranks(job, nproc) if nproc > 1 else job.run()


def follow_rank_zero() -> None:
    """torchrun's ranks > 0: run the job rank 0 resolved, in its run folder."""
    job = distributed.receive_job()
    if job is None:
        raise SystemExit(f"memexp: rank {distributed.env_rank()}: rank 0 did not start the "
                         "run (its config did not compose, or its run folder refused it); its "
                         "error says why")
    job.run()


def main() -> None:
    import_from_working_directory()
    try:
        hydra_entry()
        errors.exit_done()
    except Terminated:
        # Recorded as `terminated`, and summarized; exit as shells report SIGTERM (128 + 15).
        raise SystemExit(128 + signal.SIGTERM) from None
    except BrokenPipeError:
        errors.reader_left()


def hydra_entry() -> None:
    distributed.refuse_multirun(sys.argv)
    hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()),
                            config_name="train")(run)
    if not distributed.under_torchrun():
        errors.main(hydra_main)
    elif distributed.env_rank() > 0:
        follow_rank_zero()
    else:
        try:
            errors.main(hydra_main)
        finally:  # a config that did not compose: the other ranks must not wait for a job
            if not distributed.job_shared():
                distributed.share_job(None)
