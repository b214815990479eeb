"""Local sweep jobs forked from the preloaded server (hydra_plugins.memexp_launcher.preloaded),
through submitit's real local executor: each job is a process of its own, forked from a server
that imported torch once; a job that comes before the server is ready waits for it; a job
whose client dies dies too; a job whose environment differs from the server's, or whose
server died or never started, starts a fresh interpreter. Sweeps, time-outs and killed jobs on
this path are tested in test_sweep.py and test_reliability.py (it is the local launcher's
default)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import submitit

from hydra_plugins.memexp_launcher.launcher import PRELOADED_JOB_PYTHON
from hydra_plugins.memexp_launcher.server import SOCKET_VARIABLE, PreloadedServer, start_server

from conftest import REPO, freeze, processes

pytestmark = pytest.mark.slow


def where_it_runs() -> dict:
    """Run as a job: what its process is, and what it found loaded."""
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    return {"pid": os.getpid(), "parent": [a.decode() for a in parent if a],
            "torch_loaded": "torch" in sys.modules, "threads": os.environ.get("OMP_NUM_THREADS"),
            # torch.optim's first optimizer imports it: the server does, for every job
            "dynamo_loaded": "torch._dynamo" in sys.modules}


def wait_forever(pid_file: str) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(3600)


@pytest.fixture
def executor(tmp_path, monkeypatch):
    # this module, in the jobs; then the caller's own PYTHONPATH (a checkout's src/ ahead of an
    # installed memexp, as in the sweeps of test_sweep.py)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, (str(Path(__file__).parent), os.environ.get("PYTHONPATH")))))
    monkeypatch.chdir(tmp_path)
    local = submitit.LocalExecutor(folder=tmp_path / "submitit", python=PRELOADED_JOB_PYTHON)
    local.update_parameters(timeout_min=10)
    return local


def test_a_job_is_forked_from_the_preloaded_server(executor):
    with contextlib.closing(PreloadedServer()):
        first, second = (executor.submit(where_it_runs).result() for _ in range(2))
    for job in (first, second):
        assert "--serve" in job["parent"] and job["torch_loaded"] and job["dynamo_loaded"]
    assert first["pid"] != second["pid"]  # a process per job
    assert first["parent"] == second["parent"]  # from the same server


def test_a_job_that_comes_before_the_server_is_ready_waits_for_it(executor):
    """The server is frozen as soon as it started, before it is ready: the job's client finds
    its socket bound already (by the process that started it) and waits in its queue, to be
    forked from it once it runs (a fresh interpreter, were the socket not there yet)."""
    with contextlib.closing(PreloadedServer()) as server:
        with queued_while_frozen(executor, server) as job:
            os.kill(server.pid, signal.SIGCONT)
        ran = job.result()
    assert "--serve" in ran["parent"] and ran["torch_loaded"]


def test_a_job_waiting_for_a_server_that_dies_starts_a_fresh_interpreter(executor):
    with contextlib.closing(PreloadedServer()) as server:
        with queued_while_frozen(executor, server) as job:
            os.kill(server.pid, signal.SIGKILL)  # died while importing (out of memory, say)
        ran = job.result()
    assert "--serve" not in ran["parent"]
    assert "starts a fresh interpreter: no preloaded server answered" in job.stderr()


@contextlib.contextmanager
def queued_while_frozen(executor, server: PreloadedServer) -> Iterator[submitit.Job]:
    """A job submitted while `server` is frozen, once its client waits in the server's queue.
    The server stays frozen in the block, and is killed if the block fails."""
    path = os.environ[SOCKET_VARIABLE]
    assert stat.S_ISSOCK(os.stat(path).st_mode)  # bound before the server runs a line
    try:
        freeze(server.pid)
        job = executor.submit(where_it_runs)
        deadline = time.monotonic() + 300
        while not (queued_on(path) or job.done()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queued_on(path), job.stderr()
        yield job
    except BaseException:
        server.discard()
        raise


def queued_on(path: str) -> bool:
    """A connection to the listening socket at `path` waits to be accepted (/proc/net/unix:
    state 02, connecting)."""
    return any(line.split()[5] == "02" and line.split()[-1] == path
               for line in Path("/proc/net/unix").read_text().splitlines()[1:])


def test_a_socket_that_cannot_be_bound_leaves_the_jobs_to_fresh_interpreters(
        executor, tmp_path, monkeypatch, caplog):
    """Where the server's socket cannot be bound (here a TMPDIR too long for a socket's path,
    107 bytes), the sweep goes on without a server, as with hydra.launcher.preload=false."""
    deep = tmp_path / ("x" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    start_server().close()  # a NoServer (Hydra's plugin scan may have made the class anew)
    assert SOCKET_VARIABLE not in os.environ
    assert "no preloaded server (AF_UNIX path too long)" in caplog.text
    job = executor.submit(where_it_runs)
    ran = job.result()
    assert "--serve" not in ran["parent"] and ran["torch_loaded"]
    assert f"starts a fresh interpreter: {SOCKET_VARIABLE} is not set" in job.stderr()


def test_an_environment_the_server_did_not_import_with_starts_a_fresh_interpreter(
        executor, monkeypatch):
    with contextlib.closing(PreloadedServer()):
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read by OpenMP when torch was imported
        job = executor.submit(where_it_runs)
        ran = job.result()
    assert "--serve" not in ran["parent"] and ran["threads"] == "2"
    assert ("starts a fresh interpreter: its environment differs from the preloaded server's "
            "in OMP_NUM_THREADS") in job.stderr()


def test_a_job_whose_client_is_killed_is_killed_too(executor, tmp_path):
    pid_file = tmp_path / "job.pid"
    with contextlib.closing(PreloadedServer()):
        job = executor.submit(wait_forever, str(pid_file))
        deadline = time.monotonic() + 300
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        forked = int(pid_file.read_text())
        client = next(pid for pid, _, argv in processes()
                      if b"hydra_plugins.memexp_launcher.preloaded" in argv
                      and any(str(executor.folder).encode() in arg for arg in argv))
        os.kill(client, signal.SIGKILL)  # what submitit's controller does at the time limit
        while Path(f"/proc/{forked}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{forked}").exists(), "the job outlived its client"
        job.cancel()


def servers_under(folder: Path) -> set[bytes]:
    """The sockets of the preloaded servers under `folder` (a sweep run with TMPDIR=folder);
    a job forked from a server, with the same command line until it ends, is not another."""
    sockets = (argv[argv.index(b"--serve") + 1] for _, _, argv in processes() if b"--serve" in argv)
    return {path for path in sockets if str(folder).encode() in path}


def test_a_sweep_that_stops_before_its_launch_leaves_no_server_behind(tmp_path):
    """train.py starts the server first; a job config that does not compose stops the sweep in
    Hydra's check, before the launch. The server, still importing, goes with the sweep's
    process: nothing holds its output or its folder afterwards."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the server's socket folder, its argv too
    with open(tmp_path / "out", "w") as out:
        done = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "model.widht=1,2",
                               f"hydra.sweep.dir={tmp_path / 'sweep'}"], stdout=out,
                              stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode != 0 and "widht" in (tmp_path / "out").read_text()
    assert servers_under(tmp_path) == set()


@pytest.mark.parametrize("preload", [True, False])
def test_train_py_starts_the_sweeps_server_first_and_the_launcher_takes_or_discards_it(
        tmp_path, preload):
    """`python train.py -m` starts the preloaded server before its own imports. The local
    launcher takes that one: one server (one socket) for the whole sweep, its jobs forked from
    it, though the sweep's process set HYDRA_FULL_ERROR since. With
    hydra.launcher.preload=false none is used, and none is left once the first job has begun
    (one job shows that: each starts a fresh interpreter)."""
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "TMPDIR": str(tmp_path), "HYDRA_FULL_ERROR": "0"}
    command = [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={sweep_dir}",
               f"hydra.launcher.preload={str(preload).lower()}",
               "optim=sgd,adamw" if preload else "optim=sgd",
               "debug=fast", "data.batch_size=8", "data.num_eval=64", "model.width=4"]
    seen, once_a_job_began = set(), set()  # the servers' sockets
    with open(tmp_path / "out", "w") as out:
        sweep = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=tmp_path)
        while sweep.poll() is None:
            began = (sweep_dir / "0" / "result.json").exists()  # before the look at /proc
            alive = servers_under(tmp_path)
            seen |= alive
            if began:
                once_a_job_began |= alive
            time.sleep(0.02)
    assert sweep.returncode == 0, (tmp_path / "out").read_text()[-3000:]
    assert len(seen) == 1  # train.py's, whether taken or discarded
    assert once_a_job_began == (seen if preload else set())
    if preload:
        logs = [p.read_text() for p in sweep_dir.glob(".submitit/*/*_log.err")]
        assert len(logs) == 2 and not any("starts a fresh interpreter" in log for log in logs)
