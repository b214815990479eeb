"""Rerun what README.md and docs/ quote and write the figures into them, between markers.

    .venv/bin/python scripts/readme_figures.py [PART ...]    (make readme-figures: all of them)

Each generated part sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`, in
README.md or a page of docs/ (wherever the markers are, each in one place); everything between
them is replaced. The parts:

- quick, quick-prose, quick-time: `python train.py -m experiment=quick` (what `make run` runs):
  the table it prints at the end, the ratios the prose quotes, and how long it took here
  (README.md, "The first result");
- run: `python train.py`, the summary it prints (README.md); default-accuracy: its accuracy
  (docs/models-and-data.md);
- bad-input: the mistakes of docs/errors.md, and what each prints.

PART is a function below (bad_input, single_run, quick): only those are rerun and rewritten.

The commands run in outputs/readme-figures/ (kept: its plots and reports can be read); their
folders are written in the pages as the default ones (`outputs/...`), the only change made to
what the commands print. tests/test_readme.py reruns one of the quoted jobs and
checks the README's memory figures exactly and its accuracy to 3 decimals.
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from memexp.rows import UNCERTAIN

REPO = Path(__file__).resolve().parents[1]
# The pages that hold generated figures.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TRAIN = [sys.executable, str(REPO / "train.py")]
# The lines Hydra's logger puts before a sweep's table: `[2026-11-23 22:55:43,684][HYDRA] `.
LOG_PREFIX = re.compile(r"^\[[\d\- :,]+\]\[[\w.]+\] ?")
# docs/errors.md's mistakes: in the config itself (caught while composing it, no result.json),
# then values that compose but cannot work (caught while building the run, status: failed). Each
# error is also a test (docs/errors.md says which).
BAD_INPUT = [
    "precision=bogus", "trainer.max_steps=abc", "model.widht=3", "trainer.max_stepz=3",
    "optim.lr=fast", "-m report.budget=lots",
    "optim.accumulate=0", "optim.lr=-1", "data.batch_size=0", "data.batch_size=big",
    "memory.budget=-1", "memory.budget=0.5b", "trainer.max_steps=0", "model._target_=nope.Net",
    "model=transformer model.n_heads=0", "data.seed=100000000000000",
    "logger.filename=/tmp/m.csv", "logger.filename=../m.csv", "logger.filename=result.json",
    "logger.filename=checkpoints/m.csv", "data=cifar10 data.root=/nonexistent",
    "checkpointing=modules 'checkpointing.modules=[layer9]'",
    "precision=fp16_pure precision.dtype=float8", "logger=wandb logger.mode=sometimes",
    # mistakes only where there is no GPU
    *([] if torch.cuda.is_available() else ["data.batch_size=auto", "trainer.device=cuda"]),
]


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
        # a time ratio keeps the table's mark where it cannot be trusted (report.csv's doubt)
        doubt = key == "step_time_x_base" and row["step_time_doubt"]
        return (f"{float(row[key]):.2f}x{UNCERTAIN if doubt else ''}" if row[key]
                else "no ratio")

    kept = "exactly where it was" if same_loss else "changed"
    paired = full["step_time_x_base_paired"] == offload["step_time_x_base_paired"] == "True"
    timed = ("each timed beside the baseline in its job's process, untracked; the brackets "
             "give the spread" if paired else "the medians of separate runs, untracked")
    if full["step_time_doubt"] or offload["step_time_doubt"]:
        timed += f"; {UNCERTAIN} marks a ratio the table says why not to trust"
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
    for number, command in enumerate(BAD_INPUT):
        run_dir = work / "bad-input" / str(number)
        done = run([*shlex.split(command), f"hydra.run.dir={run_dir}"], cwd=work, check=False)
        if done.returncode == 0:
            raise SystemExit(f"readme_figures: python train.py {command} succeeded; "
                             "docs/errors.md quotes it as bad input")
        printed = (done.stdout + done.stderr).replace(str(run_dir), "outputs/runs/<time>")
        printed = printed.strip().splitlines()
        summary = next((i for i, line in enumerate(printed) if "memexp run: failed" in line), None)
        if summary is None:  # refused while composing: its `memexp: ...` lines are all it prints
            told = printed
        else:  # refused while building the run: its summary, less what did not go wrong
            error = next(i for i in range(summary, len(printed))
                         if printed[i].startswith("  error "))
            result = next(i for i in range(error, len(printed))
                          if printed[i].startswith("  result "))
            told = [printed[summary][printed[summary].index("memexp run:"):],
                    *printed[error:result]]
            if "Traceback (most recent call last):" in printed:
                traceback = printed.index("Traceback (most recent call last):")
                told.append(f"(then a traceback: {len(printed) - traceback} lines)")
        lines += [f"$ python train.py {command}", *told]
    return {"bad-input": "```\n" + "\n".join(lines) + "\n```"}


def write(pages: dict[Path, str], figures: dict[str, str]) -> dict[Path, str]:
    """`pages` (path: text) with each of `figures` written between its markers."""
    pages = dict(pages)
    for name, text in figures.items():
        pattern = re.compile(rf"(<!-- figures:{name} -->).*?(<!-- /figures:{name} -->)", re.S)
        holding = [path for path, page in pages.items() if pattern.search(page)]
        if len(holding) != 1:
            raise SystemExit(f"readme_figures: markers for {name!r} must be in one page of "
                             f"README.md and docs/, found in {len(holding)}")
        page = pages[holding[0]]
        start, end = pattern.search(page).span()
        pad = "\n" if text.startswith("```") else ""
        pages[holding[0]] = (page[:start] + f"<!-- figures:{name} -->{pad}{text}{pad}"
                             f"<!-- /figures:{name} -->" + page[end:])
    return pages


def main() -> None:
    parts = {part.__name__: part for part in (bad_input, single_run, quick)}
    unknown = set(sys.argv[1:]) - set(parts)
    if unknown:
        raise SystemExit(f"readme_figures: no part {', '.join(sorted(unknown))}; the parts: "
                         f"{', '.join(parts)}")
    figures: dict[str, str] = {}
    # Kept after the script (outputs/ is git-ignored), so its plots and reports can be read.
    work = REPO / "outputs" / "readme-figures"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for part in (parts[name] for name in sys.argv[1:] or parts):
        print(f"readme_figures: {part.__name__} ...", flush=True)
        figures.update(part(work))
    pages = {path: path.read_text() for path in PAGES}
    for path, page in write(pages, figures).items():
        if page != pages[path]:
            path.write_text(page)
    print(f"readme_figures: wrote {', '.join(figures)} into README.md and docs/; the runs are "
          f"in {work}")


if __name__ == "__main__":
    main()
