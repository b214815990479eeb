"""How a model's own loss reduces its batch: said by the model's builder (memexp.models.hf) and
read by the loss that takes it (memexp.loss, `loss=model`). A module of its own, below both,
since the models' builders are imported by the data (for a model's config) that the loss reads."""

from __future__ import annotations

from enum import Enum
from weakref import WeakKeyDictionary


class Reduction(Enum):
    """How a model's own loss reduces its batch, which weighs the micro-batches of an
    accumulated step (`shares`). The model's builder says which (`REDUCTIONS`)."""

    # Hugging Face's cross-entropy losses: a mean over the labels that are not -100 (shifted for
    # causal language models; one per sample for sequence classification)
    LABELS = "a mean over its labels"
    # torch's ctc_loss with reduction="mean": each sample's loss over its label count, then the
    # batch's mean, whatever the counts
    SAMPLES = "a mean over its samples"
    # ctc_loss with reduction="sum" (wav2vec2's and HuBERT's default)
    SUM = "a sum over its samples"


# How each model's own loss reduces its batch, where its builder knows (model=hf: from the config
# its task head reads); a mean over its labels otherwise. By model, beside it rather than on it,
# where its own code could meet it.
REDUCTIONS: WeakKeyDictionary = WeakKeyDictionary()
