"""`checkpointing.blocks=[auto]` on speech encoders: HuBERT and WavLM at 2, 4 and 6 encoder
layers, beside their convolutional feature encoder of 7 layers (a convolution, its norm and
activation each; 6 of one class).

For each: the blocks auto finds, and the bytes one training step saves for backward (the
meter's saved_activations_bytes) with checkpointing none, full (auto's blocks), and full over
the feature encoder's conv layers, named by class: what auto took before it left out layers of
single ops that sit outside every group of nested layers (with 6 or fewer encoder layers it
took the 6 conv layers, at 6 both groups). Small configs (hidden 32, conv_dim 16), 4 clips of
32 frames (10,240 samples).

    python bench/layer_finder.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from machine import describe_machine

from memexp.estimate import compose_config
from memexp.trainer import Trainer

# the small HuBERT and WavLM configs tests/test_any_model.py builds
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_any_model import speech_model  # noqa: E402

KIB = 2**10
CPU = ("trainer.device=cpu", "trainer.progress=false", "logger=none")
CONV = {"hubert": "HubertNoLayerNormConvLayer", "wavlm": "WavLMNoLayerNormConvLayer"}


def saved(overrides: tuple[str, ...]) -> tuple[int, str]:
    """The bytes one training step saves for backward, and the blocks checkpointing took."""
    trainer = Trainer(compose_config([*CPU, *overrides]))
    batches = trainer.data.train_batches()
    trainer.model.train()
    with trainer.meter:
        trainer.train_step(batches)
    found = trainer.checkpointing.found
    return (trainer.meter.report()["saved_activations_bytes"],
            "-" if found is None else found.describe())


def main() -> None:
    print(describe_machine())
    print("| model | encoder layers | blocks=[auto] finds | saved, none KiB | saved, full KiB "
          "(auto) | full / none | saved, full over the conv layers KiB |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for arch in CONV:
        for layers in (2, 4, 6):
            model = speech_model(arch, layers)
            none, _ = saved(model)
            full, found = saved((*model, "checkpointing=full"))
            conv, _ = saved((*model, "checkpointing=full",
                             f"checkpointing.blocks=[{CONV[arch]}]"))
            print(f"| {arch} | {layers} | {found} | {none / KIB:,.1f} | {full / KIB:,.1f} | "
                  f"{full / none:.3f} | {conv / KIB:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
