"""The sweep's preloaded server, as the process that launches the sweep holds it: started (by
train.py for any sweep, or by the local launcher), found by the jobs through SOCKET_VARIABLE,
and closed or discarded. What the server and each job's client do is
hydra_plugins.memexp_launcher.preloaded."""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import sys

SOCKET_VARIABLE = "MEMEXP_PRELOADED_SOCKET"
SERVER_MODULE = "hydra_plugins.memexp_launcher.preloaded"  # run as the server (--serve)


class PreloadedServer:
    """A sweep's server, for the jobs submitted while it runs: they find it through the
    environment they inherit. `close()`: it takes no more jobs (its stdin closes), and ends when
    its last one does. `discard()`: it is killed (and a job it forked, by that job's client).
    One never closed (the sweep stopped before its launch: a config that does not compose,
    Ctrl-C) is discarded when the process exits, so that it holds neither the sweep's output
    nor its folder."""

    def __init__(self):
        # here, not at the top: every job's client imports this module (SOCKET_VARIABLE), and
        # stays small
        import subprocess
        import tempfile

        self._folder = tempfile.TemporaryDirectory(prefix="memexp-")  # only this user's
        path = os.path.join(self._folder.name, "preloaded.socket")
        # set before the server starts: it compares each job's environment with its own
        os.environ[SOCKET_VARIABLE] = path
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
                listener.bind(path)
                listener.listen(64)  # jobs that come while the server imports wait here
                # above 2: the child's stdin, stdout and stderr are set over 0-2 (a process
                # started with its stdin closed could have the socket there)
                handed = fcntl.fcntl(listener.fileno(), fcntl.F_DUPFD_CLOEXEC, 3)
                try:
                    # os.environ, as submitit gives its jobs: what C code set since (torch's
                    # import sets COLUMNS and LINES without a terminal) is not in it
                    self._process = subprocess.Popen(
                        [sys.executable, "-u", "-m", SERVER_MODULE, "--serve", path,
                         str(handed)], pass_fds=[handed], stdin=subprocess.PIPE,
                        env=dict(os.environ))
                finally:
                    os.close(handed)
        except OSError:
            del os.environ[SOCKET_VARIABLE]
            self._folder.cleanup()
            raise
        self._closed = False
        atexit.register(self.discard)

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self) -> None:
        import logging
        import subprocess

        if self._closed:
            return
        self._closed = True
        os.environ.pop(SOCKET_VARIABLE, None)
        try:
            self._process.stdin.close()
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # jobs left running (the sweep was stopped)
            logging.getLogger(__name__).warning(
                f"the preloaded server (pid {self.pid}) still serves running jobs; it "
                "ends when they do")
        finally:
            self._folder.cleanup()

    def discard(self) -> None:
        if not self._closed:
            self._process.kill()
            self.close()


class NoServer:
    """Where a server could not start: the jobs start fresh interpreters (SOCKET_VARIABLE is
    not set), and there is nothing to close."""

    def close(self) -> None:
        pass

    def discard(self) -> None:
        pass


def start_server() -> PreloadedServer | NoServer:
    """A new server, or NoServer, with a warning, where none can start: its socket could not be
    bound (a TMPDIR too long for a socket's path, a full disk), or the process not started.
    A sweep goes on without it, as it would with hydra.launcher.preload=false."""
    try:
        return PreloadedServer()
    except OSError as error:
        import logging

        logging.getLogger(__name__).warning(
            f"memexp: no preloaded server ({error}); each job starts a fresh interpreter")
        return NoServer()


# The server train.py started before its own imports (start_early), until a launcher takes it.
# Hydra's plugin scan runs this module's code again, in the same module: it is kept.
_early: PreloadedServer | NoServer | None = globals().get("_early")


def start_early(argv: list[str]) -> None:
    """train.py's first step where its command line asks for a sweep (-m): start the sweep's
    server now, so that it imports torch beside this process instead of after it (seconds
    sooner to the first job on 2 cores). The launcher takes it at its set-up (`take_early`).
    A sweep that uses none (hydra/launcher=slurm, hydra.launcher.preload=false) discards it
    there; one that ends before (--help, a config that does not compose), at its exit."""
    global _early
    if _early is None and {"-m", "--multirun"} & set(argv):
        _early = start_server()


def take_early() -> PreloadedServer | NoServer | None:
    global _early
    server, _early = _early, None
    return server
