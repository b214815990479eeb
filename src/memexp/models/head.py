"""The output head of a language model, for a loss that applies it itself (loss=chunked_ce).

Found once, by what the model is: a Hugging Face model's `get_output_embeddings()` (GPT-2's tied
`lm_head`, Llama's own, BERT's masked-LM decoder), memexp's Transformer's `head`. Its place in
the model then holds a `DeferredHead`, which hands the head's input on: the model's own forward
returns the last hidden states in place of the logits, and never computes them whole.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from torch import Tensor, nn

from memexp.models.blocks import Wrapper, replace_module
from memexp.models.transformer import Transformer

log = logging.getLogger("memexp")


class DeferredHead(Wrapper):
    """Holds the head (its parameters stay the model's, tied ones included) and returns its
    input: the loss applies the head, a chunk of tokens at a time."""

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden


@dataclass
class Head:
    name: str
    linear: nn.Linear  # the model's head itself: its weight as the optimizer and precision see it

    def describe(self) -> str:
        linear = self.linear
        return (f"{self.name} ({type(linear).__name__} {linear.in_features} -> "
                f"{linear.out_features}, bias {linear.bias is not None})")


def find_head(model: nn.Module, key: str) -> nn.Module | None:
    """The output head of memexp's Transformer or of a Hugging Face model that has one."""
    if isinstance(model, Transformer):
        return model.head
    # A Hugging Face model exists only once transformers is imported (memexp.models.hf).
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        if model.config.is_encoder_decoder:
            raise ValueError(
                f"{key}: {type(model).__name__}'s decoder takes its inputs from the labels, "
                "which only its own loss passes in: use loss=model")
        return model.get_output_embeddings()
    raise ValueError(
        f"{key} applies the model's output head itself, and {type(model).__name__} is neither a "
        "Hugging Face model (model=hf) nor memexp's transformer (model=transformer), whose "
        "heads it finds. Use loss=cross_entropy, or one of those models")


def defer_head(model: nn.Module, key: str) -> Head:
    """Find the model's output head and put a DeferredHead in its place."""
    head = find_head(model, key)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{key} needs an output head of vocabulary logits (an nn.Linear), and "
            f"{type(model).__name__} has {'none' if head is None else type(head).__name__}: a "
            "task with a language-model head does (model.task=causal_lm or masked_lm). Use "
            "loss=cross_entropy or loss=model for this model")
    name = next(name for name, module in model.named_modules() if module is head)
    replace_module(model, name, DeferredHead(head))
    found = Head(name, head)
    log.info("%s: output head %s", key, found.describe())
    return found
