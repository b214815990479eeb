"""A sweep's runs as its report reads them (a Row each, from its result.json), and what the
table and the plots both compute from them: the speed of a row, and the Pareto front."""

from __future__ import annotations

from dataclasses import dataclass, field

from memexp.baseline import baseline_config, same_steps

MIB = 2**20
UNCERTAIN = "?"  # beside a time ratio, and its throughput, that cannot be trusted (Row.time_doubt)


@dataclass
class Row:
    job: str
    result: dict
    label: str = ""
    workload: tuple = ()
    memory_ratio: float | None = None
    step_time_ratio: float | None = None
    # the ratio's range from the interquartile ranges: (row's q1 / base's q3, q3 / q1)
    step_time_range: tuple[float, float] | None = None
    # why the time ratio cannot be trusted, if it cannot
    time_doubt: str | None = None
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


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both: lower x (memory), higher y."""
    front = []
    for i, (x, y) in enumerate(points):
        beaten = any((ox <= x and oy >= y) and (ox < x or oy > y)
                     for j, (ox, oy) in enumerate(points) if j != i)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def speed_range(row: Row, rows: list[Row]) -> tuple[float, float, float] | None:
    """(low, median, high) speed of an untracked step: throughput where the sweep has one
    unit (for a ratio timed beside the baseline, the base's over that ratio), otherwise speed
    against the row's baseline; None without an untracked step time."""
    time = row.step_time
    units = {r.metrics.get("throughput_unit") for r in rows if r.ok}
    if time is None:
        return None
    if len(units) == 1 and row.time_paired:  # the base's speed over the ratio timed beside it
        base, (low, high) = row.time_base.metrics["throughput"], row.step_time_range
        return base / high, base / row.step_time_ratio, base / low
    if len(units) == 1:
        items = row.metrics["throughput"] * time.median  # per step
        return items / time.q3, items / time.median, items / time.q1
    if row.step_time_ratio is None:
        return None
    low, high = row.step_time_range
    return 1 / high, 1 / row.step_time_ratio, 1 / low


def speed(row: Row, rows: list[Row]) -> float | None:
    found = speed_range(row, rows)
    return found[1] if found else None
