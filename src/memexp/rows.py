"""A sweep's runs as its report reads them (a Row each, from its result.json), and what the
table and the plots both compute from them: a row's base, its speed, repeats, the Pareto front.

A row's base is the row its ratios divide by, and the report names it. It is the row that ran
the row's own baseline config (memexp.baseline: the same workload with no memory technique),
where the sweep has one: the config a run times beside its steps, so the ratio the report gives
is the one the run measured. Otherwise it is its workload's base (memexp.report.baseline).

Throughput follows from the step time x base: a row's is its base's over that ratio, and the
base's is its own. So the throughput column and the step-time column never disagree, whichever
process each run's own steps were timed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memexp.baseline import baseline_config, same_steps

MIB = 2**20
UNCERTAIN = "?"  # beside a time ratio, and a throughput, that cannot be trusted (Row.time_doubt)
# Overrides whose runs repeat one config: rows that differ only in these are its repeats, and
# how far their accuracy moves says how far a difference from the base may be chance.
REPEAT_KEYS = ("trainer.seed", "data.seed")


@dataclass
class Row:
    job: str
    result: dict
    label: str = ""
    workload: tuple = ()
    # the overrides that vary across the sweep, as this row sets them
    varying: dict[str, str] = field(default_factory=dict)
    memory_ratio: float | None = None
    # the row its memory ratio and accuracy difference divide by or subtract
    memory_base: Row | None = field(default=None, repr=False, compare=False)
    # eval accuracy less its memory base's
    accuracy_delta: float | None = None
    step_time_ratio: float | None = None
    # the ratio's range: the interquartile range of the step-by-step ratios where paired, else
    # from the two runs' interquartile ranges: (row's q1 / base's q3, q3 / q1)
    step_time_range: tuple[float, float] | None = None
    # why the time ratio cannot be trusted, if it cannot
    time_doubt: str | None = None
    # the jobs whose busy machine is (part of) why
    time_busy: list[str] = field(default_factory=list)
    # the doubt is that the ratio may be off, not only spread: two runs' medians from a busy
    # machine, or from steps that all took turns with a baseline's
    time_biased: bool = False
    # True: the ratio was timed beside its baseline in the run's process; False: it divides the
    # medians of two runs; None: the row is the base, or has no ratio
    time_paired: bool | None = None
    # the row its time ratio is against
    time_base: Row | None = field(default=None, repr=False, compare=False)
    # why it is the base of its workload's ratios without the baseline options, if it is
    stand_in_base: str | None = None

    @property
    def status(self) -> str:
        return self.result.get("status", "unknown")

    @property
    def memory(self) -> dict:
        return self.result.get("memory") or {}

    @property
    def metrics(self) -> dict:
        return self.result.get("metrics") or {}

    @property
    def peak(self) -> int | None:
        return self.memory.get("peak_bytes")

    @property
    def device_peak(self) -> int | None:
        """What must fit on the device: reserved memory on CUDA, live bytes elsewhere."""
        return self.memory.get("reserved_peak_bytes") or self.peak

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.peak is not None

    @property
    def step_time(self) -> StepTime | None:
        """The step time taken with the tracker off, with its spread; None if there is none."""
        timing = self.metrics.get("timing")
        if self.status != "ok" or not self.metrics.get("step_time_s"):
            return None
        if timing is None:  # written before memexp.timing: untracked only with track=false
            median = self.metrics["step_time_s"]
            return None if self.memory.get("tracked") else StepTime(median, median, median)
        if timing["tracked"]:
            return None
        return StepTime(timing["step_time_s"], *timing["step_time_iqr_s"], busy=timing["busy"],
                        beside=timing.get("beside_baseline", False))

    @property
    def is_time_base(self) -> bool:
        return self.time_base is self

    @property
    def repeat_of(self) -> tuple:
        """What its repeats share: the varying overrides less REPEAT_KEYS."""
        return tuple((k, v) for k, v in self.varying.items() if k.lstrip("+~") not in REPEAT_KEYS)

    @property
    def repeat(self) -> tuple:
        """Which of its config's repeats it is: its REPEAT_KEYS overrides."""
        return tuple((k, v) for k, v in self.varying.items() if k.lstrip("+~") in REPEAT_KEYS)

    @property
    def repeat_label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.repeat_of) or "-"

    def paired_with(self, base: Row) -> dict | None:
        """The run's time against its baseline, timed beside it (memexp.timing), where that
        baseline takes the steps `base` took; else None."""
        paired = (self.metrics.get("timing") or {}).get("paired") or {}
        if "ratio" not in paired:
            return None
        mine = baseline_config(self.result["config"])
        return paired if mine is not None and same_steps(mine, base.result["config"]) else None


@dataclass
class StepTime:
    median: float
    q1: float
    q3: float
    busy: bool = False  # other processes took more than memexp.timing.BUSY_SHARE of the machine
    # every timed step ran beside the run's baseline, which slows a step (memexp.timing)
    beside: bool = False


def own_baseline(row: Row, candidates: list[Row]) -> Row | None:
    """The first of `candidates`, other than `row`, that ran `row`'s baseline config."""
    mine = baseline_config(row.result["config"])
    if mine is None:
        return None
    return next((other for other in candidates
                 if other is not row and same_steps(mine, other.result["config"])), None)


def pareto_front(points: list[tuple[float, dict]]) -> list[int]:
    """Indices of the points that no other point certainly beats, by memory (less is better)
    and a value (more is better). A point is its x (memory) and its value's range at each of
    its repeats ({repeat: (low, high)}; a single run is one repeat). One point certainly beats
    another where it has no more memory and, at each repeat the two share (of all their
    repeats where they share none), its low end is at least the other's high end, better in
    one of the two. With low == high, the usual front; a wide spread keeps a point on it."""
    def beats(a: tuple[float, dict], b: tuple[float, dict]) -> bool:
        shared = a[1].keys() & b[1].keys()
        pairs = ([(a[1][k], b[1][k]) for k in shared] if shared else
                 [(x, y) for x in a[1].values() for y in b[1].values()])
        return (a[0] <= b[0] and all(mine[0] >= theirs[1] for mine, theirs in pairs)
                and (a[0] < b[0] or any(mine[0] > theirs[1] for mine, theirs in pairs)))

    front = [i for i, point in enumerate(points)
             if not any(beats(other, point) for j, other in enumerate(points) if j != i)]
    return sorted(front, key=lambda i: (points[i][0], -max(high for _, high in
                                                          points[i][1].values())))


def time_chain(row: Row) -> list[Row]:
    """The row, its time base, that base's, ... up to the base of its workload."""
    chain = [row]
    while not chain[-1].is_time_base:
        chain.append(chain[-1].time_base)
    return chain


def speed_doubt(row: Row) -> str | None:
    """Why its throughput (or speed) cannot be trusted: its ratio's doubt, or its base's, up to
    the workload's base, whose own steps give the throughput of every row after it."""
    if row.time_base is None:
        return None
    for link in time_chain(row):
        if link.time_doubt:
            return link.time_doubt if link is row else f"its base's: job {link.job}'s"
    root = time_chain(row)[-1]
    return (f"the machine was busy during job {root.job}'s own steps, from which its "
            "workload's throughputs follow" if root.step_time.busy else None)


def in_base_steps(row: Row) -> float:
    """Its step time in units of its workload's base's: the product of the step time x base
    ratios from the row to that base."""
    return 1.0 if row.is_time_base else in_base_steps(row.time_base) * row.step_time_ratio


def step_seconds(row: Row) -> float | None:
    """The report's step time: its workload's base's own median times in_base_steps; None
    without a step time x base."""
    if row.step_time_ratio is None:
        return None
    return time_chain(row)[-1].step_time.median * in_base_steps(row)


def throughput(row: Row) -> float | None:
    """The report's throughput: its workload's base's own over in_base_steps (a workload is
    the same items per step); None without a step time x base."""
    if row.step_time_ratio is None:
        return None
    return time_chain(row)[-1].metrics["throughput"] / in_base_steps(row)


def speed_range(row: Row, rows: list[Row]) -> tuple[float, float, float] | None:
    """(low, median, high) speed of an untracked step: throughput (the report's) where the
    sweep has one unit, otherwise speed against its workload's base; None without a step time
    x base. The range is its step time x base's, or the base's own interquartile range."""
    if row.step_time_ratio is None:
        return None
    units = {r.metrics.get("throughput_unit") for r in rows if r.ok}
    middle = throughput(row) if len(units) == 1 else 1 / in_base_steps(row)
    if row.is_time_base:
        time = row.step_time
        low, high = time.q1 / time.median, time.q3 / time.median
    else:
        low, high = (bound / row.step_time_ratio for bound in row.step_time_range)
    return middle / high, middle, middle / low


def speed(row: Row, rows: list[Row]) -> float | None:
    found = speed_range(row, rows)
    return found[1] if found else None


def repeats(rows: list[Row]) -> dict[tuple, list[Row]]:
    """The rows of each config, by what its repeats share (Row.repeat_of), in the sweep's
    order."""
    grouped: dict[tuple, list[Row]] = {}
    for row in rows:
        grouped.setdefault(row.repeat_of, []).append(row)
    return grouped
