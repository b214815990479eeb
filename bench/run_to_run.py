"""How far one config's step time moves from process to process: the same `python train.py`
run, started --repeats times one after another, each its own process.

A report's "step time x base" divides two such runs, so this spread bounds what one sweep's
ratio can say. Each run's median step (taken with the tracker off, after
memory.measure_steps) and the interquartile range within it are printed, then the largest
over the smallest median, beside the share of the machine other processes took.

    python bench/run_to_run.py [--repeats 6] [--steps 60] [overrides ...]   (default:
    model=transformer)

With --blocks N, one process instead: the config's steps (tracker off) in N blocks of --steps,
one after another, each block's median and the machine's load meanwhile. Where blocks move as
much as processes do, the machine's speed moves over seconds, whatever the process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe_machine

from memexp.timing import MachineLoad, quartiles

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=0)
    parser.add_argument("overrides", nargs="*", default=["model=transformer"])
    args = parser.parse_args()
    print(describe_machine())
    if args.blocks:
        blocks(args.blocks, args.steps, args.overrides)
        return
    print(f"python train.py {' '.join(args.overrides)} trainer.max_steps={args.steps}, "
          f"{args.repeats} processes one after another\n")
    print("| run | median step ms | IQR within the run, ms | others' CPU share |")
    print("|---|---|---|---|")
    medians = []
    with tempfile.TemporaryDirectory() as folder:
        for run in range(args.repeats):
            run_dir = Path(folder) / str(run)
            load = MachineLoad(children=True)  # the run's CPU time is ours
            load.start()
            subprocess.run([sys.executable, str(REPO / "train.py"), "trainer.device=cpu",
                            "trainer.progress=false", "logger=none", *args.overrides,
                            f"trainer.max_steps={args.steps}", f"hydra.run.dir={run_dir}"],
                           check=True, capture_output=True, cwd=folder)
            others = load.others_share(load.own_cpu())
            timing = json.loads((run_dir / "result.json").read_text())["metrics"]["timing"]
            low, high = timing["step_time_iqr_s"]
            medians.append(timing["step_time_s"])
            share = "unknown" if others is None else f"{others:.0%}"
            print(f"| {run + 1} | {timing['step_time_s'] * 1e3:.1f} | {low * 1e3:.1f}-"
                  f"{high * 1e3:.1f} | {share} |", flush=True)
    print(f"\nlargest / smallest median: {max(medians) / min(medians):.2f}x")


def blocks(count: int, steps: int, overrides: list[str]) -> None:
    from time_ratios import COMMON, compose_cfg

    from memexp.trainer import Trainer

    trainer = Trainer(compose_cfg([*COMMON, "memory.track=false", *overrides]))
    batches = trainer.data.train_batches()
    trainer.model.train()
    for _ in range(5):  # warm-up
        trainer.train_step(batches)
    print(f"{' '.join(overrides)}: {count} blocks of {steps} steps in one process\n")
    print("| block | median step ms | IQR within the block, ms | others' CPU share |")
    print("|---|---|---|---|")
    medians = []
    for block in range(count):
        load = MachineLoad()
        load.start()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            trainer.train_step(batches)
            times.append(time.perf_counter() - started)
        low, median, high = quartiles(times)
        medians.append(median)
        others = load.others_share(load.own_cpu())
        share = "unknown" if others is None else f"{others:.0%}"
        print(f"| {block + 1} | {median * 1e3:.1f} | {low * 1e3:.1f}-{high * 1e3:.1f} | "
              f"{share} |", flush=True)
    print(f"\nlargest / smallest block median: {max(medians) / min(medians):.2f}x")


if __name__ == "__main__":
    main()
