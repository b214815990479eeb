"""Work done in forked copies of this process, a few at a time, each result as it comes.

memexp plan traces its candidates in parallel where cores are free. A fork starts at once with
everything the planner has imported and composed (a fresh interpreter spends seconds importing
torch, transformers and the techniques first). The planner forks before it has run any kernel
(it builds models on the meta device only): a fork copies only the thread that forks, and
OpenMP's threads, once started, would be copied as locks held by no one. Each worker runs its
tasks one after another with one intra-op thread: the cores are the workers'.

A Ctrl-C is the planner's: the workers ignore it, and `close()` ends them (SIGTERM).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait

import torch

from memexp import permanent_imports

# What a worker needs beyond the planner's own memory: an 8B model's fake trace reaches about
# 1.5 GiB of host memory (its Python objects; the tensors hold no data).
WORKER_BYTES = 2 * 2**30


def free_cores() -> int:
    """The processors this process may run on, less none: the planner itself only waits."""
    return len(os.sched_getaffinity(0))


def workers_for(tasks: int) -> int:
    """How many workers to fork for `tasks` tasks: one a core, as the memory available
    allows (at least one)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(tasks, free_cores(), available // WORKER_BYTES))


class Failed(Exception):
    """A task raised in its worker: its error, and the worker's traceback as text."""

    def __init__(self, error: BaseException, text: str):
        super().__init__(str(error))
        self.error, self.text = error, text


def _serve(tasks: Connection) -> None:
    """A worker's loop: a task (a function and its arguments) in, its result or error out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    while True:
        try:
            key, function, args = tasks.recv()
        except EOFError:  # the planner is done
            return
        try:
            reply = (key, True, function(*args))
        except Exception as error:  # the planner decides what a failure means
            reply = (key, False, (error, traceback.format_exc()))
        try:
            tasks.send(reply)
        except Exception as error:  # an unpicklable result or error: say so, as text
            tasks.send((key, False, (RuntimeError(f"{type(error).__name__}: {error}"),
                                     traceback.format_exc())))


class Pool:
    """`size` forked workers; `submit` queues a task, `results` yields each (key, result) as
    a worker finishes it, a Failed in place of the result of one that raised."""

    def __init__(self, size: int):
        # torch.optim's first optimizer imports torch._dynamo (as the preloaded launcher's server
        # says): 1 s of CPU here, instead of in every worker.
        with permanent_imports():
            import torch._dynamo  # noqa: F401
        context = multiprocessing.get_context("fork")
        self.idle: list[Connection] = []
        self.busy: dict[Connection, object] = {}
        self.processes = []
        self.queue: deque = deque()
        for _ in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.idle.append(ours)

    def submit(self, key, function: Callable, *args, first: bool = False) -> None:
        """Queue `function(*args)` (at the front with `first`)."""
        task = (key, function, args)
        self.queue.appendleft(task) if first else self.queue.append(task)
        self._hand_out()

    def drop(self, unwanted: Callable[[object], bool]) -> None:
        """Take the queued tasks whose key is `unwanted` out of the queue."""
        self.queue = deque(task for task in self.queue if not unwanted(task[0]))

    def _hand_out(self) -> None:
        while self.idle and self.queue:
            connection = self.idle.pop()
            task = self.queue.popleft()
            connection.send(task)
            self.busy[connection] = task[0]

    @property
    def pending(self) -> int:
        return len(self.queue) + len(self.busy)

    def results(self) -> Iterator[tuple[object, object]]:
        """Each finished task's key and result, until none is queued or running. Tasks
        submitted meanwhile are waited for too."""
        while self.busy:
            for connection in wait(list(self.busy)):
                key = self.busy.pop(connection)
                try:
                    key, ok, result = connection.recv()
                except (EOFError, OSError):  # its worker died (killed, out of memory)
                    connection.close()
                    if not self.idle and not self.busy and self.queue:
                        raise RuntimeError("memexp plan's workers died") from None
                    self._hand_out()
                    yield key, Failed(RuntimeError("its worker died"), "")
                    continue
                self.idle.append(connection)
                # what the caller makes of the result (tasks dropped, or put first) before
                # the next is handed out
                yield key, result if ok else Failed(*result)
                self._hand_out()

    def close(self) -> None:
        """End the workers (whatever they are doing) and reap them."""
        for connection in [*self.idle, *self.busy]:
            connection.close()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
