"""memexp's trainer against a hand-written PyTorch loop: speed, peak memory, and the math.

Same model class and arguments, batch, seed and data order, on CPU, fp32 SGD.

- The math: both train N steps from the same seed; the final weights must be bitwise equal.
- Speed: CPU wall time here drifts by 15% between identical runs even on a quiet machine (and by
  more than 4x on a busy one), so whole runs cannot resolve a 2% difference. Instead the two
  loops run side by side in one process, each with its own model, optimizer and data stream, and
  their steps are interleaved one by one (the order alternating): memexp's step is
  `Trainer.train_step`, the real step its `fit()` runs. The figure is the ratio of the median
  step times. Whole `fit()` runs against whole plain runs, interleaved in pairs, are reported
  beside it with their spread.
- Peak memory: both loops under the same live-storage tracker.

    python bench/overhead.py [--steps 60] [--runs 4] [overrides ...]

Targets: steps/s ratio >= 0.98 with tracking off; peak tracked tensor memory no higher than the
plain loop's; final weights bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from memexp.config import config_dir
from memexp.data import TensorData
from memexp.loggers import NoLogger
from memexp.memory import LiveStorageTracker
from memexp.trainer import Trainer

MIB = 2**20


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=["trainer.device=cpu", "trainer.progress=false",
                                           *overrides])


class PlainLoop:
    """The loop anyone would write by hand."""

    def __init__(self, cfg, data: TensorData):
        torch.manual_seed(cfg.trainer.seed)
        self.model = instantiate(cfg.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.optim.lr)
        self.data, self.step_count = data, 0

    def step(self) -> None:
        data, batch = self.data, self.data.batch_size
        epoch, i = divmod(self.step_count, len(data.train) // batch)
        if i == 0:
            generator = torch.Generator().manual_seed(data.seed * 1_000_003 + epoch)
            self.order = torch.randperm(len(data.train), generator=generator)
        index = self.order[i * batch : (i + 1) * batch]
        logits = self.model(data.train.inputs.index_select(0, index))
        loss = F.cross_entropy(logits, data.train.targets.index_select(0, index))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()
        self.step_count += 1

    def evaluate(self) -> float:
        self.model.eval()
        correct, count, size = 0, len(self.data.eval), self.data.eval_batch_size
        with torch.inference_mode():
            for first in range(0, count, size):
                index = torch.arange(first, min(first + size, count))
                logits = self.model(self.data.eval.inputs.index_select(0, index))
                hits = logits.argmax(-1) == self.data.eval.targets.index_select(0, index)
                correct += hits.sum().item()
        self.model.train()
        return correct / count

    def run(self, steps: int, tracker: LiveStorageTracker | None = None) -> float:
        """`steps` steps and one evaluation; returns the wall time."""
        if tracker is not None:
            tracker.track(*self.model.parameters(), *self.model.buffers())
        started = time.perf_counter()
        with tracker if tracker is not None else nullcontext():
            self.model.train()
            for _ in range(steps):
                self.step()
            self.evaluate()
        return time.perf_counter() - started


def memexp_fit(cfg) -> tuple[Trainer, float]:
    trainer = Trainer(cfg)
    started = time.perf_counter()
    trainer.fit(NoLogger())
    return trainer, time.perf_counter() - started


def interleaved_steps(cfg, data: TensorData, steps: int) -> tuple[list[float], list[float]]:
    """Step times of memexp's train_step and the plain step, taken alternately."""
    trainer, plain = Trainer(cfg), PlainLoop(cfg, data)
    batches = trainer.data.train_batches()
    trainer.model.train()
    sides = {"memexp": lambda: trainer.train_step(batches), "plain": plain.step}
    times: dict[str, list[float]] = {"memexp": [], "plain": []}
    for i in range(steps + 2):  # two warm-up pairs
        for side in ("memexp", "plain") if i % 2 == 0 else ("plain", "memexp"):
            started = time.perf_counter()
            sides[side]()
            if i >= 2:
                times[side].append(time.perf_counter() - started)
    return times["memexp"], times["plain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per side")
    parser.add_argument("--runs", type=int, default=4, help="whole-run pairs")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    base = [f"trainer.max_steps={args.steps}", "optim=sgd", *args.overrides]
    untracked = compose_cfg([*base, "memory.track=false"])
    tracked = compose_cfg([*base, "memory.track=true"])
    data: TensorData = instantiate(untracked.data)
    print(f"model={untracked.model._target_} batch={data.batch_size} steps={args.steps} "
          f"runs={args.runs} threads={torch.get_num_threads()} torch={torch.__version__}")

    # 1. The math: final weights after N fp32 steps.
    trainer, _ = memexp_fit(untracked)
    plain = PlainLoop(untracked, data)
    plain.run(args.steps)
    ours = trainer.model.state_dict()
    bitwise = all(torch.equal(ours[k], v) for k, v in plain.model.state_dict().items())

    # 2. Speed with tracking off: steps interleaved one by one.
    ours_steps, plain_steps = interleaved_steps(untracked, data, args.steps)
    ours_step, plain_step = statistics.median(ours_steps), statistics.median(plain_steps)
    ratio = plain_step / ours_step  # memexp's steps/s over the plain loop's

    # 3. Whole runs, eval included, interleaved in pairs (the order alternating).
    wall: dict[str, list[float]] = {"memexp": [], "plain": []}
    for run in range(args.runs):
        for side in ("memexp", "plain") if run % 2 == 0 else ("plain", "memexp"):
            seconds = (memexp_fit(untracked)[1] if side == "memexp"
                       else PlainLoop(untracked, data).run(args.steps))
            wall[side].append(seconds)
    wall_pairs = [p / m for p, m in zip(wall["plain"], wall["memexp"], strict=True)]
    wall_ratio = statistics.median(wall["plain"]) / statistics.median(wall["memexp"])

    # 4. Peak tracked tensor memory, both under the same live-storage tracker.
    trainer, tracked_seconds = memexp_fit(tracked)
    peak_ours = trainer.meter.report()["peak_bytes"]
    tracker = LiveStorageTracker()
    plain_tracked_seconds = PlainLoop(tracked, data).run(args.steps, tracker)
    peak_plain = max(p.peak_bytes for p in tracker.peaks.values())

    rows = [
        (f"steps/s, tracking off ({args.steps} steps each, interleaved one by one)",
         f"{1 / ours_step:.2f}", f"{1 / plain_step:.2f}", f"ratio {ratio:.3f}"),
        ("median step time", f"{ours_step * 1e3:.3f} ms", f"{plain_step * 1e3:.3f} ms",
         f"{(ours_step - plain_step) * 1e6:+.0f} us per step"),
        (f"whole runs, eval included ({args.runs} interleaved pairs)",
         f"{statistics.median(wall['memexp']):.2f} s", f"{statistics.median(wall['plain']):.2f} s",
         f"ratio {wall_ratio:.3f} (pairs {min(wall_pairs):.3f}..{max(wall_pairs):.3f})"),
        ("peak tracked tensor memory", f"{peak_ours / MIB:.2f} MiB", f"{peak_plain / MIB:.2f} MiB",
         f"{(peak_ours - peak_plain) / MIB:+.2f} MiB"),
        (f"final weights after {args.steps} fp32 steps", "", "",
         "bitwise equal" if bitwise else "DIFFERENT"),
        ("steps/s with memory.track=true (one run each)", f"{args.steps / tracked_seconds:.2f}",
         f"{args.steps / plain_tracked_seconds:.2f} (same tracker)", ""),
    ]
    print("\n| measure | memexp | plain loop | result |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    checks = {
        "steps/s ratio >= 0.98 (tracking off)": ratio >= 0.98,
        "peak memory <= plain loop": peak_ours <= peak_plain,
        "final weights bitwise equal": bitwise,
    }
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    raise SystemExit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
