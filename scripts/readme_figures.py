"""Rerun what README.md quotes and write the figures into it, between markers.

    .venv/bin/python scripts/readme_figures.py          (make readme-figures)

Each generated part of the README sits between `<!-- figures:NAME -->` and
`<!-- /figures:NAME -->`; everything between them is replaced. The parts:

- quick, quick-prose, quick-time: `python train.py -m experiment=quick` (what `make run` runs):
  the table it prints at the end, the ratios the prose quotes, and how long it took here;
- run, default-accuracy: `python train.py`, the summary it prints;
- bad-input: the three config mistakes of "Bad input", and what each prints.

The commands run in outputs/readme-figures/ (kept: its plots and reports can be read); their
folders are written in the README as the default ones (`outputs/...`), the only change made to
what the commands print. tests/test_readme.py reruns one of the quoted jobs and
checks the README's memory figures exactly and its accuracy to 3 decimals.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TRAIN = [sys.executable, str(REPO / "train.py")]
# The lines Hydra's logger puts before a sweep's table: `[2026-11-23 22:55:43,684][HYDRA] `.
LOG_PREFIX = re.compile(r"^\[[\d\- :,]+\]\[[\w.]+\] ?")
BAD_INPUT = ["precision=bogus", "trainer.max_steps=abc", "model.widht=3"]


def run(arguments: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    # 2 intra-op threads wherever it runs: the figures of another count differ (the sums run
    # in another order); tests/test_readme.py reruns with the same.
    environment = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "2"}
    environment.pop("WANDB_MODE", None)
    done = subprocess.run([*TRAIN, *arguments], cwd=cwd, capture_output=True, text=True,
                          env=environment)
    if check and done.returncode != 0:
        raise SystemExit(f"readme_figures: python train.py {' '.join(arguments)} exited "
                         f"{done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done


def quick(work: Path) -> dict[str, str]:
    sweep_dir = work / "quick"
    started = time.monotonic()
    done = run(["-m", "experiment=quick", f"hydra.sweep.dir={sweep_dir}"], cwd=work)
    minutes = (time.monotonic() - started) / 60
    lines = [LOG_PREFIX.sub("", line) for line in (done.stdout + done.stderr).splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("| job |"))
    last = next(i for i, line in enumerate(lines) if line.startswith("Report: "))
    # each job's start and end; not its heartbeats, which come with the machine's speed
    jobs = [line for line in lines
            if re.match(r"\[\d+/\d+\] job #", line) and ": running, " not in line]
    block = "\n".join([*jobs, "...", *lines[first:last + 1]])
    block = block.replace(str(sweep_dir), "outputs/sweeps/<time>")
    with open(sweep_dir / "report.csv") as f:
        rows = {row["config"]: row for row in csv.DictReader(f)}
    base, full = rows["checkpointing=none optim=sgd"], rows["checkpointing=full optim=sgd"]
    offload = rows["checkpointing=offload optim=sgd"]
    same_loss = base["final_loss"] == full["final_loss"] == offload["final_loss"]

    def ratio(row: dict, key: str) -> str:
        return f"{float(row[key]):.2f}x" if row[key] else "no ratio"

    kept = "exactly where it was" if same_loss else "changed"
    paired = full["step_time_x_base_paired"] == offload["step_time_x_base_paired"] == "True"
    timed = ("each timed beside the baseline in its job's process, untracked; the brackets "
             "give the spread" if paired else "the medians of separate runs, untracked")
    prose = (f"Checkpointing and offload leave the loss {kept} "
             f"(same math) and cut the peak to {ratio(full, 'memory_x_base')} and "
             f"{ratio(offload, 'memory_x_base')}, for {ratio(full, 'step_time_x_base')} and "
             f"{ratio(offload, 'step_time_x_base')} the step time ({timed})")
    load = os.getloadavg()[0]
    return {"quick": f"```\n{block}\n```",
            "quick-prose": prose,
            # the kernels torch picked for this CPU: tests/test_readme.py checks the accuracy only
            # where they are the same (another instruction set sums in another order)
            "quick-time": f"{len(rows)} jobs, {minutes:.1f} minutes here (2 cores, "
                          f"{torch.backends.cpu.get_cpu_capability()} kernels, 2 threads, "
                          f"load average {load:.0f} at the end)"}


def single_run(work: Path) -> dict[str, str]:
    run_dir = work / "run"
    done = run([f"hydra.run.dir={run_dir}"], cwd=work)
    lines = done.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("memexp run: "))
    last = next(i for i, line in enumerate(lines) if line.startswith("  result "))
    block = "\n".join(["$ python train.py", *lines[first:last + 1]])
    accuracy = re.search(r"accuracy +([\d.]+)", block).group(1)
    return {"run": f"```\n{block.replace(str(run_dir), 'outputs/runs/<time>')}\n```",
            "default-accuracy": f"{float(accuracy):.2f}"}


def bad_input(work: Path) -> dict[str, str]:
    lines = []
    for override in BAD_INPUT:
        done = run([override], cwd=work, check=False)
        if done.returncode == 0:
            raise SystemExit(f"readme_figures: python train.py {override} succeeded; "
                             "the README quotes it as bad input")
        lines += [f"$ python train.py {override}", *done.stderr.strip().splitlines()]
    return {"bad-input": "```\n" + "\n".join(lines) + "\n```"}


def write(readme: str, figures: dict[str, str]) -> str:
    for name, text in figures.items():
        pattern = re.compile(rf"(<!-- figures:{name} -->).*?(<!-- /figures:{name} -->)", re.S)
        found = pattern.search(readme)
        if found is None:
            raise SystemExit(f"readme_figures: README.md has no markers for {name!r}")
        pad = "\n" if text.startswith("```") else ""
        start, end = found.span()
        readme = (readme[:start] + f"<!-- figures:{name} -->{pad}{text}{pad}"
                  f"<!-- /figures:{name} -->" + readme[end:])
    return readme


def main() -> None:
    figures: dict[str, str] = {}
    # Kept after the script (outputs/ is git-ignored), so its plots and reports can be read.
    work = REPO / "outputs" / "readme-figures"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for part in (bad_input, single_run, quick):
        print(f"readme_figures: {part.__name__} ...", flush=True)
        figures.update(part(work))
    README.write_text(write(README.read_text(), figures))
    print(f"readme_figures: wrote {', '.join(figures)} into {README}; the runs are in {work}")


if __name__ == "__main__":
    main()
