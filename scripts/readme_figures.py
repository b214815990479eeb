"""Rerun what README.md and docs/ quote and write the figures into them, between markers.

    .venv/bin/python scripts/readme_figures.py [PART ...]    (make readme-figures: all of them)

Each generated part sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`, in
README.md or a page of docs/ (wherever the markers are, each in one place); everything between
them is replaced. The parts:

- quick, quick-prose, quick-time, quick-threads: `python train.py -m experiment=quick` (what
  `make run` runs): the table it prints at the end, the ratios and accuracies the prose quotes,
  how long it took here (README.md, "The first result"), and its base alone with 1 thread
  (docs/measuring-time.md); quick-busy-time, quick-busy-ratios: the same sweep beside two busy
  processes, and its paired ratios over the idle run's (quick_busy, after quick);
- run: `python train.py`, the summary it prints (README.md); default-accuracy: its accuracy
  (docs/models-and-data.md);
- bad-input: the mistakes of docs/errors.md, and what each prints;
- llm-*: every transcript of docs/llm.md, rerun (llm; the CUDA estimates trace in .venv-cuda,
  `make cuda-estimator`: about an hour on 2 busy cores, most of it the 8B's CUDA traces).

PART is a function below (bad_input, single_run, quick, quick_busy, llm): only those are rerun
and rewritten.

The commands run in outputs/readme-figures/ (kept: its plots and reports can be read); their
folders are written in the pages as the default ones (`outputs/...`), the only change made to
what the commands print. tests/test_readme.py reruns one of the quoted jobs and
checks the README's memory figures exactly and its accuracy to 3 decimals.
"""

from __future__ import annotations

import csv
import json
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


def run(arguments: list[str], cwd: Path, check: bool = True,
        threads: int = 2) -> subprocess.CompletedProcess:
    # 2 intra-op threads wherever it runs: the figures of another count differ (the sums run
    # in another order); tests/test_readme.py reruns with the same.
    environment = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": str(threads)}
    environment.pop("WANDB_MODE", None)
    done = subprocess.run([*TRAIN, *arguments], cwd=cwd, capture_output=True, text=True,
                          env=environment)
    if check and done.returncode != 0:
        raise SystemExit(f"readme_figures: python train.py {' '.join(arguments)} exited "
                         f"{done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done


QUICK = ["-m", "experiment=quick"]


def quick(work: Path) -> dict[str, str]:
    sweep_dir = work / "quick"
    started = time.monotonic()
    done = run([*QUICK, f"hydra.sweep.dir={sweep_dir}"], cwd=work)
    minutes = (time.monotonic() - started) / 60
    lines = [LOG_PREFIX.sub("", line) for line in (done.stdout + done.stderr).splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("| job |"))
    last = next(i for i, line in enumerate(lines) if line.startswith("Report: "))
    # each job's start and end; not its heartbeats, which come with the machine's speed
    jobs = [line for line in lines
            if re.match(r"\[\d+/\d+\] job #", line) and ": running, " not in line]
    block = "\n".join([*jobs, "...", *lines[first:last + 1]])
    block = block.replace(str(sweep_dir), "outputs/sweeps/<time>")
    load = os.getloadavg()[0]
    # the sweep's base at seed 0 alone, with 1 thread: the same memory, another accuracy
    run(["experiment=quick", f"hydra.run.dir={work / 'quick-1-thread'}"], cwd=work, threads=1)
    alone = json.loads((work / "quick-1-thread" / "result.json").read_text())
    with open(sweep_dir / "report.csv") as f:
        base = next(row for row in csv.DictReader(f) if row["job"] == "0")
    threads = (f"{float(base['eval_accuracy']):.3f} eval accuracy with 2 threads and at "
               f"{alone['metrics']['eval_accuracy']:.3f} with 1")
    return {"quick": f"```\n{block}\n```", "quick-prose": quick_prose(sweep_dir),
            "quick-threads": threads,
            # the kernels torch picked for this CPU: tests/test_readme.py checks the accuracy only
            # where they are the same (another instruction set sums in another order)
            "quick-time": f"{block.count(': started')} jobs, {minutes:.1f} minutes here "
                          f"(2 cores, {torch.backends.cpu.get_cpu_capability()} kernels, "
                          f"2 threads, load average {load:.0f} at the end)"}


def quick_prose(sweep_dir: Path) -> str:
    """What the README's "In short" says of the quick sweep, from its report.csv, and the
    report's own verdict on efficient eval's accuracy (its line under the table)."""
    with open(sweep_dir / "report.csv") as f:
        rows = {row["config"]: row for row in csv.DictReader(f)}

    def row(checkpointing: str, bn_mode: str, seed: int) -> dict:
        return rows[f"bn_mode={bn_mode} checkpointing={checkpointing} trainer.seed={seed}"]

    def ratio(found: dict, key: str) -> str:
        # a time ratio keeps the table's mark where it cannot be trusted (report.csv's doubt)
        doubt = key == "step_time_x_base" and found["step_time_doubt"]
        return f"{float(found[key]):.2f}x{UNCERTAIN if doubt else ''}"

    def both(checkpointing: str, bn_mode: str, key: str) -> str:
        return " and ".join(ratio(row(checkpointing, bn_mode, seed), key) for seed in (0, 1))

    def accuracy(checkpointing: str, bn_mode: str) -> str:
        return " and ".join(f"{float(row(checkpointing, bn_mode, seed)['eval_accuracy']):.3f}"
                            for seed in (0, 1))

    same = all(row("full", "train", seed)[key] == row("none", "train", seed)[key]
               for seed in (0, 1) for key in ("final_loss", "eval_accuracy"))
    # the report's own reading of the two seeds (its line under the table)
    told = re.search(r"^- bn_mode=efficient_eval checkpointing=none: eval acc .* moves by up "
                     r"to ([\d.]+) between seeds: (larger|not larger)",
                     (sweep_dir / "report.md").read_text(), re.M)
    kept = "exactly the base's at both seeds" if same else "changed"
    return (f"Full checkpointing leaves the loss and the accuracy {kept} (the same math) and "
            f"cuts the peak to {ratio(row('full', 'train', 0), 'memory_x_base')}, for "
            f"{both('full', 'train', 'step_time_x_base')} the step time; "
            f"`bn_mode=efficient_eval` cuts it to "
            f"{ratio(row('none', 'efficient_eval', 0), 'memory_x_base')}, at "
            f"{both('none', 'efficient_eval', 'step_time_x_base')} the step time, but learns "
            f"another model: eval accuracy {accuracy('none', 'efficient_eval')} at the two "
            f"seeds, against the base's {accuracy('none', 'train')}, a difference "
            f"{'larger' if told.group(2) == 'larger' else 'no larger'} than the "
            f"{told.group(1)} by which one config's accuracy moves between the seeds; both "
            f"together cut the peak to {ratio(row('full', 'efficient_eval', 0), 'memory_x_base')}")


def quick_busy(work: Path) -> dict[str, str]:
    """`make run`'s sweep beside two busy processes: how long it took, and how far its paired
    ratios are from the idle run's (`quick`, which runs first in the same call)."""
    idle = work / "quick" / "report.csv"
    if not idle.is_file():
        raise SystemExit("readme_figures: quick_busy compares with quick's run: run both "
                         "(readme_figures.py quick quick_busy)")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        started = time.monotonic()
        run([*QUICK, f"hydra.sweep.dir={work / 'quick-busy'}"], cwd=work)
        minutes = (time.monotonic() - started) / 60
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()

    def paired(report: Path) -> dict[str, float]:
        with open(report) as f:
            return {row["config"]: float(row["step_time_x_base"]) for row in csv.DictReader(f)
                    if row["step_time_x_base_paired"] == "True"}

    calm, busy = paired(idle), paired(work / "quick-busy" / "report.csv")
    apart = [busy[config] / calm[config] for config in calm]
    return {"quick-busy-time": f"{minutes:.1f} minutes beside two busy processes",
            "quick-busy-ratios": f"{min(apart):.2f}x to {max(apart):.2f}x (its {len(apart)} "
                                 f"paired ratios, each over the same job's idle one)"}


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


def llm(work: Path) -> dict[str, str]:
    """Every transcript of docs/llm.md (a `<!-- figures:llm-... -->` block: the command on its
    `$ ` line), rerun and written with what it printed. An estimate's step-time breakdown by
    phase is left out (`...`: the total and its terms are kept), and of a sweep its table and
    the lines under it; the rest is as printed."""
    page = (REPO / "docs" / "llm.md").read_text()
    figures = {}
    for name, block in re.findall(r"<!-- figures:(llm-[\w-]+) -->(.*?)<!-- /figures:\1 -->",
                                  page, re.S):
        command = re.search(r"^\$ (.+)$", block, re.M).group(1)
        print(f"readme_figures: {name}: {command}", flush=True)
        figures[name] = "```text\n" + "\n".join([f"$ {command}",
                                                   *printed(command, work)]) + "\n```"
    return figures


def printed(command: str, work: Path) -> list[str]:
    """What `command` (memexp ... or python train.py ...) printed, run in `work`, as quoted."""
    words = shlex.split(command)
    program = ([str(Path(sys.executable).parent / "memexp")] if words[0] == "memexp"
               else TRAIN)
    arguments = words[1:] if words[0] == "memexp" else words[2:]
    done = subprocess.run([*program, *arguments], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "2"})
    if done.returncode != 0:
        raise SystemExit(f"readme_figures: {command} exited {done.returncode}:\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    lines = [LOG_PREFIX.sub("", line) for line in (done.stdout + done.stderr).splitlines()]
    lines = [re.sub(r"outputs/sweeps/[\d_-]+", "outputs/sweeps/<time>", line) for line in lines]
    if "-m" in words:  # a sweep: its table and what is under it
        first = next(i for i, line in enumerate(lines) if line.startswith("| job |"))
        last = next(i for i, line in enumerate(lines) if line.startswith("Report: "))
        return ["...", *lines[first:last + 1]]
    breakdown = next((i for i, line in enumerate(lines) if re.match(r"  phase +host", line)),
                     None)
    return lines if breakdown is None else [*lines[:breakdown], "  ..."]


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
    parts = {part.__name__: part for part in (bad_input, single_run, quick, quick_busy, llm)}
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
