"""Built-in models, and the contract any model (`model._target_=pkg.Class`) follows.

The contract
------------
- A model is an `nn.Module` whose `forward(inputs)` returns logits of shape `(*batch, classes)`.
  memexp computes the loss itself: cross-entropy against integer targets of shape `(*batch)`,
  and accuracy as the share of argmax hits. Images give `(N, classes)`, token sequences
  `(N, T, vocab)`.
- A model that wants block-level techniques (`checkpointing=full|selective|sequential`) exposes
  its repeated blocks as `self.blocks`, an `nn.Sequential` in forward order that `forward` calls
  as `x = self.blocks(x)`. Techniques read the blocks through `blocks_of(model)` and never guess.
"""

from torch import nn

from memexp.models.mlp import MLP
from memexp.models.resnet import ResNet
from memexp.models.transformer import Transformer

__all__ = ["MLP", "ResNet", "Transformer", "blocks_of"]


def blocks_of(model: nn.Module) -> nn.Sequential:
    """The model's repeated blocks, per the contract above."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential):
        raise TypeError(
            f"{type(model).__qualname__} has no `blocks` nn.Sequential, which block-level "
            "techniques need (see memexp.models). Give the model one, or name the modules "
            "to target with checkpointing=modules checkpointing.modules=[...]."
        )
    return blocks
