"""Any `torch.utils.data.Dataset`, loaded with a real DataLoader (data=dataset), and Hugging Face
`datasets` from local files (data=hf_local).

Batch order is the one in-memory sets have (memexp.data.tensors.batch_indices): a pure function
of the seed and the batch number, resumable, split across ranks, and the same whatever the number
of loader workers. Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path

from hydra.utils import get_method
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from memexp.data.tensors import (
    Batch,
    BatchSize,
    batch_indices,
    check_batch_sizes,
    check_seed,
    eval_indices,
    map_batch,
)
from memexp.errors import first_line


class _Indices:
    """A batch sampler over precomputed index batches."""

    def __init__(self, batches: Iterator[Tensor]):
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return (index.tolist() for index in self.batches)


def _own(tensor: Tensor) -> Tensor:
    return tensor.clone()


class LoaderData:
    """`train` and `eval` datasets, batched by a DataLoader.

    Training batches come from `num_workers` worker processes (started before the run's memory
    is measured); evaluation batches are collated in this process. On a run's host, worker
    batches arrive in shared memory that no op of this process made, so each is copied once
    (unless pinned for a CUDA device, where the device copy is what counts): the meter then
    counts the batch as it does without workers."""

    def __init__(self, train: Dataset, eval: Dataset | None, batch_size: int,
                 eval_batch_size: int, seed: int, num_workers: int = 0,
                 pin_memory: bool = False, collate: Callable | None = None,
                 unit: str = "samples", items_per_sample: int = 1,
                 names: tuple[str, str] = ("data.train", "data.eval")):
        check_batch_sizes(batch_size, eval_batch_size)
        check_seed(seed)
        if num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers}: must be >= 0")
        self.train, self.eval = train, eval
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.seed, self.num_workers, self.pin_memory = seed, num_workers, pin_memory
        self.collate = collate or default_collate
        self.unit, self.items_per_sample = unit, items_per_sample
        self.names = names  # the keys (and what they hold) that errors name for train and eval
        # Each set's first batch, made once here: items that do not batch into tensors fail now,
        # named, rather than at a step in torch's words (the eval set's after all the training).
        self.first_batch()
        if eval is not None:
            self._batch(eval, next(eval_indices(len(eval), eval_batch_size)), names[1])

    def _loader(self, dataset: Dataset, batches: Iterator[Tensor], workers: int) -> DataLoader:
        return DataLoader(dataset, batch_sampler=_Indices(batches), num_workers=workers,
                          pin_memory=self.pin_memory, collate_fn=self.collate)

    def train_batches(self, start: int = 0, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        indices = batch_indices(len(self.train), self.batch_size, self.seed, start, rank,
                                world_size)
        batches = iter(self._loader(self.train, indices, self.num_workers))  # workers start now
        if self.num_workers and not self.pin_memory:
            return (map_batch(batch, _own) for batch in batches)
        return batches

    def eval_batches(self, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        if self.eval is None:
            return iter(())
        indices = eval_indices(len(self.eval), self.eval_batch_size, rank, world_size)
        return iter(self._loader(self.eval, indices, 0))

    def first_batch(self) -> Batch:
        first = next(batch_indices(len(self.train), self.batch_size, self.seed))
        return self._batch(self.train, first, self.names[0])

    def _batch(self, dataset: Dataset, index: Tensor, name: str) -> Batch:
        """The items at `index`, collated, and checked to be a Batch: a pair (or tuple) or a
        mapping of tensors."""
        try:
            batch = self.collate([dataset[i] for i in index.tolist()])
        except (RuntimeError, TypeError) as error:  # torch's collate: ragged, None, unknown types
            raise ValueError(
                f"{name}: its items do not make a batch ({type(error).__name__}: "
                f"{first_line(str(error))}). Items must be (inputs, target) pairs or mappings "
                "of tensors or numbers, of one shape: pad ragged ones in the dataset (or, with "
                "data=dataset, in a data.collate_fn)") from error
        if isinstance(batch, Tensor):
            raise ValueError(f"{name}: its items are single tensors; they must be (inputs, "
                             "target) pairs or mappings of tensors")
        parts = (batch.items() if isinstance(batch, Mapping) else
                 ((("inputs", "target")[i] if i < 2 else f"element {i}", value)
                  for i, value in enumerate(batch)))
        for part, value in parts:
            if not isinstance(value, Tensor):
                of = f" of {type(value[0]).__name__}" if isinstance(value, (list, tuple)) else ""
                raise ValueError(
                    f"{name}: the batch's {part!r} is a {type(value).__name__}{of}, not a "
                    "tensor. Items must hold tensors or numbers: make a list of numbers a "
                    "tensor (torch.tensor), and strings numbers (class ids, token ids)")
        return batch


def dataset(
    train: Dataset,
    eval: Dataset | None = None,
    batch_size: BatchSize = 32,
    eval_batch_size: BatchSize = 32,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: str | None = None,
    unit: str = "samples",
    items_per_sample: int = 1,
    seed: int = 0,
) -> LoaderData:
    """Your datasets (`data.train._target_=pkg.MyDataset`, and `data.eval`), whose items are
    `(inputs, target)` pairs or mappings of tensors; `collate_fn` is a dotted path (default:
    torch's default_collate)."""
    collate = get_method(collate_fn) if collate_fn else None
    names = (f"data.train ({type(train).__name__})", f"data.eval ({type(eval).__name__})")
    if len(train) == 0:
        raise ValueError(f"{names[0]}: it has no items")
    if eval is not None and len(eval) == 0:  # it would evaluate nothing, and say nothing
        raise ValueError(f"{names[1]}: it has no items; data.eval=null runs no evaluation")
    return LoaderData(train, eval, batch_size, eval_batch_size, seed, num_workers, pin_memory,
                      collate, unit, items_per_sample, names)


FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def hf_local(
    path: str | None = None,
    data_files: dict | None = None,
    train_split: str = "train",
    eval_split: str | None = "test",
    columns: list[str] = ("input_ids", "attention_mask", "labels"),
    batch_size: BatchSize = 8,
    eval_batch_size: BatchSize = 8,
    num_workers: int = 0,
    pin_memory: bool = False,
    unit: str = "samples",
    items_per_sample: int = 1,
    seed: int = 0,
) -> LoaderData:
    """A Hugging Face `datasets` dataset from local files: a folder written by
    `save_to_disk` (`path`), or `data_files` by split ({train: a.parquet, test: b.parquet};
    parquet, json or csv). Batches are mappings of `columns` (already tokenized, of one length);
    `labels` are the targets."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded
    import datasets

    if (path is None) == (data_files is None):
        raise ValueError("data=hf_local: give data.path (a save_to_disk folder) or "
                         "data.data_files ({train: file, test: file}), one of them")
    if path is not None:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"data.path={path}: no such folder. Put a dataset written by "
                "`DatasetDict.save_to_disk(folder)` (with splits train and test) there")
        source = f"data.path={path}"
        load = partial(datasets.load_from_disk, str(folder))
    else:
        files = {split: str(Path(f).expanduser()) for split, f in dict(data_files).items()}
        missing = [f for f in files.values() if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"data.data_files: no file at {', '.join(missing)}; put the "
                                    "split files (parquet, json or csv) there")
        kinds = {FORMATS.get(Path(f).suffix) for f in files.values()}
        if None in kinds or len(kinds) != 1:
            raise ValueError(f"data.data_files={files}: one format for all splits, named by "
                             f"its suffix: {', '.join(FORMATS)}")
        source = f"data.data_files={files}"
        load = partial(datasets.load_dataset, kinds.pop(), data_files=files, keep_in_memory=True)
    try:
        splits = load()
    except Exception as error:  # datasets' own words, with the key that names what it read
        # save_to_disk writes no data file for a split of no rows, and load_from_disk then
        # fails with an IndexError (huggingface/datasets PR 8385): name such splits.
        empty = [] if path is None else [
            split.name for split in sorted(folder.iterdir())
            if (split / "state.json").is_file() and not any(split.glob("*.arrow"))]
        raise ValueError(f"{source}: datasets could not load it ({type(error).__name__}: "
                         f"{first_line(str(error))})"
                         + (f"; its split(s) {empty} were saved with no rows" if empty else "")
                         ) from error
    names = list(splits)
    for key, split in (("data.train_split", train_split), ("data.eval_split", eval_split)):
        if split is not None and split not in splits:
            raise ValueError(f"data=hf_local: no split {split!r}; the dataset has {names} "
                             "(data.train_split, data.eval_split)")
        if split is not None and len(splits[split]) == 0:
            raise ValueError(f"{key}={split} of {source}: the split has no rows"
                             + ("; data.eval_split=null runs no evaluation"
                                if key == "data.eval_split" else ""))
    absent = [c for c in columns if c not in splits[train_split].column_names]
    if absent:
        raise ValueError(f"data.columns: {absent} not in the dataset, whose columns are "
                         f"{splits[train_split].column_names}")

    def as_tensors(split: str | None):
        return None if split is None else splits[split].with_format("torch", columns=list(columns))

    return LoaderData(as_tensors(train_split), as_tensors(eval_split), batch_size,
                      eval_batch_size, seed, num_workers, pin_memory, None, unit,
                      items_per_sample, (f"data.train_split={train_split} of {source}",
                                         f"data.eval_split={eval_split} of {source}"))
