"""Per-rank memory of parallel=none|ddp|zero1|fsdp (and fsdp cpu_offload) for 1 and 2 ranks.

Each row is a real `python train.py` run (trainer.nproc=N on this machine; gloo on CPU, nccl on
CUDA) with the same model, fp32 Adam and the same global batch, so every row should also have
the same losses. For each rank, from its result.json:

- the model states on the device at the optimizer phase's peak, where parameters, gradients and
  optimizer state all exist: params, grads, optimizer (MiB), and their sum beside the ZeRO
  paper's prediction for fp32 Adam (see BENCHMARKS.md);
- what the meter counts as host-resident (`offloaded`: its own running peak);
- the rank's overall peak (activations and communication buffers included);
- the largest difference of any step's loss from the one-process run.

    python bench/parallel.py [--steps 5] [--ranks 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
# An MLP of eight equal 512x512 blocks and a small input layer (8x8 images), so that ZeRO's
# greedy partition of whole parameters is near-even; 32 samples per global batch.
MODEL = ["model=mlp", "model.hidden=512", "model.depth=8", "data.image_size=8", "optim=adam",
         "data.num_eval=256", "trainer.warmup_steps=2", "trainer.device=cpu",
         "trainer.progress=false", "logger=none"]
GLOBAL_BATCH = 32
OPTIONS = {
    "none": ["parallel=none"],
    "ddp": ["parallel=ddp"],
    "zero1": ["parallel=zero1"],
    "fsdp": ["parallel=fsdp"],
    "fsdp cpu_offload": ["parallel=fsdp", "parallel.cpu_offload=true"],
}


def predicted_states(option: str, psi: int, n: int) -> float:
    """Bytes of params + grads + optimizer state per rank, for fp32 Adam (4+4+8 bytes per
    parameter): ZeRO's formulas with fp32 parameters and gradients and K = 8."""
    return {"none": 16 * psi, "ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n,
            "fsdp": 16 * psi / n, "fsdp cpu_offload": 0.0}[option]


def run(option: str, n: int, steps: int, folder: Path) -> dict:
    run_dir = folder / f"{option.replace(' ', '_')}-{n}"
    command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *MODEL,
               *OPTIONS[option], f"trainer.max_steps={steps}",
               f"data.batch_size={GLOBAL_BATCH // n}", f"trainer.nproc={n}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=folder,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{option} N={n} failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    import torch

    from memexp.models import MLP

    psi = sum(p.numel() for p in MLP(10, image_size=8, hidden=512, depth=8).parameters())
    print(f"MLP: {psi:,} parameters (psi), fp32 Adam, global batch {GLOBAL_BATCH}, "
          f"{args.steps} steps, torch {torch.__version__}, {os.cpu_count()} CPU cores\n")
    print("| option | N | rank | params | grads | optimizer | states | predicted | "
          "offloaded peak | peak | max loss diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        reference = None
        for option in OPTIONS:
            for n in args.ranks:
                if option == "none" and n > 1:
                    continue
                result = run(option, n, args.steps, Path(tmp))
                losses = result["metrics"]["losses"]
                reference = reference or losses
                diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
                memory = result["memory"]
                for rank, report in enumerate(memory.get("per_rank", [memory])):
                    b = report["phases"]["optimizer"]["breakdown"]
                    states = b["params"] + b["grads"] + b["optimizer"]
                    print(f"| {option} | {n} | {rank} | {b['params'] / MIB:.2f} | "
                          f"{b['grads'] / MIB:.2f} | {b['optimizer'] / MIB:.2f} | "
                          f"{states / MIB:.2f} | {predicted_states(option, psi, n) / MIB:.2f} | "
                          f"{report['offloaded_peak_bytes'] / MIB:.2f} | "
                          f"{report['peak_bytes'] / MIB:.2f} | {diff:.1e} |",
                          flush=True)


if __name__ == "__main__":
    main()
