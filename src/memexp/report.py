"""The comparison report of a sweep folder: a table, plots, and the best configs under a budget.

Reads every `<sweep>/<job>/result.json` there is, so it works on a finished, partial or running
sweep alike; a file that is not a usable record is skipped and named. Writes `report.md`,
`report.csv` and three PNG plots into the sweep folder. Runs by itself at the end of every sweep
(`ReportCallback`) and on demand (`memexp report <sweep>`).

Ratios compare techniques on the same workload: rows whose varying overrides differ only in
technique settings (the technique groups and their keys, model.inplace, memory.*, timing.*)
share a workload. Each row's ratios divide by its base, which the table names: the row that ran
its own baseline config (the config it timed beside its steps, memexp.rows), else its
workload's base: the first that succeeded with the baseline option of each technique group
that has one (memexp.baseline), else their first successful row.
Memory ratios need measured peaks; time ratios need step times taken with the storage tracker off
(memexp.timing), so a run with memory.track=false has one and a run too short to have untracked
steps has none. A run that timed its own baseline beside it, where that baseline is its base's
config, gives its time ratio from those paired steps; any other divides the two runs' medians.
Throughput and step time follow from the ratios (memexp.rows.throughput). A time ratio is
uncertain when its spread leaves it on either side of 1.0, when a paired ratio had not settled,
or, for a ratio of two runs' medians, when other processes were busy on the machine during
either run's steps (a paired ratio's steps took turns, and saw the same machine); the fastest
config that fits a budget is never named on one. Rows that differ only in their seeds
(memexp.rows.REPEAT_KEYS) are repeats of one config: how far their accuracy moves says whether
a technique's difference from the base is more than chance.
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
from memexp.rows import (
    MIB,
    UNCERTAIN,
    Row,
    own_baseline,
    repeats,
    speed,
    speed_doubt,
    speed_range,
    step_seconds,
    throughput,
    time_chain,
)

log = logging.getLogger("memexp")
HALF_MARK = "†"  # beside the time cells of half-precision runs on a CPU


def is_technique_key(key: str) -> bool:
    key = key.lstrip("+~")
    return key.split(".")[0] in (*GROUPS, "memory", "timing") or key == "model.inplace"


def job_folders(sweep_dir: Path) -> list[Path]:
    def order(path: Path):
        return (0, int(path.name)) if path.name.isdigit() else (1, path.name)

    return sorted((p.parent for p in sweep_dir.glob(f"*/{RECORD}")), key=order)


def load_rows(sweep_dir: Path, read: dict | None = None) -> tuple[list[Row], list[str]]:
    """The rows of the sweep's usable records, and why each other result.json was skipped.
    `read`, kept between calls on one sweep (the launcher's line as each job ends), holds the
    records read so far, by folder, with the time each was written: only new ones are read."""
    rows, skipped = [], []
    for folder in job_folders(sweep_dir):
        try:
            record = checked_record(folder, {} if read is None else read)
            rows.append(readable(folder, Row(printable(folder.name), record)))
        except BadRecord as error:
            skipped.append(str(error))
    describe_rows(rows)
    add_ratios(rows)
    return rows, skipped


def checked_record(folder: Path, read: dict) -> dict:
    """The folder's record, once check_launched has passed it; from `read` where it was read
    as it is now."""
    try:
        written = (folder / RECORD).stat().st_mtime_ns
    except OSError:
        written = None  # gone since the folder was listed: load_record says so
    if written is None or read.get(folder, (None,))[0] != written:
        record = load_record(folder / RECORD)
        check_launched(folder, record)
        read[folder] = (written, record)
    return read[folder][1]


def job_line(sweep_dir: Path, folder: Path, read: dict) -> str:
    """What the report says of a job's step time, for the line printed as it ends: its step
    time x base and the job that is against, as the table will give them, from the records
    written so far (the sweep's jobs run in order, and a base before the jobs it is the base
    of; a base still running when a job ends leaves the line without a ratio)."""
    rows, _ = load_rows(sweep_dir, read)
    row = next((row for row in rows if row.job == printable(folder.name)), None)
    if row is None or row.step_time_ratio is None:
        return ""
    return (f", step time x base {row.step_time_ratio:.2f}{UNCERTAIN if row.time_doubt else ''}"
            f" (base: job {row.time_base.job})")


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
        _ = row.step_time  # metrics.timing's keys, which add_ratios reads
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
        row.varying = {k: overrides[k] for k in varying if k in overrides}
        row.label = " ".join(f"{k}={v}" for k, v in row.varying.items()) or "-"
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
                row.memory_base = own_baseline(row, measured) or base
                row.memory_ratio = row.peak / row.memory_base.peak
                accuracies = (row.metrics.get("eval_accuracy"),
                              row.memory_base.metrics.get("eval_accuracy"))
                if None not in accuracies:
                    row.accuracy_delta = accuracies[0] - accuracies[1]
            if not is_baseline(base.result["config"]):
                base.stand_in_base = "none of those succeeded"
        timed = [row for row in mine if row.step_time is not None]
        if base := baseline(timed):
            for row in timed:
                add_time_ratio(row, own_baseline(row, timed) or base)
            if not is_baseline(base.result["config"]) and base.stand_in_base is None:
                base.stand_in_base = "none of those has an untracked step time"


def add_time_ratio(row: Row, base: Row) -> None:
    """The row's step time against its base's: the one timed beside the row's own baseline in
    its process where that baseline is the base's config, else the ratio of the two medians.
    The base's own is 1, and certain: how busy the machine was during its steps is its
    throughput's doubt (memexp.rows.speed_doubt), which every row it is the base of shares."""
    row.time_base = base
    if row is base:
        row.step_time_ratio, time = 1.0, row.step_time
        row.step_time_range = (time.q1 / time.median, time.q3 / time.median)
        return
    paired = row.paired_with(base)
    if paired is not None:
        row.step_time_ratio, row.step_time_range = paired["ratio"], tuple(paired["ratio_iqr"])
    else:
        mine, theirs = row.step_time, base.step_time
        row.step_time_ratio = mine.median / theirs.median
        row.step_time_range = (mine.q1 / theirs.q3, mine.q3 / theirs.q1)
    row.time_paired = paired is not None
    # A paired ratio's steps took turns with its baseline's: a busy machine slowed both alike.
    timed_in = () if paired is not None else (row, base)
    row.time_busy = sorted({r.job for r in timed_in if r.step_time.busy})
    beside = sorted({r.job for r in timed_in if r.step_time.beside})
    row.time_biased = bool(row.time_busy or beside)
    if row.time_busy:
        row.time_doubt = f"the machine was busy during {jobs(row.time_busy)}"
    elif beside:
        row.time_doubt = (f"{jobs(beside)} timed no step alone, only beside their baseline's, "
                          "which slows a step")
    elif paired is not None and paired.get("settled") is False:  # older records lack it
        row.time_doubt = ("its step-by-step ratios had not settled within "
                          "timing.paired_spread when its pairs ran out")
    elif row.step_time_range[0] <= 1 <= row.step_time_range[1]:
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
    # Each speed is its workload's base's over the ratios from the row to it: a busy machine
    # moves a ratio of two runs' medians, and, between workloads, their bases' own speeds.
    chains = [time_chain(row) for row in ranked]
    roots = {id(chain[-1]): chain[-1] for chain in chains}
    busy = {job for chain in chains for link in chain for job in link.time_busy}
    if len(roots) > 1:
        busy |= {root.job for root in roots.values() if root.step_time.busy}
    if others and busy:  # a busy job may be faster than it looked
        return None, f"the machine was busy during {jobs(sorted(busy))}"
    beside = sorted({link.job for chain in chains for link in chain
                     if link.step_time.beside and link.time_paired is False})
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
COLUMNS = ["job", "config", "status", *GROUPS, "base", "peak_mib",
           *[f"{c}_mib" for c in CATEGORY_ORDER], "memory_x_base", "step_time_base",
           "step_time_x_base", "step_time_x_base_low", "step_time_x_base_high",
           "step_time_x_base_paired", "step_time_doubt", "throughput", "throughput_unit",
           "throughput_doubt", "step_time_s", "eval_accuracy", "eval_accuracy_vs_base",
           "final_loss", "error"]


def job_of(row: Row | None) -> str | None:
    return row.job if row is not None else None


def csv_record(row: Row) -> dict:
    breakdown = row.memory.get("breakdown_at_peak") or {}
    error = row.result.get("error")
    return {"job": row.job, "config": row.label, "status": row.status,
            **{g: row.result.get("techniques", {}).get(g) for g in GROUPS},
            "base": job_of(row.memory_base),
            "peak_mib": row.peak / MIB if row.peak is not None else None,
            **{f"{c}_mib": breakdown[c] / MIB if c in breakdown else None
               for c in CATEGORY_ORDER},
            "memory_x_base": row.memory_ratio, "step_time_base": job_of(row.time_base),
            "step_time_x_base": row.step_time_ratio,
            "step_time_x_base_low": row.step_time_range and row.step_time_range[0],
            "step_time_x_base_high": row.step_time_range and row.step_time_range[1],
            "step_time_x_base_paired": row.time_paired, "step_time_doubt": row.time_doubt,
            # both from the step time x base (memexp.rows), never from another timing
            "throughput": throughput(row),
            "throughput_unit": row.metrics.get("throughput_unit"),
            "throughput_doubt": speed_doubt(row), "step_time_s": step_seconds(row),
            "eval_accuracy": row.metrics.get("eval_accuracy"),
            "eval_accuracy_vs_base": row.accuracy_delta,
            "final_loss": row.metrics.get("final_loss"),
            "error": error_line(error) if error else None}


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else cell(str(value))


def cell(text: str) -> str:
    """Text for a markdown table cell: a `|` (in an override such as `+model.act=a|b`) would
    end the cell, and a line break the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def base_cell(row: Row) -> str:
    """The job its ratios are against; both, where its memory and time bases differ (a base
    with no untracked step time, or no measured peak)."""
    memory, time = job_of(row.memory_base), job_of(row.time_base)
    if memory is None or time is None or memory == time:
        return cell(memory or time or "-")
    return cell(f"{memory} (time: {time})")


def time_ratio_cell(row: Row) -> str:
    """The ratio, its range, and `?` where it is uncertain."""
    if row.step_time_ratio is None:
        return "-"
    low, high = row.step_time_range
    return (f"{row.step_time_ratio:.2f}{UNCERTAIN if row.time_doubt else ''} "
            f"({low:.2f}-{high:.2f})")


TIME_LEGEND = ("Each row's ratios are against the job in `base`: the row that ran its baseline "
               "config where the sweep has one, else its workload's base. Step time x base: the "
               "step time, taken with the storage tracker off, against the base's: the median "
               "step-by-step ratio where the run timed its baseline beside it (in brackets their "
               "interquartile range), else the ratio of the two runs' medians (in brackets the "
               "range their interquartile ranges allow); `?` marks an uncertain ratio. "
               "Throughput: the base's over the step time x base (the workload's base: its own "
               "steps'). acc - base: eval accuracy less the base's.")


def ratio_notes(rows: list[Row]) -> list[str]:
    """Under the table: which job stands in as a base, which time ratios and throughputs are
    uncertain and why, and why some are missing; then what the repeats say of accuracy."""
    notes = [f"- job {row.job} is the base of its workload's ratios, though it is not a baseline "
             f"config ({', '.join(BASELINE_GROUPS)} at their baseline options): "
             f"{row.stand_in_base}" for row in rows if row.stand_in_base]
    notes += [f"- job {row.job}: step time x base uncertain: {row.time_doubt}"
              for row in rows if row.time_doubt]
    inherited: dict[str, list[str]] = {}
    for row in rows:
        if not row.time_doubt and (doubt := speed_doubt(row)):
            inherited.setdefault(doubt, []).append(row.job)
    notes += [f"- {jobs(names)}: throughput uncertain: {doubt}"
              for doubt, names in inherited.items()]
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
    return notes + accuracy_notes(rows)


def accuracy_notes(rows: list[Row]) -> list[str]:
    """For each config run with several seeds (memexp.rows.REPEAT_KEYS), its eval accuracy
    against the base at each seed, set beside how far the same config's accuracy moves between
    seeds (the base's, or its own, whichever moves more): a difference is told apart from
    chance only where every seed's has the same sign and each is larger than that."""
    notes = []
    for group in repeats([row for row in rows if row.accuracy_delta is not None]).values():
        if len(group) < 2 or any(row.memory_base is row for row in group):
            continue
        seeds: dict[str, list[str]] = {}
        for key, value in (pair for row in group for pair in row.repeat):
            seeds.setdefault(key, []).append(value)
        which = " ".join(f"{key}={','.join(dict.fromkeys(values))}"
                         for key, values in seeds.items())
        deltas = [row.accuracy_delta for row in group]
        label = cell(group[0].repeat_label)
        if all(delta == 0 for delta in deltas):
            notes.append(f"- {label}: eval acc the base's exactly at each of {len(group)} "
                         f"seeds ({which}): the same math")
            continue
        spread = max(max(accuracies) - min(accuracies) for accuracies in (
            [row.metrics["eval_accuracy"] for row in group],
            [row.memory_base.metrics["eval_accuracy"] for row in group]))
        told = (len({delta > 0 for delta in deltas}) == 1
                and min(abs(delta) for delta in deltas) > spread)
        verdict = ("larger: a difference of the technique, not of the seed" if told else
                   "not larger: not told apart from a difference of the seed")
        notes.append(f"- {label}: eval acc {', '.join(f'{d:+.3f}' for d in deltas)} against "
                     f"the base ({which}); the same config's accuracy moves by up to "
                     f"{spread:.3f} between seeds: {verdict}")
    return notes


def markdown_table(rows: list[Row]) -> str:
    columns = ["job", "config", "status", "base", "peak MiB", *DEVICE_CATEGORIES,
               "memory x base", "step time x base", "throughput", "eval acc", "acc - base",
               "final loss"]
    lines = [f"| {' | '.join(columns)} |", "|---" * len(columns) + "|"]
    for row in rows:
        r = csv_record(row)
        mark = HALF_MARK if half_precision_on_cpu(row.result) else ""
        doubt = UNCERTAIN if r["throughput_doubt"] else ""
        throughput = (f"{r['throughput']:.1f}{doubt} {r['throughput_unit']}{mark}"
                      if r["throughput"] is not None else "-")
        delta = r["eval_accuracy_vs_base"]
        lines.append(
            f"| {cell(row.job)} | {cell(row.label)} | {cell(row.status)} | {base_cell(row)} | "
            f"{fmt(r['peak_mib'], 1)} | "
            + " | ".join(fmt(r[f"{c}_mib"], 1) for c in DEVICE_CATEGORIES)
            + f" | {fmt(r['memory_x_base'])} | {time_ratio_cell(row)}{mark} | {throughput} | "
            f"{fmt(r['eval_accuracy'], 3)} | {'-' if delta is None else f'{delta:+.3f}'} | "
            f"{fmt(r['final_loss'], 4)} |")
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
