"""submitit's private job entry point. An executor starts every task as
`<python> -u -m submitit.core._submit FOLDER` (its `_submitit_command_str`), and memexp's
launchers name their own module as <python> (hydra_plugins.memexp_launcher.job), which then
runs submitit's entry itself. Checked on submitit 1.5.

Imports here stay minimal: the job module imports this before it holds its time-out signal
back, and submitit is imported only by `run_entry`.
"""

from __future__ import annotations

import sys

ENTRY = "submitit.core._submit"  # the module submitit runs as each task's main
# What an executor appends to its python: the interpreter's flag, the module and the folder.
APPENDED = ["-u", "-m", ENTRY]


def job_folder(argv: list[str], program: str) -> str:
    """The job folder of the command line submitit gave `program` (after its own name)."""
    if argv[:3] != APPENDED or len(argv) != 4:
        raise SystemExit(f"usage: python -m {program} {' '.join(APPENDED)} FOLDER (submitit "
                         f"appends these); got {argv}")
    return argv[3]


def run_entry(folder: str) -> None:
    """Run submitit's entry point as `python -m submitit.core._submit FOLDER` would."""
    import runpy  # here: the job's first lines, before its signal is held back, import nothing

    sys.argv = [ENTRY, folder]
    runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)


def command_of(executor) -> str:
    """The command an executor starts each task with (private: `_submitit_command_str`),
    for the test that it still ends with APPENDED and the folder."""
    return executor._submitit_command_str


def results_at_once(job) -> None:
    """Have `job.results()` look for the job's result file once, not for 15 s (private:
    `Job._results_timeout_s`, a wait for a shared file system's lag). Only for a job whose
    process has ended on this machine: its result was written before it exited, or never will
    be, and a killed local job held its sweep up 15 s for nothing."""
    job._results_timeout_s = 0
