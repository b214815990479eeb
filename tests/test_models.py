"""Built-in models: shapes, the blocks the resolver finds in them, and user models."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from memexp.models import MLP, ResNet, Transformer, resolve_blocks

from conftest import compose_train, first_step_gradients, max_relative_error, step_memory


def test_resnet18_has_the_published_size():
    model = ResNet(num_classes=10, width=64, blocks_per_stage=[2, 2, 2, 2])
    assert sum(p.numel() for p in model.parameters()) == 11_173_962


@pytest.mark.parametrize(
    ("model", "inputs", "logits"),
    [
        (ResNet(10, width=8), torch.randn(2, 3, 32, 32), (2, 10)),
        (MLP(10, hidden=32, depth=2), torch.randn(2, 3, 32, 32), (2, 10)),
        (Transformer(64, 16, d_model=32, n_layers=2, n_heads=4), torch.randint(64, (2, 16)),
         (2, 16, 64)),
    ],
    ids=["resnet", "mlp", "transformer"],
)
def test_forward_shapes_and_auto_blocks(model, inputs, logits):
    assert model(inputs).shape == logits
    found = resolve_blocks(model, ["auto"], "checkpointing.blocks")
    assert found.names == [f"blocks.{i}" for i in range(len(model.blocks))]


def test_blocks_count_follows_the_config():
    model = instantiate(compose_train("model.blocks_per_stage=[1,2,3,1]").model)
    assert resolve_blocks(model, ["auto"], "k").summary() == {"class": "BasicBlock", "count": 7}
    model = instantiate(compose_train("model=transformer", "model.n_layers=3").model)
    assert resolve_blocks(model, ["auto"], "k").summary() == {"class": "Block", "count": 3}


def test_a_model_without_repeated_blocks_is_told_what_to_name():
    with pytest.raises(ValueError, match=r"found no repeated blocks in Linear.*\[ClassName\]"):
        resolve_blocks(nn.Linear(2, 2), ["auto"], "checkpointing.blocks")


def test_inplace_relu_follows_the_flag():
    relus = [m for m in ResNet(10, width=8, inplace=True).modules() if isinstance(m, nn.ReLU)]
    assert relus and all(r.inplace for r in relus)


def test_inplace_activations_same_gradients_fewer_activation_bytes():
    """The source's tip 1. In-place ReLU and residual adds save no tensor autograd would keep
    anyway; what they remove is a transient copy, so the effect is small but real."""
    common = ("model=resnet", "model.width=16", "data.batch_size=32")
    _, copies = first_step_gradients(*common)
    _, in_place = first_step_gradients(*common, "model.inplace=true")
    assert max_relative_error(in_place, copies) <= 1e-6
    assert (step_memory(*common, "model.inplace=true")["activations_peak_bytes"]
            < step_memory(*common)["activations_peak_bytes"])
