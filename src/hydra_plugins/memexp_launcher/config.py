"""Launcher configs: submitit's own (every key of submitit_local / submitit_slurm works the same),
plus `parallel_jobs` and `heartbeat_s`. Registered as hydra/launcher=memexp_local and
memexp_slurm; conf/ names them `local` and `slurm`."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf


@dataclass
class MemexpLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.memexp_launcher.launcher.LocalLauncher"
    # how many jobs run at once; 1 keeps memory and speed measurements from sharing a machine
    parallel_jobs: int = 1
    # maximum time for a job in minutes (fractions too); near it, the job gets a signal, is
    # requeued, and continues from its last checkpoint (see trainer.checkpoint_every)
    timeout_min: float = 60
    # seconds before the timeout at which that signal comes
    signal_delay_s: int = 30
    # how many times a job may be requeued after a timeout
    max_num_timeout: int = 3
    # fork each job, a process of its own, from one that has imported torch and memexp (seconds
    # less per job); false: each job starts a fresh interpreter
    preload: bool = True
    # the longest a running job goes without a line in the sweep's output: how long it has run
    # and the last line it logged (its own output goes to its log file)
    heartbeat_s: float = 15


@dataclass
class MemexpSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.memexp_launcher.launcher.SlurmLauncher"
    # how many array tasks run at once (SLURM's array parallelism); 1 runs them one by one
    parallel_jobs: int = 1
    # how many times a job may be requeued after a time-out (or a preemption), to continue from
    # its newest checkpoint (see trainer.checkpoint_every); submitit_slurm's 0 never requeues
    max_num_timeout: int = 3
    # seconds before the time limit at which the time-out signal comes; unset: a tenth of
    # timeout_min, from 30 to 120 s (submitit_slurm's fixed 120 s took 2 minutes off every
    # attempt of a short job). SLURM sends it at its 30-second tick: up to 30 s earlier.
    signal_delay_s: int | None = None
    # the longest a running job goes without a line in the sweep's output: how long it has run
    # and the last line it logged (its own output goes to its log file)
    heartbeat_s: float = 15


ConfigStore.instance().store(group="hydra/launcher", name="memexp_local",
                             node=MemexpLocalConf(), provider="memexp")
ConfigStore.instance().store(group="hydra/launcher", name="memexp_slurm",
                             node=MemexpSlurmConf(), provider="memexp")
