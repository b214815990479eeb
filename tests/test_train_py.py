"""train.py as a user runs it: a subprocess smoke run, result.json's schema, and bad input."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memexp import permanent_imports

from conftest import REPO, TRAIN_PY_ENV, Background, Ran, Together, early, train_py

pytestmark = pytest.mark.slow

SMOKE = ["debug=fast", "model.width=8", "data.batch_size=16", "trainer.device=cpu"]
BREAKDOWN = {"params", "grads", "optimizer", "activations", "other"}
BAD_INPUT = [
    ("precision=bogus", ["memexp: precision=bogus: there is no such option",
                         "  valid choices for precision: amp, bf16, bf16_pure, float8, "
                         "fp16_pure, fp32, tf32"]),
    ("trainer.max_steps=abc", ["memexp: trainer.max_steps=abc: Value 'abc' of type 'str' "
                               "could not be converted to Integer"]),
]
# What the tests below read, by name: the overrides of each `python train.py` run.
RUNS = {
    "smoke": SMOKE,
    **{override: [*SMOKE, override] for override, _ in BAD_INPUT},
    "own check": [*SMOKE, "optim.lr=-1"],
    "help": ["--help"],
    "cuda": [*SMOKE[:-1], "trainer.device=cuda"],
}


@early()
def runs(folder: Path) -> Together:
    """The runs of RUNS, started together, each in folder/<its index> (its run folder `run`
    there): {name: (its folder, its CompletedProcess)}."""
    started = {}
    for index, (name, overrides) in enumerate(RUNS.items()):
        (folder / str(index)).mkdir()
        started[name] = Ran(folder / str(index), Background(
            train_py(folder / str(index), tuple(overrides)), folder / str(index), TRAIN_PY_ENV,
            timeout=180))
    return Together(started)


def test_smoke_run_writes_a_complete_result(runs):
    folder, done = runs["smoke"]
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((folder / "run" / "result.json").read_text())

    assert result["status"] == "ok" and result["error"] is None
    assert result["techniques"] == {"precision": "fp32", "checkpointing": "none", "optim": "sgd",
                                    "parallel": "none", "bn_mode": "train", "adapter": "none",
                                    "compile": "none"}
    memory = result["memory"]
    assert memory["device"] == "cpu" and memory["peak_bytes"] > 0
    assert memory["peak_phase"] in memory["phases"]
    assert BREAKDOWN <= set(memory["breakdown_at_peak"])
    for phase in ("forward", "backward", "optimizer"):
        assert memory["phases"][phase]["peak_bytes"] > 0
        assert BREAKDOWN <= set(memory["phases"][phase]["breakdown"])
    metrics = result["metrics"]
    assert {"final_loss", "eval_accuracy", "throughput", "throughput_unit",
            "step_time_s"} <= set(metrics)
    assert result["config"]["trainer"]["max_steps"] == 5
    assert {"torch", "device_name", "world_size", "hostname"} <= set(result["env"])
    assert result["env"]["torch"] == torch.__version__
    assert result["started_at"] <= result["finished_at"]
    # The summary a user sees at the end of a run.
    assert "peak memory" in done.stderr + done.stdout


@pytest.mark.parametrize(("override", "says"), BAD_INPUT)
def test_bad_input_is_told_once_in_a_few_lines_and_claims_no_success(runs, override, says):
    folder, done = runs[override]
    assert done.returncode != 0
    lines = done.stderr.splitlines()  # the message, then the valid choices, and nothing else
    assert len(lines) == len(says) and not done.stdout
    assert all(line.startswith(start) for line, start in zip(lines, says, strict=True))
    assert not (folder / "run" / "result.json").exists()


def test_a_techniques_own_check_is_told_once_by_the_run_summary(runs):
    folder, done = runs["own check"]
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert output.count("the learning rate must be positive") == 1
    assert "Traceback" not in output and "Error executing job" not in output
    assert "  error        ValueError: optim.lr=-1.0: the learning rate must be positive" in output
    assert len(output.strip().splitlines()) <= 6
    recorded = json.loads((folder / "run" / "result.json").read_text())
    assert recorded["status"] == "failed" and "Traceback" in recorded["error"]


def test_help_is_memexps_own_and_lists_only_the_groups_a_user_picks_from(runs):
    _, done = runs["help"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("memexp: which memory-saving techniques make a model fit")
    assert "powered by Hydra" not in done.stdout and "schema/" not in done.stdout
    assert "\nprecision: amp, bf16, bf16_pure, float8, fp16_pure, fp32, tf32\n" in done.stdout
    assert "  max_steps: 200" in done.stdout  # and the config, every key


def test_help_into_a_pipe_whose_reader_left_stops_quietly():
    """`python train.py --help | head`: the reader leaves early; no traceback, and the exit
    status of a tool stopped by SIGPIPE. The pipe's read end is closed before the start, so
    that every write fails."""
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "train.py", "--help"], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=180, cwd=REPO,
                          env=TRAIN_PY_ENV)
    os.close(write)
    assert (done.returncode, done.stderr) == (128 + signal.SIGPIPE, "")


EXITING = """
import atexit, sys, threading
from memexp.errors import exit_done

class Module:
    def __del__(self):
        print("finalized")

module = Module()  # a module's object: freed by the interpreter's finalization
atexit.register(print, "exit handler ran")
sys.stdout.write("buffered, not flushed")
release = threading.Event()  # the writer writes once exit_done has decided, whatever the load
if sys.argv[1] == "writer":
    threading.Thread(target=lambda: (release.wait(), print("thread wrote"))).start()
try:
    exit_done()
finally:  # only where exit_done raised SystemExit: os._exit runs no finally
    release.set()
"""


@pytest.mark.parametrize("case", ["done", "writer"])
def test_a_finished_run_exits_without_finalization_but_loses_nothing(case):
    """exit_done (train.py and every sweep job, once their work is written): the exit handlers
    run and the output is flushed; the interpreter's finalization is skipped, unless a thread
    that is not a daemon still runs, which is then waited for."""
    done = subprocess.run([sys.executable, "-c", EXITING, case], capture_output=True,
                          text=True, timeout=180, cwd=REPO, env=TRAIN_PY_ENV)
    assert done.returncode == 0, done.stderr
    assert "buffered, not flushed" in done.stdout and "exit handler ran" in done.stdout
    assert ("thread wrote" in done.stdout) == ("finalized" in done.stdout) == (case == "writer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_request_without_a_gpu_fails_and_records_it(runs):
    folder, done = runs["cuda"]
    assert done.returncode != 0
    result = json.loads((folder / "run" / "result.json").read_text())
    assert result["status"] == "failed"
    assert "trainer.device=cuda" in result["error"]


@pytest.mark.parametrize("enabled", [True, False])
def test_what_train_py_imports_is_frozen_and_the_collector_left_as_it_was(enabled):
    """train.py, a job's process and the preloaded server import under permanent_imports: no
    collection runs while the imports do, none walks what they made afterwards."""
    (gc.enable if enabled else gc.disable)()
    try:
        before = gc.get_freeze_count()
        with permanent_imports():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # what an import leaves: objects the collector tracks
        assert gc.get_freeze_count() >= before + len(made)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
