"""On a CUDA GPU: optim.offload=cpu, checkpointing=full_offload and precision=float8 run for real,
each against its `memexp estimate` for the same GPU (issue 41). A CPU cannot run them (the first
moves nothing there, the last needs compute capability 8.9), so bench/gpu.sh runs this where a
GPU is lent.

For each row: the estimate's allocated and reserved peaks against the device's counters
(torch.cuda.max_memory_allocated() and max_memory_reserved()) over the same first steps and an
evaluation, with the estimate's host bytes and transfers per step beside the measured run's
(the storage tracker counts both on a CUDA run too). The model is a Llama from LlamaConfig, 8
layers of 1024, on 1024 tokens (about 0.2B parameters), random weights.

    python bench/offload_float8.py [--gpu h200]   (--gpu: memexp.gpus' key of this GPU)
"""

from __future__ import annotations

import argparse

import torch
from machine import describe_machine

from memexp.estimate import compose_config, estimate
from memexp.first_steps import first_steps
from memexp.loggers import NoLogger
from memexp.trainer import Trainer

MIB = 2**20
LLAMA = ("model=hf", "model.arch=llama", "model.task=causal_lm",
         "+model.config.num_hidden_layers=8", "+model.config.hidden_size=1024",
         "+model.config.num_attention_heads=16", "+model.config.num_key_value_heads=4",
         "+model.config.intermediate_size=3584", "+model.config.vocab_size=32000",
         "data.seq_len=1024", "data.batch_size=4", "data.num_eval=8", "optim=adamw",
         "trainer.device=cuda", "trainer.progress=false", "logger=none")
ROWS = {
    "adamw": (),
    "optim.offload=cpu": ("optim.offload=cpu", "optim.fused=true"),
    "+ offload_gradients": ("optim.offload=cpu", "optim.fused=true",
                            "optim.offload_gradients=true"),
    "checkpointing=full": ("checkpointing=full",),
    "checkpointing=full_offload": ("checkpointing=full_offload",),
    "checkpointing=offload": ("checkpointing=offload",),
    "precision=bf16": ("precision=bf16",),
    "precision=float8": ("precision=float8",),
    "precision=float8 rowwise": ("precision=float8", "precision.recipe=rowwise"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--gpu", default="h200", help="memexp.gpus' key of this GPU")
    args = parser.parse_args()
    print(describe_machine())
    print(f"device: {torch.cuda.get_device_name()}, estimates for --gpu {args.gpu}\n")
    print("| row | estimate allocated MiB | measured MiB | ratio | estimate reserved MiB | "
          "measured MiB | ratio | host MiB est / measured | to host MiB/step est / measured |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, overrides in ROWS.items():
        cfg = first_steps(compose_config([*LLAMA, *overrides]))
        try:
            predicted = estimate(cfg, "cuda", args.gpu).memory
            trainer = Trainer(cfg)
            trainer.fit(NoLogger())
        except Exception as error:  # one row's failure is reported, the others still run
            print(f"| {name} | {type(error).__name__}: {str(error).splitlines()[0]} |")
            continue
        real = trainer.meter.report()
        cells = []
        for estimated, measured in ((predicted["allocated_peak_bytes"], real["peak_bytes"]),
                                    (predicted["reserved_peak_bytes"],
                                     real["reserved_peak_bytes"])):
            cells.append(f"{estimated / MIB:.1f} | {measured / MIB:.1f} | "
                         f"{estimated / measured:.3f}")
        host = (f"{predicted['offloaded_peak_bytes'] / MIB:.1f} / "
                f"{real['offloaded_peak_bytes'] / MIB:.1f}")
        moved = (f"{predicted['transfer_bytes_per_step']['to_host'] / MIB:.1f} / "
                 f"{real['transfer_bytes_per_step']['to_host'] / MIB:.1f}")
        print(f"| {name} | {' | '.join(cells)} | {host} | {moved} |")
        del trainer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
