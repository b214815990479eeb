"""Built-in models, ready configs for Hugging Face and timm models, and the block resolver.

What memexp asks of a model
---------------------------
Any `nn.Module`. Its forward gets the batch's inputs (or a mapping batch as keyword arguments)
and returns logits, a tuple whose first element is the logits, or a mapping such as Hugging
Face's `ModelOutput` with `logits` and/or `loss` (memexp.loss). Block-level techniques find the
model's repeated blocks themselves (memexp.models.blocks): no `blocks` attribute, no adapter.
"""

from collections.abc import Mapping
from weakref import WeakKeyDictionary

from omegaconf import DictConfig, OmegaConf

from memexp.models.blocks import Blocks, resolve_blocks
from memexp.models.mlp import MLP
from memexp.models.resnet import ResNet
from memexp.models.transformer import Transformer

__all__ = ["LOADED", "MLP", "Blocks", "ResNet", "Transformer", "plain", "resolve_blocks"]

# What loading each model's pretrained weights reported (model=hf: memexp.models.hf.load_report),
# by model, for the run's record. Kept beside the model, not on it, where its own code could
# meet it.
LOADED: WeakKeyDictionary = WeakKeyDictionary()


def plain(keys: Mapping | None) -> dict:
    """Keyword arguments for a library (`model.config`, `model.kwargs`), as plain Python values:
    Hydra passes a nested mapping as a DictConfig."""
    if isinstance(keys, DictConfig):
        return OmegaConf.to_container(keys, resolve=True)
    return dict(keys or {})
