"""result.json: the record every run leaves in its output folder, whatever happens to it.

Written atomically (a temp file, then os.replace), first with status "running" when the run
starts, then with its final status. A run killed outright therefore never leaves a record that
claims success. The schema is documented in docs/result-json.md. It is strict JSON: a
NaN or an infinity is written as null, and `non_finite` says what each one was.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import socket
import stat
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from memexp import registry
from memexp.atomic import atomic_file
from memexp.models.hf import load_warnings

# the technique groups, as the root config lists them (memexp.registry)
GROUPS = registry.techniques()
# offloaded last: every category before it is in the device's peak (the report's columns)
CATEGORY_ORDER = ("params", "frozen", "grads", "optimizer", "activations", "loss", "other",
                  "offloaded")
DEVICE_CATEGORIES = CATEGORY_ORDER[:-1]  # those in the device's peak: all but the offloaded


def category_color(category: str) -> str:
    """A memory category's colour in every plot: matplotlib's colour cycle, in CATEGORY_ORDER."""
    return f"C{CATEGORY_ORDER.index(category)}"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class TimedOut(BaseException):
    """The run was stopped at its time limit by its scheduler (submitit's time-out signal): it
    is requeued, or it had no requeue left. Recorded as status `timeout`, with this message
    rather than a traceback of whatever code the signal interrupted. A BaseException: no
    `except Exception` in the run swallows it."""


def write_json_atomic(path: Path, payload: dict) -> None:
    with atomic_file(path) as f:
        json.dump(finite(payload), f, indent=2, default=str, allow_nan=False)


def finite(payload: dict) -> dict:
    """`payload` with each NaN or infinity replaced by None (JSON has neither, and most readers
    refuse Python's NaN), and `non_finite` naming what each replaced value was, by its path:
    {"metrics.final_loss": "nan", "metrics.losses.7": "inf"}."""
    replaced: dict[str, str] = {}

    def clean(value, path: str):
        if isinstance(value, float) and not math.isfinite(value):
            replaced[path] = str(value)
            return None
        if isinstance(value, dict):
            return {key: clean(item, f"{path}.{key}" if path else str(key))
                    for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(item, f"{path}.{index}") for index, item in enumerate(value)]
        return value

    cleaned = clean(payload, "")
    if replaced:  # added to those of a record read back and rewritten (trainer.nproc's)
        cleaned["non_finite"] = {**(payload.get("non_finite") or {}), **replaced}
    return cleaned


class BadRecord(ValueError):
    """A result.json that readers cannot use; the message says what is wrong with it."""


RECORD = "result.json"  # a run's record, in its run folder
# Every status a record can have: how its run ended, or "running" while it runs
# (docs/result-json.md). A record with any other is not memexp's, and is not read.
STATUSES = ("ok", "failed", "oom", "nan", "terminated", "interrupted", "killed", "timeout",
            "running")
# What a reader reads of a record at most. A record is some 5 KiB, and each step adds about
# 25 bytes (its loss in `metrics.losses`): 64 MiB holds a run of two million steps. Anything
# larger is no record (a log written over it, a link to a device), and is refused unread.
MAX_RECORD_BYTES = 64 * 2**20
# How deeply a record may nest: about 10 levels in the deepest resolved config, and Python's
# JSON reader stops near 1000 (sys.getrecursionlimit()).
MAX_DEPTH = 100
# memexp's own integers in a record are byte counts, steps and seeds, within 64 bits (20
# digits), but its config holds whatever numbers the user's keys were given: 100 digits leaves
# them room and keeps reading cheap. Python refuses one of over 4300 digits
# (sys.get_int_max_str_digits()) at all, after reading it.
MAX_DIGITS = 100
# Characters a terminal may act on (ESC starts its escape sequences), C1 controls among them:
# taken out of every string a record holds, which are printed. Tab and newline stay.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` without the control characters that a terminal would act on."""
    return CONTROL.sub("", text)


def load_record(path: Path) -> dict:
    """A result.json, read defensively (it may be anything: a sweep folder is shared, and its
    records outlive the memexp that wrote them) and checked for the types and the status that
    the summary and the report read. A regular file only: a FIFO is opened without waiting for
    a writer, and refused; so is a link to a device. At most MAX_RECORD_BYTES, nested at most
    MAX_DEPTH deep, its strings made printable. BadRecord, naming the file, otherwise."""
    name = printable(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            kind = os.fstat(f.fileno())
            if not stat.S_ISREG(kind.st_mode):
                raise BadRecord(f"{name}: not a regular file, so not a record")
            text = f.read(MAX_RECORD_BYTES + 1)
    except OSError as error:
        raise BadRecord(f"{name}: not readable ({printable(str(error))})") from None
    if len(text) > MAX_RECORD_BYTES:
        raise BadRecord(f"{name}: larger than {MAX_RECORD_BYTES // 2**20} MiB, so not a record")
    try:
        record = cleaned(json.loads(text, parse_int=bounded_int))
    except RecursionError:  # Python's reader stops near its recursion limit, `cleaned` sooner
        raise BadRecord(f"{name}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:  # not UTF-8, not JSON, or an integer past MAX_DIGITS
        raise BadRecord(f"{name}: not readable as JSON ({printable(str(error))})") from None
    problem = record_problem(record)
    if problem:
        raise BadRecord(f"{name}: {problem}")
    return record


def bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits, more than a record's "
                         f"{MAX_DIGITS}")
    return int(text)


def cleaned(value, depth: int = 0):
    """A record read from JSON, its strings (keys too) made printable; RecursionError where it
    nests deeper than MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise RecursionError(f"deeper than {MAX_DEPTH}")
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(key): cleaned(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [cleaned(item, depth + 1) for item in value]
    return value


def record_problem(record) -> str | None:
    """What makes `record` unusable as a result.json, or None: the types its readers read, then
    its figures (figures_problem). The one check of a record: load_record's (memexp show, memexp
    report, the end-of-sweep report, and through the report wandb's table) and the wandb run's
    summary's (memexp.loggers.summary_of)."""
    if not isinstance(record, dict):
        return f"holds a {type(record).__name__}, not a result record"
    expected = {"status": str, "techniques": dict, "overrides": list}
    for key, kind in expected.items():
        if not isinstance(record.get(key), kind):
            return f"`{key}` is {record.get(key)!r}, not a {kind.__name__}"
    if not all(isinstance(override, str) for override in record["overrides"]):
        return f"`overrides` is {record['overrides']!r}, not a list of strings"
    if record["status"] not in STATUSES:
        return f"`status` is {record['status']!r}, not one of {', '.join(STATUSES)}"
    for key in ("memory", "metrics", "env"):
        if not isinstance(record.get(key), (dict, type(None))):
            return f"`{key}` is {record[key]!r}, not an object or null"
    if not isinstance(record.get("error"), (str, type(None))):
        return f"`error` is {record['error']!r}, not a string or null"
    if not isinstance((record.get("metrics") or {}).get("throughput_unit"), (str, type(None))):
        return (f"`metrics.throughput_unit` is {record['metrics']['throughput_unit']!r}, not a "
                "string or null")
    return figures_problem(record)


# A count of bytes as torch keeps it, in an int64 (a storage's nbytes, the caching allocator's
# statistics): a larger one, or a fraction of a byte, is no figure a run measured.
MAX_BYTES = 2**63 - 1
# The peaks: a run that measured one held its parameters at least.
PEAKS = ("peak_bytes", "reserved_peak_bytes")
# Counts in a `memory` section that are not `*_bytes` (CUDA's allocator events).
COUNTS = ("num_alloc_retries", "num_ooms")


def figures_problem(record: dict) -> str | None:
    """The first figure of `record` that no run writes, or that contradicts another, or None.
    Each rule is how the trainer and the meter write them (docs/result-json.md, "Records
    whose figures disagree"): an ok run records its memory and its metrics; bytes and counts
    are whole numbers from 0 to MAX_BYTES, peaks from 1; each breakdown is within its peak
    (memory_problem); an accuracy is a fraction; a step time and a throughput are positive."""
    memory, metrics = record.get("memory"), record.get("metrics")
    if record["status"] == "ok" and (memory is None or metrics is None):
        return (f"`status` is 'ok', but `{'memory' if memory is None else 'metrics'}` is null: "
                "a run that ends ok records its memory and its metrics")
    problem = memory_problem(memory, "memory") if memory is not None else None
    if problem:
        return problem

    def number(value) -> bool:
        return (isinstance(value, numbers.Real) and not isinstance(value, bool)
                and math.isfinite(value))

    for key, fits, what in (
            ("final_loss", number, "a number"),
            # correct predictions over those made (memexp.loss.Hits)
            ("eval_accuracy", lambda v: number(v) and 0 <= v <= 1, "a fraction in [0, 1]"),
            # the median of measured step times, and the items of a step over it
            ("throughput", lambda v: number(v) and v > 0, "a positive number"),
            ("step_time_s", lambda v: number(v) and v > 0, "a positive number of seconds")):
        value = (metrics or {}).get(key)
        if value is not None and not fits(value):
            return f"`metrics.{key}` is {value!r}, not {what} or null"
    return None


def count_problem(value, least: int = 0, null: bool = True) -> str | None:
    """Why `value` is no count of bytes (or of events) from `least` up, or None (for null too
    where `null`): as the message's tail, after the figure's name."""
    if (value is None and null or isinstance(value, int) and not isinstance(value, bool)
            and least <= value <= MAX_BYTES):
        return None
    return f"{'null' if value is None else repr(value)}, not a whole number from {least} to 2^63-1"


def memory_problem(memory: dict, where: str) -> str | None:
    """What contradicts itself in a `memory` section at `where` (a rank's in `per_rank` too), or
    None. Its breakdowns are the storage tracker's bytes by category at a phase's peak, taken
    when its peak was: with the tracker as the source they add up to the phase's peak exactly
    (memexp.memory.tracker settles the storages alive at the peak, with their sizes then); with
    CUDA's counters as the source at most to it (the counters count every allocation of the
    same phase, each rounded up, and the tracker's storages are among them; the `other`
    phase's, to the run's peak). The host's `offloaded` bytes are outside the device's peak,
    and within `offloaded_peak_bytes`, the tracker's highest. The peak is the highest phase's,
    and its breakdown that phase's."""
    for key, value in memory.items():
        if key.endswith("_bytes") or key in COUNTS:
            problem = count_problem(value, least=1 if key in PEAKS else 0)
            if problem:
                return f"`{where}.{key}` is {problem}"
    leak = memory.get("leak")
    if isinstance(leak, dict) and (problem := count_problem(leak.get("bytes_per_step"), 1)):
        return f"`{where}.leak.bytes_per_step` is {problem}"
    peak, phases = memory.get("peak_bytes"), memory.get("phases")
    if peak is not None and not isinstance(phases, dict):
        return f"`{where}.peak_bytes` is set, but `{where}.phases` is missing"
    breakdowns = [("breakdown_at_peak", "peak_bytes", peak, memory.get("breakdown_at_peak"))]
    for name, phase in (phases or {}).items():
        if not isinstance(phase, dict):
            return f"`{where}.phases.{name}` is {phase!r}, not a phase's peak_bytes and breakdown"
        if problem := count_problem(phase.get("peak_bytes"), null=False):
            return f"`{where}.phases.{name}.peak_bytes` is {problem}"
        # CUDA's counters leave out a stretch between phases that allocated nothing beyond what
        # it started with, the tracker does not: what it saw there is within what the phase
        # before held, and so within the run's peak (memexp.memory.meter.CudaCounters.switch).
        own = name != "other" or memory.get("source") != "cuda-counters"
        breakdowns.append((f"phases.{name}.breakdown",
                           f"phases.{name}.peak_bytes" if own else "peak_bytes",
                           phase["peak_bytes"] if own else peak, phase.get("breakdown")))
    exact = memory.get("source") == "storage-tracker"
    for key, peak_key, peak_of, breakdown in breakdowns:
        if breakdown is None:
            continue
        if not isinstance(breakdown, dict):
            return f"`{where}.{key}` is {breakdown!r}, not bytes by category"
        for category, nbytes in breakdown.items():
            if category not in CATEGORY_ORDER:
                return (f"`{where}.{key}` has {category!r}, not one of the categories "
                        f"{', '.join(CATEGORY_ORDER)}")
            if problem := count_problem(nbytes, null=False):
                return f"`{where}.{key}.{category}` is {problem}"
        if peak_of is None:
            return (f"`{where}.{key}` is set, but `{where}.{peak_key}` is null: a breakdown of "
                    "no peak")
        device = sum(n for category, n in breakdown.items() if category in DEVICE_CATEGORIES)
        if device > peak_of or exact and device != peak_of:
            return (f"`{where}.{key}` adds up to {device:,} B on the device, "
                    f"{'not' if exact else 'more than'} the {peak_of:,} B of `{where}.{peak_key}`"
                    + (": the storage tracker's peak is its categories' sum" if exact else ""))
        host, host_peak = breakdown.get("offloaded", 0), memory.get("offloaded_peak_bytes")
        if host_peak is not None and host > host_peak:
            return (f"`{where}.{key}.offloaded` is {host:,} B, more than the {host_peak:,} B "
                    f"of `{where}.offloaded_peak_bytes`, the host's highest")
    if peak is not None:
        highest = max((phase["peak_bytes"] for phase in phases.values()), default=None)
        peak_phase = memory.get("peak_phase")
        if peak != highest:
            return (f"`{where}.peak_bytes` is {peak:,} B, not the highest of "
                    f"`{where}.phases`' peaks ({'none' if highest is None else f'{highest:,} B'})")
        if (not isinstance(peak_phase, str) or peak_phase not in phases
                or phases[peak_phase]["peak_bytes"] != peak):
            return (f"`{where}.peak_phase` is {peak_phase!r}, not a phase whose peak is "
                    f"`{where}.peak_bytes`")
        if memory.get("breakdown_at_peak") != phases[peak_phase].get("breakdown"):
            return (f"`{where}.breakdown_at_peak` is not `{where}.phases.{peak_phase}.breakdown`, "
                    "the breakdown of the phase of the peak")
    return ranks_problem(memory, where) if "per_rank" in memory else None


def ranks_problem(memory: dict, where: str) -> str | None:
    """A multi-rank run's `memory` (memexp.app.ranks_memory): each rank's section in `per_rank`
    holds, and the rest is the section of the rank with the highest peak, `rank`."""
    per_rank, rank = memory["per_rank"], memory.get("rank")
    if not isinstance(per_rank, list) or not all(isinstance(report, dict) for report in per_rank):
        return f"`{where}.per_rank` is {per_rank!r}, not a list of each rank's memory"
    for number, report in enumerate(per_rank):
        if problem := memory_problem(report, f"{where}.per_rank.{number}"):
            return problem
    top = max((report.get("peak_bytes") or 0 for report in per_rank), default=0)
    section = {key: value for key, value in memory.items() if key not in ("rank", "per_rank")}
    if (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < len(per_rank)
            or per_rank[rank] != section or (section.get("peak_bytes") or 0) != top):
        return (f"`{where}` is not the section in `{where}.per_rank` of the rank with the highest "
                f"peak (`{where}.rank` is {rank!r})")
    return None


class RunRecord:
    """A run's result.json, written when the run starts (`start`: status "running") and when
    it ends (`finish`), or only then if it ends before it starts. `path` None: a rank > 0 of a
    multi-rank run, whose record rank 0 writes."""

    def __init__(self, path: Path | None, config: dict, choices: dict[str, str],
                 overrides: list[str]):
        self.path = path
        self.payload: dict = {
            "status": "running",
            "error": None,
            "techniques": {group: choices.get(group) for group in GROUPS},
            "overrides": overrides,
            "memory": None,
            "metrics": None,
            "config": config,
            "env": {
                "torch": torch.__version__,
                "device_name": None,
                "world_size": int(os.environ.get("WORLD_SIZE", 1)),
                "hostname": socket.gethostname(),
            },
            "started_at": now(),
            "finished_at": None,
        }

    def start(self) -> None:
        self._write()

    def finish(self, status: str, memory: dict | None = None, metrics: dict | None = None,
               error: BaseException | str | None = None) -> None:
        """`error`: the exception, or a traceback already formatted (another rank's)."""
        self.payload.update(status=status, memory=memory, metrics=metrics, finished_at=now())
        if isinstance(error, TimedOut):
            error = str(error)
        if error is not None:
            self.payload["error"] = (error if isinstance(error, str)
                                     else "".join(traceback.format_exception(error)))
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            write_json_atomic(self.path, self.payload)


def record_killed(path: Path, overrides: list[str], reason: str, status: str = "killed") -> None:
    """Record a job that ended without recording it: killed outright (SIGKILL, the host's OOM
    killer), or, with status "timeout", stopped at its time limit before it could record it.
    It wrote at most its "running" record (or, for "timeout", an earlier attempt's, requeued).
    Any other record is final and left alone (the end came after it)."""
    try:
        payload = load_record(path)
    except BadRecord:  # none, or none that is a record: the job's own is written afresh
        payload = {
            "techniques": {group: next((o.split("=", 1)[1] for o in overrides
                                        if o.startswith(f"{group}=")), None) for group in GROUPS},
            "overrides": overrides, "memory": None, "metrics": None, "started_at": None,
        }
    # A requeued attempt's "timeout" is not final: the job went on.
    replaceable = {"running", "timeout"} if status == "timeout" else {"running"}
    if payload.get("status", "running") not in replaceable:
        return
    payload.update(status=status, error=reason, finished_at=now())
    write_json_atomic(path, payload)


HALF_ON_CPU = ("half precision on a CPU, where its kernels are emulated or slow: these step "
               "times do not carry over to a GPU")


def half_precision_on_cpu(result: dict) -> bool:
    """A run that computed in float16 or bfloat16 (precision.dtype) on a CPU."""
    dtype = ((result.get("config") or {}).get("precision") or {}).get("dtype")
    device = (result.get("env") or {}).get("device_name")
    return dtype in ("float16", "bfloat16") and device == "cpu"


def error_message(error: str, most: int | None = 4) -> list[str]:
    """The exception's own message from a formatted traceback (its lines after the last frame;
    a text that is no traceback, such as a killed job's reason, as it is): its first lines and
    its last, `most` in all (None: every line)."""
    lines = error.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    while start < len(lines) and lines[start].startswith("    "):  # the frame's code lines
        start += 1
    message = lines[start:] or lines[-1:]
    if most is None or len(message) <= most:
        return message
    return [*message[:most - 2], f"... ({len(message) - most + 1} more lines)", message[-1]]


def mib(nbytes: int | None) -> str:
    """A size for people: GiB from 1 GiB up, else MiB."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def timed(metrics: dict) -> str:
    """How the step time was taken (memexp.timing), for the summary."""
    timing = metrics.get("timing")
    if not timing:
        return ""
    q1, q3 = (t * 1000 for t in timing["step_time_iqr_s"])
    how = "under the storage tracker" if timing["tracked"] else "tracker off"
    busy = ", machine busy" if timing["busy"] else ""
    beside = ", beside the baseline's steps" if timing.get("beside_baseline") else ""
    return f" ({how}, IQR {q1:.1f}-{q3:.1f} ms{beside}{busy})"


def summary(result: dict, run_dir: Path | str) -> str:
    """A few lines for the end of a run: peak memory and its breakdown, speed, accuracy."""
    techniques = " ".join(f"{k}={v}" for k, v in result["techniques"].items() if k != "blocks")
    lines = [f"memexp run: {result['status']}  ({run_dir})", f"  techniques   {techniques}"]
    for group, found in (result["techniques"].get("blocks") or {}).items():
        lines.append(f"  blocks       {found['class']} x{found['count']} ({group})")
    if result.get("model_load"):
        load = result["model_load"]
        lines.append(f"  weights      {load['pretrained']}: "
                     f"{load_warnings(load) or 'every tensor of the model loaded'}")
    memory = result.get("memory")
    if memory and memory.get("oom"):
        lines.append(f"  OUT OF MEMORY in {memory['oom']['phase'] or 'an unknown phase'} at step "
                     f"{memory['oom']['step']}; what it reached before:")
    if memory and memory.get("peak_bytes") is not None:
        lines.append(f"  peak memory  {mib(memory['peak_bytes'])} in {memory['peak_phase']} "
                     f"({memory['device']}, {memory['source']})")
        breakdown = memory.get("breakdown_at_peak")
        if breakdown:
            parts = [f"{k} {breakdown[k] / 2**20:.1f}" for k in CATEGORY_ORDER if breakdown.get(k)]
            lines.append(f"    at peak    {', '.join(parts)} (MiB)")
        phases = " | ".join(f"{name} {mib(p['peak_bytes'])}"
                            for name, p in memory["phases"].items())
        lines.append(f"    by phase   {phases}")
        if memory.get("per_rank"):
            peaks = " | ".join(f"rank {r} {mib(m['peak_bytes'])}"
                               for r, m in enumerate(memory["per_rank"]))
            lines.append(f"    per rank   {peaks} (the above: rank {memory['rank']})")
    elif memory:
        lines.append(f"  peak memory  not measured (memory.track=false on {memory['device']})")
    if memory and memory.get("leak"):
        leak = memory["leak"]
        lines.append(f"  LEAK?        live memory grew {leak['bytes_per_step']:,} bytes after each "
                     f"of {leak['steps']} steps from step {leak['from_step']}: something keeps "
                     "every step's tensors (the source's `total_loss += loss`)")
    metrics = result.get("metrics")
    if metrics and metrics.get("throughput"):
        lines.append(f"  throughput   {metrics['throughput']:.1f} {metrics['throughput_unit']}, "
                     f"median step {metrics['step_time_s'] * 1000:.1f} ms{timed(metrics)}")
    elif metrics and metrics.get("timing") and not metrics["timing"]["timed_steps"]:
        lines.append(f"  throughput   not measured: all {metrics['steps']} steps were warm-up "
                     "(trainer.warmup_steps)")
    paired = ((metrics or {}).get("timing") or {}).get("paired") or {}
    if "ratio" in paired:
        low, high = paired["ratio_iqr"]
        steps = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in paired["steps"])
        lines.append(f"  x baseline   step time {paired['ratio']:.2f}x the baseline's (IQR "
                     f"{low:.2f}-{high:.2f}), steps {steps} timed beside it in this process")
    if metrics and metrics.get("final_loss") is not None:
        accuracy = metrics["eval_accuracy"]
        lines.append(f"  accuracy     {accuracy:.3f} (eval), final loss {metrics['final_loss']:.4f}"
                     if accuracy is not None else f"  final loss   {metrics['final_loss']:.4f}")
    if metrics and metrics.get("resumed_from"):
        lines.append(f"  resumed      from step(s) {metrics['resumed_from']}")
    if metrics and metrics.get("skipped_steps"):
        lines.append(f"  skipped      {metrics['skipped_steps']} steps with non-finite "
                     f"gradients (loss scale now {metrics['loss_scale']:g})")
    if metrics and metrics.get("bad_steps"):
        lines.append(f"  non-finite   {metrics['bad_steps']} steps had a NaN or infinite loss or "
                     "gradients; none reached the weights")
    if result.get("failed_rank") is not None:
        lines.append(f"  failed rank  {result['failed_rank']} (its traceback is the error)")
    if result.get("error"):
        message = error_message(result["error"])
        lines.append("  error        " + "\n               ".join(message))
    lines.append(f"  result       {Path(run_dir) / RECORD}")
    return "\n".join(lines)


def error_line(error: str) -> str:
    """The exception's whole message on one line, for a table (an error's cause is often on the
    message's second line); of a text that is no traceback (a killed job's reason, then its
    stderr), the last line."""
    if "Traceback (most recent call last)" not in error:
        return (error.strip().splitlines() or [""])[-1]
    return " ".join(line.strip() for line in error_message(error, most=None) if line.strip())
