"""`memexp estimate ... parallel=ddp|zero1|fsdp --world-size N`: one rank's peak, in one process.

The rank is traced as memexp.estimate traces one process, on torch's fake process group
(torch.testing._internal.distributed.fake_pg): its collectives return at once and move no data.
Everything else is torch's own code, as in a real run of N ranks: DistributedDataParallel's
gradient buckets, ZeroRedundancyOptimizer's partition of the optimizer state, fully_shard's
sharded parameters, its all-gathered blocks (freed after forward under reshard_after_forward),
its reduce-scatter buffers, mixed-precision gather and reduce dtypes and CPU offload. Nothing
here is a formula of ours. The collectives' results hold no values, which a trace does not read
anyway; so the estimate is of memory only. Its time does not grow with N: one rank is traced,
and fully_shard makes only the chunks of each parameter that the rank reads (Chunks).

memexp.estimate traces the ranks (`on_ranks`). Ranks hold the same memory except where torch
partitions unevenly: ZeRO's greedy partition of whole parameters can give any rank the most
optimizer state. Rank 0 is traced first; where its option names another rank as holding more
(Parallel.heaviest_rank), that rank is traced too, and the larger peak is reported, with the
rank it is.

What cannot be traced is refused before the group is made (`check_world_size`, and a rank's
`check_samples`): torch's init_process_group keeps a dict of every rank, which at a billion ranks
grows past the host's memory before any other check runs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from memexp.quiet import c_stderr_dropped

# torch's fake process-group backend (torch.testing._internal.distributed.fake_pg)
FAKE_BACKEND = "fake"


def on_fake_group() -> bool:
    """Whether this process is a rank traced by memexp estimate: the parallel options skip, or
    stand in for, what reads the data a fake group does not move."""
    return dist.get_backend() == FAKE_BACKEND


def reduce_in_place(group: dist.ProcessGroup | None, bucket):
    """DistributedDataParallel's default gradient hook, as the fake group can run it: the
    bucket (a dist.GradBucket; DDP refuses annotations as strings) averaged in place. The
    fake group's futures hold no result, which DDP's own hook returns."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    dist.all_reduce(buffer, group=group)
    reduced = torch.futures.Future()
    reduced.set_result(buffer)
    return reduced


# c10d's ProcessGroup takes its rank and size as C ints: torch refuses 2**31 ranks with a TypeError
# ("incompatible constructor arguments").
MOST_RANKS = 2**31 - 1
# The least a rank costs this process before anything is traced: init_process_group's dict of the
# world's ranks (pg_group_ranks, {rank: rank}) holds a dict entry (hash, key, value: 24 B) and an
# int (28 B) for each. tracemalloc measures 66 B a rank at 10**7 ranks (0.66 GB, torch 2.13).
RANK_BYTES = 24 + 28


def check_world_size(world_size: int) -> None:
    """Refuse a world that the fake process group cannot hold: more ranks than c10d counts, or
    than this machine's physical memory holds torch's bookkeeping of (RANK_BYTES each)."""
    if world_size > MOST_RANKS:
        raise ValueError(f"--world-size {world_size}: more ranks than torch's process groups "
                         f"count (a C int: at most {MOST_RANKS})")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if world_size * RANK_BYTES > memory:
        raise ValueError(
            f"--world-size {world_size}: more ranks than a process group can hold on this "
            f"machine: torch keeps at least {RANK_BYTES} B of bookkeeping for each rank (a dict "
            f"of the world's ranks), {world_size * RANK_BYTES / 2**30:.1f} GiB for this world, "
            f"and the machine has {memory / 2**30:.1f} GiB of memory")


class OneProcess:
    """What a trace of one process (no parallel option) is: in no process group."""

    def check_samples(self, data) -> None:
        """A process of its own takes every batch: the data's own checks suffice."""

    def joined(self) -> AbstractContextManager:
        return nullcontext()


ONE_PROCESS = OneProcess()


@dataclass(frozen=True)
class FakeRank:
    """What a trace of rank `rank` of `world_size` is: on a fake process group (fake_rank),
    joined only after its data is known to have samples for every rank."""

    rank: int
    world_size: int

    def check_samples(self, data) -> None:
        """The rank's first batch, whose indices a real run's ranks would draw (refused where
        data.batch_size x world_size is more than the training samples)."""
        next(iter(data.train_batches(0, self.rank, self.world_size)))

    def joined(self) -> AbstractContextManager:
        return fake_rank(self.rank, self.world_size)


@contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size` on a fake process group, which the parallel
    options join as they join a real one (memexp.distributed.init_process_group)."""
    if dist.is_initialized():
        raise ValueError(
            "memexp estimate with a parallel option puts this process on a fake process group "
            "of its own, and this process is already in one (under torchrun, or a group the "
            "caller made): estimate from a plain process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        _unused_parameter_warning_said()
        with _chunked_when_read():
            yield
    finally:
        dist.destroy_process_group()


@functools.cache
def _unused_parameter_warning_said() -> None:
    """A rank's DDP searches for unused parameters (memexp.techniques.parallel.DDP: the search
    keeps its first bucket layout), and torch's reducer then says, in C++ on stderr and once a
    process (TORCH_WARN_ONCE), that the search found none and costs a run time: advice for a
    run, printed into an estimate or a plan. It is said here first, on a model of one weight,
    where it is dropped."""
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(1, 1), init_sync=False,
                                              find_unused_parameters=True)
    ddp.register_comm_hook(None, reduce_in_place)
    with c_stderr_dropped():
        ddp(torch.zeros(1, 1)).sum().backward()


class Chunks(Sequence):
    """fully_shard's split of a parameter into one chunk per rank (_chunk_with_empty:
    torch.chunk's views, padded to `count` with empty tensors), each view made when it is read.
    A rank reads its own chunk and rank 0's (the padded size); made all at once, the
    `count` views of every parameter cost the trace of one rank a time that grows with N
    (0.15 s of CPU per rank for an 8B Llama), and under the trace every view is a fake tensor
    made in Python. The views are torch.chunk's: the same sizes, strides and offsets."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int):
        self.tensor, self.count, self.dim = tensor, count, dim
        self.size = tensor.size(dim)
        self.step = -(-self.size // count)  # torch.chunk's chunk size, rounded up

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        start = range(self.count)[index] * self.step
        if start < self.size or self.size == 0:  # torch.chunk makes this chunk
            return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))
        return self[0].new_empty(0)  # beyond torch.chunk's chunks: fully_shard's padding


@contextmanager
def _chunked_when_read() -> Iterator[None]:
    """fully_shard's parameters split by Chunks while this rank is traced."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    made_at_once = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = made_at_once
