"""Learnable synthetic data, generated in memory, deterministic by seed: the embedded defaults."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memexp.data.tensors import BatchSize, Split, TensorData


def synthetic_images(
    batch_size: BatchSize = 64,
    eval_batch_size: BatchSize = 64,
    num_classes: int = 10,
    channels: int = 3,
    image_size: int = 32,
    num_train: int = 4096,
    num_eval: int = 1024,
    signal: float = 0.15,
    max_shift: int = 4,
    seed: int = 0,
) -> TensorData:
    """Image classification. Each class is a smooth random pattern of amplitude `signal` under
    unit pixel noise, shifted by up to `max_shift` pixels per sample: learnable by a conv net,
    but not trivially, so accuracy differences between techniques stay visible."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=generator)
    patterns = signal * F.interpolate(coarse, size=image_size, mode="bilinear",
                                      align_corners=False)

    def split(count: int) -> Split:
        labels = torch.randint(num_classes, (count,), generator=generator)
        shifts = torch.randint(-max_shift, max_shift + 1, (count, 2), generator=generator)
        pixels = torch.randn(count, channels, image_size, image_size, generator=generator)
        # Each sample's pattern rolled by its (dy, dx), for all samples at once: row y of the
        # rolled image is row (y - dy) mod size of the pattern.
        positions = torch.arange(image_size)
        rows = (positions - shifts[:, :1]) % image_size  # (count, size)
        cols = (positions - shifts[:, 1:]) % image_size
        rolled = patterns[labels]
        rolled = rolled.gather(2, rows[:, None, :, None].expand_as(rolled))
        rolled = rolled.gather(3, cols[:, None, None, :].expand_as(rolled))
        return Split(pixels + rolled, labels)

    train = split(num_train)
    return TensorData(train, split(num_eval), batch_size, eval_batch_size, seed)


def synthetic_tokens(
    batch_size: BatchSize = 16,
    eval_batch_size: BatchSize = 16,
    vocab_size: int = 64,
    seq_len: int = 64,
    num_train: int = 2048,
    num_eval: int = 256,
    noise: float = 0.1,
    seed: int = 0,
) -> TensorData:
    """Next-token prediction. Each token follows from the two before it by a fixed random rule,
    so the model must attend back, not just look up a bigram; a `noise` share of tokens is
    random, so the best possible accuracy is about 1 - noise."""
    generator = torch.Generator().manual_seed(seed)
    rule = torch.randint(vocab_size, (vocab_size, vocab_size), generator=generator)

    def split(count: int) -> Split:
        tokens = torch.randint(vocab_size, (count, seq_len + 1), generator=generator)
        for t in range(2, seq_len + 1):
            keep = torch.rand(count, generator=generator) >= noise
            follow = rule[tokens[:, t - 2], tokens[:, t - 1]]
            tokens[:, t] = torch.where(keep, follow, tokens[:, t])
        return Split(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    train = split(num_train)
    return TensorData(
        train, split(num_eval), batch_size, eval_batch_size, seed,
        unit="tokens", items_per_sample=seq_len,
    )
