"""Models and datasets as a user writes them, for `model=custom` and `data=dataset`
(tests/ is on sys.path under pytest): no `blocks` attribute, no adapter."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset


class Layer(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.dropout(self.down(F.gelu(self.up(self.norm(x)))))


class LayerStack(nn.Module):
    """Token embeddings, layers in an nn.ModuleList that forward loops over, a head; returns a
    tuple (logits, last hidden state)."""

    def __init__(self, vocab_size: int = 64, width: int = 32, depth: int = 3,
                 dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(Layer(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x), x


class CopiedBlocks(LayerStack):
    """The trap: `blocks` is a copy of the layers, and forward never calls it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = copy.deepcopy(nn.Sequential(*self.layers))


class Routed(LayerStack):
    """Each token goes through one of two layers, picked by its own activations (a mixture of
    experts): which tokens, and how many, each layer gets depends on the model's values."""

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(tokens)
        routed, first = torch.zeros_like(x), x.sum(-1) > 0
        routed[first] = self.layers[0](x[first])
        routed[~first] = self.layers[1](x[~first])
        return self.head(routed), routed


class ReadsValues(LayerStack):
    """Reads its activations' values: `unique_consecutive` (the size of its output depends on
    them) or `equal` (its answer does)."""

    def __init__(self, op: str, **kwargs):
        super().__init__(**kwargs)
        self.op = op

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(tokens)
        if self.op == "unique_consecutive":
            x = x * len(torch.unique_consecutive(x.argmax(-1)))
        elif torch.equal(x[0], x[-1]):
            x = x * 2
        return self.head(x), x

class Tokens(Dataset):
    """`size` pairs (tokens, next tokens) of a counting sequence with noise, made from the index
    alone, so that every worker process makes the same items."""

    def __init__(self, size: int = 64, seq_len: int = 16, vocab_size: int = 64):
        self.size, self.seq_len, self.vocab_size = size, seq_len, vocab_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(index)
        start = torch.randint(self.vocab_size, (), generator=generator)
        tokens = (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


def half_cross_entropy(outputs, batch) -> Tensor:
    """A loss of one's own: (outputs, batch) -> loss."""
    logits, targets = outputs.logits, batch[1]
    return 0.5 * F.cross_entropy(logits.flatten(0, -2), targets.flatten())


# -- wrappers (issue 26: a module in two slots, nn.TransformerEncoder) ---------------------------
class SharedLayer(LayerStack):
    """LayerStack whose first and last slots hold one module: it runs twice per forward."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        shared = self.layers[0]
        self.layers = nn.ModuleList([shared, self.layers[1], shared])


class Encoder(nn.Module):
    """torch's own nn.TransformerEncoder between an embedding (and a projection, so that under
    autocast its input is in half precision) and a head. Its forward reads
    `self.layers[0].self_attn.batch_first`; in eval each layer takes torch's fused fast path."""

    def __init__(self, vocab_size: int = 64, width: int = 32, depth: int = 2, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.project = nn.Linear(width, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.project(self.embed(tokens))))


# -- Mistakes, and runs that must not end ok (tests/test_trust.py) ------------------------------
class Features(Dataset):
    """`size` pairs (features, label), the labels counting 0 to `classes` - 1 and again; with
    `labels=false`, mappings {"x": features} that carry no labels."""

    def __init__(self, size: int = 32, features: int = 8, classes: int = 10,
                 labels: bool = True):
        self.size, self.features, self.classes, self.labels = size, features, classes, labels

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Tensor, int] | dict[str, Tensor]:
        x = torch.randn(self.features, generator=torch.Generator().manual_seed(index))
        return (x, index % self.classes) if self.labels else {"x": x}


class Classifier(nn.Module):
    """A linear classifier whose forward returns `output`: logits; nan_gradient (the logits plus
    a term of value 0 whose gradient is NaN: sqrt's gradient at 0 is infinite, times 0), in its
    first `nan_forwards` training forward passes (every one by default); none; or scalar (the
    logits summed). The parameters named in `frozen` do not train."""

    def __init__(self, features: int = 8, classes: int = 10, output: str = "logits",
                 nan_forwards: int | None = None, frozen: tuple[str, ...] = ()):
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.output, self.nan_forwards = output, nan_forwards
        for name in frozen:
            self.linear.get_parameter(name).requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor | None:
        logits = self.linear(x)
        if self.output == "nan_gradient" and self.training and self.nan_forwards != 0:
            self.nan_forwards = None if self.nan_forwards is None else self.nan_forwards - 1
            return logits + torch.sqrt(logits - logits).sum() * 0
        if self.output == "none":
            return None
        return logits.sum() if self.output == "scalar" else logits


def leaf_loss(outputs, batch) -> Tensor:
    """A loss of its own: it trains nothing."""
    return torch.tensor(1.5, requires_grad=True)


def own_weight_loss(outputs, batch) -> Tensor:
    """Computed from a weight the loss made itself, not from the model's outputs."""
    weight = torch.ones(2, requires_grad=True)
    return (weight * 2).sum()


def unreduced_loss(outputs, batch) -> Tensor:
    return F.cross_entropy(outputs.logits, batch[1], reduction="none")


def count_loss(outputs, batch) -> Tensor:
    return (outputs.logits.argmax(-1) != batch[1]).sum()


def no_loss(outputs, batch) -> None:
    return None
