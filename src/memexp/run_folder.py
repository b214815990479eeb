"""A run folder: held by one process at a time, and read before a rerun writes anything in it.

- `hold(folder)` (or `lock`): an exclusive lock (flock) on `<folder>/.memexp.lock` for as long
  as the run goes. A second process that would train, or run a sweep, in the same folder is
  refused: two would resume from each other's checkpoints and interleave their records. The OS
  releases the lock when its process ends, however it ends, so a killed run never leaves a
  stale lock.
- `finished_run(folder, config)`: what a rerun finds. Nothing to resume: it trains. A checkpoint
  of its own config with steps left: it resumes. The same run, finished `ok` at exactly
  trainer.max_steps, its record reporting the steps of that very checkpoint: there is nothing
  to train, and its record is returned and kept as it is. Anything else (a checkpoint of
  another config, or one at or past trainer.max_steps without that finished record) is refused
  before anything is written, so the folder's result.json is never replaced by a rerun that
  trained nothing, nor passed off as a run it is not. (Trainer.load_checkpoint refuses the rest
  before the run writes anything: a checkpoint that does not load into the run.)
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from memexp import checkpoint, errors
from memexp.result import RECORD, BadRecord, finite, load_record

LOCK = ".memexp.lock"


class FolderInUse(errors.Refused, RuntimeError):
    """Another live process holds this run or sweep folder."""


def lock(folder: Path, what: str = "run") -> int:
    """Take `folder`'s lock (creating the folder); returns the file descriptor that holds it,
    until it is closed or the process ends. FolderInUse if another process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise FolderInUse(
            f"{folder} is in use by another {what} ({holder}). Two in one folder would resume "
            "from each other's checkpoints and mix their records. Wait for it to end, or give "
            f"this {what} its own folder (hydra.run.dir=... or hydra.sweep.dir=...).") from None
    with suppress(OSError):  # who holds it, for the refusal's message; a full disk may not
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    return fd


@contextmanager
def hold(folder: Path, what: str = "run") -> Iterator[None]:
    """Hold `folder` until the block ends."""
    fd = lock(folder, what)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def finished_run(folder: Path, config: dict) -> dict | None:
    """The folder's record when it holds this very run, finished: a rerun has nothing to do.
    None when the rerun is to train (from scratch, or from its own checkpoint); ResumeRefused
    when it must not. `config` is the run's resolved config."""
    if config["trainer"]["resume"] != "auto":
        return None
    found = checkpoint.load_newest(folder / checkpoint.FOLDER, mmap=True)
    if found is None:
        return None
    path, state = found
    try:
        record = load_record(folder / RECORD)
    except BadRecord:  # none, or unreadable: it cannot be a finished run's
        record = None
    mine = checkpoint.fingerprint_against(state, config)
    if (record is not None and record["status"] == "ok" and mine == state.get("config")
            and checkpoint.fingerprint(record.get("config") or {}) == mine
            and state["step"] == config["trainer"]["max_steps"]):
        if records(record, state):
            return record
        # A later run in this folder replaced the record and left the checkpoint (it wrote
        # none as late as this one): the record is another run's, not this run's result.
        raise checkpoint.ResumeRefused(
            f"{path} ends a run of this config at step {state['step']}, but "
            f"{folder / RECORD} is not that run's record (it records "
            f"{record['metrics'].get('steps')} steps): a later run in this folder replaced it. "
            f"A run resumed from the checkpoint would train nothing. {checkpoint.WHAT_TO_DO}")
    checkpoint.check_resumable(path, state, config)
    return None


def records(record: dict, state: dict) -> bool:
    """`record` reports the steps that checkpoint `state` trained, and no others: the same
    losses (as result.json holds them: NaN as null), from the same resumed steps."""
    saved, reported = finite(state["metrics"]), record["metrics"]
    return all(reported.get(key) == saved.get(key) for key in ("losses", "resumed_from"))

