"""scripts/check_readme.py, the check that README.md's commands work pasted into a fresh clone:
what it reads from the README, and that a command past its timeout leaves nothing running."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from conftest import REPO

spec = importlib.util.spec_from_file_location("check_readme", REPO / "scripts" / "check_readme.py")
check_readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_readme)


def test_reads_every_command_of_the_readme_in_order():
    commands = [command for command, _ in check_readme.commands((REPO / "README.md").read_text())]
    assert commands[:2] == ["make run", "make test"]  # the two set-up commands come first
    assert "python train.py" in commands  # the single run's transcript (`$ python train.py`)
    # a command continued with `\` is one command, its comment dropped
    slurm = next(command for command in commands if "partition=gpu" in command)
    assert "\\" not in slurm and "checkpointing=none,full" in slurm
    assert all(" #" not in command for command in commands)


def test_a_transcript_that_quotes_an_error_must_fail():
    readme = "```\n$ python train.py precision=bogus\nmemexp: precision=bogus: ...\n" \
             "$ python train.py\nmemexp run: ok\n```\n"
    assert check_readme.commands(readme) == [("python train.py precision=bogus", True),
                                             ("python train.py", False)]


def test_a_command_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path):
    # A grandchild in the background, as `make run`'s sweep is under make: the old check killed
    # only bash, and the sweep ran on beside the next commands.
    status, output = check_readme.run("echo started; sleep 60 & echo $! > pid; wait", tmp_path,
                                      timeout=2)
    assert status == "timeout" and "started" in output
    stat = Path(f"/proc/{(tmp_path / 'pid').read_text().strip()}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split()[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "sleep 60 outlived the check"


def test_reads_every_transcript_of_the_llm_guide_and_traces_cuda_where_a_cuda_build_is(
        monkeypatch):
    """docs/llm.md is checked as the README is: each generated transcript's command runs;
    `--target cuda` ones in a CUDA build's venv, this checkout's .venv-cuda or
    MEMEXP_CUDA_PYTHON's, handed to the clone; skipped, saying how to get one, without."""
    page = (REPO / "docs" / "llm.md").read_text()
    commands = [command for command, _ in check_readme.commands(page)]
    assert len(commands) == page.count("<!-- figures:llm-") > 5
    cuda = next(command for command in commands if "--target cuda" in command)
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "/opt/cuda-venv/bin/python")
    assert check_readme.skip_reason(cuda) is None
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")
    assert "make cuda-estimator" in check_readme.skip_reason(cuda)
    assert check_readme.skip_reason(commands[0]) is None  # a CPU estimate always runs
