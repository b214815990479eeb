"""memexp's trainer against a hand-written PyTorch loop, with the storage tracker off and on.

Same model class and arguments, batch, seed and data order, on CPU, fp32 SGD.

- Speed: CPU wall time here drifts by 15% between identical runs even on a quiet machine (and by
  more than 4x on a busy one), so four loops run side by side in one process, each with its own
  model, optimizer and data stream, and their steps are interleaved one by one, the order
  rotating each round:
    plain            the loop anyone would write;
    plain+tracker    the same, under a LiveStorageTracker;
    memexp           Trainer.train_step (the step fit() runs) with memory.track=false;
    memexp+tracker   the same step with the meter's tracker on (a measured step).
  Each ratio is taken round by round (two steps run next to each other) and given as the median
  and interquartile range over the rounds. The tracker's cost per op is the difference of the
  median step times over the ops a step dispatches.
- Whole runs: fit() with the defaults (memory measured on memory.measure_steps steps, the rest
  untracked) against fit() with memory.track=false, interleaved in pairs.
- The math: memexp and the plain loop train N steps from the same seed; the final weights must
  be bitwise equal.
- Peak memory: memexp's measured peak against the plain loop's under the same tracker.
- Load: the share of the machine's CPU time other processes took while the steps ran
  (/proc/stat), and the CPU model.

    python bench/overhead.py [--model resnet|transformer|mlp] [--steps 40] [--rounds N]
                             [--runs 4] [overrides ...]

On a busy machine, `--rounds 30 --steps 10 --runs 0` keeps the interleaved steps (the tracker's
cost) and drops the whole runs.

Targets: the tracker costs <= 1.10x a step while tracking (resnet, transformer); memexp's
steps/s >= 0.98x the plain loop's with tracking off; peak memory no higher than the plain
loop's; final weights bitwise equal.
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
from machine import describe_machine
from torch.utils._python_dispatch import TorchDispatchMode

from memexp.config import config_dir
from memexp.data import TensorData
from memexp.loggers import NoLogger
from memexp.memory import LiveStorageTracker
from memexp.timing import MachineLoad, quartiles
from memexp.trainer import Trainer

MIB = 2**20
MODELS = {"resnet": ["model=resnet"], "transformer": ["model=transformer"], "mlp": ["model=mlp"]}


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=["trainer.device=cpu", "trainer.progress=false",
                                           "logger=none", *overrides])


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
        logits = self.model(data.decode(data.train.inputs.index_select(0, index)))
        targets = data.train.targets.index_select(0, index)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
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
                logits = self.model(self.data.decode(self.data.eval.inputs.index_select(0, index)))
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


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def memexp_fit(cfg) -> tuple[Trainer, float]:
    trainer = Trainer(cfg)
    started = time.perf_counter()
    trainer.fit(NoLogger())
    return trainer, time.perf_counter() - started


def interleaved_steps(untracked, tracked, data: TensorData, rounds: int):
    """Step times of the four sides, one step each per round (two warm-up rounds), the order
    rotating; and the ops one memexp step dispatches."""
    ours, measured = Trainer(untracked), Trainer(tracked)
    plain, plain_measured = PlainLoop(untracked, data), PlainLoop(untracked, data)
    tracker = LiveStorageTracker()
    tracker.track(*plain_measured.model.parameters(), *plain_measured.model.buffers())
    streams = {trainer: trainer.data.train_batches() for trainer in (ours, measured)}
    for trainer in (ours, measured):
        trainer.model.train()

    def memexp_step(trainer):
        batches = streams[trainer]
        with trainer.meter:  # the tracker on for `measured`, nothing for `ours`
            started = time.perf_counter()
            trainer.train_step(batches)
            return time.perf_counter() - started

    def plain_step(loop, mode):
        with mode:
            started = time.perf_counter()
            loop.step()
            return time.perf_counter() - started

    sides = {
        "plain": lambda: plain_step(plain, nullcontext()),
        "plain+tracker": lambda: plain_step(plain_measured, tracker),
        "memexp": lambda: memexp_step(ours),
        "memexp+tracker": lambda: memexp_step(measured),
    }
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    load = MachineLoad()
    for i in range(rounds + 2):
        if i == 2:
            load.start()
        for name in names[i % 4:] + names[:i % 4]:
            seconds = sides[name]()
            if i >= 2:
                times[name].append(seconds)
    others = load.others_share(load.own_cpu())
    counter = OpCounter()
    with counter:
        ours.train_step(streams[ours])
    return times, counter.ops, others


def paired(times, top: str, bottom: str) -> tuple[float, float, float]:
    """(q1, median, q3) of the round-by-round ratio top / bottom."""
    return quartiles([a / b for a, b in zip(times[top], times[bottom], strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="resnet")
    parser.add_argument("--steps", type=int, default=40, help="steps of each whole run")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: --steps)")
    parser.add_argument("--runs", type=int, default=4, help="whole-run pairs (0: none)")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    args.rounds = args.rounds or args.steps
    base = [*MODELS[args.model], f"trainer.max_steps={args.steps}", "optim=sgd", *args.overrides]
    untracked = compose_cfg([*base, "memory.track=false"])
    tracked = compose_cfg([*base, "memory.track=true"])
    data: TensorData = instantiate(untracked.data)
    print(describe_machine())
    print(f"model={args.model} ({untracked.model._target_}) batch={data.batch_size} "
          f"rounds={args.rounds} runs={args.runs} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} overrides={' '.join(args.overrides) or '-'}")

    # 1. The math: final weights after N fp32 steps.
    trainer, _ = memexp_fit(untracked)
    plain = PlainLoop(untracked, data)
    plain.run(args.steps)
    ours = trainer.model.state_dict()
    bitwise = all(torch.equal(ours[k], v) for k, v in plain.model.state_dict().items())

    # 2. Steps of the four sides, interleaved one by one.
    times, ops, others = interleaved_steps(untracked, tracked, data, args.rounds)
    median = {name: statistics.median(values) for name, values in times.items()}
    cost = paired(times, "memexp+tracker", "memexp")
    overhead = paired(times, "memexp", "plain")
    per_op = (median["memexp+tracker"] - median["memexp"]) / ops

    # 3. Whole runs with the default measure_steps against track=false, interleaved in pairs.
    wall: dict[str, list[float]] = {"default": [], "untracked": []}
    load = MachineLoad()
    load.start()
    for run in range(args.runs):
        for side in ("default", "untracked") if run % 2 == 0 else ("untracked", "default"):
            wall[side].append(memexp_fit(tracked if side == "default" else untracked)[1])
    run_others = load.others_share(load.own_cpu())
    wall_ratio = quartiles([a / b for a, b in zip(wall["default"], wall["untracked"],
                                                   strict=True)]) if args.runs else None

    # 4. Peak tracked tensor memory, both under the same live-storage tracker.
    trainer, _ = memexp_fit(tracked)
    peak_ours = trainer.meter.report()["peak_bytes"]
    tracker = LiveStorageTracker()
    PlainLoop(tracked, data).run(args.steps, tracker)
    peak_plain = max(p.peak_bytes for p in tracker.peaks.values())

    def spread(q):
        return f"{q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f})" if q else "not run (--runs 0)"

    def share(value):
        return "unknown" if value is None else f"{value:.0%}"

    print(f"\nops per memexp step: {ops}; other processes' share of the machine: "
          f"{share(others)} during the steps, {share(run_others)} during the whole runs")
    print("\n| side | median step time | x memexp (tracker off) |\n|---|---|---|")
    for name in times:
        print(f"| {name} | {median[name] * 1e3:.2f} ms | {spread(paired(times, name, 'memexp'))} |")
    rows = [
        ("tracker cost while tracking: memexp+tracker / memexp", spread(cost)),
        ("tracker cost on the plain loop: plain+tracker / plain",
         spread(paired(times, "plain+tracker", "plain"))),
        ("framework, tracker off: memexp / plain", spread(overhead)),
        ("framework, tracker on: memexp+tracker / plain+tracker",
         spread(paired(times, "memexp+tracker", "plain+tracker"))),
        ("tracker cost per op", f"{per_op * 1e6:.1f} us ({ops} ops per step)"),
        (f"whole runs of {args.steps} steps + eval, default (memory.measure_steps="
         f"{tracked.memory.measure_steps}) / track=false ({args.runs} pairs)", spread(wall_ratio)),
        ("peak tracked tensor memory, memexp vs plain",
         f"{peak_ours / MIB:.2f} vs {peak_plain / MIB:.2f} MiB "
         f"({(peak_ours - peak_plain) / MIB:+.2f})"),
        (f"final weights after {args.steps} fp32 steps",
         "bitwise equal" if bitwise else "DIFFERENT"),
    ]
    print("\n| measure | result |\n|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    checks = {
        "steps/s ratio >= 0.98 (tracking off)": 1 / overhead[1] >= 0.98,
        "peak memory <= plain loop": peak_ours <= peak_plain,
        "final weights bitwise equal": bitwise,
    }
    if args.model != "mlp":
        checks["tracker cost <= 1.10x while tracking"] = cost[1] <= 1.10
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    raise SystemExit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
