"""Learnable synthetic data, generated in memory, deterministic by seed: the embedded defaults,
and token batches in the shape Hugging Face models take."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memexp.data.tensors import IGNORE, LABELS, BatchSize, Columns, Split, TensorData


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


HF_TASKS = ("causal_lm", "masked_lm", "seq2seq_lm", "sequence_classification",
            "token_classification")


def synthetic_hf_tokens(
    task: str = "causal_lm",
    batch_size: BatchSize = 8,
    eval_batch_size: BatchSize = 8,
    vocab_size: int = 1024,
    seq_len: int = 128,
    num_labels: int = 2,
    pad_token_id: int = 0,
    eos_token_id: int | None = None,
    num_train: int = 1024,
    num_eval: int = 128,
    padding: float = 0.25,
    noise: float = 0.1,
    seed: int = 0,
) -> TensorData:
    """Mapping batches for a Hugging Face task: `input_ids`, `attention_mask` and `labels`.

    Each sequence ends in up to `padding` x seq_len padding positions (id `pad_token_id`, mask
    0, label -100), so the attention mask matters. Learnable, with a `noise` share of random
    tokens:
    - causal_lm: each token follows from the two before it by a fixed linear rule mod the
      vocabulary; labels are the inputs (the model shifts them);
    - seq2seq_lm (encoder-decoders): the same sequences, each ending in `eos_token_id`, as a
      tokenizer ends them; labels are the inputs, to copy (the model builds its decoder's
      inputs from them, shifted right after its decoder_start_token_id);
    - masked_lm: the same sequences with 15% of tokens replaced by the last id, labelled there;
    - sequence_classification: one label per sequence; its tokens are mostly those whose id is
      the label modulo num_labels;
    - token_classification: each token's label is its id modulo num_labels.
    Memory is linear in the vocabulary, so real vocabularies (50k words) cost nothing."""
    if task not in HF_TASKS:
        raise ValueError(f"data.task={task}: choose one of {', '.join(HF_TASKS)} (data=hf_tokens "
                         "follows model.task)")
    if not 0 <= padding < 1:
        raise ValueError(f"data.padding={padding}: must be in [0, 1)")
    if task == "seq2seq_lm" and eos_token_id is None:
        raise ValueError("data.eos_token_id: seq2seq_lm sequences end in the model's "
                         "end-of-sequence id, and the model's config has none: set "
                         "+model.config.eos_token_id (or data.eos_token_id)")
    generator = torch.Generator().manual_seed(seed)
    # The rule's factors are coprime to the vocabulary, so that it reaches every token.
    coprime = [f for f in range(1, vocab_size) if math.gcd(f, vocab_size) == 1]
    a, b = (coprime[int(i)] for i in torch.randint(len(coprime), (2,), generator=generator))
    c = int(torch.randint(vocab_size, (), generator=generator))

    def split(count: int) -> Columns:
        tokens = torch.randint(vocab_size, (count, seq_len), generator=generator)
        labels_per_sequence = torch.randint(num_labels, (count,), generator=generator)
        if task == "sequence_classification":
            # ids of the label's residue class, except for the noise share
            bands = torch.randint(max(vocab_size // num_labels, 1), (count, seq_len),
                                  generator=generator)
            banded = (bands * num_labels + labels_per_sequence[:, None]) % vocab_size
            keep = torch.rand(count, seq_len, generator=generator) >= noise
            tokens = torch.where(keep, banded, tokens)
        elif task != "token_classification":
            for t in range(2, seq_len):
                keep = torch.rand(count, generator=generator) >= noise
                follow = (a * tokens[:, t - 1] + b * tokens[:, t - 2] + c) % vocab_size
                tokens[:, t] = torch.where(keep, follow, tokens[:, t])
        lengths = seq_len - torch.randint(int(padding * seq_len) + 1, (count,),
                                          generator=generator)
        mask = (torch.arange(seq_len) < lengths[:, None]).long()
        if task == "seq2seq_lm":
            tokens[torch.arange(count), lengths - 1] = eos_token_id
        if task == "sequence_classification":
            labels = labels_per_sequence
        elif task == "token_classification":
            labels = tokens % num_labels
        elif task == "masked_lm":
            masked = (torch.rand(count, seq_len, generator=generator) < 0.15) & mask.bool()
            labels = torch.where(masked, tokens, IGNORE)
            tokens = torch.where(masked, vocab_size - 1, tokens)
        else:
            labels = tokens.clone()
        if labels.dim() == 2:
            labels = labels.masked_fill(mask == 0, IGNORE)
        return Columns({"input_ids": tokens.masked_fill(mask == 0, pad_token_id),
                        "attention_mask": mask, LABELS: labels})

    train = split(num_train)
    return TensorData(train, split(num_eval), batch_size, eval_batch_size, seed,
                      unit="tokens", items_per_sample=seq_len)

