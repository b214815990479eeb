"""submitit launchers whose sweeps go on whatever happens to a job.

The stock launcher hands the sweeper each job's return, and the sweeper raises on the first
failure: the rest of the sweep never runs, and a killed job (SIGKILL, the host's OOM killer)
aborts it with submitit's UncompletedJobError, discarding the finished results. Here:

- jobs run `parallel_jobs` at a time (local: in chunks; SLURM: one array, throttled);
- a job that never produced a result is recorded as `killed` in its own result.json (as
  `timeout` where SLURM stopped it at its time limit);
- the sweeper gets a completed return for every job, so the sweep goes on and the end-of-sweep
  report runs. Each job's truth is its result.json; the report says which jobs did not
  succeed, and the sweep exits non-zero when any did not.

Time limits (`timeout_min`): near it a job gets submitit's time-out signal; submitit's handler
asks this launcher for a checkpoint (the same Hydra job, which resumes from its newest
checkpoint with trainer.resume=auto), requeues it, up to `max_num_timeout` times, and exits.
memexp adds two things (see `job` and `timeout`): the signal is held back from the job's first
line until that handler is installed, so an early one requeues instead of killing; and what the
handler raises is recorded as status `timeout`, not as a traceback of the code it interrupted.

submitit, torch and memexp's records are imported where they are used: Hydra imports every
plugin module at each start, to discover its plugins.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.memexp_launcher import server
from memexp.adapters import hydra as hydra_private
from memexp.adapters import submitit as submitit_private

log = logging.getLogger(__name__)

# Keys that are this launcher's own, or submitit's executor-construction arguments.
NOT_JOB_PARAMETERS = {"submitit_folder", "max_num_timeout", "parallel_jobs", "array_parallelism",
                      "preload", "heartbeat_s"}
# What a local job is given after a Ctrl-C to record that it was interrupted, before it is
# killed (SLURM's KillWait gives its jobs 30 s between SIGTERM and SIGKILL by default).
INTERRUPT_GRACE_S = 30
# submitit's <python> for every job: the job module holds the time-out signal back first.
JOB_PYTHON = f"{shlex.quote(sys.executable)} -u -m hydra_plugins.memexp_launcher.job"
# The same job, forked from a server that has imported torch and memexp (see preloaded).
PRELOADED_JOB_PYTHON = f"{shlex.quote(sys.executable)} -u -m {server.SERVER_MODULE}"


class ComposedOnce:
    """The sweep's config loader, keeping each job's config from the sweeper's check of its batch
    (Hydra's Sweeper.validate_batch_is_legal composes every job's config before the launch)
    until the launcher takes it, so that each job's config is composed once, not twice (0.4 s a
    job on 2 cores); its composes share one SharedRepository. Everything else goes to the loader
    it wraps."""

    def __init__(self, loader):
        self._loader = loader
        self._composed: dict[tuple, DictConfig] = {}
        hydra_private.wrap_repository(loader, hydra_private.SharedRepository)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]):
        key = (id(master_config), tuple(sweep_overrides))
        if key not in self._composed:
            self._composed[key] = self._loader.load_sweep_config(master_config,
                                                                 list(sweep_overrides))
        return self._composed[key]

    def take(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        """The job's config, for the launcher to change: the check's, or composed now."""
        config = self.load_sweep_config(master_config, sweep_overrides)
        del self._composed[(id(master_config), tuple(sweep_overrides))]
        return config

    def __getattr__(self, name: str):
        loader = self.__dict__.get("_loader")
        if loader is None:  # pickle's probes, before the instance has its state
            raise AttributeError(name)
        return getattr(loader, name)


class _SurvivingLauncher(BaseSubmititLauncher):
    _CHUNKED = True  # submit `parallel_jobs` at a time and wait (the local executor has no queue)
    _STARTED = "started"  # what a job is once submitted

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        # The sweeper holds the same context, and checks each batch with its loader next.
        hydra_private.replace_loader(hydra_context, ComposedOnce)
        # train.py started a preloaded server for any sweep (-m); only local jobs use one.
        self._server = self._preloaded_server(server.take_early())

    def _preloaded_server(self, early: server.PreloadedServer | server.NoServer | None):
        """The server this launcher's first batch of jobs is forked from: none here."""
        if early is not None:
            early.discard()
        return None

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        import submitit

        self._refuse_bad_input()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        executor = self._executor(submitit)
        jobs = [(list(overrides), initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
        for overrides, number in jobs:
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
        # Each job's config is composed once (by the sweeper's check of the batch, see
        # ComposedOnce), not again in each job as submitit_local's own launcher does; the
        # launcher finds the job's folder in it too.
        configs = {number: self._job_config(overrides, number) for overrides, number in jobs}
        width = self.params["parallel_jobs"] if self._CHUNKED else len(jobs)
        returns = []
        records: dict = {}  # what each job's line has read of the sweep (memexp.report.job_line)
        for first in range(0, len(jobs), max(width, 1)):
            chunk = jobs[first:first + max(width, 1)]
            arguments = [(overrides, Singleton.get_state(), configs[number])
                         for overrides, number in chunk]
            submitted_at = time.monotonic()
            submitted = self._submit(executor, arguments)
            names = {number: f"[{first + i + 1}/{len(jobs)}] job #{number} "
                             f"{' '.join(filter_overrides(overrides))}"
                     for i, (overrides, number) in enumerate(chunk)}
            for _, number in chunk:
                log.info(f"{names[number]}: {self._STARTED}")
            running = [(job, job_dir(configs[number]) / "result.json", overrides, number)
                       for job, (overrides, number) in zip(submitted, chunk, strict=True)]
            try:
                for job, result_file, overrides, number in running:
                    heartbeat = Heartbeat(names[number], job, submitted_at,
                                          self.params["heartbeat_s"])
                    returns.append(self._outcome(job, overrides, number, result_file, heartbeat))
                    log.info(self._ended(names[number], result_file, returns[-1].return_value,
                                         time.monotonic() - submitted_at, records))
            except KeyboardInterrupt:
                self._interrupted(running)
                raise
        return returns

    def _interrupted(self, jobs: list[tuple]) -> None:
        """Ctrl-C while `jobs` (job, its result.json, its overrides, its number) ran: SLURM's
        go on in the cluster (scancel stops them, and they record it)."""

    def _ended(self, job: str, result_file: Path, status: str, seconds: float,
               records: dict) -> str:
        """One line per job as it ends, into the sweep's own output: its result.json (read by
        `memexp show`) says the same, but sits in a folder nobody watches mid-sweep; its step
        time x base is the report's, against the base the report names (`records`: what the
        sweep's lines have read so far, memexp.report.job_line). A job that failed (`status`,
        submitit's) beside a record of a run that did not is a rerun refused before it wrote
        anything: the record is an earlier run's."""
        from memexp.progress import duration
        from memexp.report import job_line
        from memexp.result import BadRecord, load_record, mib

        try:
            record = load_record(result_file)
        except BadRecord as error:
            return f"{job}: {error}"
        if status == "failed" and record["status"] in ("ok", "running"):
            return (f"{job}: refused before it ran (its log says why); {result_file} is an "
                    f"earlier run's record ({record['status']}), kept as it was")
        peak = (record.get("memory") or {}).get("peak_bytes")
        # the table's step time x base, and its base, as the report reads the records so far
        try:
            ratio = job_line(result_file.parent.parent, result_file.parent, records)
        except Exception as error:  # the sweep goes on; its report at the end says what it can
            ratio = f", no step time x base yet ({type(error).__name__}: {error})"
        return f"{job}: {record['status']}, peak {mib(peak)}{ratio}, {duration(seconds)}"

    def __call__(self, sweep_overrides: list[str], singleton_state: dict,
                 sweep_config: DictConfig) -> JobReturn:
        """One task of a submitted job: Hydra's run of `sweep_config`, the job's config as the
        launcher composed it. With hydra.launcher.tasks_per_node=N each task is a rank of the
        run: submitit's TorchDistributedEnvironment exports RANK, WORLD_SIZE, MASTER_ADDR and
        MASTER_PORT (and one GPU per task) for parallel=ddp|zero1|fsdp."""
        import submitit
        from hydra.core.utils import run_job, setup_globals
        from submitit.core.utils import UncompletedJobError

        from hydra_plugins.memexp_launcher import timeout
        from memexp.result import record_killed

        if submitit.JobEnvironment().num_tasks > 1:
            submitit.helpers.TorchDistributedEnvironment().export()
        Singleton.set_state(singleton_state)
        setup_globals()
        try:
            # A signal held back since the job started is handled here, before the run starts.
            timeout.take_over(self.params["timeout_min"], self.params["max_num_timeout"])
            # Hydra's run marks its config read-only: a requeue resubmits these arguments, so
            # the run gets a copy
            config = copy.deepcopy(sweep_config)
            with open_dict(config.hydra.job):
                config.hydra.job.id = submitit.JobEnvironment().job_id
            return run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                           config=config, job_dir_key="hydra.sweep.dir",
                           job_subdir_key="hydra.sweep.subdir")
        except timeout.OutOfRequeues as error:
            # A run that has begun records this itself; one that came before (held back since
            # the job started, or while Hydra set the job up) is recorded here.
            record_killed(job_dir(sweep_config) / "result.json", sweep_overrides, str(error),
                          status="timeout")
            raise UncompletedJobError(str(error)) from None  # how submitit's own handler ends

    def _refuse_bad_input(self) -> None:
        """Stop the sweep, before anything is submitted, on input that cannot work."""

    def _executor(self, submitit):
        raise NotImplementedError

    def _submit(self, executor, arguments: list[tuple]) -> list:
        return executor.map_array(self, *zip(*arguments, strict=True))

    def _wait(self, job, heartbeat: Heartbeat) -> None:
        """Until `job` has ended (memexp_launcher.launcher.wait)."""
        wait(job, heartbeat)

    def _job_parameters(self) -> dict[str, Any]:
        """The job's resources; unset (None) ones are left to submitit's defaults."""
        return {k: v for k, v in self.params.items()
                if k not in NOT_JOB_PARAMETERS and v is not None}

    def _outcome(self, job, overrides: list[str], number: int, result_file: Path,
                 heartbeat: Heartbeat) -> JobReturn:
        from submitit.core.utils import UncompletedJobError

        from memexp.result import record_killed

        self._wait(job, heartbeat)
        try:
            status = job.results()[0].status.name.lower()
        except UncompletedJobError as error:
            # SLURM's own TIMEOUT: its time limit came before the job could requeue or record.
            status = "timeout" if job.state == "TIMEOUT" else "killed"
            stderr = (job.stderr() or "").strip().splitlines()[-20:]
            record_killed(result_file, overrides, f"{error}\n" + "\n".join(stderr),
                          status=status)
            log.error(f"job #{number} ended ({job.state}) before it could record a result; "
                      "its result.json says how; the sweep goes on")
        outcome = JobReturn(overrides=overrides, status=JobStatus.COMPLETED)
        outcome.return_value = status
        return outcome

    def _job_config(self, overrides: list[str], number: int) -> DictConfig:
        """The job's config, composed as Hydra's own launchers compose it."""
        config = self.hydra_context.config_loader.take(self.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.num = number
        return config


def job_dir(config: DictConfig) -> Path:
    """A job's output folder, from its config."""
    return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)


class Heartbeat:
    """A line into the sweep's output every `every_s` (hydra.launcher.heartbeat_s) while a job
    runs: how long it has run, and the last line it logged (its progress: memexp.progress).
    The job's own output goes to its log file, which nobody watches mid-sweep; a silent
    console on a busy machine looks like a hung sweep."""

    def __init__(self, name: str, job, started: float, every_s: float):
        self.name, self.job, self.started, self.every_s = name, job, started, every_s
        self.last = started

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        from memexp.progress import duration

        line = last_logged(Path(self.job.paths.stdout))
        log.info(f"{self.name}: running, {duration(now - self.started)}"
                 + (f"; its last line: {line}" if line else ""))


def last_logged(path: Path, tail_bytes: int = 8192) -> str | None:
    """The last line memexp's logger wrote to a job's output file (not submitit's, nor
    Hydra's), less its time and name prefix; None before it wrote any."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    # "[2026-11-26 21:53:46,712][memexp][INFO] - step 47/60 ..." -> "step 47/60 ..."
    return next((line.split("] - ", 1)[1].strip() for line in reversed(lines)
                 if "][memexp][" in line and "] - " in line and line.split("] - ", 1)[1].strip()),
                None)


def wait(job, heartbeat: Heartbeat, state_every_s: float = 30, poll_s: float = 0.1) -> None:
    """Until the job ends. A job that ends with a result is seen within `poll_s` (a local
    job's process is polled, a SLURM job's result file looked for: both cheap); one that ends
    without (cancelled, killed) only when its state is asked for, and submitit asks SLURM
    (sacct) less and less often, every 10 minutes in the end. Here at least every
    `state_every_s`: one sacct call for every job of the sweep."""
    asked = time.monotonic()
    while not job.done():
        heartbeat()
        if time.monotonic() - asked > state_every_s:
            job.done(force_check=True)
            asked = time.monotonic()
        time.sleep(poll_s)


class LocalLauncher(_SurvivingLauncher):
    _EXECUTOR = "local"

    def _preloaded_server(self, early: server.PreloadedServer | server.NoServer | None):
        # train.py's, or one started now: either imports while Hydra's sweeper composes every
        # job's config (its check of the batch, before the launch).
        if not self.params["preload"]:
            return super()._preloaded_server(early)
        return early or server.start_server()

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        if not self.params["preload"]:
            self._threads = self._job_threads([])
            return super().launch(job_overrides, initial_job_idx)
        # setup's server serves the first batch; a later batch (hydra.sweeper.max_batch_size)
        # starts its own. None is left on the launcher, which each job gets pickled.
        running, self._server = self._server or server.start_server(), None
        try:
            # the server imports meanwhile: its CPU time is this sweep's, not another process's
            self._threads = self._job_threads(
                [running.pid] if isinstance(running, server.PreloadedServer) else [])
            return super().launch(job_overrides, initial_job_idx)
        finally:
            running.close()

    def _job_threads(self, ours: list[int]) -> int | None:
        """The intra-op threads of this batch's jobs that leave trainer.threads unset: one per
        core that other processes leave free, from half a second of the machine's CPU time.
        Each thread of an op waits for the others at its end, so one that shares its core with
        another process holds up every op: `make run` with two busy processes on 2 cores took
        7 times as long as idle with 2 threads; at load 30, one quick job took 0.28x the wall
        time (0.24x the CPU time) with 1 thread that it took with 2. None where
        OMP_NUM_THREADS or the config chose, or the machine's load cannot be read."""
        from memexp.timing import free_cores

        if "OMP_NUM_THREADS" in os.environ or self.config.trainer.threads is not None:
            return None
        found = free_cores(0.5, ours)
        if found is None:
            return None
        threads, busy = found
        log.info(f"torch threads per job: {threads} (other processes kept {busy:.1f} of "
                 f"{os.cpu_count()} cores busy; trainer.threads=N sets it)")
        return threads

    def _job_config(self, overrides: list[str], number: int) -> DictConfig:
        config = super()._job_config(overrides, number)
        if self._threads is not None and config.trainer.threads is None:
            config.trainer.threads = self._threads
        return config

    def _submit(self, executor, arguments: list[tuple]) -> list:
        # submitit's controller takes a Ctrl-C by passing it on to its task and SIGKILLing the
        # task a second later: a job that needs longer to record that it was interrupted (on a
        # loaded machine) would be left `running`, its figures lost. Started with SIGINT
        # blocked, a mask its children inherit, the controller never takes one; each job
        # unblocks it first thing (job.py, the preloaded client) and takes the terminal's own,
        # and this launcher gives it its time (_interrupted).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return super()._submit(executor, arguments)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _interrupted(self, jobs: list[tuple]) -> None:
        """Ctrl-C while `jobs` ran. Each job still running is passed the SIGINT (a job takes
        only its first, so one the terminal gave it too is no second) and given
        INTERRUPT_GRACE_S to record that it was interrupted and end; one still running then,
        or at a second Ctrl-C, is killed. A job that ended without its own record (killed, or
        interrupted before its run began) is recorded `interrupted` here."""
        from memexp.result import record_killed

        running = [entry for entry in jobs if not entry[0].done()]
        if not running:
            return
        for job, *_ in running:
            signal_tasks(job, signal.SIGINT)
        log.warning(f"Ctrl-C: {len(running)} running job(s) record that they were interrupted; "
                    f"waiting up to {INTERRUPT_GRACE_S} s for them (Ctrl-C again kills them)")
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        with contextlib.suppress(KeyboardInterrupt):
            while time.monotonic() < deadline and not all(job.done() for job, *_ in running):
                time.sleep(0.05)
        for job, result_file, overrides, _ in running:
            reason = "KeyboardInterrupt: Ctrl-C; the job ended before it recorded it"
            if not job.done():
                signal_tasks(job, signal.SIGKILL)
                reason = (f"KeyboardInterrupt: Ctrl-C; the job had not recorded it and ended "
                          f"{INTERRUPT_GRACE_S} s later, or at a second Ctrl-C, and was killed")
            record_killed(result_file, overrides, reason, status="interrupted")

    def _executor(self, submitit):
        # The local executor itself, not submitit's AutoExecutor: only it takes fractions of a
        # minute for timeout_min, and signal_delay_s.
        executor = submitit.LocalExecutor(
            folder=self.params["submitit_folder"], max_num_timeout=self.params["max_num_timeout"],
            python=PRELOADED_JOB_PYTHON if self.params["preload"] else JOB_PYTHON)
        parameters = self._job_parameters()
        # submitit_local hides every GPU (CUDA_VISIBLE_DEVICES="") unless gpus_per_node is set,
        # and trainer.device=auto would then quietly train on CPU. Give each job one GPU where
        # this machine has one.
        import torch

        if parameters.get("gpus_per_node") is None and torch.cuda.is_available():
            log.info("hydra.launcher.gpus_per_node unset: giving each local job 1 GPU")
            parameters["gpus_per_node"] = 1
        executor.update_parameters(**parameters)
        return executor

    def _wait(self, job, heartbeat: Heartbeat) -> None:
        # A local job's end is its process's exit, cheap to check often; submitit's once a
        # second costs half a second per job on average.
        while not job.done():
            heartbeat()
            time.sleep(0.02)
        submitit_private.results_at_once(job)


def signal_tasks(job, signum: signal.Signals) -> None:
    """Send `signum` to a local job's tasks: the children of its submitit controller, whose pid
    is the job's id (with preload, each task is the client that passes a signal on, and whose
    SIGKILL its server passes on as one)."""
    try:
        children = Path(f"/proc/{job.job_id}/task/{job.job_id}/children").read_text().split()
    except OSError:  # the controller has ended
        return
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signum)


def signal_delay(timeout_min: int) -> int:
    """The default seconds between the time-out signal and the time limit: a tenth of the
    limit, from 30 s to 120 s. The job needs only seconds to requeue (the work since its newest
    checkpoint is lost either way), and SLURM sends the signal at its scheduler's 30-second
    tick, so 0 to 30 s before this."""
    return min(120, max(30, timeout_min * 6))


class SlurmLauncher(_SurvivingLauncher):
    _EXECUTOR = "slurm"
    _CHUNKED = False  # one array; SLURM throttles it
    _STARTED = "submitted"  # it may wait in SLURM's queue

    def _refuse_bad_input(self) -> None:
        missing = [c for c in ("sbatch", "sacct", "sinfo") if shutil.which(c) is None]
        if missing:
            raise SystemExit(f"memexp: hydra/launcher=slurm needs SLURM's commands on this "
                             f"machine; {', '.join(missing)} not found. A one-node cluster on "
                             "this machine: make slurm-up (see the README)")
        timeout_min, delay = self.params["timeout_min"], self.params["signal_delay_s"]
        if timeout_min < 1:
            raise SystemExit(f"memexp: hydra.launcher.timeout_min={timeout_min}: must be a "
                             "number of minutes >= 1 (SLURM reads 0 as no time limit at all)")
        if delay is not None and not 0 < delay < 60 * timeout_min:
            raise SystemExit(f"memexp: hydra.launcher.signal_delay_s={delay}: the time-out "
                             "signal must come after the job starts and before its time limit "
                             f"(hydra.launcher.timeout_min={timeout_min}): 0 < signal_delay_s "
                             f"< {60 * timeout_min}")
        if self.params["max_num_timeout"] < 0:
            raise SystemExit(f"memexp: hydra.launcher.max_num_timeout="
                             f"{self.params['max_num_timeout']}: must be >= 0 (requeues after "
                             "a time-out)")
        partition = self.params["partition"]
        if partition is not None:
            listed = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True,
                                    text=True, timeout=60)
            partitions = sorted(set(listed.stdout.split()))
            if listed.returncode == 0 and partition not in partitions:
                raise SystemExit(f"memexp: hydra.launcher.partition={partition}: no such SLURM "
                                 f"partition here; choose one of: {', '.join(partitions)}")

    def _executor(self, submitit):
        executor = submitit.AutoExecutor(cluster="slurm", folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params["max_num_timeout"],
                                         slurm_python=JOB_PYTHON)
        parameters = self._job_parameters()
        parameters.setdefault("signal_delay_s", signal_delay(self.params["timeout_min"]))
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{key if key in shared else f"slurm_{key}": value
               for key, value in parameters.items()},
            slurm_array_parallelism=self.params["parallel_jobs"],
        )
        return executor

    def _submit(self, executor, arguments: list[tuple]) -> list:
        from submitit.core.utils import FailedJobError

        try:
            return super()._submit(executor, arguments)
        except FailedJobError as error:  # sbatch said no: nothing was submitted
            said = " ".join(str(error).split())
            raise SystemExit(f"memexp: SLURM refused the sweep, and nothing was submitted. "
                             f"sbatch said: {said}") from None
