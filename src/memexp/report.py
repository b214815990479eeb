"""The comparison report of a sweep folder: a table, plots, and the best configs under a budget.

Reads every `<sweep>/<job>/result.json` there is, so it works on a finished, partial or running
sweep alike; a file that is not a usable record is skipped and named. Writes `report.md`,
`report.csv` and three PNG plots into the sweep folder. Runs by itself at the end of every sweep
(`ReportCallback`) and on demand (`memexp report <sweep>`).

Ratios compare techniques on the same workload: rows whose varying overrides differ only in
technique settings (the technique groups and their keys, model.inplace, memory.*, timing.*)
share a base: the first that succeeded with the baseline option of precision, checkpointing and
bn_mode (memexp.baseline), else their first successful row.
Memory ratios need measured peaks; time ratios need step times taken with the storage tracker off
(memexp.timing), so a run with memory.track=false has one and a run too short to have untracked
steps has none. A run that timed its own baseline beside it, where that baseline is the base's
config, gives its time ratio from those paired steps; any other divides the two runs' medians.
A time ratio is uncertain when its spread leaves it on either side of 1.0, or when other
processes were busy on the machine during the steps it comes from; the fastest config that fits
a budget is never named on one.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from memexp import run_folder
from memexp.atomic import atomic_file
from memexp.baseline import BASELINE_GROUPS, is_baseline
from memexp.checkpoint import is_run_length_key
from memexp.memory.sizes import parse_size
from memexp.plots import write_plots
from memexp.result import (
    CATEGORY_ORDER,
    DEVICE_CATEGORIES,
    GROUPS,
    HALF_ON_CPU,
    RECORD,
    BadRecord,
    error_line,
    half_precision_on_cpu,
    load_record,
    mib,
    printable,
)
from memexp.rows import MIB, UNCERTAIN, Row, speed, speed_range

log = logging.getLogger("memexp")
HALF_MARK = "†"  # beside the time cells of half-precision runs on a CPU


def is_technique_key(key: str) -> bool:
    key = key.lstrip("+~")
    return key.split(".")[0] in (*GROUPS, "memory", "timing") or key == "model.inplace"


def job_folders(sweep_dir: Path) -> list[Path]:
    def order(path: Path):
        return (0, int(path.name)) if path.name.isdigit() else (1, path.name)

    return sorted((p.parent for p in sweep_dir.glob(f"*/{RECORD}")), key=order)


def load_rows(sweep_dir: Path) -> tuple[list[Row], list[str]]:
    """The rows of the sweep's usable records, and why each other result.json was skipped."""
    rows, skipped = [], []
    for folder in job_folders(sweep_dir):
        try:
            record = load_record(folder / RECORD)
            check_launched(folder, record)
            rows.append(readable(folder, Row(printable(folder.name), record)))
        except BadRecord as error:
            skipped.append(str(error))
    describe_rows(rows)
    add_ratios(rows)
    return rows, skipped


def check_launched(folder: Path, record: dict) -> None:
    """BadRecord when a job folder's record is not of the job Hydra last launched there: a rerun
    that was refused (another config's checkpoint) leaves the earlier run's record, while
    Hydra's `.hydra/overrides.yaml` names the job that did not run. Run-length overrides may
    differ (a no-op rerun keeps the record it found), but not trainer.max_steps: a no-op rerun
    is of the record's own steps (run_folder.finished_run), and one refused for more steps
    (its checkpoint does not load) leaves a record of fewer."""
    launched = folder / ".hydra" / "overrides.yaml"
    if not launched.is_file():  # not a Hydra job folder (memexp plan --verify's)
        return

    def measured(overrides: list[str]) -> list[str]:  # less what a rerun may change
        return [o for o in overrides if not is_run_length_key(o.split("=")[0].lstrip("+~"))]

    overrides = OmegaConf.to_container(hydra_file(launched))
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise BadRecord(f"{printable(str(launched))}: not Hydra's list of overrides")
    # written first, by Hydra, when the job was launched
    steps = OmegaConf.select(hydra_file(folder / ".hydra" / "config.yaml"), "trainer.max_steps")
    config = record.get("config")  # none in the launcher's record of a job killed at its start
    if (measured(overrides) != measured(record["overrides"])
            or config is not None and config["trainer"]["max_steps"] != steps):
        raise BadRecord(f"{printable(str(folder / RECORD))}: the record of an earlier run "
                        f"({' '.join(record['overrides'])}); the job last launched here "
                        f"({printable(' '.join(overrides))}) did not run, and its log says why")


def hydra_file(path: Path):
    """One of the files Hydra writes in a job's .hydra folder, or BadRecord naming it."""
    try:
        return OmegaConf.load(path)
    except Exception as error:  # YAML's, OmegaConf's (an OSError for a scalar), RecursionError
        raise BadRecord(f"{printable(str(path))}: not the file Hydra wrote "
                        f"({type(error).__name__})") from None


def readable(folder: Path, row: Row) -> Row:
    """`row`, once what the report reads of it alone reads: load_record checks the types of a
    record's top keys, not those below them (`metrics.timing`'s). BadRecord otherwise."""
    try:
        csv_record(row)
        speed_range(row, [row])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise BadRecord(f"{printable(str(folder / RECORD))}: an incomplete record "
                        f"({type(error).__name__}: {printable(str(error))})") from None
    return row


def describe_rows(rows: list[Row]) -> None:
    """Each row's label (the overrides whose values differ across the sweep) and workload
    (those of them that are not technique settings)."""
    parsed = [dict(o.split("=", 1) for o in row.result.get("overrides", []) if "=" in o)
              for row in rows]
    keys = sorted({k for p in parsed for k in p})
    varying = [k for k in keys if len({p.get(k) for p in parsed}) > 1]
    for row, overrides in zip(rows, parsed, strict=True):
        row.label = " ".join(f"{k}={overrides[k]}" for k in varying if k in overrides) or "-"
        row.workload = tuple((k, samples_per_step(row, overrides.get(k)) if k == "data.batch_size"
                              else overrides.get(k)) for k in varying if not is_technique_key(k))


def samples_per_step(row: Row, batch_size: str | None) -> int | str | None:
    """The batch of a whole optimizer step: accumulating 4 micro-batches of 4 is the workload of
    one batch of 16, so those two rows are compared (`batch_size` where the config is missing)."""
    config = row.result.get("config") or {}
    try:
        return config["data"]["batch_size"] * config["optim"]["accumulate"]
    except (KeyError, TypeError):
        return batch_size


def baseline(rows: list[Row]) -> Row | None:
    """The row the others of a workload are compared with."""
    return next((row for row in rows if is_baseline(row.result["config"])),
                rows[0] if rows else None)


def add_ratios(rows: list[Row]) -> None:
    for workload in {row.workload for row in rows}:
        mine = [row for row in rows if row.workload == workload]
        measured = [row for row in mine if row.ok]
        if base := baseline(measured):
            for row in measured:
                row.memory_ratio = row.peak / base.peak
            if not is_baseline(base.result["config"]):
                base.stand_in_base = "none of those succeeded"
        timed = [row for row in mine if row.step_time is not None]
        if base := baseline(timed):
            for row in timed:
                add_time_ratio(row, base)
            if not is_baseline(base.result["config"]) and base.stand_in_base is None:
                base.stand_in_base = "none of those has an untracked step time"


def add_time_ratio(row: Row, base: Row) -> None:
    """The row's step time against the base's: the one timed beside the row's own baseline in
    its process where that baseline is the base's config, else the ratio of the two medians."""
    paired = row.paired_with(base) if row is not base else None
    if paired is not None:
        row.step_time_ratio, row.step_time_range = paired["ratio"], tuple(paired["ratio_iqr"])
        timed_in = (row,)
    else:
        mine, theirs = row.step_time, base.step_time
        row.step_time_ratio = mine.median / theirs.median
        row.step_time_range = (mine.q1 / theirs.q3, mine.q3 / theirs.q1)
        timed_in = (row, base)
    row.time_paired, row.time_base = None if row is base else paired is not None, base
    busy = sorted({r.job for r in timed_in if r.step_time.busy})
    beside = sorted({r.job for r in timed_in if r.step_time.beside} if paired is None else ())
    if busy:
        row.time_doubt = f"the machine was busy during {jobs(busy)}"
    elif beside:
        row.time_doubt = (f"{jobs(beside)} timed no step alone, only beside their baseline's, "
                          "which slows a step")
    elif paired is not None and paired.get("settled") is False:  # older records lack it
        row.time_doubt = ("its step-by-step ratios had not settled within "
                          "timing.paired_spread when its pairs ran out")
    elif row is not base and row.step_time_range[0] <= 1 <= row.step_time_range[1]:
        row.time_doubt = "its spread overlaps 1.0"


@dataclass
class BudgetPick:
    budget: int
    fitting: list[Row] = field(default_factory=list)
    fastest: Row | None = None
    # why no fastest is named although configs fit
    fastest_doubt: str | None = None
    most_accurate: Row | None = None


def pick(rows: list[Row], budget: int) -> BudgetPick:
    fitting = [row for row in rows if row.ok and row.device_peak <= budget]
    choice = BudgetPick(budget, fitting)
    if fitting:
        choice.fastest, choice.fastest_doubt = fastest(fitting, rows)
        scored = [r for r in fitting if r.metrics.get("eval_accuracy") is not None]
        choice.most_accurate = max(scored, key=lambda r: r.metrics["eval_accuracy"], default=None)
    return choice


def fastest(fitting: list[Row], rows: list[Row]) -> tuple[Row | None, str | None]:
    """The fastest of `fitting`, or why none can be named: a config without an untracked step
    time, a busy machine, or a runner-up within its spread."""
    untimed = [row.job for row in fitting if speed_range(row, rows) is None]
    if untimed:
        return None, f"{jobs(untimed)}: no step time taken with the tracker off"
    ranked = sorted(fitting, key=lambda r: speed(r, rows), reverse=True)
    first, others = ranked[0], ranked[1:]
    busy = [row.job for row in ranked if row.step_time.busy]
    if others and busy:  # a busy job may be faster than it looked
        return None, f"the machine was busy during {jobs(busy)}"
    beside = [row.job for row in ranked if row.step_time.beside and not row.time_paired]
    if others and beside:  # so may a job whose steps took turns with its baseline's
        return None, f"{jobs(beside)} timed no step alone, only beside their baseline's"
    close = [row.job for row in others
             if speed_range(first, rows)[0] <= speed_range(row, rows)[2]]
    if close:
        return None, f"{jobs(close)} within job {first.job}'s timing spread"
    return first, None


def jobs(names: list[str]) -> str:
    """'job 3', 'jobs 1 and 3', 'jobs 1, 2 and 3'."""
    if len(names) == 1:
        return f"job {names[0]}"
    return f"jobs {', '.join(names[:-1])} and {names[-1]}"


# -- writing -------------------------------------------------------------------------------------
COLUMNS = ["job", "config", "status", *GROUPS, "peak_mib",
           *[f"{c}_mib" for c in CATEGORY_ORDER], "memory_x_base", "step_time_x_base",
           "step_time_x_base_low", "step_time_x_base_high", "step_time_x_base_paired",
           "step_time_doubt",
           "throughput", "throughput_unit", "eval_accuracy", "final_loss", "step_time_s", "error"]


def csv_record(row: Row) -> dict:
    breakdown = row.memory.get("breakdown_at_peak") or {}
    error = row.result.get("error")
    record = {"job": row.job, "config": row.label, "status": row.status,
              **{g: row.result.get("techniques", {}).get(g) for g in GROUPS},
              "peak_mib": row.peak / MIB if row.peak is not None else None,
              **{f"{c}_mib": breakdown[c] / MIB if c in breakdown else None
                 for c in CATEGORY_ORDER},
              "memory_x_base": row.memory_ratio, "step_time_x_base": row.step_time_ratio,
              "step_time_x_base_low": row.step_time_range and row.step_time_range[0],
              "step_time_x_base_high": row.step_time_range and row.step_time_range[1],
              "step_time_x_base_paired": row.time_paired,
              "step_time_doubt": row.time_doubt, "error": error_line(error) if error else None}
    for key in ("throughput", "throughput_unit", "eval_accuracy", "final_loss", "step_time_s"):
        record[key] = row.metrics.get(key)
    return record


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else cell(str(value))


def cell(text: str) -> str:
    """Text for a markdown table cell: a `|` (in an override such as `+model.act=a|b`) would
    end the cell, and a line break the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def time_ratio_cell(row: Row) -> str:
    """The ratio, its range from the interquartile ranges, and `?` where it is uncertain."""
    if row.step_time_ratio is None:
        return "-"
    low, high = row.step_time_range
    return (f"{row.step_time_ratio:.2f}{UNCERTAIN if row.time_doubt else ''} "
            f"({low:.2f}-{high:.2f})")


TIME_LEGEND = ("Step time x base: the step time, taken with the storage tracker off, against the "
               "base's: the median step-by-step ratio where the run timed its baseline beside it "
               "(in brackets their interquartile range), else the ratio of the two runs' medians "
               "(in brackets the range their interquartile ranges allow); `?` marks an uncertain "
               "ratio.")


def ratio_notes(rows: list[Row]) -> list[str]:
    """Under the table: which job stands in as a base, which time ratios are uncertain and why,
    and why some are missing."""
    notes = [f"- job {row.job} is the base of its workload's ratios, though it is not a baseline "
             f"config ({', '.join(BASELINE_GROUPS)} at their baseline options): "
             f"{row.stand_in_base}" for row in rows if row.stand_in_base]
    notes += [f"- job {row.job}: step time x base uncertain: {row.time_doubt}"
              for row in rows if row.time_doubt]
    paired = [row.job for row in rows if row.time_paired]
    apart = [row.job for row in rows if row.time_paired is False]
    if paired:
        notes.append(f"- {jobs(paired)}: step time x base timed beside the baseline, their steps "
                     "alternating in the job's process (timing.paired_steps)")
    if apart:
        notes.append(f"- {jobs(apart)}: step time x base divides the medians of two runs, each "
                     "its own process, so it carries the two processes' speeds as well")
    untimed = [row.job for row in rows if row.ok and row.step_time is None]
    if untimed:
        notes.append(f"- {jobs(untimed)}: no step time x base: every step ran under the storage "
                     "tracker (no more steps than memory.measure_steps), which slows steps by "
                     "their number of ops")
    return notes


def markdown_table(rows: list[Row]) -> str:
    columns = ["job", "config", "status", "peak MiB", *DEVICE_CATEGORIES, "memory x base",
               "step time x base", "throughput", "eval acc", "final loss"]
    lines = [f"| {' | '.join(columns)} |", "|---" * len(columns) + "|"]
    for row in rows:
        r = csv_record(row)
        mark = HALF_MARK if half_precision_on_cpu(row.result) else ""
        doubt = UNCERTAIN if row.time_doubt else ""  # as its time ratio's: the same steps
        throughput = (f"{r['throughput']:.1f}{doubt} {r['throughput_unit']}{mark}"
                      if r["throughput"] is not None else "-")
        lines.append(
            f"| {cell(row.job)} | {cell(row.label)} | {cell(row.status)} | "
            f"{fmt(r['peak_mib'], 1)} | "
            + " | ".join(fmt(r[f"{c}_mib"], 1) for c in DEVICE_CATEGORIES)
            + f" | {fmt(r['memory_x_base'])} | {time_ratio_cell(row)}{mark} | {throughput} | "
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
    elif choice.fastest_doubt is not None:
        lines.append(f"- fastest that fits: not named: {choice.fastest_doubt}")
    if choice.most_accurate is not None:
        accuracy = choice.most_accurate.metrics["eval_accuracy"]
        lines.append(f"- most accurate that fits: job {choice.most_accurate.job} "
                     f"({choice.most_accurate.label}), eval accuracy {accuracy:.3f}")
    return lines


def plot(rows: list[Row], sweep_dir: Path) -> list[Path]:
    return [chart.path for chart in write_plots(rows, sweep_dir)]


@dataclass
class Report:
    rows: list[Row]
    table: str
    markdown: Path
    csv: Path
    plots: list[Path]
    budget: BudgetPick | None = None
    skipped: list[str] = field(default_factory=list)  # result.json files that were unusable

    @property
    def unsuccessful(self) -> list[Row]:
        return [row for row in self.rows if row.status != "ok"]

    def problems(self) -> str | None:
        """Why this sweep is not a clean success (jobs that did not succeed, records that could
        not be used), or None."""
        parts = [f"job {r.job} {r.status}" for r in self.unsuccessful]
        parts += [f"{len(self.skipped)} result.json unusable"] if self.skipped else []
        if not parts:
            return None
        return (f"{len(self.unsuccessful) + len(self.skipped)} of "
                f"{len(self.rows) + len(self.skipped)} jobs did not succeed: {', '.join(parts)}."
                f" See {self.markdown}")


def write_report(sweep_dir: Path | str, budget: str | None = None) -> Report:
    sweep_dir = Path(sweep_dir)
    rows, skipped = load_rows(sweep_dir)
    table = markdown_table(rows)
    choice = pick(rows, parse_size(budget, "report.budget")) if budget else None
    lines = [f"# Sweep {sweep_dir.name}", "", f"{len(rows)} jobs: " + ", ".join(
        f"{sum(r.status == s for r in rows)} {s}" for s in sorted({r.status for r in rows})),
        "", table, ""]
    if any(row.step_time_ratio is not None for row in rows):
        lines += [TIME_LEGEND, ""]
    if notes := ratio_notes(rows):
        lines += [*notes, ""]
    if skipped:
        lines += ["## Skipped: result.json files that are not usable records of these jobs", "",
                  *[f"- {cell(why)}" for why in skipped], ""]
    if choice is not None:
        lines += [*budget_lines(choice, rows), ""]
    plots = plot(rows, sweep_dir)
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    failures = [row for row in rows if row.status != "ok" and row.result.get("error")]
    if failures:
        lines += ["", "## Jobs that did not succeed", ""]
        lines += [f"- job {row.job} ({row.label}): {row.status}: "
                  f"{error_line(row.result['error'])}" for row in failures]
    markdown = sweep_dir / "report.md"
    with atomic_file(markdown) as f:
        f.write("\n".join(lines) + "\n")
    csv_path = sweep_dir / "report.csv"
    with atomic_file(csv_path) as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(csv_record(row) for row in rows)
    return Report(rows, table, markdown, csv_path, plots, choice, skipped)


def describe(report: Report) -> str:
    """What a user sees in the terminal at the end of a sweep."""
    lines = [report.table, ""]
    if notes := ratio_notes(report.rows):
        lines += [*notes, ""]
    lines += [f"skipped {why}" for why in report.skipped]
    if report.budget is not None:
        lines += [*budget_lines(report.budget, report.rows), ""]
    lines.append(f"Report: {report.markdown}, {report.csv.name}; plots: "
                 + (", ".join(p.name for p in report.plots) or "none (no job succeeded)"))
    return "\n".join(lines)


class ReportCallback(Callback):
    """Holds the sweep folder for the sweep's duration (a second sweep into it is refused
    before any job runs). At the end: the report, in the terminal, on disk and in the logger;
    then a non-zero exit if any job did not succeed, a result.json was unreadable, or the
    report itself could not be written.

    Hydra turns a callback's exceptions into warnings, and the sweep would exit 0; SystemExit
    gets through, so every failure here leaves as one."""

    def __init__(self) -> None:
        self._lock: int | None = None  # the sweep folder's lock, while the sweep runs

    def __getstate__(self) -> dict:
        # The launcher pickles Hydra's callbacks into every job; a job holds its own folder.
        return {"_lock": None}

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # A bad budget must stop the sweep before its jobs run, not after the last one.
        try:
            if config.report.budget is not None:
                parse_size(config.report.budget, "report.budget")
            self._lock = run_folder.lock(Path(str(config.hydra.sweep.dir)), "sweep")
        except (ValueError, run_folder.FolderInUse) as error:
            raise SystemExit(f"memexp: {error}") from None

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            report = write_report(sweep_dir, config.report.budget)
        except Exception as error:
            raise SystemExit(f"memexp: the sweep's report could not be written "
                             f"({type(error).__name__}: {error}); each job's record is in "
                             f"{sweep_dir}/<job>/result.json") from error
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None
        log.info("\n" + describe(report))
        try:
            instantiate(config.logger).report(sweep_dir, report)
        except Exception as error:  # a logger never fails what it logs
            log.warning("the logger could not take the report: %s: %s",
                        type(error).__name__, error)
        problems = report.problems()
        if problems:
            raise SystemExit(f"memexp: {problems}")
