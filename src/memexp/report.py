"""The comparison report of a sweep folder: a table, plots, and the best configs under a budget.

Reads every `<sweep>/<job>/result.json` there is, so it works on a finished, partial or running
sweep alike. Writes `report.md`, `report.csv` and three PNG plots into the sweep folder. Runs by
itself at the end of every sweep (`ReportCallback`) and on demand (`memexp report <sweep>`).

Ratios compare techniques on the same workload: rows whose varying overrides differ only in
technique settings (the technique groups and their keys, model.inplace, memory.*) share a
baseline, the first that succeeded with the baseline option of precision, checkpointing and
bn_mode (the classes' `baseline` attribute: fp32, none, train), else their first successful row.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from memexp.memory.sizes import parse_size
from memexp.result import CATEGORY_ORDER, GROUPS, HALF_ON_CPU, half_precision_on_cpu, mib

log = logging.getLogger("memexp")
MIB = 2**20
BASELINE_GROUPS = ("precision", "checkpointing", "bn_mode")
HALF_MARK = "†"  # beside the time cells of half-precision runs on a CPU


def is_technique_key(key: str) -> bool:
    key = key.lstrip("+~")
    return key.split(".")[0] in (*GROUPS, "memory") or key == "model.inplace"


@dataclass
class Row:
    job: str
    result: dict
    label: str = ""
    workload: tuple = ()
    memory_ratio: float | None = None
    step_time_ratio: float | None = None

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


def job_folders(sweep_dir: Path) -> list[Path]:
    def order(path: Path):
        return (0, int(path.name)) if path.name.isdigit() else (1, path.name)

    return sorted((p.parent for p in sweep_dir.glob("*/result.json")), key=order)


def load_rows(sweep_dir: Path) -> list[Row]:
    rows = [Row(folder.name, json.loads((folder / "result.json").read_text()))
            for folder in job_folders(sweep_dir)]
    describe_rows(rows)
    add_ratios(rows)
    return rows


def describe_rows(rows: list[Row]) -> None:
    """Each row's label (the overrides whose values differ across the sweep) and workload
    (those of them that are not technique settings)."""
    parsed = [dict(o.split("=", 1) for o in row.result.get("overrides", []) if "=" in o)
              for row in rows]
    keys = sorted({k for p in parsed for k in p})
    varying = [k for k in keys if len({p.get(k) for p in parsed}) > 1]
    for row, overrides in zip(rows, parsed, strict=True):
        row.label = " ".join(f"{k}={overrides[k]}" for k in varying if k in overrides) or "-"
        row.workload = tuple((k, overrides.get(k)) for k in varying if not is_technique_key(k))


def is_baseline(config: dict) -> bool:
    """A run whose precision, checkpointing and bn_mode are each their group's baseline."""
    return all(get_class(config[group]["_target_"]).baseline for group in BASELINE_GROUPS)


def add_ratios(rows: list[Row]) -> None:
    for workload in {row.workload for row in rows}:
        mine = [row for row in rows if row.workload == workload and row.ok]
        if not mine:
            continue
        base = next((row for row in mine if is_baseline(row.result["config"])), mine[0])
        for row in mine:
            row.memory_ratio = row.peak / base.peak
            step, base_step = row.metrics.get("step_time_s"), base.metrics.get("step_time_s")
            if step and base_step:
                row.step_time_ratio = step / base_step


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both: lower x (memory), higher y."""
    front = []
    for i, (x, y) in enumerate(points):
        beaten = any((ox <= x and oy >= y) and (ox < x or oy > y)
                     for j, (ox, oy) in enumerate(points) if j != i)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


@dataclass
class BudgetPick:
    budget: int
    fitting: list[Row] = field(default_factory=list)
    fastest: Row | None = None
    most_accurate: Row | None = None


def speed(row: Row, rows: list[Row]) -> float:
    """Throughput where the sweep has one unit; otherwise speed against the row's baseline."""
    units = {r.metrics.get("throughput_unit") for r in rows if r.ok}
    if len(units) == 1:
        return row.metrics.get("throughput") or 0.0
    return 1 / row.step_time_ratio if row.step_time_ratio else 0.0


def pick(rows: list[Row], budget: int) -> BudgetPick:
    fitting = [row for row in rows if row.ok and row.device_peak <= budget]
    choice = BudgetPick(budget, fitting)
    if fitting:
        choice.fastest = max(fitting, key=lambda r: speed(r, rows))
        scored = [r for r in fitting if r.metrics.get("eval_accuracy") is not None]
        choice.most_accurate = max(scored, key=lambda r: r.metrics["eval_accuracy"], default=None)
    return choice


# -- writing -------------------------------------------------------------------------------------
COLUMNS = ["job", "config", "status", *GROUPS, "peak_mib",
           *[f"{c}_mib" for c in CATEGORY_ORDER], "memory_x_base", "step_time_x_base",
           "throughput", "throughput_unit", "eval_accuracy", "final_loss", "step_time_s", "error"]


def csv_record(row: Row) -> dict:
    breakdown = row.memory.get("breakdown_at_peak") or {}
    error = (row.result.get("error") or "").strip().splitlines()
    record = {"job": row.job, "config": row.label, "status": row.status,
              **{g: row.result.get("techniques", {}).get(g) for g in GROUPS},
              "peak_mib": row.peak / MIB if row.peak is not None else None,
              **{f"{c}_mib": breakdown[c] / MIB if c in breakdown else None
                 for c in CATEGORY_ORDER},
              "memory_x_base": row.memory_ratio, "step_time_x_base": row.step_time_ratio,
              "error": error[-1] if error else None}
    for key in ("throughput", "throughput_unit", "eval_accuracy", "final_loss", "step_time_s"):
        record[key] = row.metrics.get(key)
    return record


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[Row]) -> str:
    lines = ["| job | config | status | peak MiB | params | grads | optimizer | activations "
             "| other | memory x base | step time x base | throughput | eval acc | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r = csv_record(row)
        mark = HALF_MARK if half_precision_on_cpu(row.result) else ""
        throughput = (f"{r['throughput']:.1f} {r['throughput_unit']}{mark}"
                      if r["throughput"] is not None else "-")
        lines.append(
            f"| {row.job} | {row.label} | {row.status} | {fmt(r['peak_mib'], 1)} | "
            + " | ".join(fmt(r[f"{c}_mib"], 1) for c in CATEGORY_ORDER[:5])
            + f" | {fmt(r['memory_x_base'])} | {fmt(r['step_time_x_base'])}{mark} | {throughput} | "
            f"{fmt(r['eval_accuracy'], 3)} | {fmt(r['final_loss'], 4)} |")
    if any(half_precision_on_cpu(row.result) for row in rows):
        lines += ["", f"{HALF_MARK} {HALF_ON_CPU}."]
    return "\n".join(lines)


def budget_lines(choice: BudgetPick, rows: list[Row]) -> list[str]:
    lines = [f"Budget {mib(choice.budget)}: {len(choice.fitting)} of {sum(r.ok for r in rows)} "
             "successful configs fit (peak reserved on CUDA, peak live bytes elsewhere)."]
    if choice.fastest is not None:
        lines.append(f"- fastest that fits: job {choice.fastest.job} ({choice.fastest.label}), "
                     f"peak {mib(choice.fastest.device_peak)}")
    if choice.most_accurate is not None:
        accuracy = choice.most_accurate.metrics["eval_accuracy"]
        lines.append(f"- most accurate that fits: job {choice.most_accurate.job} "
                     f"({choice.most_accurate.label}), eval accuracy {accuracy:.3f}")
    return lines


def plot(rows: list[Row], sweep_dir: Path) -> list[Path]:
    from memexp.plots import write_plots  # matplotlib only when there is something to draw

    return [chart.path for chart in write_plots(rows, sweep_dir)]


@dataclass
class Report:
    rows: list[Row]
    table: str
    markdown: Path
    csv: Path
    plots: list[Path]
    budget: BudgetPick | None = None

    @property
    def unsuccessful(self) -> list[Row]:
        return [row for row in self.rows if row.status != "ok"]


def write_report(sweep_dir: Path | str, budget: str | None = None) -> Report:
    sweep_dir = Path(sweep_dir)
    rows = load_rows(sweep_dir)
    table = markdown_table(rows)
    choice = pick(rows, parse_size(budget, "report.budget")) if budget else None
    lines = [f"# Sweep {sweep_dir.name}", "", f"{len(rows)} jobs: " + ", ".join(
        f"{sum(r.status == s for r in rows)} {s}" for s in sorted({r.status for r in rows})),
        "", table, ""]
    if choice is not None:
        lines += [*budget_lines(choice, rows), ""]
    plots = plot(rows, sweep_dir)
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    failures = [row for row in rows if row.status != "ok" and row.result.get("error")]
    if failures:
        lines += ["", "## Jobs that did not succeed", ""]
        lines += [f"- job {row.job} ({row.label}): {row.status}: "
                  f"{row.result['error'].strip().splitlines()[-1]}" for row in failures]
    markdown = sweep_dir / "report.md"
    markdown.write_text("\n".join(lines) + "\n")
    csv_path = sweep_dir / "report.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(csv_record(row) for row in rows)
    return Report(rows, table, markdown, csv_path, plots, choice)


def describe(report: Report) -> str:
    """What a user sees in the terminal at the end of a sweep."""
    lines = [report.table, ""]
    if report.budget is not None:
        lines += [*budget_lines(report.budget, report.rows), ""]
    lines.append(f"Report: {report.markdown}, {report.csv.name}; plots: "
                 + (", ".join(p.name for p in report.plots) or "none (no job succeeded)"))
    return "\n".join(lines)


class ReportCallback(Callback):
    """At the end of every sweep: the report, in the terminal, on disk and in the logger; then a
    non-zero exit if any job did not succeed."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # A bad budget must stop the sweep before its jobs run, not after the last one.
        if config.report.budget is not None:
            try:
                parse_size(config.report.budget, "report.budget")
            except ValueError as error:
                raise SystemExit(f"memexp: {error}") from None

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        report = write_report(sweep_dir, config.report.budget)
        log.info("\n" + describe(report))
        instantiate(config.logger).report(sweep_dir, report)
        if report.unsuccessful:
            # Hydra turns a callback's exceptions into warnings; SystemExit gets through, so the
            # sweep's exit code says that some jobs failed.
            raise SystemExit(
                f"memexp: {len(report.unsuccessful)} of {len(report.rows)} jobs did not "
                "succeed: " + ", ".join(f"job {r.job} {r.status}" for r in report.unsuccessful)
                + f". See {report.markdown}")
