"""Inside a submitit job: submitit's time-out handler, with what it raises made a `TimedOut`.

submitit's handler of the time-out signal (installed before the job's first call) requeues the
job and exits, or, with no requeue left, raises UncompletedJobError. Either comes out of
whatever the run was doing (a forward pass, say), and the run would record a traceback of it
as `failed`. Wrapped here, the run records status `timeout` and a sentence instead, and the
process still ends as submitit means it to (its exit code is kept: submitit_local's controller
requeues on it).
"""

from __future__ import annotations

import signal

from submitit.core.utils import UncompletedJobError

from hydra_plugins.memexp_launcher.job import let_in, timeout_signal
from memexp.result import TimedOut


class Requeued(TimedOut, SystemExit):
    """submitit requeued the job; the process exits with submitit's exit code."""

    def __init__(self, code, message: str):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class OutOfRequeues(TimedOut):
    """The job timed out with no requeue left."""


def take_over(timeout_min: float, max_num_timeout: int) -> None:
    """Wrap submitit's handler of the time-out signal, then let in a signal held back since the
    job started (hydra_plugins.memexp_launcher.job): it is handled at once, here."""
    submitits = signal.getsignal(timeout_signal())
    limits = f"hydra.launcher.timeout_min={timeout_min}"

    def on_timeout(signum, frame) -> None:
        try:
            submitits(signum, frame)  # returns on ranks > 0: rank 0 requeues the job
        except SystemExit as requeued:
            raise Requeued(requeued.code, f"timed out ({limits}, or preempted): requeued, to "
                           "continue from its newest checkpoint") from None
        except UncompletedJobError:
            raise OutOfRequeues(
                f"timed out ({limits}) with no requeue left (hydra.launcher.max_num_timeout="
                f"{max_num_timeout}); its newest checkpoint, if trainer.checkpoint_every wrote "
                "one, is kept: rerun the sweep in the same folder, with a longer timeout_min or "
                "more max_num_timeout, to continue from it") from None

    signal.signal(timeout_signal(), on_timeout)
    let_in()
