"""The report's step-time ratios against ratios measured with the tracker off, steps interleaved.

For each model and technique (optim.accumulate=4 at a quarter of the batch, checkpointing=full,
precision=bf16), against the model's baseline:
- report: each config runs as its own `python train.py` process (as a sweep's job does), into
  numbered folders, and the ratio is the report's `step time x base`, read with
  memexp.report.load_rows (the run times its steps after memory.measure_steps, tracker off);
- reference: the same two configs in one process, their steps (Trainer.train_step with
  memory.track=false) interleaved one by one, the order alternating; the ratio of the medians,
  and the interquartile range of the round-by-round ratios.
Reference and report runs alternate (reference, runs, reference, runs, ...), --repeats times; the
share of the machine other processes took during each is printed.

    python bench/time_ratios.py [--models transformer resnet] [--steps 60] [--repeats 2]

Target: every report ratio within 5% of its reference.
"""

from __future__ import annotations

import argparse
import statistics
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
COMMON = ("trainer.device=cpu", "trainer.progress=false", "logger=none")
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
    """(ratio of median step times, round-by-round ratio quartiles, others' CPU share)."""
    sides = [Trainer(compose_cfg([*MODELS[model], "memory.track=false", *extra]))
             for extra in ((), technique_overrides(model, technique))]
    streams = [side.data.train_batches() for side in sides]
    for side in sides:
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
    ratio = statistics.median(times[1]) / statistics.median(times[0])
    pairs = quartiles([b / a for a, b in zip(times[0], times[1], strict=True)])
    return ratio, pairs, load.others_share(load.own_cpu())


def report_ratios(model: str, steps: int, folder: Path) -> tuple[dict, float | None]:
    """Each technique's report ratio (the row), one `python train.py` run per config."""
    configs = [(), *(technique_overrides(model, t) for t in TECHNIQUES)]
    load = MachineLoad(children=True)  # the runs' CPU time is ours, not other processes'
    load.start()
    for number, extra in enumerate(configs):
        subprocess.run(
            [sys.executable, str(REPO / "train.py"), *COMMON, *MODELS[model],
             f"trainer.max_steps={steps}", *extra, f"hydra.run.dir={folder / str(number)}"],
            check=True, capture_output=True, cwd=folder)
    rows, _ = load_rows(folder)
    return dict(zip(TECHNIQUES, rows[1:], strict=True)), load.others_share(load.own_cpu())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=60, help="steps of each report run")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved reference rounds")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(describe_machine())
    print("| model | technique | repeat | report ratio (IQR range) | reference ratio (round "
          "IQR) | report / reference | others' CPU share: runs, reference |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for model in args.models:
        for repeat in range(args.repeats):
            refs = {t: reference(model, t, args.rounds) for t in TECHNIQUES}
            with tempfile.TemporaryDirectory() as folder:
                rows, others = report_ratios(model, args.steps, Path(folder))
            for technique, row in rows.items():
                ratio, pairs, ref_others = refs[technique]
                low, high = row.step_time_range
                off = row.step_time_ratio / ratio
                worst = max(worst, abs(off - 1))
                doubt = f", uncertain: {row.time_doubt}" if row.time_doubt else ""
                print(f"| {model} | {technique} | {repeat + 1} | {row.step_time_ratio:.3f} "
                      f"({low:.3f}-{high:.3f}{doubt}) | {ratio:.3f} ({pairs[0]:.3f}-"
                      f"{pairs[2]:.3f}) | {off:.3f} | {others:.0%}, {ref_others:.0%} |",
                      flush=True)
    print(f"\nlargest difference: {worst:.1%} (target: 5%)")


if __name__ == "__main__":
    main()
