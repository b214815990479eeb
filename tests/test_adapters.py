"""The dependencies' private APIs that memexp builds on (memexp.adapters), each checked against
the installed version: an upgrade that moves one fails here, naming what moved, and not in a
sweep. pyproject.toml pins the versions these were checked on."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import shlex
import subprocess
import sys

import pytest
import submitit
from hydra.plugins.sweeper import Sweeper

from memexp.adapters import hydra as hydra_private
from memexp.adapters import submitit as submitit_private


def test_hydra_still_has_the_private_apis_the_sweep_launcher_wraps():
    hydra_private.check()


def test_a_hydra_that_moved_one_is_named_in_the_failure(monkeypatch):
    def composes_otherwise(self, batch):  # a sweeper that no longer composes through its loader
        pass

    monkeypatch.setattr(Sweeper, "validate_batch_is_legal", composes_otherwise)
    with pytest.raises(RuntimeError, match=r"hydra-core .*: Sweeper.validate_batch_is_legal no "
                                           "longer composes each job"):
        hydra_private.check()


@pytest.mark.parametrize("executor", [submitit.LocalExecutor, submitit.SlurmExecutor])
def test_submitit_starts_each_task_as_its_python_then_the_entry_module(executor, tmp_path):
    python = "/venv/bin/python -u -m hydra_plugins.memexp_launcher.job"
    command = submitit_private.command_of(executor(folder=tmp_path, python=python))
    assert command.startswith(python + " "), f"submitit no longer starts tasks with {python}"
    appended = shlex.split(command[len(python):])
    assert submitit_private.job_folder(appended, "job") == str(tmp_path), (
        f"submitit {submitit.__version__} appends {appended}, not "
        f"{submitit_private.APPENDED} and the folder")
    entry = importlib.util.find_spec(submitit_private.ENTRY)
    assert entry is not None, f"submitit {submitit.__version__} has no {submitit_private.ENTRY}"
    assert "submitit_main()" in inspect.getsource(importlib.import_module(submitit_private.ENTRY))


def test_a_command_line_submitit_did_not_give_is_refused_with_its_usage():
    with pytest.raises(SystemExit, match=r"usage: python -m job -u -m submitit.core._submit "
                                         r"FOLDER .*got \['-m', 'other'\]"):
        submitit_private.job_folder(["-m", "other"], "job")


def test_exit_handlers_run_once_before_an_exit_without_finalization():
    script = ("import atexit, os\n"
              "from memexp.adapters.atexit import run_exit_handlers\n"
              "atexit.register(print, 'handler ran', flush=True)\n"
              "run_exit_handlers()\n"
              "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "handler ran\n"), done.stderr


def test_a_local_job_s_results_can_be_read_without_submitit_s_wait(tmp_path):
    executor = submitit.LocalExecutor(folder=tmp_path)
    job = executor.submit(int, "1")
    assert job.result() == 1
    assert job._results_timeout_s > 0, "submitit no longer waits for a job's result file"
    submitit_private.results_at_once(job)
    assert job._results_timeout_s == 0
