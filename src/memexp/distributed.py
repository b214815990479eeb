"""Ranks and process groups: how one run becomes N processes, and how they find each other.

Launch modes (docs/parallel.md, "Launching"):

- one process: `parallel=ddp|fsdp|zero1` still needs a process group; it gets a 1-rank group on
  an in-process store (gloo on CPU, nccl on CUDA), so no port is ever taken;
- torchrun, or submitit with `hydra.launcher.tasks_per_node=N`: every rank finds RANK,
  WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment (submitit's
  TorchDistributedEnvironment exports them) and meets the others through that store;
- `trainer.nproc=N`: the Hydra process spawns N local workers (`spawn`) on a free port.

Under torchrun only rank 0 runs Hydra: it resolves the config and the run folder once and hands
the job to the other ranks through the store (`share_job` / `receive_job`), so a run has one
output folder. A rank that fails leaves its traceback in `<run dir>/ranks/` (`record_failure`);
rank 0 names the first failure in result.json (`first_failure`).
"""

from __future__ import annotations

import functools
import gc
import json
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from memexp.atomic import atomic_file

JOB_KEY = "memexp/job"
RANKS = "ranks"  # each failed rank's error, in the run folder


def env_rank() -> int:
    """This process's rank, as its launcher set it (0 in a plain process)."""
    return int(os.environ.get("RANK", 0))


def env_world_size() -> int:
    """How many processes the launcher started for this run (1 in a plain process)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def under_torchrun() -> bool:
    """torchrun (torch.distributed.elastic) sets TORCHELASTIC_RUN_ID in every worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ


@functools.cache
def launcher_store() -> dist.Store:
    """The launcher's rendezvous store (env://): torchrun's agent store, or one rank 0 hosts."""
    store, _, _ = next(dist.rendezvous("env://"))
    return store


def init_process_group(timeout_s: float) -> tuple[int, int]:
    """Join (or create) the default process group; returns (rank, world size).

    `timeout_s` bounds every collective: a rank that died or hangs fails the others after it,
    instead of after torch's default of 10 (nccl) or 30 (gloo) minutes."""
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            # One GPU per local rank; a launcher that narrowed CUDA_VISIBLE_DEVICES leaves one.
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        # gloo for CPU tensors, nccl for CUDA ones: the group serves either trainer.device.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        launched = "WORLD_SIZE" in os.environ
        dist.init_process_group(
            backend, store=launcher_store() if launched else dist.HashStore(),
            rank=env_rank(), world_size=env_world_size(), timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def destroy_process_group() -> None:
    """Leave the group at the end of a run, and free it now, while the interpreter lives.

    A process group lives on while anything holds it (the trainer's DDP wrapper does, inside
    reference cycles), and its destructor is what joins gloo's threads. Left to the collection
    at exit, a gloo thread still releasing the last collective's tensors needs the GIL during
    finalization and aborts the process: "terminate called without an active exception", exit
    -6, after a run that finished ok (pytorch/pytorch#190489; 5 of 76 torchrun runs here). The
    caller drops its trainer first."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


# -- torchrun: rank 0 resolves the job, the others receive it -----------------------------------
def share_job(job) -> None:
    """Rank 0: hand the resolved job to the other ranks (None: there is none, composing failed)."""
    launcher_store().set(JOB_KEY, pickle.dumps(job))


def job_shared() -> bool:
    return launcher_store().check([JOB_KEY])


def receive_job():
    """Ranks > 0: wait for rank 0's job (None when rank 0 could not compose the config)."""
    return pickle.loads(launcher_store().get(JOB_KEY))


def refuse_multirun(argv: list[str]) -> None:
    """`-m` under torchrun would make every rank run the whole sweep."""
    if under_torchrun() and any(arg in ("-m", "--multirun") for arg in argv):
        raise SystemExit(
            "memexp: -m/--multirun under torchrun would run the whole sweep on every rank. "
            "Run the sweep without torchrun and give each job its processes with "
            "hydra.launcher.tasks_per_node=N (local or SLURM), or use trainer.nproc=N.")


# -- a rank's failure ---------------------------------------------------------------------------
def _failure_path(run_dir: Path, rank: int) -> Path:
    return run_dir / RANKS / f"rank{rank}.error.json"


def record_failure(run_dir: Path, rank: int, status: str, error: BaseException) -> None:
    """This rank's traceback, written before the process ends (and so before the others see
    its connections close): the record rank 0 reads to name the rank that failed first."""
    with atomic_file(_failure_path(run_dir, rank)) as f:
        json.dump({"rank": rank, "status": status, "time": time.time(),
                   "error": "".join(traceback.format_exception(error))}, f)


def failure_recorded(run_dir: Path, rank: int) -> bool:
    return _failure_path(run_dir, rank).exists()


def first_failure(run_dir: Path) -> dict | None:
    """The earliest failure any rank recorded: the cause; later ones are its consequences
    ("Connection closed by peer" on the ranks that waited for it)."""
    found = [json.loads(p.read_text()) for p in sorted((run_dir / RANKS).glob("*.error.json"))]
    return min(found, key=lambda failure: failure["time"], default=None)


# -- trainer.nproc: local workers ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _worker(target: Callable, args: tuple, rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N ranks with a thread per core each would oversubscribe the cores
        # (and gloo's busy threads with them), making step times slow and erratic.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    target(*args)


def spawn(target: Callable, args: tuple, nproc: int) -> dict[int, int]:
    """Run `target(*args)` in `nproc` fresh processes (ranks 0..nproc-1); returns the exit code
    of every rank that did not succeed. All ranks are waited for: a rank that fails makes the
    others fail within the process-group timeout, and each records its own failure first."""
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked threads
    port = free_port()
    workers = [context.Process(target=_worker, args=(target, args, rank, nproc, port))
               for rank in range(nproc)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return {rank: w.exitcode for rank, w in enumerate(workers) if w.exitcode != 0}
