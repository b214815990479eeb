"""Batches, and in-memory datasets with a deterministic, resumable batch order.

A batch is either a pair `(inputs, targets)` or a mapping of named tensors (`input_ids`,
`attention_mask`, `labels`, ...), as Hugging Face models take them. The model is called with
`inputs`, or with the mapping as keyword arguments; `labels` are the targets (see memexp.loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

Batch = tuple[Tensor, Tensor] | Mapping[str, Tensor]
# The targets of a mapping batch: Hugging Face's name, which its models compute a loss from.
LABELS = "labels"
# The label of positions and samples that count for nothing (padding): PyTorch's and Hugging
# Face's convention.
IGNORE = -100
# A number of samples, or "auto" for data.batch_size: the largest that fits (memexp.find_batch).
# OmegaConf cannot type a union, so the data builders check it (check_batch_sizes).
BatchSize = int | str


def map_inputs(batch: Batch, change: Callable[[Tensor], Tensor]) -> Batch:
    """`batch` with `change` applied to what the model gets (targets and labels untouched)."""
    if isinstance(batch, Mapping):
        return {key: value if key == LABELS else change(value) for key, value in batch.items()}
    inputs, targets = batch
    return change(inputs), targets


def map_batch(batch: Batch, change: Callable[[Tensor], Tensor]) -> Batch:
    """`batch` with `change` applied to every tensor."""
    if isinstance(batch, Mapping):
        return {key: change(value) for key, value in batch.items()}
    return tuple(change(tensor) for tensor in batch)


def targets_of(batch: Batch) -> Tensor | None:
    """The second element of a pair, or a mapping's `labels` (None without)."""
    return batch.get(LABELS) if isinstance(batch, Mapping) else batch[1]


def check_batch_sizes(batch_size: BatchSize, eval_batch_size: BatchSize) -> None:
    for key, value in (("data.batch_size", batch_size), ("data.eval_batch_size", eval_batch_size)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive number of samples "
                             "(data.batch_size=auto is resolved before the data is built)")


def batch_indices(size: int, batch_size: int, seed: int, start: int = 0, rank: int = 0,
                  world_size: int = 1) -> Iterator[Tensor]:
    """The sample indices of micro-batches `start`, `start + 1`, ... forever, of a set of `size`.

    Batch k is a pure function of (seed, k): epoch e = k // batches_per_epoch is a permutation
    drawn from a generator seeded with (seed, e), so a resumed run sees exactly what an
    uninterrupted run would have seen. With `world_size` ranks, each global batch of
    `batch_size * world_size` samples is split into contiguous per-rank slices, so N ranks see
    the same samples as one process at N times the batch."""
    global_batch = batch_size * world_size
    if global_batch > size:
        raise ValueError(f"data.batch_size={batch_size} x {world_size} rank(s) is more than the "
                         f"{size} training samples")
    per_epoch = size // global_batch
    epoch, index = divmod(start, per_epoch)
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(size, generator=generator)
        for i in range(index, per_epoch):
            first = (i * world_size + rank) * batch_size
            yield order[first : first + batch_size]
        epoch, index = epoch + 1, 0


def eval_indices(size: int, eval_batch_size: int, rank: int = 0,
                 world_size: int = 1) -> Iterator[Tensor]:
    """The whole eval set once, in order; rank r takes every world_size-th batch."""
    for first in range(rank * eval_batch_size, size, world_size * eval_batch_size):
        yield torch.arange(first, min(first + eval_batch_size, size))


class Data(Protocol):
    """What the trainer reads from a `data` option."""

    batch_size: int
    eval_batch_size: int
    unit: str  # what throughput counts: samples, or tokens
    items_per_sample: int  # units per sample (tokens per sequence)

    def train_batches(self, start: int = 0, rank: int = 0,
                      world_size: int = 1) -> Iterator[Batch]:
        """Micro-batches from number `start` on, forever."""

    def eval_batches(self, rank: int = 0, world_size: int = 1) -> Iterator[Batch]: ...

    def first_batch(self) -> Batch:
        """The first training micro-batch, made in this process (for checks before a run)."""


@dataclass
class Split:
    """Samples as `(inputs, targets)` pairs."""

    inputs: Tensor
    targets: Tensor

    def __len__(self) -> int:
        return len(self.targets)

    def take(self, index: Tensor) -> Batch:
        return self.inputs.index_select(0, index), self.targets.index_select(0, index)


@dataclass
class Columns:
    """Samples as named tensors of one length (`input_ids`, `attention_mask`, `labels`)."""

    tensors: dict[str, Tensor]

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def take(self, index: Tensor) -> Batch:
        return {key: value.index_select(0, index) for key, value in self.tensors.items()}


def unchanged(inputs: Tensor) -> Tensor:
    return inputs


class TensorData:
    """A train and an eval split held in host memory, batched by `batch_indices`. `decode`
    turns stored inputs into what the model gets (uint8 pixels into normalized floats)."""

    def __init__(
        self,
        train: Split | Columns,
        eval: Split | Columns,
        batch_size: int,
        eval_batch_size: int,
        seed: int,
        unit: str = "samples",
        items_per_sample: int = 1,
        decode: Callable[[Tensor], Tensor] = unchanged,
    ):
        check_batch_sizes(batch_size, eval_batch_size)
        self.train, self.eval = train, eval
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.seed = seed
        self.unit, self.items_per_sample = unit, items_per_sample
        self.decode = decode

    def train_batches(self, start: int = 0, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        for index in batch_indices(len(self.train), self.batch_size, self.seed, start, rank,
                                   world_size):
            yield self._take(self.train, index)

    def eval_batches(self, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        for index in eval_indices(len(self.eval), self.eval_batch_size, rank, world_size):
            yield self._take(self.eval, index)

    def first_batch(self) -> Batch:
        return next(self.train_batches())

    def _take(self, split: Split | Columns, index: Tensor) -> Batch:
        # Copies, never views: a batch is what a device would receive, and a view would make a
        # memory tracker count the whole host-side dataset behind it.
        return map_inputs(split.take(index), self.decode)
