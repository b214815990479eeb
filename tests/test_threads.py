"""torch's intra-op threads: trainer.threads, and a local sweep that gives its jobs one thread per
core that other processes leave free (hydra_plugins.memexp_launcher.launcher.LocalLauncher)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from memexp import timing

from conftest import REPO, compose_train, train


def test_trainer_threads_sets_torchs_intra_op_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train("model=mlp", "trainer.threads=1")  # one: a second would only slow a busy machine
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_trainer_threads_below_one_is_refused():
    from memexp.trainer import Trainer

    with pytest.raises(ValueError, match=r"trainer.threads=0: must be >= 1"):
        Trainer(compose_train("model=mlp", "trainer.threads=0"))


def test_a_process_cpu_time_is_read_from_proc():
    sum(i * i for i in range(300_000))  # some CPU time of this process's own
    # /proc counts in clock ticks (0.01 s), os.times in finer steps
    assert timing.process_cpu_seconds(os.getpid()) == pytest.approx(timing.own_cpu_seconds(),
                                                                 abs=0.05)
    threads, busy = timing.free_cores(0.1, [os.getpid()])
    assert 1 <= threads <= len(os.sched_getaffinity(0)) and 0 <= busy <= os.cpu_count()


@pytest.mark.slow
def test_a_local_sweep_gives_its_jobs_a_thread_per_free_core_and_records_it(tmp_path):
    """Without OMP_NUM_THREADS, the sweep says how many threads its jobs get, and each job's
    result.json records them as trainer.threads (which a rerun can set)."""
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}",
         "model=mlp", "debug=fast", "trainer.max_steps=1", "trainer.device=cpu",
         "trainer.progress=false"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**environment, "HYDRA_FULL_ERROR": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.search(r"torch threads per job: (\d+) \(other processes kept [\d.]+ of \d+ cores "
                     r"busy; trainer.threads=N sets it\)", done.stdout + done.stderr)
    assert said, done.stderr[-3000:]
    record = json.loads((tmp_path / "sweep" / "0" / "result.json").read_text())
    assert record["config"]["trainer"]["threads"] == int(said.group(1))
    assert 1 <= int(said.group(1)) <= len(os.sched_getaffinity(0))
