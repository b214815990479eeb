"""Sweeps through `hydra/launcher=slurm` against a real SLURM cluster, as users run them.

`make test` brings up a one-node cluster on this machine where it can (scripts/slurm-local: root,
Debian or Ubuntu, the package registry reachable) and stops it afterwards; elsewhere these tests
are skipped, with the reason. The sweeps start together (SLURM queues their jobs on the node's
CPUs) as soon as the session's tests are known, beside the tests before these (tests/conftest.py,
`early`), and the tests read what they left:

- chaos: 3 jobs as one array. Job 0 trains 6 steps. Jobs 1 and 2 wait at step 4, after a
  checkpoint at step 3, for what comes: job 1 gets the signal SLURM sends at a time limit (sent
  with `scancel --signal`, as SLURM's own timer would send it, when the job is waiting for it:
  SLURM's timing is only good to its 30-second tick), job 2 is cancelled (`scancel`).
- timeout: 1 job that waits for its signal in every attempt, with SLURM's own timer: a 5-minute
  limit and a 270 s signal delay, so the signal comes within a tick of each start, and the
  limit never comes first, however slow a start is. One requeue is allowed.
- ddp, fsdp: `tasks_per_node=2`: each job is 2 ranks under srun.
- bad input: refused before anything is submitted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos import holding
from conftest import REPO, early, submitit_log_lines

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TESTS = Path(__file__).resolve().parent
CHAOS = ["model=custom", "model._target_=chaos.Chaos", "data.batch_size=8", "data.num_eval=64",
         "trainer.progress=false"]
NAME = f"memexp-tests-{os.getpid()}"  # the SLURM job name of every sweep here


def sweeps_in(root: Path) -> dict[str, list[str]]:
    """Each sweep's overrides; the chaos jobs' hold files go under `root`."""
    return {
        "chaos": [*CHAOS, "+model.mode=ok,hold,hold", f"+model.hold_dir={root / 'holds'}",
                  "trainer.max_steps=6", "trainer.checkpoint_every=3",
                  "hydra.launcher.timeout_min=10", "hydra.launcher.parallel_jobs=3"],
        "timeout": [*CHAOS, "+model.mode=hold", "+model.hold_at=2",
                    f"+model.hold_dir={root / 'timeout-holds'}", "trainer.max_steps=6",
                    "trainer.checkpoint_every=1", "hydra.launcher.timeout_min=5",
                    "hydra.launcher.signal_delay_s=270", "hydra.launcher.max_num_timeout=1"],
        # Last in the queue (nice): each job takes both CPUs, and 1-CPU jobs queued behind it
        # could not start meanwhile.
        "parallel": ["model=mlp", "trainer.max_steps=3", "trainer.progress=false",
                     "hydra.launcher.tasks_per_node=2", "parallel=ddp,fsdp",
                     "+hydra.launcher.additional_parameters.nice=1000"],
        "no_partition": ["model=mlp", "hydra.launcher.partition=nope"],
        "no_time_limit": ["model=mlp", "hydra.launcher.timeout_min=0"],
        "too_big": ["model=mlp", "hydra.launcher.mem_gb=100000"],
    }


# What the test does when a chaos job waits at step 4, by its array task: signal it, or cancel it.
ACTIONS = {"1": ["--signal=USR2"], "2": []}


def no_cluster() -> str | None:
    """Why SLURM cannot run these tests here, or None."""
    if shutil.which("sbatch") is None:
        return ("no SLURM here (no sbatch). `make test` brings up a local cluster where it can "
                "(root, Debian/Ubuntu, the package registry): scripts/slurm-local up")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
    if "UP" not in ping.stdout:
        return f"SLURM's controller does not answer: {(ping.stdout + ping.stderr).strip()}"
    return None


@dataclass
class Sweep:
    folder: Path
    returncode: int
    output: str

    def result(self, job: int | str) -> dict:
        return json.loads((self.folder / str(job) / "result.json").read_text())


def start(folder: Path, overrides: list[str]) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(TESTS), "HYDRA_FULL_ERROR": "0"}
    environment.pop("WANDB_MODE", None)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=slurm",
             f"hydra.sweep.dir={folder}", f"hydra.launcher.name={NAME}", *overrides],
            stdout=log, stderr=subprocess.STDOUT, cwd=folder.parent, env=environment)


class Sweeps:
    """The sweeps above, started together; a thread acts on the chaos jobs as they wait, until
    every sweep has ended (or 900 s have passed: then what still runs is stopped), and then
    writes how they ended to root/ended.json. Under xdist every worker makes one on the same
    root, and the first to claim it starts the sweeps; the others read root/ended.json."""

    def __init__(self, root: Path):
        self.root, self.ended = root, root / "ended.json"
        self.running: dict[str, subprocess.Popen] = {}
        try:
            (root / "claimed").mkdir()
        except FileExistsError:
            return  # another worker's
        self.skip = no_cluster()
        if not self.skip:
            self.running = {name: start(root / name, overrides)
                            for name, overrides in sweeps_in(root).items()}
        self.thread = threading.Thread(target=self.drive, name="slurm sweeps", daemon=True)
        self.thread.start()

    def drive(self) -> None:
        acted, deadline = set(), time.monotonic() + 900
        try:
            while (any(p.poll() is None for p in self.running.values())
                   and time.monotonic() < deadline):
                for hold in holding(self.root / "holds"):
                    task = hold["SLURM_ARRAY_TASK_ID"]
                    job = f"{hold['SLURM_ARRAY_JOB_ID']}_{task}"
                    if job not in acted:
                        subprocess.run(["scancel", *ACTIONS[task], job], check=True, timeout=60)
                        acted.add(job)
                time.sleep(1)
        finally:
            self.stop()
            written = self.root / ".ended.tmp"  # renamed whole: a reader never sees half
            written.write_text(json.dumps({
                "skip": self.skip,
                "returncodes": {name: p.wait() for name, p in self.running.items()}}))
            written.rename(self.ended)

    def stop(self) -> None:
        """A sweep that did not end in time leaves nothing behind, here or on the cluster."""
        stuck = [process for process in self.running.values() if process.poll() is None]
        for process in stuck:
            process.kill()
        if stuck:
            subprocess.run(["scancel", f"--name={NAME}"], timeout=60)

    def wait(self) -> None:
        """Until the sweeps have ended, whichever worker started them (the thread's 900 s,
        and a minute more)."""
        deadline = time.monotonic() + 960
        while not self.ended.exists():
            assert time.monotonic() < deadline, "the SLURM sweeps never ended"
            time.sleep(0.5)

    def result(self) -> dict[str, Sweep]:
        self.wait()
        ended = json.loads(self.ended.read_text())
        if ended["skip"]:
            pytest.skip(ended["skip"])
        return {name: Sweep(self.root / name, code, (self.root / f"{name}.log").read_text())
                for name, code in ended["returncodes"].items()}


@early(lane=False)  # they wait for SLURM's timers, beside the tests before these
def sweeps(root: Path) -> Sweeps:
    return Sweeps(root)


def test_a_three_job_sweep_is_one_array_with_its_report(sweeps):
    chaos = sweeps["chaos"]
    arrays = {p.name.split("_")[0] for p in chaos.folder.glob(".submitit/[0-9]*_[0-9]*")}
    assert len(arrays) == 1, arrays  # one sbatch, one array
    accounted = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID", "-j", arrays.pop()],
                               capture_output=True, text=True, timeout=60).stdout.split()
    assert sorted({job.split("_")[1] for job in accounted}) == ["0", "1", "2"]
    assert [chaos.result(j)["status"] for j in range(3)] == ["ok", "ok", "killed"]
    report = (chaos.folder / "report.md").read_text()
    for job, status in enumerate(["ok", "ok", "killed"]):
        assert f"| {job} | +model.mode=" in report and f"| {status} |" in report


def test_the_time_out_signal_comes_a_tenth_of_the_limit_early(sweeps):
    script = next(sweeps["chaos"].folder.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --time=10\n" in script and "#SBATCH --signal=USR2@60\n" in script


def test_a_cancelled_job_is_killed_and_the_sweep_goes_on(sweeps):
    chaos = sweeps["chaos"]
    assert chaos.returncode != 0
    assert "1 of 3 jobs did not succeed: job 2 killed" in chaos.output
    killed = chaos.result(2)
    assert "CANCELLED" in killed["error"] and killed["finished_at"]
    assert chaos.result(1)["status"] == "ok"  # the job after it in the array


def test_a_job_at_its_time_limit_is_requeued_and_resumes_bitwise(sweeps):
    chaos = sweeps["chaos"]
    straight, resumed = chaos.result(0), chaos.result(1)
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["metrics"]["resumed_from"] == [3]
    assert resumed["metrics"]["losses"] == straight["metrics"]["losses"]  # all 6 steps, bitwise
    assert len(submitit_log_lines(chaos.folder, "Requeued job")) == 1


def test_a_job_out_of_requeues_ends_with_status_timeout(sweeps):
    timeout = sweeps["timeout"]
    assert timeout.returncode != 0
    assert "1 of 1 jobs did not succeed: job 0 timeout" in timeout.output
    result = timeout.result(0)
    assert result["status"] == "timeout" and result["finished_at"]
    assert result["error"].startswith("timed out (hydra.launcher.timeout_min=5) with no requeue "
                                      "left (hydra.launcher.max_num_timeout=1)")
    assert "Traceback" not in result["error"]
    assert len(submitit_log_lines(timeout.folder, "Requeued job")) == 1
    assert submitit_log_lines(timeout.folder, "not requeued because: timed-out too many times")
    assert "| 0 | - | timeout |" in (timeout.folder / "report.md").read_text()


def test_ddp_and_fsdp_on_two_tasks_each_write_one_result_with_both_ranks(sweeps):
    parallel = sweeps["parallel"]
    assert parallel.returncode == 0, parallel.output[-3000:]
    ddp, fsdp = parallel.result(0), parallel.result(1)
    for job, result in enumerate((ddp, fsdp)):
        assert len(list((parallel.folder / str(job)).rglob("result.json"))) == 1
        assert result["status"] == "ok" and result["env"]["world_size"] == 2
        ranks = result["memory"]["per_rank"]
        assert len(ranks) == 2 and all(rank["peak_bytes"] > 0 for rank in ranks)
    # FSDP shards the parameters across the 2 ranks; DDP keeps them whole on each.
    params = [r["memory"]["breakdown_at_peak"]["params"] for r in (ddp, fsdp)]
    assert 0.45 < params[1] / params[0] < 0.55


@pytest.mark.parametrize(("sweep", "says"), [
    ("no_partition", "hydra.launcher.partition=nope: no such SLURM partition here; choose one "
                     "of: local"),
    ("no_time_limit", "hydra.launcher.timeout_min=0: must be a number of minutes >= 1"),
    ("too_big", "memexp: SLURM refused the sweep, and nothing was submitted. sbatch said: "
                "sbatch: error: Memory specification can not be satisfied"),
])
def test_bad_slurm_input_is_refused_before_anything_is_submitted(sweeps, sweep, says):
    refused = sweeps[sweep]
    assert refused.returncode != 0
    assert says in refused.output
    assert "Traceback" not in refused.output
    assert not list(refused.folder.glob(".submitit/[0-9]*_[0-9]*"))  # no job folder: nothing ran
    assert not list(refused.folder.glob("*/result.json"))
