"""result.json: the record every run leaves in its output folder, whatever happens to it.

Written atomically (a temp file, then os.replace), first with status "running" when the run
starts, then with its final status. A run killed outright therefore never leaves a record that
claims success. The schema is documented in the README ("result.json").
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from memexp.atomic import atomic_file

GROUPS = ("precision", "checkpointing", "optim", "parallel", "bn_mode")
CATEGORY_ORDER = ("params", "grads", "optimizer", "activations", "other", "offloaded")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def write_json_atomic(path: Path, payload: dict) -> None:
    with atomic_file(path) as f:
        json.dump(payload, f, indent=2, default=str)


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
        if error is not None:
            self.payload["error"] = (error if isinstance(error, str)
                                     else "".join(traceback.format_exception(error)))
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            write_json_atomic(self.path, self.payload)


def record_killed(path: Path, overrides: list[str], reason: str) -> None:
    """Record a job killed outright (SIGKILL, the host's OOM killer): it wrote at most its
    "running" record. A record already final is left alone (the kill came after it)."""
    payload = json.loads(path.read_text()) if path.exists() else {
        "techniques": {group: next((o.split("=", 1)[1] for o in overrides
                                    if o.startswith(f"{group}=")), None) for group in GROUPS},
        "overrides": overrides, "memory": None, "metrics": None, "started_at": None,
    }
    if payload.get("status", "running") != "running":
        return
    payload.update(status="killed", error=reason, finished_at=now())
    write_json_atomic(path, payload)


HALF_ON_CPU = ("half precision on a CPU, where its kernels are emulated or slow: these step "
               "times do not carry over to a GPU")


def half_precision_on_cpu(result: dict) -> bool:
    """A run that computed in float16 or bfloat16 (precision.dtype) on a CPU."""
    dtype = ((result.get("config") or {}).get("precision") or {}).get("dtype")
    device = (result.get("env") or {}).get("device_name")
    return dtype in ("float16", "bfloat16") and device == "cpu"


def error_message(error: str, most: int = 4) -> list[str]:
    """The exception's own message from a formatted traceback (its lines after the last frame;
    a text that is no traceback, such as a killed job's reason, as it is): its first lines and
    its last, `most` in all."""
    lines = error.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    while start < len(lines) and lines[start].startswith("    "):  # the frame's code lines
        start += 1
    message = lines[start:] or lines[-1:]
    if len(message) <= most:
        return message
    return [*message[:most - 2], f"... ({len(message) - most + 1} more lines)", message[-1]]


def mib(nbytes: int | None) -> str:
    """A size for people: GiB from 1 GiB up, else MiB."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


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
                     f"median step {metrics['step_time_s'] * 1000:.1f} ms")
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
        lines.append(f"  non-finite   {metrics['bad_steps']} steps had a NaN or infinite loss; "
                     "their updates were skipped")
    if result.get("failed_rank") is not None:
        lines.append(f"  failed rank  {result['failed_rank']} (its traceback is the error)")
    if result.get("error"):
        message = error_message(result["error"])
        lines.append("  error        " + "\n               ".join(message))
    lines.append(f"  result       {Path(run_dir) / 'result.json'}")
    return "\n".join(lines)
