"""`memexp estimate --world-size N` against real ranks: each rank's peak, estimated and measured.

For every cell (model x parallel option x checkpointing x N) the estimate traces one rank on
torch's fake process group, in this process (memexp.estimate_parallel); the real run is
`python train.py trainer.nproc=N` on gloo, the same config cut to the estimate's two steps, and
each rank's peak is read from its result.json (memexp's own meter). The error is the estimated
rank's peak against the measured peak of that rank; `offloaded` is the host-resident peak
(FSDP's cpu_offload), estimated against measured likewise.

    python bench/estimate_parallel.py [--ranks 2 4] [--models transformer gpt2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
COMMON = ["trainer.device=cpu", "trainer.progress=false", "logger=none", "trainer.max_steps=2"]
MODELS = {
    "transformer": ["model=transformer", "data.num_eval=64"],
    # tests/conftest.py's tiny GPT-2 (random weights, nothing downloaded)
    "gpt2": ["model=hf", "model.arch=gpt2", "model.task=causal_lm", "+model.config.n_layer=2",
             "+model.config.n_embd=32", "+model.config.n_head=2", "+model.config.vocab_size=64",
             "+model.config.n_positions=64", "data.batch_size=4", "data.num_train=64",
             "data.num_eval=16", "data.seq_len=32"],
}
OPTIONS = {
    "ddp": ["parallel=ddp"],
    "zero1": ["parallel=zero1"],
    "fsdp": ["parallel=fsdp"],
    "fsdp offload": ["parallel=fsdp", "parallel.cpu_offload=true"],
}
CHECKPOINTING = {"-": ["checkpointing=none"], "full": ["checkpointing=full"]}


def measured(overrides: list[str], n: int, folder: Path) -> list[dict]:
    """Each rank's memory report from a real run of `n` ranks."""
    run_dir = folder / f"run{time.monotonic_ns()}"
    done = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *overrides,
         f"trainer.nproc={n}"], capture_output=True, text=True, cwd=folder,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{overrides} N={n} failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "result.json").read_text())["memory"]["per_rank"]


def error(estimated: int, real: int) -> str:
    if real == 0:
        return "exact" if estimated == 0 else "-"
    return f"{100 * (estimated - real) / real:+.2f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    import torch

    from memexp.estimate import compose_config, estimate

    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo; peaks in MiB, the "
          "estimated rank's against the same rank measured\n")
    print("| model | parallel | checkpointing | N | rank | estimated | measured | error | "
          "largest measured | offloaded est. | offloaded meas. | estimate s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for model, option, policy, n in itertools.product(args.models, OPTIONS, CHECKPOINTING,
                                                          args.ranks):
            overrides = [*COMMON, *MODELS[model], *OPTIONS[option], *CHECKPOINTING[policy]]
            result = estimate(compose_config(overrides), world_size=n)
            ranks = measured(overrides, n, Path(tmp))
            real = ranks[result.rank]
            est, meas = result.memory["peak_bytes"], real["peak_bytes"]
            worst = max(worst, abs(est - meas) / meas)
            print(f"| {model} | {option} | {policy} | {n} | {result.rank} | {est / MIB:.2f} | "
                  f"{meas / MIB:.2f} | {error(est, meas)} | "
                  f"{max(r['peak_bytes'] for r in ranks) / MIB:.2f} | "
                  f"{result.memory['offloaded_peak_bytes'] / MIB:.2f} | "
                  f"{real['offloaded_peak_bytes'] / MIB:.2f} | {result.seconds:.1f} |",
                  flush=True)
    print(f"\nlargest error: {100 * worst:.2f}%")


if __name__ == "__main__":
    main()
