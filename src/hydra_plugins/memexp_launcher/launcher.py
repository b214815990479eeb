"""submitit launchers whose sweeps go on whatever happens to a job.

The stock launcher hands the sweeper each job's return, and the sweeper raises on the first
failure: the rest of the sweep never runs, and a killed job (SIGKILL, the host's OOM killer)
aborts it with submitit's UncompletedJobError, discarding the finished results. Here:

- jobs run `parallel_jobs` at a time (local: in chunks; SLURM: one array, throttled);
- a job that never produced a result is recorded as `killed` in its own result.json;
- the sweeper gets a completed return for every job, so the sweep goes on and the end-of-sweep
  report runs. Each job's truth is its result.json; the report says which jobs did not
  succeed, and the sweep exits non-zero when any did not.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)

# Keys that are this launcher's own, or submitit's executor-construction arguments.
NOT_JOB_PARAMETERS = {"submitit_folder", "max_num_timeout", "parallel_jobs", "array_parallelism"}


class _SurvivingLauncher(BaseSubmititLauncher):
    _CHUNKED = True  # submit `parallel_jobs` at a time and wait (the local executor has no queue)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        import submitit

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        executor = self._executor(submitit)
        jobs = [(list(overrides), initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
        for overrides, number in jobs:
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
        width = self.params["parallel_jobs"] if self._CHUNKED else len(jobs)
        returns = []
        for first in range(0, len(jobs), max(width, 1)):
            chunk = jobs[first:first + max(width, 1)]
            arguments = [(overrides, "hydra.sweep.dir", number, f"job_id_for_{number}",
                          Singleton.get_state()) for overrides, number in chunk]
            submitted = executor.map_array(self, *zip(*arguments, strict=True))
            returns += [self._outcome(job, overrides, number)
                        for job, (overrides, number) in zip(submitted, chunk, strict=True)]
        return returns

    def __call__(self, *args, **kwargs):
        """One task of a submitted job. With hydra.launcher.tasks_per_node=N each task is a rank
        of the run: submitit's TorchDistributedEnvironment exports RANK, WORLD_SIZE,
        MASTER_ADDR and MASTER_PORT (and one GPU per task) for parallel=ddp|zero1|fsdp."""
        import submitit

        if submitit.JobEnvironment().num_tasks > 1:
            submitit.helpers.TorchDistributedEnvironment().export()
        return super().__call__(*args, **kwargs)

    def _executor(self, submitit):
        raise NotImplementedError

    def _wait(self, job) -> None:
        """Until `job` has ended; submitit's own wait looks every second."""

    def _job_parameters(self) -> dict[str, Any]:
        """The job's resources; unset (None) ones are left to submitit's defaults."""
        return {k: v for k, v in self.params.items()
                if k not in NOT_JOB_PARAMETERS and v is not None}

    def _outcome(self, job, overrides: list[str], number: int) -> JobReturn:
        from submitit.core.utils import UncompletedJobError

        from memexp.result import record_killed

        try:
            self._wait(job)
            status = job.results()[0].status.name.lower()
        except UncompletedJobError as error:
            status = "killed"
            stderr = (job.stderr() or "").strip().splitlines()[-20:]
            record_killed(self._job_dir(overrides, number) / "result.json", overrides,
                          f"{error}\n" + "\n".join(stderr))
            log.error(f"job #{number} was killed before it finished; the sweep goes on")
        outcome = JobReturn(overrides=overrides, status=JobStatus.COMPLETED)
        outcome.return_value = status
        return outcome

    def _job_dir(self, overrides: list[str], number: int) -> Path:
        """The job's output folder, resolved as the job itself resolves it."""
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.num = number
        return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)


class LocalLauncher(_SurvivingLauncher):
    _EXECUTOR = "local"

    def _executor(self, submitit):
        # The local executor itself, not submitit's AutoExecutor: only it takes fractions of a
        # minute for timeout_min, and signal_delay_s.
        executor = submitit.LocalExecutor(folder=self.params["submitit_folder"],
                                          max_num_timeout=self.params["max_num_timeout"])
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

    def _wait(self, job) -> None:
        # A local job's end is its process's exit, cheap to check often; submitit's once a
        # second costs half a second per job on average.
        while not job.done():
            time.sleep(0.02)


class SlurmLauncher(_SurvivingLauncher):
    _EXECUTOR = "slurm"
    _CHUNKED = False  # one array; SLURM throttles it

    def _executor(self, submitit):
        executor = submitit.AutoExecutor(cluster="slurm", folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params["max_num_timeout"])
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{key if key in shared else f"slurm_{key}": value
               for key, value in self._job_parameters().items()},
            slurm_array_parallelism=self.params["parallel_jobs"],
        )
        return executor
