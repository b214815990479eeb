"""What storing LoRA's frozen base weights in bf16 changes in the losses (issue 39, item 3).

A small Llama from LlamaConfig (4 layers of 128, 512 words, random weights) with LoRA (r=8 on
every projection) and AdamW trains 20 steps of 8 x 64 tokens on CPU under four precisions:
fp32; bf16 autocast with the frozen weights in fp32 (precision.frozen=fp32, memexp's behaviour
before); bf16 autocast with them in bf16 (precision.frozen=compute, the default: the embeddings,
norms and head in bf16, and the activations made from them); and bf16_pure. Each row: the first
step's loss (every run starts from the same weights, so this is the model's function), and how
far each step's loss lies from fp32's, relative.

    python bench/frozen_weights.py [--lr 0.01] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from machine import describe_machine

from memexp.estimate import compose_config
from memexp.loggers import NoLogger
from memexp.trainer import Trainer

LLAMA = ("model=hf", "model.arch=llama", "model.task=causal_lm",
         "+model.config.hidden_size=128", "+model.config.num_hidden_layers=4",
         "+model.config.num_attention_heads=4", "+model.config.intermediate_size=256",
         "+model.config.vocab_size=512", "data.seq_len=64", "data.batch_size=8",
         "data.num_train=256", "data.num_eval=8", "data.padding=0", "adapter=lora",
         "optim=adamw", "trainer.device=cpu", "trainer.progress=false", "memory.track=false",
         "timing.paired_steps=0", "logger=none")
ROWS = {"fp32": ("precision=fp32",),
        "bf16, frozen=fp32": ("precision=bf16", "precision.frozen=fp32"),
        "bf16, frozen=compute": ("precision=bf16", "precision.frozen=compute"),
        "bf16_pure": ("precision=bf16_pure",)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(describe_machine())
    print(f"LoRA on a small Llama, AdamW lr={args.lr}, {args.steps} steps\n")
    losses = {name: Trainer(compose_config([*LLAMA, *overrides, f"optim.lr={args.lr}",
                                            f"trainer.max_steps={args.steps}"]))
              .fit(NoLogger()).losses for name, overrides in ROWS.items()}
    fp32 = losses["fp32"]
    print("| precision | first step's loss | vs fp32 | steps' loss vs fp32: largest | mean |")
    print("|---|---:|---:|---:|---:|")
    for name, row in losses.items():
        apart = [abs(a - b) / b for a, b in zip(row, fp32, strict=True)]
        print(f"| {name} | {row[0]:.7f} | {apart[0]:.1e} | {max(apart):.1e} | "
              f"{statistics.mean(apart):.1e} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
