"""Data: synthetic sets are deterministic and learnable; readers parse the real file formats."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import Dataset

from memexp.build import build
from memexp.data import TensorData, cifar10, mnist, synthetic_images, synthetic_tokens
from memexp.data.readers import read_idx
from memexp.loggers import NoLogger
from memexp.trainer import Trainer

from conftest import compose_train, write_idx, write_tiny_cifar10, write_tiny_mnist


def take(stream, count):
    return list(itertools.islice(stream, count))


@pytest.mark.parametrize("make", [synthetic_images, synthetic_tokens])
def test_synthetic_data_is_deterministic_by_seed(make):
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    assert torch.equal(a.train.inputs, b.train.inputs)
    assert torch.equal(a.eval.targets, b.eval.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)


def test_batch_order_resumes_exactly_across_epochs():
    data = synthetic_images(batch_size=100, num_train=1000, num_eval=10)
    straight = take(data.train_batches(), 25)  # 10 batches per epoch: crosses two boundaries
    resumed = take(data.train_batches(start=13), 12)
    for (x1, y1), (x2, y2) in zip(straight[13:], resumed, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    epoch0 = torch.cat([y for _, y in straight[:10]])
    assert len(epoch0) == 1000  # an epoch visits each sample once


def test_ranks_split_the_global_batch_of_one_process():
    data = synthetic_tokens(batch_size=8, num_train=64, num_eval=8)
    single = TensorData(data.train, data.eval, 16, 16, data.seed)
    for step in range(6):
        whole = take(single.train_batches(start=step), 1)[0][0]
        parts = [take(data.train_batches(step, rank, 2), 1)[0][0] for rank in (0, 1)]
        assert torch.equal(torch.cat(parts), whole)


def test_eval_batches_cover_the_split_once_across_ranks():
    data = synthetic_images(batch_size=32, num_eval=100)
    seen = [y for rank in (0, 1) for _, y in data.eval_batches(rank, 2)]
    assert sum(len(y) for y in seen) == 100


def test_cifar10_reader(tmp_path):
    data = cifar10(root=str(write_tiny_cifar10(tmp_path)), batch_size=4)
    assert data.train.inputs.shape == (100, 3, 32, 32) and data.train.inputs.dtype == torch.uint8
    assert len(data.eval) == 20
    inputs, targets = take(data.train_batches(), 1)[0]
    assert inputs.dtype == torch.float32 and inputs.shape == (4, 3, 32, 32)
    assert targets.dtype == torch.long and int(targets.max()) < 10
    assert -3 < float(inputs.mean()) < 3  # normalized, not raw bytes


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reader(tmp_path, gz):
    data = mnist(root=str(write_tiny_mnist(tmp_path / "m", gz=gz)), batch_size=5)
    assert data.train.inputs.shape == (40, 1, 28, 28)
    inputs, _ = take(data.train_batches(), 1)[0]
    assert inputs.shape == (5, 1, 28, 28) and inputs.dtype == torch.float32


def test_idx_reader_rejects_a_file_that_is_not_idx(tmp_path):
    bad = tmp_path / "x-ubyte"
    bad.write_bytes(b"\x12\x34\x56\x78")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad)
    import numpy as np

    write_idx(tmp_path / "ok-ubyte", np.arange(6, dtype=np.uint8).reshape(2, 3))
    assert read_idx(tmp_path / "ok-ubyte").tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("reader", [cifar10, mnist])
def test_missing_folder_says_what_to_put_where(reader, tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        reader(root=str(tmp_path / "nowhere"))
    message = str(raised.value)
    assert "data.root=" in message and str(tmp_path / "nowhere") in message
    expected_file = "data_batch_1" if reader is cifar10 else "train-images-idx3-ubyte"
    assert expected_file in message


def test_declared_shape_must_match_the_files(tmp_path):
    with pytest.raises(ValueError, match="data.num_classes/channels/image_size"):
        mnist(root=str(write_tiny_mnist(tmp_path)), channels=3)


@pytest.mark.parametrize("key", ["batch_size", "eval_batch_size"])
def test_batch_size_must_be_positive(key):
    with pytest.raises(ValueError, match=f"data.{key}=0"):
        synthetic_images(**{key: 0})


@pytest.mark.parametrize(
    ("overrides", "chance", "at_least"),
    [
        (["model=mlp", "trainer.max_steps=150"], 0.1, 0.3),
        (["model=transformer", "model.d_model=64", "model.n_layers=2",
          "trainer.max_steps=200"], 1 / 64, 0.1),
    ],
    ids=["images", "tokens"],
)
def test_synthetic_data_is_learnable(overrides, chance, at_least):
    trainer = Trainer(compose_train(*overrides, "memory.track=false"))
    accuracy = trainer.fit(NoLogger()).eval_accuracy
    assert accuracy >= at_least, f"accuracy {accuracy:.3f}, chance {chance:.3f}"


def test_real_data_runs_through_the_trainer(tmp_path):
    root = write_tiny_cifar10(tmp_path)
    cfg = compose_train("data=cifar10", f"data.root={root}", "data.batch_size=10",
                        "model.width=4", "trainer.max_steps=2")
    assert instantiate(cfg.data).batch_size == 10
    assert Trainer(cfg).fit(NoLogger()).eval_accuracy is not None


class Ragged(Dataset):
    """Token sequences of three lengths: items that torch's collate cannot stack."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        tokens = torch.arange(8 + index % 3)
        return tokens, tokens


class Words(Ragged):
    def __getitem__(self, index: int):
        return "a sentence", 3


class ListsOfIds(Ragged):
    def __getitem__(self, index: int):
        return {"input_ids": [1, 2, 3, 4], "labels": [2, 3, 4, 5]}


class Nothing(Ragged):
    def __getitem__(self, index: int):
        return None


USER_DATA = ("data=dataset", "data.batch_size=4", "model=custom",
             "model._target_=user_models.LayerStack")


@pytest.mark.parametrize(("data", "says"), [
    (("data.train._target_=test_data.Ragged",),
     r"^data.train \(Ragged\): its items do not make a batch \(RuntimeError: stack expects each "
     r"tensor to be equal size.*pad ragged ones in the dataset \(or, with data=dataset, in a "
     r"data.collate_fn\)$"),
    (("data.train._target_=test_data.Words",),
     r"^data.train \(Words\): the batch's 'inputs' is a tuple of str, not a tensor\. Items must "
     r"hold tensors or numbers"),
    (("data.train._target_=test_data.ListsOfIds",),
     r"^data.train \(ListsOfIds\): the batch's 'input_ids' is a list of Tensor, not a tensor"),
    (("data.train._target_=test_data.Nothing",),
     r"^data.train \(Nothing\): its items do not make a batch \(TypeError: .*NoneType"),
    (("data.train._target_=user_models.Tokens", "data.eval={_target_: test_data.Ragged}"),
     r"^data.eval \(Ragged\): its items do not make a batch"),  # found before any training
    (("data.train._target_=user_models.Tokens",
      "data.eval={_target_: user_models.Tokens, size: 0}"),
     r"^data.eval \(Tokens\): it has no items; data.eval=null runs no evaluation$"),
], ids=["ragged", "str", "lists", "none", "ragged-eval", "empty-eval"])
def test_a_datasets_items_that_do_not_batch_into_tensors_are_named_once_built(data, says):
    with pytest.raises(ValueError, match=says):
        Trainer(compose_train(*USER_DATA, *data))


def test_hf_local_names_a_split_of_strings_or_of_no_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    ids = [[i % 64] * 8 for i in range(8)]
    words = datasets.Dataset.from_dict({"input_ids": ids, "labels": ["no", "yes"] * 4})
    numbers = datasets.Dataset.from_dict({"input_ids": ids, "labels": [0, 1] * 4})
    saved = {"strings": {"train": words, "test": words},
             "filtered": {"train": numbers, "test": numbers.filter(lambda row: False)},
             # save_to_disk writes no data file for a split of no rows (datasets 5.2)
             "selected": {"train": numbers, "test": numbers.select([])}}
    for name, splits in saved.items():
        datasets.DatasetDict(splits).save_to_disk(str(tmp_path / name))

    def error(name: str) -> str:
        with pytest.raises(ValueError) as raised:
            build(compose_train("data=hf_local", f"data.path={tmp_path / name}",
                                "data.columns=[input_ids,labels]", "data.batch_size=4").data)
        return str(raised.value)

    assert error("strings") == (
        f"data.train_split=train of data.path={tmp_path / 'strings'}: the batch's 'labels' is a "
        "list of str, not a tensor. Items must hold tensors or numbers: make a list of numbers a "
        "tensor (torch.tensor), and strings numbers (class ids, token ids)")
    assert error("filtered") == (f"data.eval_split=test of data.path={tmp_path / 'filtered'}: "
                                 "the split has no rows; data.eval_split=null runs no evaluation")
    assert re.fullmatch(  # or as "filtered", where datasets writes the split's data file
        rf"data.path={tmp_path / 'selected'}: datasets could not load it \(IndexError: .*\); its "
        r"split\(s\) \['test'\] were saved with no rows|data.eval_split=test of .*: the split "
        r"has no rows; .*", error("selected"))
