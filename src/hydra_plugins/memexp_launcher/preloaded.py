"""Local sweep jobs forked from a process that has imported torch and memexp already.

A job that starts a fresh interpreter spends seconds importing torch before its first line of
work (2.4-3.5 s on a 2-core machine), and a sweep pays that for every job. With
`hydra.launcher.preload=true` (the local launcher's default) a sweep has one server: it
imports what a job imports, then waits. `python train.py -m` starts it first thing, to import
while the sweep's own process does (the launcher starts one at its set-up otherwise). Each job
is still a process of its own, with its own memory and its own CUDA context (the server never
touches CUDA): the server forks it, and it runs as `python -u -m
hydra_plugins.memexp_launcher.job` would.

submitit's local controller starts this module as the job's <python>:

    python -u -m hydra_plugins.memexp_launcher.preloaded -u -m submitit.core._submit FOLDER

This side (the client) imports nothing heavy. It hands the server its command line, its
environment, its folder and its stdin, stdout and stderr, then stands in for the forked job:
the signals submitit sends it (the time-out signal, SIGINT, SIGTERM) go on to the job, and it
exits as the job did (with its code, or killed by the same signal). The server kills a job
whose client is gone (SIGKILL, which cannot be passed on). The client starts a fresh
interpreter instead, and says why on stderr, where there is no server, the server is gone, or
the job's environment differs from the server's beyond submitit's own variables: what torch
read when it was imported would be wrong for the job.

The server: `python -u -m hydra_plugins.memexp_launcher.preloaded --serve SOCKET FD`, its stdin
a pipe from the launcher, which starts and stops it through memexp_launcher.server. The process
that starts it binds SOCKET and hands it the listening socket as FD, so that a job that comes
before the server is ready waits for it in the socket's queue instead of finding no socket. It
stops taking jobs when that pipe closes (the sweep ended, or its process died), and exits once
its running jobs have ended. Its loop runs in one thread, and no other Python thread runs there,
so a fork never copies a lock one of them holds (torch's import leaves one idle native thread; a
fork copies only the thread that forks).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading

from hydra_plugins.memexp_launcher import job
from hydra_plugins.memexp_launcher.server import SOCKET_VARIABLE
from memexp import permanent_imports

# Read after the fork, or by the job itself, never by an import: what submitit's controller
# sets for each task, and what memexp's main sets around Hydra's (memexp.errors.main).
JOB_OWN_VARIABLES = ("SUBMITIT_", "CUDA_VISIBLE_DEVICES", "HYDRA_FULL_ERROR")
# What the client passes on to the job; the rest keep their default action.
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
MESSAGE_BYTES = 1 << 20


def fresh_interpreter(argv: list[str], why: str) -> None:
    """Run the job as a fresh process: replace this one with memexp's job module. The time-out
    signal stays blocked across the exec (a pending one with it), as job.py would hold it."""
    print(f"memexp: this job starts a fresh interpreter: {why}", file=sys.stderr, flush=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(PASSED_ON) - {job.timeout_signal()})
    os.execv(sys.executable, [sys.executable, "-u", "-m", job.__name__, *argv])


def client(argv: list[str]) -> None:
    # Signals wait until the job exists to take them (the job holds its time-out signal back
    # from its first line, as a fresh one does: see job.py).
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    path = os.environ.get(SOCKET_VARIABLE)
    if not path:
        fresh_interpreter(argv, f"{SOCKET_VARIABLE} is not set")
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.connect(path)
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(server.recv(MESSAGE_BYTES) or b'{"refused": "the server is gone"}')
    except OSError as error:
        fresh_interpreter(argv, f"no preloaded server answered at {path} ({error})")
    if "refused" in reply:
        fresh_interpreter(argv, reply["refused"])
    pid = reply["pid"]

    def pass_on(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended; its status is on the way
            os.kill(pid, signum)

    for signum in PASSED_ON:
        signal.signal(signum, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    ended = server.recv(MESSAGE_BYTES)
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)  # nothing left to pass them on to
    if not ended:
        os.kill(pid, signal.SIGKILL)
        raise SystemExit(f"memexp: the preloaded server went away while job {pid} ran; the job "
                         "was killed")
    status = json.loads(ended)["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        with contextlib.suppress(OSError):  # SIGKILL's action cannot be set, nor needs to be
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    raise SystemExit(os.waitstatus_to_exitcode(status))


def import_time_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(JOB_OWN_VARIABLES)}


def refusal(request: dict, own_env: dict[str, str]) -> str | None:
    """Why this request needs a fresh interpreter, if it does."""
    theirs = import_time_environment(request["env"])
    if theirs != own_env:
        changed = sorted(k for k in theirs.keys() | own_env.keys()
                         if theirs.get(k) != own_env.get(k))
        return (f"its environment differs from the preloaded server's in {', '.join(changed)}, "
                "which may have been read when torch was imported")
    if request["cwd"] != os.getcwd():
        return f"it runs in {request['cwd']}, the preloaded server in {os.getcwd()}"
    return None


def run_job(request: dict, fds: list[int]) -> None:
    """In the forked child: become the job, and never return. The server's signals are
    undone first; the time-out signal stays blocked (see job.py)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd, target in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        job.hold_back()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(PASSED_ON) - {job.timeout_signal()})
        job.main(request["argv"])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # what a fresh interpreter would print, then exit 1
        sys.excepthook(*sys.exc_info())
    finally:
        # What a fresh interpreter does at its end, then the exit, whatever comes meanwhile.
        signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
        try:
            # here: memexp.errors imports Hydra, and every job's client imports this module
            from memexp.errors import exit_now

            for thread in threading.enumerate():  # one that is not a daemon is waited for
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
            exit_now(code)
        finally:
            os._exit(code)


def serve(listener_fd: int) -> None:
    # A job is forked with these blocked, so that none comes before it is ready for it. The
    # server takes none itself: a Ctrl-C is for the sweep and its jobs.
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    listener = socket.socket(fileno=listener_fd)
    listener.set_inheritable(False)  # as a socket of its own would be: no child keeps it open
    # as it was before the imports: a fresh job starts from the same, and sets the same
    own_env = import_time_environment(dict(os.environ))
    # What the imports make lives as long as any job does: frozen, a job's full collections
    # never walk it, nor touch (and so copy) its pages.
    with permanent_imports():
        job.preload()
        # torch.optim's first optimizer imports torch._dynamo (torch.optim.Optimizer.__init__):
        # 1.6 s of CPU on 2 cores that each forked job would pay again. (A job in a fresh
        # interpreter leaves it to its optimizer: imported before the run, it raised a train.py
        # run's peak RSS by 73 MiB.) Never imported by a client.
        import torch._dynamo  # noqa: F401

    if torch.cuda.is_initialized():  # a forked child could not use CUDA: no server, then
        raise SystemExit("memexp: the preloaded server initialized CUDA while importing; "
                         "jobs start fresh interpreters")
    # SIGCHLD wakes the loop up through this pipe: a job that ended is reported at once.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    clients: dict[int, socket.socket] = {}  # job pid: its client
    orphans: set[int] = set()  # jobs killed since their client died, until they are reaped
    taking = True
    while taking or clients:
        watched = [wake_read, *(c for pid, c in clients.items() if pid not in orphans),
                   *([listener, sys.stdin] if taking else [])]
        readable, _, _ = select.select(watched, [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            taking = False  # the launcher is done, or gone
            listener.close()
        for pid, conn in list(clients.items()):
            if conn in readable and not conn.recv(16):  # its client died: so does the job
                os.kill(pid, signal.SIGKILL)
                orphans.add(pid)
        while clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = clients.pop(pid, None)
            orphans.discard(pid)
            if conn is None:
                continue
            with contextlib.suppress(OSError):  # its client may be gone already
                conn.send(json.dumps({"status": status}).encode())
            conn.close()
        if taking and listener in readable:
            try:
                conn, _ = listener.accept()
            except OSError:  # out of file descriptors: the client is refused, and starts fresh
                continue
            fds: list[int] = []
            try:
                message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
                request = json.loads(message)
                why = refusal(request, own_env)
            except (OSError, ValueError):  # a client that died before it asked
                why = "its request did not come whole"
            if not why:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                try:
                    pid = os.fork()
                except OSError as error:  # out of memory or processes: it starts fresh
                    why = f"the preloaded server could not fork it ({error})"
            if why:
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"refused": why}).encode())
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for other in (listener, conn, *clients.values()):
                    other.close()
                os.close(wake_read)
                os.close(wake_write)
                run_job(request, fds)
            for fd in fds:
                os.close(fd)
            clients[pid] = conn
            try:
                conn.send(json.dumps({"pid": pid}).encode())
            except OSError:  # its client died meanwhile
                os.kill(pid, signal.SIGKILL)
                orphans.add(pid)
    os._exit(0)  # without the interpreter's finalization, seconds with torch loaded


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[3]))
    else:
        client(sys.argv[1:])
