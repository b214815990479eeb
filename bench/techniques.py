"""Every technique against its baseline, on the ResNet, the transformer, three Hugging Face
models (GPT-2, BERT and T5 from configs) and two timm models (ConvNeXt and ViT), random weights,
on CPU.

For each row:
- peak bytes and activation bytes (the meter's overall peak and its running peak of live
  activations), over two training steps, and their ratios to the model's baseline row;
- the step-time ratio to the baseline: every row's steps are interleaved round-robin (the order
  rotating each round) and compared by their medians, since CPU wall time drifts too much here
  for anything else;
- gradient bytes at their own peak, and the optimizer state after a step;
- the correctness error: the first step's gradients (unscaled, for loss-scaled precision)
  against the row they should equal (`ref`), as |g - g_ref| / |g_ref| over all gradients
  together. Optimizers and BatchNorm variants differ by design; they show "-".

The HF and timm models get the rows that concern them (checkpointing none/full/selective/
selective_ops/offload, beside the library's own for HF, bf16, accumulation; loss=chunked_ce for
causal LMs). Their tables show the saved activations, what the peak holds beyond parameters and
gradients (by category: activations, the loss's own, other), and the first 3 per-step losses
against the reference row's, in place of the gradient-peak and optimizer columns.

With --estimate, each HF or timm row's `memexp estimate` against a real run of what it
predicts (two steps and an evaluation, the live-storage tracker). With --adapters, only LoRA and
QLoRA against full fine-tuning (AdamW), by category at the peak (adapter_table); with both,
their estimates against real runs. With --optimizers, only the optimizer options against AdamW
(optimizer_table: their state, their loss after 20 steps; optim.offload=cpu on the fake H100
where the CUDA build is installed); with both, their estimates against real runs.

compile=default and checkpointing=budget have their rows in bench/compile_budget.py: a compiled
model is measured by the CPU allocator's count, which has no activation peak or breakdown for
these tables.

    python bench/techniques.py [--model resnet|transformer|hf-gpt2|...|timm-vit|all]
                               [--rounds 5] [--estimate] [--rows NAME ...] [--adapters]
                               [--optimizers]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from hydra import compose, initialize_config_dir
from machine import describe_machine

from memexp.config import config_dir
from memexp.estimate import estimate
from memexp.first_steps import first_steps
from memexp.loggers import NoLogger
from memexp.trainer import Trainer

MIB = 2**20

MODELS = {
    # ResNet-18 at width 32, batch 32: the model MMEngine's fold was measured on.
    "resnet": ("model=resnet", "model.width=32", "data.batch_size=32", "optim=sgd"),
    # Eight layers: one recomputed block is then an eighth of the model. (model=transformer
    # brings optim=adamw; plain SGD keeps every row one change away from the baseline.)
    "transformer": ("model=transformer", "model.n_layers=8", "data.batch_size=16", "optim=sgd"),
    # transformers' own GPT-2 and BERT, through the generic path (no adapter): 4 layers at width
    # 128, a 2k vocabulary, 64 tokens, small enough for a few minutes on 2 busy cores.
    # loss=model is their own loss.
    "hf-gpt2": ("model=hf", "model.arch=gpt2", "model.task=causal_lm", "+model.config.n_layer=4",
                "+model.config.n_embd=128", "+model.config.n_head=4",
                "+model.config.vocab_size=2048", "data.seq_len=64", "data.batch_size=8",
                "optim=sgd"),
    "hf-bert": ("model=hf", "model.arch=bert", "model.task=sequence_classification",
                "+model.config.num_hidden_layers=4", "+model.config.hidden_size=128",
                "+model.config.num_attention_heads=4", "+model.config.intermediate_size=512",
                "+model.config.vocab_size=2048", "data.seq_len=64", "data.batch_size=8",
                "optim=sgd"),
    # An encoder-decoder (model.task=seq2seq_lm): T5-small's depth (6 encoder and 6 decoder
    # blocks) and structure at a quarter of its width (d_model 128 for 512, feed-forward 512 for
    # 2048, 4 heads of 32 for 8 of 64) and the 2k vocabulary of the others: 3M parameters. At
    # its full width (45M parameters with this vocabulary) a step took 20 s on 2 busy cores.
    "hf-t5": ("model=hf", "model.arch=t5", "model.task=seq2seq_lm", "+model.config.d_model=128",
              "+model.config.d_ff=512", "+model.config.num_heads=4", "+model.config.d_kv=32",
              "+model.config.vocab_size=2048", "data.seq_len=64", "data.batch_size=8",
              "optim=sgd"),
    # timm's smallest ConvNeXt and ViT-Tiny, by their registry names, on 64-pixel images (the
    # ViT's patch grid resized to them: 4x4 patches and a class token).
    "timm-convnext": ("model=timm", "model.name=convnext_atto", "data.image_size=64",
                      "data.batch_size=16", "optim=sgd"),
    "timm-vit": ("model=timm", "model.name=vit_tiny_patch16_224", "+model.kwargs.img_size=64",
                 "data.image_size=64", "data.batch_size=32", "optim=sgd"),
    # Whisper-tiny, whose sizes are WhisperConfig's defaults (4+4 layers at width 384, 6 heads,
    # 80 mel bins, a 51865-token vocabulary), on 64-token transcripts, batch 4. Its windows are
    # cut from 30 s (3000 frames) to 7.5 s (max_source_positions 375): a step of the full
    # window took 20 s on 2 busy cores.
    "hf-whisper-tiny": ("model=hf", "model.arch=whisper", "model.task=speech_seq2seq",
                        "+model.config.max_source_positions=375", "data.seq_len=64",
                        "data.batch_size=4", "data.num_train=64", "data.num_eval=8",
                        "optim=sgd"),
    # A Llama from LlamaConfig at a small width (4 layers of 128, 4 heads sharing 2 KV heads,
    # SwiGLU 344) with Llama 2's 32k vocabulary, on 256 tokens, batch 4: the vocabulary-sized
    # logits are then a large share of the peak, as they are in the real ones.
    "hf-llama": ("model=hf", "model.arch=llama", "model.task=causal_lm",
                 "+model.config.num_hidden_layers=4", "+model.config.hidden_size=128",
                 "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=2",
                 "+model.config.intermediate_size=344", "+model.config.vocab_size=32000",
                 "data.seq_len=256", "data.batch_size=4", "optim=sgd"),
    # wav2vec2-base, whose sizes are Wav2Vec2Config's defaults (12 layers at width 768, the
    # 7-layer conv feature encoder), on 1 s of 16 kHz audio (49 frames), batch 4; the CTC loss
    # a mean over the batch, as fine-tuning sets it (a sum by default).
    "hf-wav2vec2-base": ("model=hf", "model.arch=wav2vec2", "model.task=ctc",
                         "+model.config.ctc_loss_reduction=mean", "data.seq_len=49",
                         "data.batch_size=4", "data.num_train=64", "data.num_eval=8",
                         "optim=sgd"),
}

# The HF correctness runs switch dropout off: a micro-batch of 2 draws other masks than a batch
# of 8, so accumulation could not match the baseline with it. (Checkpointing replays the same
# masks: tests/test_any_model.py checks its losses with dropout on.) Memory keeps dropout, as
# the models train.
NO_DROPOUT = {
    "hf-gpt2": ("+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0",
                "+model.config.attn_pdrop=0"),
    "hf-bert": ("+model.config.hidden_dropout_prob=0",
                "+model.config.attention_probs_dropout_prob=0"),
    "hf-t5": ("+model.config.dropout_rate=0",),
    # timm builds them with drop_rate=0 and drop_path_rate=0: nothing to switch off.
    "timm-convnext": (),
    "timm-vit": (),
    "hf-whisper-tiny": (),  # its dropouts are 0 by default
    "hf-llama": (),  # LlamaConfig's attention_dropout is 0 by default
    # and SpecAugment's masks, and LayerDrop
    "hf-wav2vec2-base": ("+model.config.hidden_dropout=0", "+model.config.attention_dropout=0",
                         "+model.config.activation_dropout=0", "+model.config.feat_proj_dropout=0",
                         "+model.config.final_dropout=0", "+model.config.layerdrop=0",
                         "+model.config.mask_time_prob=0"),
}
LOSS_STEPS = 3  # the HF tables compare this many per-step losses with the reference's

# What --estimate's rows (and the real runs they are set against) add: `memexp estimate` refuses
# a branch on a value drawn at random, as LayerDrop's; at 0, every layer runs (the most memory).
ESTIMATE_EXTRA = {"hf-wav2vec2-base": ("+model.config.layerdrop=0",)}


BASELINE = "baseline: fp32, none, sgd"


@dataclass
class Row:
    name: str
    overrides: tuple[str, ...]
    ref: str | None = BASELINE  # the row whose gradients this one should match


def batch_of(model: str) -> int:
    return int(next(o for o in MODELS[model] if o.startswith("data.batch_size")).split("=")[1])


def accumulation_row(model: str) -> Row:
    """optim.accumulate=4 at a quarter of the batch: the same samples per optimizer step."""
    return Row("optim.accumulate=4 (batch/4)",
               ("optim.accumulate=4", f"data.batch_size={batch_of(model) // 4}"))


def hf_rows(model: str) -> list[Row]:
    """The HF and timm models' rows: every checkpointing option that applies to them, beside the
    library's own for HF, bf16 and accumulation (sequential is refused on HF's nn.ModuleList).
    A causal LM's loss is a mean over each micro-batch's labelled tokens, whose number padding
    varies: accumulation is also compared on data without padding."""
    rows = [
        Row(BASELINE, ()),
        Row("checkpointing=full", ("checkpointing=full",)),
        Row("checkpointing=selective every=2", ("checkpointing=selective",)),
        Row("checkpointing=selective_ops", ("checkpointing=selective_ops",)),
        Row("checkpointing=offload", ("checkpointing=offload",)),
        Row("precision=bf16", ("precision=bf16",)),
        accumulation_row(model),
        Row("checkpointing=full_offload", ("checkpointing=full_offload",)),
    ]
    if "model=hf" in MODELS[model]:
        rows.insert(5, Row("the library's own gradient checkpointing",
                           ("model.gradient_checkpointing=true",)))
    if "model.task=causal_lm" in MODELS[model]:
        # the model's own loss against its head applied a chunk of 256 tokens at a time
        rows.append(Row("loss=chunked_ce", ("loss=chunked_ce",)))
        unpadded = Row("baseline, data.padding=0", ("data.padding=0",), ref=None)
        accumulated = accumulation_row(model)
        rows += [unpadded, Row(f"{accumulated.name}, data.padding=0",
                               (*accumulated.overrides, "data.padding=0"), ref=unpadded.name)]
        # Other parameters train (the adapters, not the weights): no gradient to compare.
        rows += [Row("adapter=lora", ("adapter=lora",), ref=None),
                 Row("adapter=qlora", ("adapter=qlora",), ref=None)]
    return rows


# The adapter table's rows, against full fine-tuning with AdamW (what LoRA saves is gradients
# and optimizer state, which plain SGD has little of); dropout > 0 keeps a dropped-out copy of
# each adapted layer's input (peft#1514, #2196), checkpointing recomputes it.
ADAPTER_ROWS = [
    Row("full fine-tuning (adamw)", ()),
    Row("adapter=lora", ("adapter=lora",), ref=None),
    Row("adapter=lora dropout=0.1", ("adapter=lora", "adapter.dropout=0.1"), ref=None),
    Row("adapter=qlora", ("adapter=qlora",), ref=None),
    Row("adapter=qlora dropout=0.1", ("adapter=qlora", "adapter.dropout=0.1"), ref=None),
    Row("full fine-tuning, checkpointing=full", ("checkpointing=full",)),
    Row("adapter=lora, checkpointing=full", ("adapter=lora", "checkpointing=full"), ref=None),
    Row("adapter=lora dropout=0.1, checkpointing=full",
        ("adapter=lora", "adapter.dropout=0.1", "checkpointing=full"), ref=None),
]
ADAPTER_CATEGORIES = ("params", "frozen", "grads", "optimizer", "activations", "other")


def rows_for(model: str) -> list[Row]:
    rows = [
        Row(BASELINE, ()),
        Row("precision=amp", ("precision=amp",)),
        Row("precision=bf16", ("precision=bf16",)),
        Row("precision=bf16_pure", ("precision=bf16_pure",)),
        Row("precision=fp16_pure master_weights", ("precision=fp16_pure",
                                                   "precision.master_weights=true")),
        Row("checkpointing=full", ("checkpointing=full",)),
        Row("checkpointing=selective every=2", ("checkpointing=selective",)),
        Row("checkpointing=selective_ops", ("checkpointing=selective_ops",)),
        Row("checkpointing=offload", ("checkpointing=offload",)),
        Row("optim=sgd_momentum", ("optim=sgd_momentum",), ref=None),
        Row("optim=adamw", ("optim=adamw",), ref=None),
        Row("optim=adafactor", ("optim=adafactor",), ref=None),
        Row("optim=adamw_8bit", ("optim=adamw_8bit",), ref=None),
        Row("optim=adamw in_backward", ("optim=adamw", "optim.in_backward=true"),
            ref="optim=adamw"),
    ]
    rows.append(accumulation_row(model))
    rows.insert(8, Row("checkpointing=sequential segments=2", ("checkpointing=sequential",)))
    if model == "resnet":
        rows += [
            Row("bn_mode=eval", ("bn_mode=eval",), ref=None),
            Row("bn_mode=efficient_eval", ("bn_mode=efficient_eval",), ref="bn_mode=eval"),
            Row("bn_mode=group_norm", ("bn_mode=group_norm",), ref=None),
            Row("model.inplace=true", ("model.inplace=true",)),
        ]
    return rows


# The optimizer options against AdamW (--optimizers): their state, and what they learn in
# OPTIMIZER_STEPS steps, all measured (the storage tracker runs torchao's steps eagerly, as
# compiled on 2 CPU cores each took 15-55 s).
OPTIMIZER_ROWS = [Row(f"optim={name}", (f"optim={name}",), ref=None) for name in
                  ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit", "adamw_fp8", "muon")]
OPTIMIZER_STEPS = 20


def optimizer_table(model: str) -> str:
    """Each optimizer option over OPTIMIZER_STEPS steps against AdamW: the peak, the optimizer's
    state in the optimizer phase (the meter reads it from the optimizer's own tensors), the
    loss at the last step and the mean of the last 5; then optim.offload=cpu, refused on CPU,
    estimated on the fake H100 where the CUDA build is installed (offload_table)."""
    lines = [f"| {model}: optimizer | peak MiB | optimizer MiB | x adamw | loss at step "
             f"{OPTIMIZER_STEPS} | x adamw | mean of the last 5 | x adamw |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    runs = {}
    for row in OPTIMIZER_ROWS:
        trainer = Trainer(compose_row(model, row, f"trainer.max_steps={OPTIMIZER_STEPS}",
                                      f"memory.measure_steps={OPTIMIZER_STEPS}"))
        runs[row.name] = (trainer, trainer.fit(NoLogger()).losses, trainer.meter.report())
    _, base_losses, base = runs[OPTIMIZER_ROWS[0].name]
    base_state = base["phases"]["optimizer"]["breakdown"]["optimizer"]
    for name, (_, losses, memory) in runs.items():
        state = memory["phases"]["optimizer"]["breakdown"]["optimizer"]
        tail, base_tail = sum(losses[-5:]) / 5, sum(base_losses[-5:]) / 5
        lines.append(f"| {name} | {memory['peak_bytes'] / MIB:.2f} | {state / MIB:.2f} | "
                     f"{state / base_state:.3f} | {losses[-1]:.4f} | "
                     f"{losses[-1] / base_losses[-1]:.4f} | {tail:.4f} | {tail / base_tail:.4f} |")
    muon = runs["optim=muon"][0]
    stepped = sum(p.numel() for g in muon.optimizer.optimizers[0].param_groups for p in g["params"])
    trained = sum(p.numel() for p in muon.model.parameters() if p.requires_grad)
    lines.append(f"\nmuon steps {stepped:,} of the {trained:,} trained parameters "
                 f"({stepped / trained:.0%}): the blocks' 2-D weights; AdamW the rest. "
                 f"Loss at step 1: {base_losses[0]:.4f}. Overrides: {' '.join(MODELS[model])}")
    lines.append(f"\n{muon_where_blocks_hold_most(model)}")
    try:
        Trainer(compose_row(model, Row("offload", ("optim=adamw", "optim.offload=cpu"))))
    except ValueError as refused:
        lines.append(f"\noptim.offload=cpu on CPU: refused ({str(refused).split(':')[1].strip()})")
    return "\n".join(lines + ["", offload_table(model)])


def muon_where_blocks_hold_most(model: str, vocab: int = 64) -> str:
    """Muon against AdamW on the same model with a `vocab`-word vocabulary, where the blocks'
    2-D weights are most of the parameters (the bench models' embeddings and head are not)."""
    small = f"++model.config.vocab_size={vocab}"
    state, share = {}, 0.0
    for name in ("adamw", "muon"):
        trainer = Trainer(compose_row(model, Row(name, (f"optim={name}", small)),
                                      "trainer.max_steps=2"))
        state[name] = two_steps(trainer)["phases"]["optimizer"]["breakdown"]["optimizer"]
        if name == "muon":
            stepped = sum(p.numel() for g in trainer.optimizer.optimizers[0].param_groups
                          for p in g["params"])
            share = stepped / sum(p.numel() for p in trainer.model.parameters())
    return (f"muon at a {vocab}-word vocabulary ({share:.0%} of the parameters in the blocks' "
            f"2-D weights): optimizer state {state['muon'] / MIB:.2f} MiB against AdamW's "
            f"{state['adamw'] / MIB:.2f} MiB, {state['muon'] / state['adamw']:.3f}x")


def offload_table(model: str) -> str:
    """AdamW with and without optim.offload=cpu (and offload_gradients), estimated for an H100
    on the CUDA build's fake device: the device's optimizer state and gradients, the host's
    bytes, and what a step copies to the host and back."""
    from memexp.cudatrace import cuda_python

    if cuda_python() is None:
        return "(no CUDA build of torch: `make cuda-estimator` for the offload rows)"
    lines = [f"| {model}: on the fake h100 | allocated peak MiB | device optimizer MiB | "
             "device grads MiB (optimizer phase) | host peak MiB | to host MiB/step | "
             "to device MiB/step |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, extra in (("optim=adamw", ()), ("optim.offload=cpu", ("optim.offload=cpu",)),
                        ("+ optim.offload_gradients", ("optim.offload=cpu",
                                                       "optim.offload_gradients=true"))):
        memory = estimate(compose_row(model, Row(name, ("optim=adamw", *extra)),
                                      "trainer.device=cuda"), "cuda", "h100").memory
        at_step = memory["phases"]["optimizer"]["breakdown"]
        moved = memory["transfer_bytes_per_step"]
        lines.append(f"| {name} | {memory['allocated_peak_bytes'] / MIB:.2f} | "
                     f"{at_step['optimizer'] / MIB:.2f} | {at_step['grads'] / MIB:.2f} | "
                     f"{memory['offloaded_peak_bytes'] / MIB:.2f} | "
                     f"{moved['to_host'] / MIB:.2f} | {moved['to_device'] / MIB:.2f} |")
    return "\n".join(lines)


def compose_row(model: str, row: Row, *extra: str):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=["trainer.device=cpu", "trainer.progress=false",
                                           *MODELS[model], *row.overrides, *extra])


def memory_of(model: str, row: Row) -> dict:
    return two_steps(Trainer(compose_row(model, row)))


def two_steps(trainer: Trainer) -> dict:
    """The meter's report over two training steps."""
    batches = trainer.data.train_batches()
    trainer.model.train()
    with trainer.meter:
        for _ in range(2):
            trainer.train_step(batches)
    return trainer.meter.report()


def correctness_run(model: str, row: Row, *extra: str,
                    steps: int = 1) -> tuple[torch.Tensor, list[float]]:
    """The first step's gradients (all of them, flat, unscaled) and the loss of each of `steps`
    steps, with plain SGD."""
    trainer = Trainer(compose_row(model, row, "memory.track=false", "optim=sgd",
                                  "optim.in_backward=false", *extra))
    trainer.model.train()
    # those that train (Whisper's encoder keeps its sinusoidal positions frozen)
    params = [param for param in trainer.model.parameters() if param.requires_grad]
    captured: dict[int, torch.Tensor] = {}
    # After the last micro-batch's backward, the hook holds the step's whole gradient.
    hooks = [param.register_post_accumulate_grad_hook(
        lambda p, index=index: captured.__setitem__(index, p.grad.detach().float().clone()))
        for index, param in enumerate(params)]
    scale = trainer.precision.loss_scale()  # the step may change it; read it before
    batches = trainer.data.train_batches()
    losses = [trainer.train_step(batches)]
    for hook in hooks:
        hook.remove()
    losses += [trainer.train_step(batches) for _ in range(steps - 1)]
    return torch.cat([captured[i].flatten() for i in range(len(params))]) / scale, losses


def gradient_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def step_times(model: str, rows: list[Row], rounds: int) -> dict[str, float]:
    """Median step time of every row, the rows' steps interleaved round-robin."""
    trainers = {row.name: Trainer(compose_row(model, row, "memory.track=false")) for row in rows}
    streams = {name: t.data.train_batches() for name, t in trainers.items()}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for round_ in range(rounds + 1):  # the first round warms up
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            trainers[name].model.train()
            started = time.perf_counter()
            trainers[name].train_step(streams[name])
            if round_:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def table(model: str, rounds: int) -> str:
    rows = rows_for(model)
    memory = {row.name: memory_of(model, row) for row in rows}
    # Optimizer-in-backward's step equals the regular one (tested); its gradients are those of
    # adamw's and are taken with a regular step here.
    gradients = {row.name: correctness_run(model, row)[0] for row in rows
                 if row.ref is not None or any(r.ref == row.name for r in rows)}
    times = step_times(model, rows, rounds)
    base = memory[rows[0].name]
    lines = [
        f"| {model}: technique | peak MiB | x base | activations MiB | x base | grads peak MiB"
        " | optimizer MiB | step time x base | gradient error vs ref |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = memory[row.name]
        error = "-"
        if row.ref is not None:
            error = f"{gradient_error(gradients[row.name], gradients[row.ref]):.1e}"
            if row.ref != BASELINE:
                error += f" (vs {row.ref})"
        peak, activations = m["peak_bytes"], m["activations_peak_bytes"]
        optimizer = m["phases"]["optimizer"]["breakdown"]["optimizer"]
        lines.append(
            f"| {row.name} | {peak / MIB:.1f} | {peak / base['peak_bytes']:.2f}"
            f" | {activations / MIB:.1f} | {activations / base['activations_peak_bytes']:.2f}"
            f" | {m['grads_peak_bytes'] / MIB:.1f} | {optimizer / MIB:.1f}"
            f" | {times[row.name] / times[rows[0].name]:.2f} | {error} |"
        )
    lines.append(f"\nbaseline step time {times[rows[0].name] * 1e3:.0f} ms (median of {rounds}); "
                 f"overrides: {' '.join(MODELS[model])}")
    return "\n".join(lines)


def chosen_rows(rows: list[Row], only: list[str] | None) -> list[Row]:
    """The rows whose names hold one of `only` (all without it), with the rows they are
    compared with."""
    if not only:
        return rows
    chosen = {row.name for row in rows if any(part in row.name for part in only)}
    chosen |= {row.ref for row in rows if row.name in chosen and row.ref is not None}
    return [row for row in rows if row.name in chosen or row.name == BASELINE]


def hf_table(model: str, rounds: int, only: list[str] | None = None) -> str:
    """The HF model's rows: memory with dropout on, as it trains; per-step losses and the first
    step's gradients with dropout off, against the row they should equal."""
    rows = chosen_rows(hf_rows(model), only)
    memory = {row.name: memory_of(model, row) for row in rows}
    correct = {row.name: correctness_run(model, row, *NO_DROPOUT[model], steps=LOSS_STEPS)
               for row in rows}
    times = step_times(model, rows, rounds)
    base = memory[BASELINE]
    lines = [
        f"| {model}: technique | peak MiB | x base | activations MiB | x base | saved MiB"
        " | x base | at the peak: activations + loss + other MiB | step time x base"
        f" | loss vs ref, {LOSS_STEPS} steps | gradient error vs ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = memory[row.name]
        figures = " | ".join(f"{m[key] / MIB:.1f} | {m[key] / base[key]:.2f}" for key in
                             ("peak_bytes", "activations_peak_bytes", "saved_activations_bytes"))
        at_peak = m["phases"][m["peak_phase"]]["breakdown"]
        lines.append(f"| {row.name} | {figures}"
                     f" | {at_peak['activations'] / MIB:.1f} + {at_peak['loss'] / MIB:.1f}"
                     f" + {at_peak['other'] / MIB:.1f}"
                     f" | {times[row.name] / times[BASELINE]:.2f} | {errors(row, correct)} |")
    losses = correct[BASELINE][1]
    lines.append(f"\nbaseline step time {times[BASELINE] * 1e3:.0f} ms (median of {rounds}); "
                 f"baseline losses {', '.join(f'{x:.4f}' for x in losses)}; "
                 f"overrides: {' '.join(MODELS[model])}")
    return "\n".join(lines)


def adapter_table(model: str, rounds: int) -> str:
    """LoRA and QLoRA against full fine-tuning, all with AdamW: the breakdown at the peak (the
    frozen weights apart), the saved activations, the trainable parameters and the time."""
    rows = [Row(row.name, (*row.overrides, "optim=adamw"), row.ref) for row in ADAPTER_ROWS]
    memory, trainable = {}, {}
    for row in rows:
        trainer = Trainer(compose_row(model, row))
        trainable[row.name] = sum(p.numel() for p in trainer.model.parameters()
                                  if p.requires_grad)
        memory[row.name] = two_steps(trainer)
    times = step_times(model, rows, rounds)
    base = rows[0].name
    lines = [f"| {model}: adapter, adamw | peak MiB | x full | "
             + " | ".join(ADAPTER_CATEGORIES) + " | saved activations MiB | trainable params"
             " | step time x full |", "|---" * (6 + len(ADAPTER_CATEGORIES)) + "|"]
    for row in rows:
        m = memory[row.name]
        at_peak = m["breakdown_at_peak"]
        lines.append(
            f"| {row.name} | {m['peak_bytes'] / MIB:.2f} | "
            f"{m['peak_bytes'] / memory[base]['peak_bytes']:.2f} | "
            + " | ".join(f"{at_peak[c] / MIB:.2f}" for c in ADAPTER_CATEGORIES)
            + f" | {m['saved_activations_bytes'] / MIB:.2f} ({m['saved_activations_bytes']:,} B)"
            f" | {trainable[row.name]:,} | {times[row.name] / times[base]:.2f} |")
    lines.append(f"\nfull fine-tuning step time {times[base] * 1e3:.0f} ms (median of {rounds}); "
                 f"no gradient error: the adapters train other parameters than full fine-tuning; "
                 f"overrides: {' '.join(MODELS[model])} optim=adamw")
    return "\n".join(lines)


def estimate_table(model: str, only: list[str] | None = None,
                   rows: list[Row] | None = None) -> str:
    """Each HF row's estimate (or each of `rows`', or those `only` names) against a real run of
    what it traces: the first two steps and an evaluation (of 16 samples)."""
    lines = [f"| {model}: technique | estimate MiB | measured MiB | estimate / measured |",
             "|---|---:|---:|---:|"]
    for row in chosen_rows(hf_rows(model), only) if rows is None else rows:
        cfg = first_steps(compose_row(model, row, "data.num_eval=16",
                                      *ESTIMATE_EXTRA.get(model, ())))
        predicted = estimate(cfg).memory["peak_bytes"]
        trainer = Trainer(cfg)
        trainer.fit(NoLogger())
        real = trainer.meter.report()["peak_bytes"]
        lines.append(f"| {row.name} | {predicted / MIB:.2f} | {real / MIB:.2f}"
                     f" | {predicted / real:.4f} |")
    return "\n".join(lines)


def errors(row: Row, correct: dict[str, tuple[torch.Tensor, list[float]]]) -> str:
    """The row's largest relative per-step loss difference and its gradient error, against its
    ref row's."""
    if row.ref is None:
        return "- | -"
    (grads, losses), (ref_grads, ref_losses) = correct[row.name], correct[row.ref]
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    vs = "" if row.ref == BASELINE else f" (vs {row.ref})"
    return f"{loss:.1e}{vs} | {gradient_error(grads, ref_grads):.1e}{vs}"


def fold_table() -> str:
    """Efficient Conv-BN eval against eval on the CIFAR ResNet-18 (width 64), at batch 8 and 32:
    the bytes saved for backward (what the anchors measured) and the running activation peak."""
    lines = ["| ResNet-18 w64 | eval saved MiB | efficient_eval saved MiB | ratio"
             " | activations peak ratio | total peak ratio |", "|---|---|---|---|---|---|"]
    for batch in (8, 32):
        reports = [memory_of("resnet", Row(mode, (f"bn_mode={mode}", "model.width=64",
                                                  f"data.batch_size={batch}")))
                   for mode in ("eval", "efficient_eval")]
        saved = [r["saved_activations_bytes"] for r in reports]
        peaks = [r["activations_peak_bytes"] for r in reports]
        totals = [r["peak_bytes"] for r in reports]
        lines.append(f"| batch {batch} | {saved[0] / MIB:.1f} | {saved[1] / MIB:.1f} | "
                     f"{saved[1] / saved[0]:.2f} | {peaks[1] / peaks[0]:.2f} | "
                     f"{totals[1] / totals[0]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--estimate", action="store_true",
                        help="the HF rows' estimates against real runs")
    parser.add_argument("--rows", nargs="+", metavar="NAME",
                        help="only the HF rows whose names hold one of these (and the rows "
                             "they are compared with), e.g. --rows loss=chunked_ce")
    parser.add_argument("--adapters", action="store_true",
                        help="only the adapter table (LoRA, QLoRA against full fine-tuning)")
    parser.add_argument("--optimizers", action="store_true",
                        help="only the optimizer table (bf16, 8-bit, 4-bit and fp8 state, Muon, "
                             "the step on the host, against AdamW)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(describe_machine())
    for model in MODELS if args.model == "all" else [args.model]:
        print()
        if args.adapters:
            print(adapter_table(model, args.rounds) if not args.estimate else estimate_table(
                model, rows=[Row(row.name, (*row.overrides, "optim=adamw"))
                             for row in ADAPTER_ROWS]))
            continue
        if args.optimizers:
            print(optimizer_table(model) if not args.estimate else estimate_table(
                model, rows=OPTIMIZER_ROWS))
            continue
        # The HF and timm models (those in NO_DROPOUT) have tables of their own.
        print(hf_table(model, args.rounds, args.rows) if model in NO_DROPOUT
              else table(model, args.rounds))
        if args.estimate and model in NO_DROPOUT:
            print()
            print(estimate_table(model, args.rows))
    if args.model in ("resnet", "all"):
        print()
        print(fold_table())


if __name__ == "__main__":
    main()
