"""Shared fixtures: the real configs, composed with Hydra's compose API and shrunk for CPU."""

from __future__ import annotations

# ruff: noqa: E402  (the imports below come after the collector is turned off)
import gc

# Python's collector stays off while this module and the test modules import torch,
# transformers and the rest, until the tests are collected (collected()): what
# memexp.permanent_imports does for train.py, across pytest's hooks.
gc.disable()

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from memexp import cudatrace
from memexp.distributed import destroy_process_group
from memexp.estimate import compose_config

REPO = Path(__file__).resolve().parents[1]
# The same for the runs tests start (train.py, sweeps, SLURM jobs inherit it), unless set.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Small, quiet runs: tests check behaviour, not speed.
CPU_SMALL = ["trainer.device=cpu", "trainer.progress=false", "trainer.warmup_steps=1"]
# Hugging Face models from small configs (random weights, nothing downloaded), on small data.
HF_DATA = ("data.batch_size=4", "data.num_train=32", "data.num_eval=8", "data.seq_len=32")
HF_GPT2 = ("model=hf", "model.arch=gpt2", "model.task=causal_lm", "+model.config.n_layer=2",
           "+model.config.n_embd=32", "+model.config.n_head=2", "+model.config.vocab_size=64",
           "+model.config.n_positions=64", *HF_DATA)
HF_BERT = ("model=hf", "model.arch=bert", "model.task=sequence_classification",
           "+model.config.num_hidden_layers=2", "+model.config.hidden_size=32",
           "+model.config.num_attention_heads=2", "+model.config.intermediate_size=64",
           "+model.config.vocab_size=64", "+model.config.max_position_embeddings=64", *HF_DATA)

# The CUDA build of torch that `--target cuda` traces with (memexp.cudatrace): tests marked
# `cudabuild` need it and are skipped without it, or under MEMEXP_CUDA_PYTHON=none.
CUDA_PYTHON = cudatrace.cuda_python() if os.environ.get("MEMEXP_CUDA_PYTHON") != "none" else None
needs_cuda_build = pytest.mark.skipif(
    CUDA_PYTHON is None, reason="needs the CUDA build of torch: run `make cuda-estimator`")


@pytest.fixture(autouse=True, scope="session")
def one_thread() -> Iterator[None]:
    """The tests' models are small: a second intra-op thread only adds synchronisation, and
    while other processes keep both cores busy its spin-waits made steps several times slower
    (tests/test_any_model.py: 0.28x the wall time with one thread, at load 12). Runs in
    subprocesses (train.py, ranks) keep torch's own choice."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_process_group_left() -> Iterator[None]:
    """A test whose in-process run joins a one-rank group (parallel=fsdp built by a Trainer, or
    refused after it was built) leaves it joined; the next test's estimate with a parallel
    option would then refuse to join its fake group ("already in one")."""
    yield
    destroy_process_group()


# -- slow work started at the session's start ----------------------------------------------------
# The tests run one at a time, in one thread, and so do the runs they start (OMP_NUM_THREADS=1):
# on 2 cores, one is idle most of the time. Sweeps whose tests only read what they left start as
# soon as the session's tests are known, one at a time in a lane of their own beside the tests
# before theirs; a test that comes to one not started yet runs it itself. SLURM's sweeps, which
# mostly wait for the cluster's timers, start at once, outside the lane.
#
# Under pytest-xdist (`make test`: 2 workers, --dist loadfile) the workers keep both cores busy
# instead. Each worker collects every test but runs the files the controller sends it, so no
# lane starts there: a file's early work runs at the first of its tests that reads it, in the
# worker that runs the file. Work that mostly waits (lane=False: SLURM's sweeps) still starts at
# once, whichever worker will read it: in a folder that the workers share (SHARED, made by the
# controller), which its `start(folder)` claims, so that one worker starts it and the others
# read what it leaves there.
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
SHARED = "MEMEXP_TESTS_SHARED"


class Early:
    """Slow work behind a module-scoped fixture (`early`): `start(folder)` starts it and returns
    an object whose `result()` waits for it and gives the fixture's value, and whose `stop()`
    ends what of it still runs (a session stopped early). Shared work (lane=False, under xdist)
    also has `wait()`, until it ends on its own: another worker may still read it."""

    def __init__(self, start: Callable[[Path], object], lane: bool):
        self.start, self.lane = start, lane
        self.shared = XDIST_WORKER and not lane
        self.started: object | None = None
        self.lock = threading.Lock()

    def begin(self) -> object:
        """Start it where it has not started (the lane, or a test before the lane got to it)."""
        with self.lock:
            if ENDED.is_set():
                raise RuntimeError("the session has ended: no early work starts now")
            if self.started is None:
                if self.shared:
                    folder = Path(os.environ[SHARED]) / self.start.__name__
                    folder.mkdir(exist_ok=True)
                else:
                    folder = Path(tempfile.mkdtemp(prefix=f"{self.start.__name__}-",
                                                   dir=EARLY_ROOT))
                self.started = self.start(folder)
            return self.started


EARLY: dict[str, Early] = {}
EARLY_ROOT = tempfile.mkdtemp(prefix="memexp-tests-early-")
LANE: queue.Queue[Early | None] = queue.Queue()
ENDED = threading.Event()  # set at the session's end: nothing starts after it


def early(lane: bool = True):
    """A module-scoped fixture, named as the decorated `start(folder)`, whose work begins when
    the session's tests are known (pytest_collection_finish) where a selected test uses it: in
    the lane where `lane` (it keeps a core busy), at once otherwise (it mostly waits)."""

    def register(start: Callable[[Path], object]):
        assert start.__name__ not in EARLY, f"two early fixtures named {start.__name__}"
        EARLY[start.__name__] = work = Early(start, lane)

        @pytest.fixture(scope="module", name=start.__name__)
        def fixture():
            return work.begin().result()

        return fixture

    return register


def run_lane() -> None:
    """The lane's work, one at a time: each to its end before the next begins."""
    while (work := LANE.get()) is not None:
        try:
            work.begin().result()
        except BaseException:  # a failure (or a skip) is the test's to report, when it reads it
            pass


def collected() -> None:
    """The imports are done: what they made is frozen, and the collector back on."""
    gc.freeze()
    gc.enable()


def pytest_configure(config: pytest.Config) -> None:
    if not XDIST_WORKER and config.getoption("numprocesses", None):  # xdist's controller
        os.environ[SHARED] = tempfile.mkdtemp(prefix="memexp-tests-shared-")  # workers inherit it
        collected()  # it collects no tests


def pytest_collection_finish(session: pytest.Session) -> None:
    collected()
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    chosen = [work for name, work in EARLY.items() if name in used]
    if XDIST_WORKER:
        for work in chosen:
            if work.shared:
                work.begin()
        return
    for work in chosen:
        if work.lane:
            LANE.put(work)
        else:
            work.begin()
    LANE.put(None)
    threading.Thread(target=run_lane, name="early lane", daemon=True).start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """What of the early work still runs (the session stopped before its tests) ends here;
    shared work first ends on its own, unless the session was interrupted."""
    ENDED.set()
    for work in EARLY.values():
        with work.lock:
            if work.started is not None:
                if work.shared and exitstatus != pytest.ExitCode.INTERRUPTED:
                    work.started.wait()
                work.started.stop()
    shutil.rmtree(EARLY_ROOT, ignore_errors=True)
    if not XDIST_WORKER and SHARED in os.environ:
        shutil.rmtree(os.environ[SHARED], ignore_errors=True)


class Background:
    """A command started in its own session (a test's signal to its own process group never
    reaches it), its output in files; `result()` is its CompletedProcess."""

    def __init__(self, command: list[str], folder: Path, env: dict, timeout: float = 400):
        self.command, self.timeout = command, timeout
        self.out, self.err = folder / "stdout", folder / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, cwd=folder,
                                            env=env, start_new_session=True)

    def result(self) -> subprocess.CompletedProcess:
        code = self.process.wait(timeout=self.timeout)
        return subprocess.CompletedProcess(self.command, code, self.out.read_text(),
                                           self.err.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class Ran:
    """Background work in `folder`: result() is (folder, its CompletedProcess)."""

    def __init__(self, folder: Path, started: Background):
        self.folder, self.started = folder, started

    def result(self) -> tuple[Path, subprocess.CompletedProcess]:
        return self.folder, self.started.result()

    def stop(self) -> None:
        self.started.stop()


class Together:
    """Pieces of background work started at once, behind one fixture: result() is
    {name: its result()}."""

    def __init__(self, started: dict[str, Ran]):
        self.started = started

    def result(self) -> dict:
        return {name: started.result() for name, started in self.started.items()}

    def stop(self) -> None:
        for started in self.started.values():
            started.stop()


def compose_train(*overrides: str) -> DictConfig:
    return compose_config([*CPU_SMALL, *overrides])


def job(run_dir: Path, *overrides: str) -> dict:
    """One run as train.py runs it (a resolved config, its folder held and checked first:
    memexp.app.run_job), in this process; with trainer.nproc=N, its N ranks are spawned from
    this process, as train.py spawns them (without train.py's own interpreter start)."""
    from memexp.app import Job, run_job

    config = OmegaConf.to_container(compose_train(*overrides), resolve=True, enum_to_str=True)
    return run_job(Job(config, run_dir, {}, list(overrides), run_dir.name),
                   config["trainer"]["nproc"])


def run_train_py(tmp_path: Path, *overrides: str,
                 timeout: float = 180) -> subprocess.CompletedProcess:
    """`python train.py` in a subprocess, its run folder under tmp_path/run."""
    return subprocess.run(train_py(tmp_path, overrides), capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, env=TRAIN_PY_ENV)


def start_train_py(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    """run_train_py, started and left running; its output goes to tmp_path/train_py.log."""
    with open(tmp_path / "train_py.log", "ab") as log:
        return subprocess.Popen(train_py(tmp_path, overrides), stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp_path, env=TRAIN_PY_ENV,
                                preexec_fn=default_sigint)


def default_sigint() -> None:
    """SIGINT as a terminal gives it. A shell script's background job (`make test &`) starts
    with SIGINT ignored, which its children inherit: Python then installs no KeyboardInterrupt
    handler, and a test's SIGINT would be ignored, as that shell asked."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


TRAIN_PY_ENV = {**os.environ, "HYDRA_FULL_ERROR": "0", "WANDB_MODE": "offline"}


def train_py(tmp_path: Path, overrides: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp_path / 'run'}",
            *overrides]


def submitit_log_lines(sweep_dir: Path, says: str) -> list[str]:
    """The lines of the sweep's submitit job logs that say `says`, in submitit's own format
    (once Hydra configured logging in a job, it repeats each of them in its own format)."""
    return [line for path in sorted(sweep_dir.glob(".submitit/*/*_log.out"))
            for line in path.read_text().splitlines()
            if line.startswith("submitit ") and says in line]


def processes() -> Iterator[tuple[int, int, list[bytes]]]:
    """Each process: (its pid, its parent's, its command line's arguments); one that ends while
    it is read is left out."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(proc.name), ppid, argv


def preloaded_server_of(parent: int) -> int | None:
    """The preloaded server process `parent` started (`... preloaded --serve SOCKET FD`)."""
    return next((pid for pid, ppid, argv in processes() if ppid == parent and b"--serve" in argv),
                None)


def freeze(pid: int) -> None:
    """SIGSTOP, and return once it took effect; raise where the process died instead."""
    os.kill(pid, signal.SIGSTOP)
    while (state := Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]) != "T":
        if state in "ZX":
            raise AssertionError(f"process {pid} died before it could be frozen")
        time.sleep(0.001)


def train(*overrides: str, steps: int = 1):
    """A short run of the composed config: (the Trainer, with its meter, and the Metrics)."""
    from memexp.loggers import NoLogger
    from memexp.trainer import Trainer

    trainer = Trainer(compose_train(f"trainer.max_steps={steps}", *overrides))
    return trainer, trainer.fit(NoLogger())


def step_memory(*overrides: str, steps: int = 1) -> dict:
    """The meter's report over `steps` training steps alone (no evaluation)."""
    from memexp.trainer import Trainer

    trainer = Trainer(compose_train(*overrides))
    batches = trainer.data.train_batches()
    trainer.model.train()
    with trainer.meter:
        for _ in range(steps):
            trainer.train_step(batches)
    return trainer.meter.report()


def first_step_gradients(*overrides: str):
    """The gradients of the first optimizer step, in parameter order (wrappers such as
    checkpointing's keep the order, though they rename parameters)."""
    from memexp.trainer import Trainer

    trainer = Trainer(compose_train("memory.track=false", *overrides))
    grads: dict[int, torch.Tensor] = {}
    params = list(trainer.model.parameters())
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(
            lambda p, index=index: grads.__setitem__(index, p.grad.detach().clone()))
    trainer.model.train()
    trainer.train_step(trainer.data.train_batches())
    return trainer, [grads[i] for i in range(len(params)) if i in grads]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """|actual - expected| / |expected|, as norms over the whole tensor."""
    scale = expected.double().norm().clamp_min(1e-30)
    return float((actual.double() - expected.double()).norm() / scale)


def max_relative_error(actual: list, expected: list) -> float:
    assert len(actual) == len(expected)
    return max(relative_error(a, e) for a, e in zip(actual, expected, strict=True))


def write_tiny_cifar10(root: Path, per_batch: int = 20) -> Path:
    """The CIFAR-10 python-version layout, with `per_batch` random images per file."""
    import pickle

    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, per_batch).tolist(),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
    return root


def write_idx(path: Path, array) -> None:
    import numpy as np

    codes = {np.dtype(np.uint8): 0x08}
    header = bytes([0, 0, codes[array.dtype], array.ndim])
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + dims + array.tobytes())


def write_tiny_mnist(root: Path, count: int = 40, gz: bool = False) -> Path:
    """MNIST IDX files (optionally gzipped) with `count` random digits per split."""
    import gzip

    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "t10k"):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            path = root / f"{split}-{kind}-ubyte"
            write_idx(path, array)
            if gz:
                gz_path = path.with_name(path.name + ".gz")
                gz_path.write_bytes(gzip.compress(path.read_bytes()))
                path.unlink()
    return root


@contextmanager
def small_filesystem(folder: Path, size: str = "256k") -> Iterator[Path]:
    """A real tmpfs of `size` mounted at `folder`, unmounted at the end (`fill` fills it). Skips
    the test where mounting is not allowed (it needs root)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full filesystem needs a tmpfs mount, refused here: "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Write `folder`'s filesystem full: every later write there fails with ENOSPC."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
