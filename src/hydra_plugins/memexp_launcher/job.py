"""The first lines a submitit job runs: its time-out signal is held back until submitit can
handle it.

submitit starts each task as `<python> -u -m submitit.core._submit FOLDER`, and installs its
handler of the time-out signal (SIGUSR2, or what SUBMITIT_PREEMPT_SIGNAL names) only after the
job's imports and its pickle are loaded: seconds, and many more under load. A signal in that
window ended the process (SIGUSR2's default action) or, on submitit_local, left it to be
interrupted at the time limit, instead of requeuing it. memexp's launchers give submitit
`python -u -m hydra_plugins.memexp_launcher.job` as its <python>; this module blocks the signal
before anything else is imported, then runs submitit's entry point. A signal that comes early
waits, pending, until the launcher installed its handler and calls `let_in()` (in the job's
first call). Imports here stay minimal: they run before the signal is held back.
"""

import os
import signal
import sys

from memexp import permanent_imports
from memexp.adapters import submitit as submitit_private


def timeout_signal() -> signal.Signals:
    """submitit's time-out and preemption signal."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


def hold_back() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {timeout_signal()})


def let_in() -> None:
    """Unblock the signal: one that came while it was held back is handled now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {timeout_signal()})


def preload() -> None:
    """What every job imports: submitit, torch and memexp's app (its trainer with it; the
    launcher whose function the job's pickle names takes 14 ms more). The preloaded server
    imports it once, before it forks its jobs; a job in a fresh interpreter imports it before
    submitit loads its pickle."""
    import submitit  # noqa: F401
    import torch  # noqa: F401

    import memexp.app  # noqa: F401


def main(argv: list[str]) -> None:
    # Threads started from here on inherit the blocked signal; let_in() unblocks it in the main
    # thread, the one where Python runs signal handlers.
    hold_back()
    # The local launcher starts submitit's controller with SIGINT blocked, and a task inherits
    # that: the job takes a Ctrl-C itself (memexp_launcher.launcher.LocalLauncher._submit).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    with permanent_imports():
        preload()
    submitit_private.run_entry(submitit_private.job_folder(argv, __spec__.name))
    # submitit has written the job's result: what is left is the interpreter's finalization.
    from memexp.errors import exit_done

    exit_done()


if __name__ == "__main__":
    main(sys.argv[1:])
