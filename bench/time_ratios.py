"""The report's step-time ratios against ratios measured with the tracker off, steps interleaved.

For each model and technique (optim.accumulate=4 at a quarter of the batch, checkpointing=full,
precision=bf16), against the model's baseline:
- report: each config runs as its own `python train.py` process (as a sweep's job does), into
  numbered folders, and the ratio is the report's `step time x base`, read with
  memexp.report.load_rows: the one each technique's run timed beside its baseline in its own
  process (timing.paired_steps, the default), with the interquartile range of its step-by-step
  ratios. Beside it, from the same runs, what the report gave before runs timed their baseline:
  the ratio of the two runs' median step times;
- reference: the same two configs in one process, their steps (Trainer.train_step with
  memory.track=false) interleaved one by one, the order alternating; the median of the
  round-by-round ratios and their interquartile range.
Reference and report runs alternate (reference, runs, reference, runs, ...), --repeats times; the
share of the machine other processes took during each is printed.

    python bench/time_ratios.py [--models transformer resnet] [--steps 60] [--repeats 2]
                                [--techniques precision=bf16 ...] [--device cuda]

On CUDA each step waits for its kernels (Trainer.wait_for_device), so the wall clock times the
device's work, and neither side counts memory (as a run and its baseline beside it do not).

Target: every report ratio within 5% of its reference.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from machine import describe_machine

from memexp.config import config_dir
from memexp.report import load_rows
from memexp.timing import MachineLoad, quartiles
from memexp.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
COMMON = ["trainer.device=cpu", "trainer.progress=false", "logger=none"]  # --device sets [0]
MODELS = {"transformer": ("model=transformer",), "resnet": ("model=resnet",)}
TECHNIQUES = {
    "optim.accumulate=4 (batch/4)": ("optim.accumulate=4", "data.batch_size={quarter}"),
    "checkpointing=full": ("checkpointing=full",),
    "precision=bf16": ("precision=bf16",),
}


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=[*COMMON, *overrides])


def technique_overrides(model: str, technique: str) -> tuple[str, ...]:
    batch = compose_cfg(MODELS[model]).data.batch_size
    return tuple(o.format(quarter=batch // 4) for o in TECHNIQUES[technique])


def reference(model: str, technique: str, rounds: int) -> tuple[float, tuple, float | None]:
    """(median round-by-round ratio, their quartiles, others' CPU share)."""
    sides = [Trainer(compose_cfg([*MODELS[model], "memory.track=false", *extra]))
             for extra in ((), technique_overrides(model, technique))]
    streams = [side.data.train_batches() for side in sides]
    for side in sides:
        side.meter.count_nothing()
        side.model.train()
    times: list[list[float]] = [[], []]
    load = MachineLoad()
    for i in range(rounds + 3):  # three warm-up rounds
        if i == 3:
            load.start()
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            started = time.perf_counter()
            sides[k].train_step(streams[k])
            if i >= 3:
                times[k].append(time.perf_counter() - started)
    pairs = quartiles([b / a for a, b in zip(times[0], times[1], strict=True)])
    return pairs[1], pairs, load.others_share(load.own_cpu())


def report_ratios(model: str, techniques: list[str], steps: int,
                  folder: Path) -> tuple[list, float | None]:
    """The report's rows: the baseline's, then each technique's, one `python train.py` run per
    config."""
    configs = [(), *(technique_overrides(model, t) for t in techniques)]
    load = MachineLoad(children=True)  # the runs' CPU time is ours, not other processes'
    load.start()
    for number, extra in enumerate(configs):
        subprocess.run(
            [sys.executable, str(REPO / "train.py"), *COMMON, *MODELS[model],
             f"trainer.max_steps={steps}", *extra, f"hydra.run.dir={folder / str(number)}"],
            check=True, capture_output=True, cwd=folder)
    rows, _ = load_rows(folder)
    return rows, load.others_share(load.own_cpu())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=60, help="steps of each report run")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved reference rounds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--techniques", nargs="+", choices=TECHNIQUES, default=list(TECHNIQUES))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    COMMON[0] = f"trainer.device={args.device}"
    techniques = {name: TECHNIQUES[name] for name in args.techniques}
    print(describe_machine())
    print("| model | technique | repeat | report ratio (IQR) | how | reference ratio (round "
          "IQR) | report / reference | medians of the two runs / reference | others' CPU "
          "share: runs, reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst, worst_apart = 0.0, 0.0
    for model in args.models:
        for repeat in range(args.repeats):
            refs = {t: reference(model, t, args.rounds) for t in techniques}
            with tempfile.TemporaryDirectory() as folder:
                (base, *rows), others = report_ratios(model, techniques, args.steps,
                                                      Path(folder))
            for technique, row in zip(techniques, rows, strict=True):
                ratio, pairs, ref_others = refs[technique]
                low, high = row.step_time_range
                off = row.step_time_ratio / ratio
                apart = row.step_time.median / base.step_time.median / ratio
                worst, worst_apart = max(worst, abs(off - 1)), max(worst_apart, abs(apart - 1))
                how = "paired" if row.time_paired else "medians of two runs"
                doubt = f", uncertain: {row.time_doubt}" if row.time_doubt else ""
                print(f"| {model} | {technique} | {repeat + 1} | {row.step_time_ratio:.3f} "
                      f"({low:.3f}-{high:.3f}{doubt}) | {how} | {ratio:.3f} ({pairs[0]:.3f}-"
                      f"{pairs[2]:.3f}) | {off:.3f} | {apart:.3f} | {others:.0%}, "
                      f"{ref_others:.0%} |", flush=True)
    print(f"\nlargest difference: {worst:.1%} (target: 5%); the medians of two runs: "
          f"{worst_apart:.1%}")


if __name__ == "__main__":
    main()
