"""Readers for real datasets in their published file formats, from a local folder (`data.root`)."""

from __future__ import annotations

import gzip
import pickle
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from memexp.data.tensors import BatchSize, Split, TensorData

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


def normalize_bytes(images: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """uint8 pixels (kept compact in memory) to normalized float32, one batch at a time."""
    shape = (1, len(mean), 1, 1)
    mean_t = torch.tensor(mean).view(shape)
    std_t = torch.tensor(std).view(shape)
    return (images.float() / 255 - mean_t) / std_t


def _check_declared(dataset: str, train: Split, num_classes: int, channels: int,
                    image_size: int) -> None:
    """The declared shape (which models read through ${data.*}) must match the files."""
    classes = int(train.targets.max()) + 1
    shape = tuple(train.inputs.shape[1:])
    if classes > num_classes or shape != (channels, image_size, image_size):
        raise ValueError(
            f"data={dataset}: the files hold {classes} classes of {shape} images, but "
            f"data.num_classes/channels/image_size say {num_classes} classes of "
            f"{(channels, image_size, image_size)}"
        )


def _missing(root: Path, folder: Path, what: str, files: list[str],
             source: str) -> FileNotFoundError:
    listing = "\n  ".join(files)
    return FileNotFoundError(
        f"data.root={root}: no {what} there. Put these files in {folder}:\n  {listing}\n"
        f"(from {source}), or point data.root at the folder that holds them."
    )


def cifar10(
    root: str = "data",
    batch_size: BatchSize = 64,
    eval_batch_size: BatchSize = 256,
    num_classes: int = 10,
    channels: int = 3,
    image_size: int = 32,
    seed: int = 0,
) -> TensorData:
    """CIFAR-10, python version: `data_batch_1` .. `data_batch_5` and `test_batch` pickles, in
    `root` or in `root/cifar-10-batches-py`."""
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    base = Path(root).expanduser()
    folder = next((p for p in (base, base / "cifar-10-batches-py")
                   if all((p / n).is_file() for n in names)), None)
    if folder is None:
        raise _missing(base, base / "cifar-10-batches-py", "CIFAR-10", names,
                       "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extracted")

    def load(files: list[str]) -> Split:
        images, labels = [], []
        for name in files:
            with open(folder / name, "rb") as f:
                entry = pickle.load(f, encoding="bytes")
            images.append(np.asarray(entry[b"data"], dtype=np.uint8))
            labels.extend(entry[b"labels"])
        pixels = torch.from_numpy(np.concatenate(images)).view(-1, 3, 32, 32)
        return Split(pixels, torch.tensor(labels, dtype=torch.long))

    train = load(names[:5])
    _check_declared("cifar10", train, num_classes, channels, image_size)
    return TensorData(
        train, load(names[5:]), batch_size, eval_batch_size, seed,
        decode=partial(normalize_bytes, mean=CIFAR10_MEAN, std=CIFAR10_STD),
    )


IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format): zero bytes, a type code, the rank, big-endian dims, data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    rank = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank)]
    data = np.frombuffer(raw, dtype=IDX_DTYPES[raw[2]], offset=4 + 4 * rank)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} values")
    return data.reshape(dims)


def mnist(
    root: str = "data",
    batch_size: BatchSize = 64,
    eval_batch_size: BatchSize = 256,
    num_classes: int = 10,
    channels: int = 1,
    image_size: int = 28,
    seed: int = 0,
) -> TensorData:
    """MNIST IDX files (optionally .gz) in `root`, `root/MNIST/raw` or `root/mnist`."""
    names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    base = Path(root).expanduser()

    def find(name: str) -> Path | None:
        for folder in (base, base / "MNIST" / "raw", base / "mnist"):
            for candidate in (folder / name, folder / f"{name}.gz"):
                if candidate.is_file():
                    return candidate
        return None

    paths = [find(n) for n in names]
    if None in paths:
        raise _missing(base, base, "MNIST", names,
                       "http://yann.lecun.com/exdb/mnist/, .gz or not")

    def load(images: Path, labels: Path) -> Split:
        pixels = torch.from_numpy(read_idx(images).copy()).unsqueeze(1)
        return Split(pixels, torch.from_numpy(read_idx(labels).astype(np.int64)))

    train = load(*paths[:2])
    _check_declared("mnist", train, num_classes, channels, image_size)
    return TensorData(
        train, load(*paths[2:]), batch_size, eval_batch_size, seed,
        decode=partial(normalize_bytes, mean=MNIST_MEAN, std=MNIST_STD),
    )
