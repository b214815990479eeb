"""In-memory datasets with a deterministic, resumable batch order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

Batch = tuple[Tensor, Tensor]
# A number of samples, or "auto" for data.batch_size: the largest that fits (memexp.find_batch).
# OmegaConf cannot type a union, so the data builders check it (TensorData).
BatchSize = int | str


@dataclass
class Split:
    inputs: Tensor
    targets: Tensor

    def __len__(self) -> int:
        return len(self.targets)


def unchanged(inputs: Tensor) -> Tensor:
    return inputs


class TensorData:
    """A train and an eval split held in host memory.

    Batch k of a run is a pure function of (seed, k): epoch e = k // batches_per_epoch is a
    permutation drawn from a generator seeded with (seed, e). A resumed run asks for
    `train_batches(start=k)` and sees exactly what an uninterrupted run would have seen. With
    `world_size` ranks, each global batch of `batch_size * world_size` samples is split into
    contiguous per-rank slices, so N ranks see the same samples as one process at N times the batch.
    """

    def __init__(
        self,
        train: Split,
        eval: Split,
        batch_size: int,
        eval_batch_size: int,
        seed: int,
        unit: str = "samples",
        items_per_sample: int = 1,
        decode: Callable[[Tensor], Tensor] = unchanged,
    ):
        for key, value in (("data.batch_size", batch_size),
                           ("data.eval_batch_size", eval_batch_size)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{key}={value!r}: must be a positive number of samples "
                                 "(data.batch_size=auto is resolved before the data is built)")
        if not 0 <= seed < 2**32:  # each epoch's generator is seeded with seed * 1_000_003 + epoch
            raise ValueError(f"data.seed={seed}: must be an integer from 0 to 2**32 - 1")
        self.train, self.eval = train, eval
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.seed = seed
        self.unit, self.items_per_sample = unit, items_per_sample
        self.decode = decode

    def batches_per_epoch(self, world_size: int = 1) -> int:
        global_batch = self.batch_size * world_size
        if global_batch > len(self.train):
            raise ValueError(
                f"data.batch_size={self.batch_size} x {world_size} rank(s) is more than the "
                f"{len(self.train)} training samples"
            )
        return len(self.train) // global_batch

    def train_batches(self, start: int = 0, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """Micro-batches from number `start` on, forever."""
        per_epoch = self.batches_per_epoch(world_size)
        epoch, index = divmod(start, per_epoch)
        while True:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.train), generator=generator)
            for i in range(index, per_epoch):
                first = (i * world_size + rank) * self.batch_size
                yield self._take(self.train, order[first : first + self.batch_size])
            epoch, index = epoch + 1, 0

    def eval_batches(self, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """The whole eval split once, in order; rank r takes every world_size-th batch."""
        for first in range(rank * self.eval_batch_size, len(self.eval),
                           world_size * self.eval_batch_size):
            last = min(first + self.eval_batch_size, len(self.eval))
            yield self._take(self.eval, torch.arange(first, last))

    def _take(self, split: Split, index: Tensor) -> Batch:
        # Copies, never views: a batch is what a device would receive, and a view would make a
        # memory tracker count the whole host-side dataset behind it.
        return (self.decode(split.inputs.index_select(0, index)),
                split.targets.index_select(0, index))
