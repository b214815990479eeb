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


def _split(images: Tensor, labels: Tensor, source: str) -> Split:
    """One image per label, and no label below 0, checked as the files are read: a mismatch
    would otherwise train on whatever lines up, and a negative label fail at some later step."""
    if len(images) != len(labels):
        raise ValueError(f"{source}: {len(images)} images but {len(labels)} labels")
    if len(labels) and int(labels.min()) < 0:
        index = int(labels.argmin())
        raise ValueError(f"{source}: label {int(labels[index])} at index {index}; labels are "
                         "class numbers from 0")
    return Split(images, labels)


def _unreadable(path: Path, what: str, error: Exception) -> ValueError:
    return ValueError(f"{path}: not {what} ({type(error).__name__}: {error})")


class _CifarUnpickler(pickle.Unpickler):
    """Only what CIFAR-10's python-version files hold: a dict with bytes keys, lists of ints and
    of bytes, and a uint8 numpy array, which pickle rebuilds through these numpy functions (the
    files were written by Python 2 and numpy 1; newer pickles name numpy._core, and bytes through
    _codecs.encode). Any other global, such as os.system, is refused before it is looked up: a
    crafted file in data.root runs nothing."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
               ("numpy", "dtype"), ("numpy.core.numeric", "_frombuffer"),
               ("numpy._core.numeric", "_frombuffer"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch "
                                         "never holds (refused without running it)")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    """One CIFAR-10 batch file: its N x 3072 uint8 pixels and its N labels."""
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="bytes").load()
    except Exception as error:  # truncated, corrupt, or not a pickle at all
        raise _unreadable(path, "a CIFAR-10 python-version batch", error) from error
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: holds a {type(entry).__name__}, not a CIFAR-10 batch dict")
    pixels, labels = entry.get(b"data"), entry.get(b"labels")
    if (not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 2
            or pixels.shape[1] != 3 * 32 * 32):
        raise ValueError(f"{path}: b'data' is not an N x 3072 array of uint8 pixels")
    if not isinstance(labels, list) or not all(type(label) is int for label in labels):
        raise ValueError(f"{path}: b'labels' is not a list of integers")
    return pixels, labels


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
        parts = []
        for name in files:
            pixels, labels = read_cifar_batch(folder / name)
            parts.append(_split(torch.from_numpy(pixels).view(-1, 3, 32, 32),
                                torch.tensor(labels, dtype=torch.long), str(folder / name)))
        return Split(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]))

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
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as error:  # a .gz that is not gzip, or cut short
        raise _unreadable(path, "a readable IDX file", error) from error
    if not raw:
        raise ValueError(f"{path} is not an IDX file: it is empty")
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
        pixels, targets = read_idx(images), read_idx(labels)
        if pixels.ndim != 3 or targets.ndim != 1:
            raise ValueError(f"{images} and {labels}: expected N x rows x columns images and N "
                             f"labels, found shapes {pixels.shape} and {targets.shape}")
        return _split(torch.from_numpy(pixels.copy()).unsqueeze(1),
                      torch.from_numpy(targets.astype(np.int64)), f"{images} and {labels}")

    train = load(*paths[:2])
    _check_declared("mnist", train, num_classes, channels, image_size)
    return TensorData(
        train, load(*paths[2:]), batch_size, eval_batch_size, seed,
        decode=partial(normalize_bytes, mean=MNIST_MEAN, std=MNIST_STD),
    )
