"""atexit's private `_run_exitfuncs`: the exit handlers, run now, before an exit that skips the
interpreter's finalization (memexp.errors.exit_now). It is the function Python's own exit
calls; no public API runs the handlers without exiting. Checked on CPython 3.11 (it has been
there since 3.0)."""

from __future__ import annotations

import atexit
import sys


def run_exit_handlers() -> None:
    """Every handler registered with atexit, last first, as Python's exit runs them; each runs
    once (atexit forgets them)."""
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is None:
        raise RuntimeError(
            f"memexp needs atexit._run_exitfuncs to run the exit handlers before its fast exit; "
            f"Python {sys.version.split()[0]} has none (checked on 3.11)")
    run()
