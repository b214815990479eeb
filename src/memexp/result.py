"""result.json: the record every run leaves in its output folder, whatever happens to it.

Written atomically (a temp file, then os.replace), first with status "running" when the run
starts, then with its final status. A run killed outright therefore never leaves a record that
claims success. The schema is documented in the README ("result.json"). It is strict JSON: a
NaN or an infinity is written as null, and `non_finite` says what each one was.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import socket
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from memexp.atomic import atomic_file

GROUPS = ("precision", "checkpointing", "optim", "parallel", "bn_mode")
CATEGORY_ORDER = ("params", "grads", "optimizer", "activations", "other", "offloaded")


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


def load_record(path: Path) -> dict:
    """A result.json, checked for the types that the summary and the report read."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRecord(f"{path}: not readable as JSON ({error})") from None
    problem = record_problem(record)
    if problem:
        raise BadRecord(f"{path}: {problem}")
    return record


def record_problem(record) -> str | None:
    """What makes `record` unusable as a result.json, or None."""

    def number(value, positive: bool = False) -> bool:
        return (value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                                  and (not positive or value > 0)))

    if not isinstance(record, dict):
        return f"holds a {type(record).__name__}, not a result record"
    expected = {"status": str, "techniques": dict, "overrides": list}
    for key, kind in expected.items():
        if not isinstance(record.get(key), kind):
            return f"`{key}` is {record.get(key)!r}, not a {kind.__name__}"
    for key in ("memory", "metrics"):
        if not isinstance(record.get(key), (dict, type(None))):
            return f"`{key}` is {record[key]!r}, not an object or null"
    if not isinstance(record.get("error"), (str, type(None))):
        return f"`error` is {record['error']!r}, not a string or null"
    memory, metrics = record.get("memory") or {}, record.get("metrics") or {}
    for key in ("peak_bytes", "reserved_peak_bytes"):
        if not number(memory.get(key), positive=True):
            return f"`memory.{key}` is {memory[key]!r}, not a positive number of bytes or null"
    if memory.get("peak_bytes") is not None and not isinstance(memory.get("phases"), dict):
        return "`memory.peak_bytes` is set, but `memory.phases` is missing"
    breakdown = memory.get("breakdown_at_peak") or {}
    if not isinstance(breakdown, dict) or not all(map(number, breakdown.values())):
        return f"`memory.breakdown_at_peak` is {breakdown!r}, not bytes by category"
    for key in ("final_loss", "eval_accuracy", "throughput", "step_time_s"):
        if not number(metrics.get(key)):
            return f"`metrics.{key}` is {metrics[key]!r}, not a number or null"
    return None


class RunRecord:
    """`path` None: a rank > 0 of a multi-rank run, whose record rank 0 writes."""

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
    payload = json.loads(path.read_text()) if path.exists() else {
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
    lines.append(f"  result       {Path(run_dir) / 'result.json'}")
    return "\n".join(lines)


def error_line(error: str) -> str:
    """The exception's whole message on one line, for a table (an error's cause is often on the
    message's second line); of a text that is no traceback (a killed job's reason, then its
    stderr), the last line."""
    if "Traceback (most recent call last)" not in error:
        return (error.strip().splitlines() or [""])[-1]
    return " ".join(line.strip() for line in error_message(error, most=None) if line.strip())
