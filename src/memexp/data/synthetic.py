"""Learnable synthetic data, generated in memory, deterministic by seed: the embedded defaults,
and token batches in the shape Hugging Face models take."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from memexp.data.tensors import IGNORE, LABELS, Batch, BatchSize, Columns, Split, TensorData
from memexp.models.hf import check_choice, hf_config


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
    num_train: int = 1024,
    num_eval: int = 128,
    padding: float = 0.25,
    noise: float = 0.1,
    seed: int = 0,
    model: dict | None = None,
) -> TensorData:
    """Mapping batches for a Hugging Face task: `input_ids`, `attention_mask` and `labels`;
    for the audio tasks, the features and labels of `synthetic_hf_audio`. `model` is model=hf's
    arch, config, config_extra and pretrained (all None with another model): the data agrees
    with the config its model is built from (model_config), for the padding and end-of-sequence
    ids here and the audio's shapes.

    Each sequence ends in up to `padding` x seq_len padding positions (id: the config's
    pad_token_id, else 0; mask 0, label -100), so the attention mask matters. Learnable, with a
    `noise` share of random tokens:
    - causal_lm: each token follows from the two before it by a fixed linear rule mod the
      vocabulary; labels are the inputs (the model shifts them);
    - seq2seq_lm (encoder-decoders): the same sequences, each ending in the config's
      eos_token_id, as a tokenizer ends them; labels are the inputs, to copy (the model builds
      its decoder's inputs from them, shifted right after its decoder_start_token_id);
    - masked_lm: the same sequences with 15% of tokens replaced by the last id, labelled there;
    - sequence_classification: one label per sequence; its tokens are mostly those whose id is
      the label modulo num_labels;
    - token_classification: each token's label is its id modulo num_labels.
    Memory is linear in the vocabulary, so real vocabularies (50k words) cost nothing."""
    if not 0 <= padding < 1:
        raise ValueError(f"data.padding={padding}: must be in [0, 1)")
    if task not in HF_TASKS + AUDIO_TASKS:
        raise ValueError(f"data.task={task}: choose one of {', '.join(HF_TASKS + AUDIO_TASKS)} "
                         "(data=hf_tokens follows model.task)")
    config = model_config(model, task)
    if task in AUDIO_TASKS:
        return synthetic_hf_audio(task, config, batch_size, eval_batch_size, seq_len, num_train,
                                  num_eval, padding, seed)
    shortest = seq_len - int(padding * seq_len)
    if task == "causal_lm" and shortest < 2:
        raise ValueError(
            f"data.seq_len={seq_len}: a causal LM predicts each token from the ones before it, "
            f"and the shortest sequence here is {shortest} token{'s' * (shortest != 1)} long "
            f"(up to data.padding={padding} of data.seq_len is padding), with nothing to "
            "predict: a batch of such sequences has no target, and its loss is nan (0 / 0). "
            "Make every sequence 2 tokens or longer: a larger data.seq_len, or a smaller "
            "data.padding")
    # GPT-2's config has no pad id
    pad_token_id = 0 if getattr(config, "pad_token_id", None) is None else config.pad_token_id
    eos_token_id = getattr(config, "eos_token_id", None)
    if config is not None:
        check_written_ids(config, task, {
            **({"pad_token_id": (pad_token_id, "padding the input_ids")}
               if shortest < seq_len else {}),
            **({"eos_token_id": (eos_token_id, "ending each sequence")}
               if task == "seq2seq_lm" else {})})
    elif task == "seq2seq_lm":
        raise ValueError("data.task=seq2seq_lm: its sequences end in the model's "
                         "end-of-sequence id, and there is no model config to take it from: "
                         "use it with model=hf")
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


AUDIO_TASKS = ("speech_seq2seq", "ctc")


def check_written_ids(config, task: str, written: dict[str, tuple[int | None, str]]) -> None:
    """The ids of the model's `config` that the synthetic batches hold (`written`: each one's
    key, its value and where the data writes it) must exist and be rows of the vocabulary that
    the model looks them up in: with +model.config.vocab_size=1000, Whisper's eos_token_id of
    50256 ended each transcript, and the decoder's lookup failed, blamed on a position table.
    The model's own ids (pad_token_id as its embeddings' padding_idx, an encoder-decoder's
    decoder_start_token_id) are checked as it is built (memexp.models.hf)."""
    name = type(config).__name__
    for key, (value, where) in written.items():
        if not isinstance(value, int):  # none, or several (Qwen3-ASR's end-of-sequence pair)
            raise ValueError(f"data.task={task}: the synthetic batches hold the model's {key} "
                             f"({where}), and {name}'s is {value!r}, not one id: set "
                             f"+model.config.{key}=...")
    vocab = config.get_text_config(decoder=True).to_dict().get("vocab_size")
    past = {key: (value, where) for key, (value, where) in written.items()
            if vocab is not None and not 0 <= value < vocab}
    if past:
        held = ", ".join(f"{key}={value} ({where})" for key, (value, where) in past.items())
        raise ValueError(
            f"data.task={task}: the synthetic batches hold {name}'s {held}, past its vocabulary "
            f"of {vocab} (ids 0 to {vocab - 1}), and the model looks "
            f"{'it' if len(past) == 1 else 'them'} up: set "
            + " and ".join(f"+model.config.{key}=..." for key in past)
            + " within it, or a larger vocab_size")


def model_config(model: dict | None, task: str):
    """The transformers config that model=hf builds its model from (memexp.models.hf.hf_config),
    for data that must agree with it; None with another model (no `arch`). An unknown
    architecture, a task it lacks, a folder that holds no config or another model's: refused
    here (the data is built first) as the model's build would refuse them."""
    if not model or model.get("arch") is None:
        return None
    check_choice(model["arch"], task)
    return hf_config(model["arch"], model.get("config"), model.get("config_extra"),
                     model.get("pretrained"))


def synthetic_hf_audio(task: str, config, batch_size: BatchSize,
                       eval_batch_size: BatchSize, seq_len: int, num_train: int, num_eval: int,
                       padding: float, seed: int) -> TensorData:
    """Audio batches shaped by the model's own `config` (model_config's):
    - speech_seq2seq (Whisper): `input_features`, num_mel_bins x 2 * max_source_positions
      log-mel frames (the one length Whisper's encoder takes), and `labels` of seq_len tokens
      at most (max_target_positions), each transcript ending in eos_token_id; the model starts
      its decoder inputs with decoder_start_token_id itself, as in fine-tuning;
    - ctc (wav2vec2, HuBERT): `input_values`, the raw samples from which the conv feature
      encoder (conv_kernel, conv_stride) makes exactly seq_len frames, and `labels` of up to
      seq_len // 3 characters (about the rate of speech: 15 a second against wav2vec2's 50
      frames), never the blank (pad_token_id).
    Each clip is one of 16 classes: a fixed pattern under unit noise, transcribed as that class's
    token sequence, so the task is learnable. Transcripts end in up to `padding` x their length
    of label -100. Clips are made from (seed, index) when batched: a set of long clips is never
    held in memory."""
    if config is None:
        raise ValueError(f"data.task={task}: synthetic audio is shaped by the model's config; "
                         "use it with model=hf")
    name = type(config).__name__
    needs = {"speech_seq2seq": ("num_mel_bins", "max_source_positions", "max_target_positions"),
             "ctc": ("conv_kernel", "conv_stride")}[task]
    lacking = [key for key in needs if key not in config.to_dict()]
    if lacking:
        raise ValueError(f"data.task={task}: synthetic features need the config's "
                         f"{', '.join(needs)} (Whisper's log-mel frames, wav2vec2's conv "
                         f"feature encoder), and {name} has no {', '.join(lacking)}. Give real "
                         "features with data=hf_local")
    if task == "speech_seq2seq":
        key, shape = "input_features", (config.num_mel_bins, 2 * config.max_source_positions)
        if seq_len > config.max_target_positions:
            raise ValueError(f"data.seq_len={seq_len}: {name} takes transcripts of at most "
                             f"max_target_positions={config.max_target_positions} tokens")
        check_written_ids(config, task,
                          {"eos_token_id": (config.eos_token_id, "ending each transcript")})
        length, ends = seq_len, [config.eos_token_id]
        specials = {config.eos_token_id, config.pad_token_id, config.bos_token_id,
                    config.decoder_start_token_id}
    else:
        # the samples that the conv layers reduce to seq_len frames, from the last layer back
        samples = seq_len
        for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride,
                                                strict=True))):
            samples = (samples - 1) * stride + kernel
        key, shape = "input_values", (samples,)
        check_spec_augment(config, seq_len)
        length, ends = max(seq_len // 3, 1), []
        specials = {config.pad_token_id, config.bos_token_id, config.eos_token_id}
    ordinary = torch.tensor([i for i in range(config.vocab_size) if i not in specials])
    generator = torch.Generator().manual_seed(seed)
    classes = 16
    patterns = torch.randn(classes, *shape, generator=generator)
    transcripts = ordinary[torch.randint(len(ordinary), (classes, length - len(ends)),
                                         generator=generator)]
    ends = torch.tensor(ends, dtype=torch.long)  # ids, even where there are none (ctc)
    transcripts = torch.cat([transcripts, ends.expand(classes, len(ends))], 1)

    def split(count: int) -> Clips:
        labels_of = torch.randint(classes, (count,), generator=generator)
        lengths = length - torch.randint(int(padding * length) + 1, (count,), generator=generator)
        labels = transcripts[labels_of]
        if len(ends):  # the transcript ends in eos wherever it is cut
            labels[torch.arange(count), lengths - 1] = ends[0]
        labels = labels.masked_fill(torch.arange(length) >= lengths[:, None], IGNORE)
        base = int(torch.randint(2**62, (), generator=generator))
        return Clips(key, patterns, labels_of, base, Columns({LABELS: labels}))

    train = split(num_train)
    return TensorData(train, split(num_eval), batch_size, eval_batch_size, seed)


def check_spec_augment(config, frames: int) -> None:
    """A CTC model's SpecAugment (wav2vec2's and its kin's) masks spans of mask_time_length
    frames while it trains, where mask_time_prob > 0 and apply_spec_augment (read as their
    models read it: true where the config lacks it); transformers refuses clips of fewer
    frames deep in the forward pass, naming neither key ("`mask_length` has to be smaller
    than `sequence_length`")."""
    keys = config.to_dict()
    if not (getattr(config, "apply_spec_augment", True) and keys.get("mask_time_prob")):
        return
    span = keys["mask_time_length"]
    if span > frames:
        raise ValueError(
            f"data.seq_len={frames}: {type(config).__name__}'s SpecAugment masks spans of "
            f"mask_time_length={span} frames in training (mask_time_prob="
            f"{keys['mask_time_prob']}), and the synthetic clips are {frames} frames long "
            f"(data.seq_len): set data.seq_len={span} or more, +model.config.mask_time_length="
            f"{frames} or less, or +model.config.mask_time_prob=0 (no masking)")


@dataclass
class Clips:
    """Audio samples made when taken: sample i is its class's pattern plus unit noise drawn
    from a generator seeded with `base + i`, followed by its stored `columns`."""

    key: str
    patterns: Tensor
    classes: Tensor
    base: int
    columns: Columns

    def __len__(self) -> int:
        return len(self.classes)

    def take(self, index: Tensor) -> Batch:
        noise = torch.stack([
            torch.randn(self.patterns.shape[1:],
                        generator=torch.Generator().manual_seed(self.base + int(i)))
            for i in index])
        return {self.key: self.patterns[self.classes[index]] + noise, **self.columns.take(index)}
