"""Step times that can be compared: which steps are timed, their spread, and how busy the machine
was meanwhile.

The storage tracker costs time in proportion to a step's ops, so a technique that adds ops
(accumulation, recomputation) looks slower under it than it is. A run therefore measures memory
on its first steps (`memory.measure_steps`, the tracker on) and takes its step time from the
steps after them (the tracker off). A run too short to have such steps is timed on its tracked
steps and says so (`tracked: true`); the report leaves its time ratio out.

Step times on a shared machine move with what else runs on it, so each run records the share of
the machine's CPU time that other processes took while its timed steps ran (from /proc/stat),
and the interquartile range of its step times. The report marks a ratio uncertain when either is
too large to trust it.

A machine's speed also moves over seconds and differs between processes, so the median step
times of two runs, each its own process, carry the two processes' speeds as well as the two
configs'. A run therefore times its baseline beside itself (`timing.paired_steps`,
memexp.baseline): their steps alternate in one process, and the median of the step-by-step
ratios (`paired`) is what the report gives as the run's step time against its baseline. Two
models taking turns slow each other's steps, so the run's own step time (and throughput) comes
from the timed steps after the pairs, which run alone. The pairs go on only until the ratio is
known well enough: the run drops its baseline once a 90% confidence interval of the median
ratio lies within `timing.paired_spread` of their median, on either side (`settled`). The interval
is distribution-free (a step's time on a shared machine is not normal, and its outliers are
one-sided): the order statistics that cover the median with at least that probability, whatever
the ratios' distribution (`median_interval`). It exists from MIN_PAIRS (5) pairs on, where it is
the lowest and highest ratio, so a steady machine settles after 5 pairs and a noisy one goes on.
A ratio whose pairs ran out first (`timing.paired_steps`, or the run's end) is not settled, and the
report marks it uncertain.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from dataclasses import dataclass

# A run whose timed steps shared the machine with other processes taking more than this share of
# its CPU time (all cores together) is marked busy: its step time may be theirs as much as its own.
BUSY_SHARE = 0.10
# The fewest steps that ran alone (after the pairs with the baseline) that give the run's step time.
ALONE_STEPS = 5
# How sure the pairs must make the median ratio before the pairing stops (`median_interval`).
CONFIDENCE = 0.9


def median_interval_rank(n: int, confidence: float = CONFIDENCE) -> int | None:
    """The largest k for which the k-th lowest and the k-th highest of n values cover their
    distribution's median with at least `confidence`, whatever that distribution: each value
    falls below the median with probability 1/2, so the pair misses it with probability
    2 P(Binomial(n, 1/2) < k). None where even the lowest and the highest do not (n < 5 at 90%)."""
    ranks = [k for k in range(1, n // 2 + 1)
             if 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n >= confidence]
    return ranks[-1] if ranks else None


def median_interval(values: list[float]) -> tuple[float, float] | None:
    """A CONFIDENCE interval of the median of `values`' distribution (median_interval_rank), or
    None where there are too few values for one."""
    k = median_interval_rank(len(values))
    if k is None:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[-k]


# The fewest pairs that have a median interval (5): the pairing can settle from then on.
MIN_PAIRS = next(n for n in itertools.count(1) if median_interval_rank(n) is not None)


def machine_cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine since boot, in clock ticks, from /proc/stat's
    first line; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal; idle and iowait are the idle time.
    return sum(fields) - fields[3] - fields[4], sum(fields)


def own_cpu_seconds(children: bool = False) -> float:
    """CPU time this process has used, all its threads (and its children that have ended)."""
    times = os.times()
    own = times.user + times.system
    return own + times.children_user + times.children_system if children else own


@dataclass
class MachineLoad:
    """How much of the machine other processes used from `start()` on; `children`: this
    process's child processes count as its own."""

    children: bool = False
    _ticks: tuple[int, int] | None = None
    _own: float = 0.0

    def start(self) -> None:
        self._ticks, self._own = machine_cpu_ticks(), own_cpu_seconds(self.children)

    def own_cpu(self) -> float:
        """This process's CPU seconds since `start()`."""
        return own_cpu_seconds(self.children) - self._own

    def others_share(self, ours: float) -> float | None:
        """The share of the machine's CPU time since `start()` that did not go to `ours` (CPU
        seconds of this run's processes), or None where it cannot be read."""
        now = machine_cpu_ticks()
        if now is None or self._ticks is None or now[1] <= self._ticks[1]:
            return None
        busy, total = now[0] - self._ticks[0], now[1] - self._ticks[1]
        return max(0.0, busy - ours * os.sysconf("SC_CLK_TCK")) / total


def process_cpu_seconds(pid: int) -> float:
    """CPU time process `pid` has used so far, all its threads (0 where /proc has none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def free_cores(sample_s: float, ours: list[int]) -> tuple[int, float] | None:
    """(threads, busy): how many cores of this process's the machine's other processes leave
    free, at least 1, and how many cores' worth they kept busy over the next `sample_s`
    seconds; this process and the processes `ours` are not others. None where /proc/stat
    cannot be read."""
    load, before = MachineLoad(), sum(process_cpu_seconds(pid) for pid in ours)
    load.start()
    time.sleep(sample_s)
    share = load.others_share(load.own_cpu()
                              + sum(process_cpu_seconds(pid) for pid in ours) - before)
    if share is None:
        return None
    busy = share * (os.cpu_count() or 1)
    return max(1, min(len(os.sched_getaffinity(0)), round((os.cpu_count() or 1) - busy))), busy


def step_ranges(steps: list[int]) -> list[list[int]]:
    """[3, 4, 5, 9] -> [[3, 5], [9, 9]]: sets of steps, as result.json gives them."""
    ranges: list[list[int]] = []
    for step in steps:
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return ranges


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def paired_timing(step_times: list[float], untracked: list[int], baseline_times: list[list],
                  unpaired: str | None, spread: float) -> dict:
    """The run's time against its baseline's, from the untracked steps past warm-up that ran
    beside one of the baseline's steps (memexp.paired.PairedBaseline): the median of the
    step-by-step ratios, their interquartile range, and whether the median's CONFIDENCE interval
    (median_interval) is within `spread` of it on either side (`settled`); else why there is
    none."""
    candidates = set(untracked)
    pairs = {step: seconds for step, seconds in baseline_times if step in candidates}
    if not pairs:
        return {"skipped": unpaired or "no timed step ran beside a baseline step"}
    ratios = [step_times[step - 1] / seconds for step, seconds in pairs.items()]
    q1, ratio, q3 = quartiles(ratios)
    interval = median_interval(ratios)
    paired = {"steps": step_ranges(sorted(pairs)),
              "baseline_step_time_s": statistics.median(pairs.values()),
              "ratio": ratio, "ratio_iqr": [q1, q3],
              "settled": interval is not None and ratio * (1 - spread) <= interval[0]
              and interval[1] <= ratio * (1 + spread)}
    return paired | ({"stopped": unpaired} if unpaired else {})  # a baseline that failed later


def step_timing(step_times: list[float], measured: list[int], warmup_steps: int,
                others_share: float | None, baseline_times: list[list],
                unpaired: str | None, spread: float) -> dict:
    """The `timing` part of result.json's metrics: the median step time of the untracked steps
    past warm-up that ran alone (of those beside the baseline's where none did; of the tracked
    ones where none is untracked; None where every step was warm-up), its interquartile range,
    which steps were timed and which measured memory, how busy the machine was, and the time
    against the run's baseline timed beside it (`paired`, settled within `spread`)."""
    skip, beside = set(measured), {step for step, _ in baseline_times}
    steps = list(range(1, len(step_times) + 1))
    untracked = [s for s in steps if s not in skip and s > warmup_steps]
    # A step beside the baseline's is slower in itself (the two models take turns in the
    # caches): the step time is that of the untracked steps that ran alone, where there are any.
    alone = [s for s in untracked if s not in beside]
    if 0 < len(alone) < min(ALONE_STEPS, len(untracked)):
        alone = []  # too few to stand for the run: all of the untracked steps, and it says so
    # Warm-up steps are never timed: a run of warm-up only has no step time, not a wrong one.
    timed = alone or untracked or [s for s in steps if s > warmup_steps]
    q1, median, q3 = quartiles([step_times[s - 1] for s in timed]) if timed else (None,) * 3
    return {
        "step_time_s": median,
        "step_time_iqr_s": [q1, q3] if timed else None,
        "timed_steps": step_ranges(timed),
        "measured_steps": step_ranges(sorted(skip)),
        # the timed steps ran under the storage tracker: slower, by more for ops-heavy steps
        "tracked": not untracked,
        "others_cpu_share": others_share,
        "busy": others_share is not None and others_share > BUSY_SHARE,
        # no untracked step ran alone: the step time is of steps beside the baseline's
        "beside_baseline": any(s in beside for s in timed),
        "paired": paired_timing(step_times, untracked, baseline_times, unpaired, spread),
    }
