"""What a sweep costs beyond its jobs: `python train.py -m experiment=quick`, timed whole.

Job time is each job's own span in its result.json (started_at to finished_at: building,
training, evaluating, recording). Per-job overhead is the sweep's wall time minus the jobs'
time, over the number of jobs: starting the job's processes and importing (torch, Hydra),
Hydra's per-job set-up, noticing the job ended, and the sweep's own start and report, shared
out. The gap between one job's end and the next one's start is printed too: the per-job part
alone; and the sweep's own parts: from the command to the first job's start, and from the last
job's end to the sweep's (the report). Each repeat runs the sweep twice, in turn: with jobs
forked from the preloaded server (hydra.launcher.preload=true, the default) and with a fresh
interpreter per job (false). The share of the machine other processes took during each is
printed, and the last sweep's report (the table `make run` ends with).

    python bench/sweep_overhead.py [--repeats 3] [--preload both|true|false] [overrides ...]

Target: per-job overhead <= 2.0 s on experiment=quick.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from machine import describe_machine

from memexp.timing import MachineLoad

REPO = Path(__file__).resolve().parents[1]


def sweep(folder: Path, overrides: list[str]) -> dict:
    load = MachineLoad(children=True)  # the sweep's processes are ours
    load.start()
    began = datetime.now(timezone.utc)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "experiment=quick",
                           f"hydra.sweep.dir={folder}", *overrides],
                          capture_output=True, text=True, cwd=folder)
    wall = time.perf_counter() - started
    ended = datetime.now(timezone.utc)
    if done.returncode != 0:
        raise SystemExit(f"the sweep failed:\n{done.stderr[-3000:]}")
    spans = []
    for result in sorted(folder.glob("*/result.json"), key=lambda p: int(p.parent.name)):
        record = json.loads(result.read_text())
        spans.append((datetime.fromisoformat(record["started_at"]),
                      datetime.fromisoformat(record["finished_at"])))
    jobs = sum((end - start).total_seconds() for start, end in spans)
    gaps = [(b[0] - a[1]).total_seconds() for a, b in itertools.pairwise(spans)]
    return {"report": (folder / "report.md").read_text(), "wall": wall, "jobs": len(spans),
            "job_time": jobs,
            "per_job": (wall - jobs) / len(spans), "gap": statistics.median(gaps),
            "to_first": (spans[0][0] - began).total_seconds(),
            "after_last": (ended - spans[-1][1]).total_seconds(),
            "others": load.others_share(load.own_cpu())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preload", choices=("both", "true", "false"), default="both",
                        help="which way jobs start: both in turn (default), or only one")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    print(describe_machine())
    print("| run | preload | jobs | sweep wall s | job time s | per-job overhead s | median gap "
          "between jobs s | command to first job s | last job to the end s | others' CPU share "
          "|\n|---|---|---|---|---|---|---|---|---|---|")
    results = {p: [] for p in ("true", "false") if args.preload in (p, "both")}
    for repeat, preload in itertools.product(range(args.repeats), results):
        with tempfile.TemporaryDirectory() as folder:
            r = sweep(Path(folder), [f"hydra.launcher.preload={preload}", *args.overrides])
        results[preload].append(r)
        print(f"| {repeat + 1} | {preload} | {r['jobs']} | {r['wall']:.1f} | {r['job_time']:.1f} "
              f"| {r['per_job']:.2f} | {r['gap']:.2f} | {r['to_first']:.1f} | "
              f"{r['after_last']:.1f} | {r['others']:.0%} |", flush=True)
    for preload, runs in results.items():
        per_job = statistics.median(r["per_job"] for r in runs)
        print(f"\npreload={preload}: per-job overhead, median of {args.repeats}: {per_job:.2f} s "
              "(target <= 2.0 s)")
    print(f"\nThe last sweep's report.md:\n\n{runs[-1]['report']}")


if __name__ == "__main__":
    main()
