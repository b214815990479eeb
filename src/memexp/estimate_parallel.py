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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

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
        with _chunked_when_read():
            yield
    finally:
        dist.destroy_process_group()


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
