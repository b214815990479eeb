"""Run the shell code blocks of README.md and docs/llm.md, as pasted, from a fresh clone; report
each exit status.

    python3 scripts/check_readme.py [--clone DIR] [--timeout S] [--page PAGE ...]
                                                                    (make check-readme)

Without --clone it clones this checkout's HEAD (`git clone <repo> <tmp>/fresh`), so what is
checked is what is committed. The pages (README.md, then docs/llm.md; `--page` names others)
are read in order, and in each its code blocks: every command of a ```bash block (a line, with
its `\\` continuations; comments dropped), and every `$ ` line of the other blocks (the
transcripts), runs in the clone through `bash -c 'source .venv/bin/activate; <command>'`. A
transcript command whose quoted output starts with an error (`memexp: ...`) must fail, every
other command must succeed. The README's first block's `make run` makes .venv.

`--target cuda` traces in a venv with a CUDA build of torch: the clone has none (`make
cuda-estimator` downloads 6.3 GB), so its commands get this checkout's `.venv-cuda`, or
MEMEXP_CUDA_PYTHON's, through MEMEXP_CUDA_PYTHON (the trace imports the clone's memexp, not
that venv's); they are skipped where there is none.

What is changed in a command, and nothing else:
- `python train.py` and `memexp plan ... --verify` get short runs: `trainer.max_steps=N` set to
  SHORT_STEPS (replacing the command's own value, or appended);
- `outputs/sweeps/<time>` is the newest sweep folder the commands before it made.

Commands that need what this machine lacks (a GPU, SLURM, the network, files of your own) are
listed as skipped with the reason, not run. Exit status 1 if any command failed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHORT_STEPS = 3
# (what in the command, why it is not run here); the first that matches wins.
SKIPS = [
    ("make test", "the whole test suite (7 to 8 minutes on 2 idle cores); CI runs it as .ci/run"),
    ("hydra/launcher=slurm", "needs a SLURM cluster (make slurm-up: root and the package "
                             "registry)"),
    ("make slurm-", "starts or stops SLURM daemons (root, the package registry)"),
    ("sinfo", "needs a SLURM cluster"),
    ("make cuda-estimator", "downloads a CUDA build of torch (.venv-cuda: 6.3 GB)"),
    ("data.batch_size=auto", "needs a GPU (on CPU it needs memory.budget, as the README says)"),
    ("data=cifar10", "needs the CIFAR-10 files in ~/datasets (nothing is downloaded)"),
    ("model.pretrained=", "needs your own weights at that path"),
    ("mypkg.", "mypkg is a placeholder for your own package"),
]


def commands(readme: str) -> list[tuple[str, bool]]:
    """(command, whether it must fail) for every command of the README's code blocks, in order."""
    found = []
    for language, block in re.findall(r"^ *```(\w*)\n(.*?)^ *```", readme, re.S | re.M):
        lines = re.sub(r"\\\n\s*", "", block).splitlines()
        for i, line in enumerate(lines):
            if language == "bash":
                command = line.split(" #")[0].strip() if not line.strip().startswith("#") else ""
                fails = False
            elif line.strip().startswith("$ "):
                command = line.strip()[2:].split(" #")[0].strip()
                # its output: the lines up to the next `$ ` (none when one follows at once)
                output = lines[i + 1].strip() if i + 1 < len(lines) else ""
                fails = output.startswith("memexp: ")
            else:
                continue
            if command:
                found.append((command, fails))
    return found


def shortened(command: str) -> str:
    """`command` with short runs, where it trains."""
    trains = "train.py" in command or "--verify" in command
    if not trains:
        return command
    if "trainer.max_steps=" in command:
        return re.sub(r"trainer\.max_steps=\d+", f"trainer.max_steps={SHORT_STEPS}", command)
    if command.startswith("memexp "):  # before the options (`--verify 2`): memexp's overrides
        words = command.split(" --", 1)
        return " --".join([f"{words[0]} trainer.max_steps={SHORT_STEPS}", *words[1:]])
    return f"{command} trainer.max_steps={SHORT_STEPS}"


def resolved(command: str, clone: Path) -> str:
    if "outputs/sweeps/<time>" in command:
        newest = max((clone / "outputs" / "sweeps").iterdir(), key=lambda p: p.stat().st_mtime)
        command = command.replace("outputs/sweeps/<time>", f"outputs/sweeps/{newest.name}")
    return command


# Pages whose commands are run, in order, in one clone: the README's make the venv.
PAGES = ("README.md", "docs/llm.md")


def cuda_python() -> str | None:
    """A python with a CUDA build of torch for `--target cuda`: MEMEXP_CUDA_PYTHON, else this
    checkout's .venv-cuda, else None."""
    named = os.environ.get("MEMEXP_CUDA_PYTHON")
    if named:
        return None if named == "none" else named
    python = REPO / ".venv-cuda" / "bin" / "python"
    return str(python) if python.is_file() else None


def skip_reason(command: str) -> str | None:
    if "--target cuda" in command and cuda_python() is None:
        return ("needs a CUDA build of torch: make cuda-estimator (.venv-cuda, 6.3 GB), or "
                "MEMEXP_CUDA_PYTHON")
    return next((why for what, why in SKIPS if what in command), None)


def run(command: str, clone: Path, timeout: float) -> tuple[int | str, str]:
    """(exit status, or "timeout"; stdout and stderr) of `command` in the clone's venv. A command
    past its timeout is killed with everything it started (`make run`'s sweep and its servers):
    left running, it would share the machine with the commands after it."""
    cuda = cuda_python()
    environment = {**os.environ, **({"MEMEXP_CUDA_PYTHON": cuda} if cuda else {})}
    process = subprocess.Popen(["bash", "-c", f"source .venv/bin/activate 2>/dev/null; {command}"],
                               cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, env=environment)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return "timeout", output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clone", type=Path, help="a clone to run in (default: a fresh one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    parser.add_argument("--page", action="append", help="a page to run (default: "
                        f"{', '.join(PAGES)}); repeat for several, in order")
    args = parser.parse_args()
    clone = args.clone
    if clone is None:
        clone = Path(tempfile.mkdtemp(prefix="check-readme-")) / "fresh"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    commit = subprocess.check_output(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                                     text=True).strip()
    failed = 0
    for page in args.page or PAGES:
        print(f"check_readme: {page} of {clone} (commit {commit})", flush=True)
        failed += check(clone / page, clone, args.timeout)
    print(f"check_readme: {failed} command(s) did not do what the pages show", flush=True)
    return 1 if failed else 0


def check(page: Path, clone: Path, timeout: float) -> int:
    """Run `page`'s commands in `clone`; how many did not do what it shows."""
    failed = 0
    for command, must_fail in commands(page.read_text()):
        why = skip_reason(command)
        if why:
            print(f"skip     {command}\n         ({why})", flush=True)
            continue
        ran = resolved(shortened(command), clone)
        started = time.monotonic()
        status, output = run(ran, clone, timeout)
        seconds = time.monotonic() - started
        wrong = status == 0 if must_fail else status != 0
        expected = " (must fail)" if must_fail else ""
        print(f"{'FAILED' if wrong else 'ok':<6} exit {status!s:<3} {ran}{expected}  "
              f"({seconds:.0f} s)", flush=True)
        if wrong:
            failed += 1
            tail = output.strip().splitlines()[-8:]
            print("\n".join(f"         | {line}" for line in tail), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
