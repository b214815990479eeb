"""Nothing lost: out of memory, NaN, checkpoints and resume, preemption, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException

from memexp import checkpoint, cli
from memexp.app import run_config
from memexp.checkpoint import ResumeRefused
from memexp.config import config_dir
from memexp.loggers import NoLogger
from memexp.out_of_memory import OutOfMemory
from memexp.result import record_killed
from memexp.trainer import NonFiniteLoss, Trainer

from chaos import holding
from conftest import (
    CPU_SMALL,
    REPO,
    compose_train,
    freeze,
    job,
    preloaded_server_of,
    processes,
    run_train_py,
    submitit_log_lines,
    train,
)

CHAOS = ("model=custom", "model._target_=chaos.Chaos", "data.batch_size=8", "data.num_eval=64")


@pytest.fixture(autouse=True)
def chaos_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def run_in(run_dir: Path, *overrides: str) -> dict:
    """memexp's run, as train.py does it, into `run_dir`; returns result.json (raised or not)."""
    try:
        run_config(compose_train(*overrides), run_dir, {}, list(overrides), run_dir.name)
    except BaseException:
        pass
    return json.loads((run_dir / "result.json").read_text())


# -- out of memory -------------------------------------------------------------------------------
def test_out_of_memory_is_a_result_and_the_memory_is_given_back():
    trainer = Trainer(compose_train(*CHAOS, "+model.mode=oom", "trainer.max_steps=3"))
    with pytest.raises(OutOfMemory) as raised:
        trainer.fit(NoLogger())
    assert raised.value.phase == "forward" and raised.value.step == 1
    assert "can't allocate memory" in str(raised.value)
    # Freed outside the except block: only the model is left, not the failed step's logits.
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert trainer.meter.tracker.current == model_bytes
    # ...so the process goes on: the next run in it trains.
    _, metrics = train(*CHAOS, "+model.mode=ok", steps=2)
    assert len(metrics.losses) == 2


def test_an_out_of_memory_run_ends_with_status_oom_its_peak_and_phase(tmp_path):
    result = run_in(tmp_path / "run", *CHAOS, "+model.mode=oom", "trainer.max_steps=3")
    assert result["status"] == "oom"
    assert result["memory"]["oom"] == {"phase": "forward", "step": 1}
    assert result["memory"]["peak_bytes"] > 0
    assert "DefaultCPUAllocator: can't allocate memory" in result["error"]


# -- NaN -----------------------------------------------------------------------------------------
def test_non_finite_losses_stop_the_run_and_never_touch_the_weights(tmp_path):
    trainer = Trainer(compose_train(*CHAOS, "+model.mode=diverge", "trainer.max_steps=10",
                                    "trainer.max_bad_steps=3"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(NonFiniteLoss, match="3 steps with a non-finite loss"):
        trainer.fit(NoLogger())
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
    result = run_in(tmp_path / "run", *CHAOS, "+model.mode=diverge", "trainer.max_steps=10")
    assert result["status"] == "nan" and result["metrics"]["bad_steps"] == 3


def test_stepping_in_backward_never_applies_a_non_finite_gradient():
    trainer = Trainer(compose_train(*CHAOS, "+model.mode=diverge", "optim=adamw",
                                    "optim.in_backward=true", "trainer.max_steps=5"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(NonFiniteLoss):
        trainer.fit(NoLogger())
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))


# -- checkpoints and resume ----------------------------------------------------------------------
RESUMABLE = [
    # dropout (the RNG state) and AdamW's moments
    ("model=transformer", "model.n_layers=2", "model.d_model=32", "model.dropout=0.1"),
    # BatchNorm's running statistics and SGD's momentum buffers
    ("model.width=4", "data.batch_size=16", "optim=sgd_momentum"),
    # fp32 master copies and the loss scale
    ("model=mlp", "model.hidden=32", "precision=fp16_pure", "precision.master_weights=true",
     "optim=adamw"),
]


@pytest.mark.parametrize("workload", RESUMABLE, ids=["transformer", "resnet", "fp16_master"])
def test_a_resumed_run_repeats_an_uninterrupted_one_bitwise(tmp_path, workload):
    _, straight = train(*workload, "memory.track=false", steps=10)
    first = run_in(tmp_path, *workload, "trainer.max_steps=7", "trainer.checkpoint_every=3")
    assert first["status"] == "ok"
    resumed = run_in(tmp_path, *workload, "trainer.max_steps=10", "trainer.checkpoint_every=3")
    assert resumed["metrics"]["resumed_from"] == [7]
    assert resumed["metrics"]["losses"] == straight.losses  # every step, bitwise


TINY = ("model=mlp", "model.hidden=16", "model.depth=1", "data.batch_size=8",
        "data.num_train=64", "data.num_eval=32")


def test_a_rerun_never_takes_another_runs_record_for_its_own(tmp_path):
    """Issue 26, #2: a run started over (trainer.resume=never) that wrote no checkpoint left the
    earlier run's last one behind it, and a rerun of the earlier run took the later run's
    record for its own, finished (with its 2 steps' figures, for 4 steps)."""
    run = tmp_path / "run"
    four = job(run, *TINY, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    job(run, *TINY, "trainer.max_steps=2", "trainer.resume=never")
    again = job(run, *TINY, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    assert again["metrics"]["losses"] == four["metrics"]["losses"]  # trained, all 4 steps
    assert again["metrics"]["eval_accuracy"] == four["metrics"]["eval_accuracy"]
    assert again["metrics"]["resumed_from"] == []  # the started-over run removed step 4
    # A record that reports more steps than the checkpoint at max_steps (a resumed run that
    # wrote no checkpoint) is not that checkpoint's run either: refused, not passed off.
    job(run, *TINY, "trainer.max_steps=6", "trainer.checkpoint_every=0")
    kept = (run / "result.json").read_bytes()
    with pytest.raises(ResumeRefused, match=r"step_00000004.pt ends a run of this config at "
                       r"step 4, but .*result.json is not that run's record \(it records 6 "):
        job(run, *TINY, "trainer.max_steps=4")
    assert (run / "result.json").read_bytes() == kept


def add_a_metric_of_another_version(path: Path) -> None:
    """Save checkpoint `path` again with a metric that this memexp's Metrics does not have."""
    state = torch.load(path, weights_only=True)
    state["metrics"]["peak_note"] = None
    torch.save(state, path)


GROWN = """
from torch import nn

class Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Flatten(), {layers})
"""


@pytest.mark.parametrize("change", ["model", "metrics"])
def test_a_checkpoint_that_does_not_load_is_refused_and_the_record_kept(tmp_path, monkeypatch,
                                                                        change):
    """Issue 26, #9: a checkpoint of this config that does not load into the run (the user's
    Net gained a layer; metrics from another memexp version) is refused before the run writes
    anything. It turned the folder's ok record into `failed`, steps 0."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "grown_net.py").write_text(GROWN.format(layers="nn.Linear(3072, 10)"))
    run = tmp_path / "run"
    net = ("model=custom", "model._target_=grown_net.Net", "data.batch_size=8",
           "data.num_eval=32", "trainer.checkpoint_every=2")
    assert job(run, *net, "trainer.max_steps=2")["status"] == "ok"
    kept = {name: (run / name).read_bytes() for name in ("result.json", "metrics.csv")}
    newest = run / "checkpoints" / "step_00000002.pt"
    if change == "model":
        (tmp_path / "grown_net.py").write_text(GROWN.format(
            layers="nn.Linear(3072, 16), nn.ReLU(), nn.Linear(16, 10)"))
        monkeypatch.delitem(sys.modules, "grown_net")
        says = 'Missing key(s) in state_dict: "3.weight"'
    else:
        add_a_metric_of_another_version(newest)
        says = "unexpected keyword argument 'peak_note'"
    with pytest.raises(ResumeRefused) as refused:
        job(run, *net, "trainer.max_steps=4")
    assert f"{newest} was written by this run's config, but it does not load" in str(refused.value)
    assert says in str(refused.value) and "trainer.resume=never" in str(refused.value)
    assert {name: (run / name).read_bytes() for name in kept} == kept
    # As it says: started over, the run trains.
    assert job(run, *net, "trainer.max_steps=4", "trainer.resume=never")["status"] == "ok"


@pytest.mark.slow
def test_a_rerun_refused_more_steps_is_not_reported_as_the_job(tmp_path):
    """train.py, and the report of its folder: the refused rerun leaves the 2-step record, which
    must not stand as the 4-step job's (its overrides differ only in trainer.max_steps)."""
    settings = (*TINY, "trainer.checkpoint_every=2", *CPU_SMALL)
    job(tmp_path / "run", *settings, "trainer.max_steps=2")  # in this process: train.py's record
    newest = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    add_a_metric_of_another_version(newest)
    refused = run_train_py(tmp_path, *settings, "trainer.max_steps=4")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"memexp: {newest} was written by this run's config, but" in refused.stderr
    assert cli.main(["report", str(tmp_path)]) == 1
    report = (tmp_path / "report.md").read_text()
    assert "the job last launched here" in report and "trainer.max_steps=4) did not run" in report


def test_checkpoints_keep_the_newest_and_skip_a_corrupt_one(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, {"step": step}, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000003.pt",
                                                                  "step_00000002.pt"]
    newest = tmp_path / "step_00000003.pt"
    newest.write_bytes(newest.read_bytes()[:20])  # truncated
    path, state = checkpoint.load_newest(tmp_path)
    assert path.name == "step_00000002.pt" and state["step"] == 2


def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path):
    script = f"""
import os, signal, torch
from pathlib import Path
from memexp import checkpoint
folder = Path({str(tmp_path)!r})
checkpoint.save(folder, 1, {{"weights": torch.arange(1000)}}, keep=2)
def dies_halfway(state, file):  # half the bytes of a real save, then a real SIGKILL
    file.write(b"\\0" * 4096); file.flush(); os.kill(os.getpid(), signal.SIGKILL)
torch.save = dies_halfway
checkpoint.save(folder, 2, {{"weights": torch.arange(2000)}}, keep=2)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # the half-written file
    path, state = checkpoint.load_newest(tmp_path)
    assert path.name == "step_00000001.pt" and torch.equal(state["weights"], torch.arange(1000))


def test_a_time_out_with_no_requeue_left_replaces_the_requeued_record(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"status": "timeout", "error": "timed out: requeued"}))
    record_killed(path, [], "timed out with no requeue left", status="timeout")
    assert json.loads(path.read_text())["error"] == "timed out with no requeue left"
    record_killed(path, [], "submitit saw no result")  # the launcher, after the job
    assert json.loads(path.read_text())["status"] == "timeout"  # final: left alone


def processes_of(sweep_dir: Path, *, running: str = "") -> list[int]:
    """The processes whose command line names the sweep folder (submitit's controller and the
    job's tasks: `python -u -m hydra_plugins.memexp_launcher.preloaded ...
    <sweep_dir>/.submitit/%j`, the clients of the jobs forked from the preloaded server), those
    running the module `running` only, if given."""
    return [pid for pid, _, argv in processes()
            if (not running or running.encode() in argv)
            and any(str(sweep_dir).encode() in arg for arg in argv)]


def holds_back_usr2(pid: int) -> bool:
    """The process blocks SIGUSR2 and has no handler for it yet (its /proc status masks)."""
    masks = dict(line.split(":\t") for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                 if line.startswith(("SigBlk", "SigCgt")))
    usr2 = 1 << (signal.SIGUSR2 - 1)
    return bool(int(masks["SigBlk"], 16) & usr2) and not int(masks["SigCgt"], 16) & usr2


def wait_for(what: str, found, sweep: subprocess.Popen, timeout_s: float = 300):
    """Poll `found()` until it returns something true, while the sweep runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sweep.poll() is None:
        try:
            if result := found():
                return result
        except OSError:  # a process that ended between two reads
            pass
        time.sleep(0.01)
    raise AssertionError(f"never saw {what} (sweep exit code {sweep.poll()})")


def signal_while_starting(pid: int) -> None:
    """SIGUSR2 to a job that has not installed submitit's handler yet, frozen meanwhile (SIGSTOP),
    so that it cannot install it between the check and the signal."""
    freeze(pid)
    try:
        assert holds_back_usr2(pid), "the job installed its handler before the signal"
        os.kill(pid, signal.SIGUSR2)
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def chaos_sweep(tmp_path: Path, sweep_dir: Path, overrides: list[str]):
    """`train.py -m` on submitit_local with chaos importable, its output in tmp_path/sweep.log;
    whatever of it still runs at the end (a failed test) is killed."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    with open(tmp_path / "sweep.log", "w") as log, subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={sweep_dir}",
             *overrides], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path) as sweep:
        try:
            yield sweep
        finally:
            for pid in [sweep.pid, *processes_of(sweep_dir)] if sweep.poll() is None else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_timed_out_job_is_requeued_and_resumes_exactly(tmp_path):
    """The Hydra path on submitit_local, for real. The job gets submitit's time-out signal twice,
    each time when it cannot race it: while it is still starting, before submitit's handler
    exists (held back until then: issue 12, #15), and while it waits for it at step 4, after a
    checkpoint at step 3. The first goes where submitit sends it: to the job's client, while it
    waits for the preloaded server to fork the job, which holds it back from its first line.
    The server is frozen from before the job is submitted until then, so that the client waits
    however fast the server is (train.py starts it first thing: it is often ready before the
    job comes). Each time the launcher requeues it; the last run continues from step 3 (and the
    same wandb run) and repeats an uninterrupted one bitwise."""
    sweep_dir, holds = tmp_path / "sweep", tmp_path / "holds"
    overrides = [*CHAOS, "+model.mode=hold", f"+model.hold_dir={holds}", "trainer.max_steps=6",
                 "trainer.checkpoint_every=3", "trainer.progress=false", "logger=wandb",
                 "hydra.launcher.timeout_min=30"]  # no time-out but the two signals sent here
    with chaos_sweep(tmp_path, sweep_dir, overrides) as sweep:
        client = "hydra_plugins.memexp_launcher.preloaded"
        server = wait_for("the sweep's preloaded server", lambda: preloaded_server_of(sweep.pid),
                          sweep)
        freeze(server)
        try:
            # frozen before it forked the job (it imports for seconds, and the sweep composes)
            assert not [pid for pid, ppid, _ in processes() if ppid == server]
            starting = wait_for("a job holding back its time-out signal", lambda: next(
                (p for p in processes_of(sweep_dir, running=client) if holds_back_usr2(p)), None),
                sweep)
            signal_while_starting(starting)
        finally:
            os.kill(server, signal.SIGCONT)
        held = wait_for("the job waiting at step 4", lambda: holding(holds), sweep)
        os.kill(held[0]["pid"], signal.SIGUSR2)
        sweep.wait(timeout=400)
    output = (tmp_path / "sweep.log").read_text()
    assert sweep.returncode == 0, output[-3000:]
    # The early signal requeued the job too, instead of killing it.
    assert len(submitit_log_lines(sweep_dir, "Requeued job")) == 2
    result = json.loads((sweep_dir / "0" / "result.json").read_text())
    assert result["status"] == "ok" and result["metrics"]["resumed_from"] == [3]
    _, straight = train(*CHAOS, "memory.track=false", steps=6)
    assert result["metrics"]["losses"] == straight.losses
    run_id = result["logger"]["wandb"]["run_id"]
    attempts = list((sweep_dir / "0" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(attempts) == 2  # one wandb run, continued after the requeue



@pytest.mark.slow
def test_a_time_out_with_no_requeue_left_ends_as_timeout_not_a_traceback(tmp_path):
    """Issue 12, #14, on submitit_local (tests/test_slurm.py checks it where a SLURM cluster
    runs): the job gets its time-out signal while it waits at step 4, with no requeue left. Its
    record says `timeout` and what to change, not a traceback from inside the forward pass."""
    sweep_dir, holds = tmp_path / "sweep", tmp_path / "holds"
    # Under 10 minutes of timeout_min, submitit counts any signal as a time-out (not preemption).
    overrides = [*CHAOS, "+model.mode=hold", f"+model.hold_dir={holds}", "trainer.max_steps=6",
                 "trainer.checkpoint_every=3", "trainer.progress=false",
                 "hydra.launcher.timeout_min=5", "hydra.launcher.max_num_timeout=0"]
    with chaos_sweep(tmp_path, sweep_dir, overrides) as sweep:
        held = wait_for("the job waiting at step 4", lambda: holding(holds), sweep)
        os.kill(held[0]["pid"], signal.SIGUSR2)
        sweep.wait(timeout=400)
    assert sweep.returncode == 1, (tmp_path / "sweep.log").read_text()[-3000:]
    assert not submitit_log_lines(sweep_dir, "Requeued job")
    result = json.loads((sweep_dir / "0" / "result.json").read_text())
    assert result["status"] == "timeout", result["error"]
    assert "with no requeue left (hydra.launcher.max_num_timeout=0)" in result["error"]
    assert "Traceback" not in result["error"]


def test_the_slurm_launcher_requeues_time_outs_by_default():
    """submitit_slurm's own default, max_num_timeout=0, would never requeue (issue 12, #14)."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        config = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    assert config.hydra.launcher.max_num_timeout == 3

# -- bad input -----------------------------------------------------------------------------------
BAD_INPUT = [
    # (overrides, what is raised, what the message says)
    (["precision=fp33"], ConfigCompositionException, "Available options in 'precision'"),
    (["trainer.max_stepz=3"], ConfigCompositionException, "Key 'max_stepz' not in"),
    (["optim.lr=fast"], ConfigCompositionException, "full_key: optim.lr"),
    (["optim.accumulate=0"], ValueError, "optim.accumulate=0: must be >= 1"),
    (["optim.lr=-1"], ValueError, "optim.lr=-1.0: the learning rate must be positive"),
    (["data.batch_size=0"], ValueError, "data.batch_size=0: must be a positive number"),
    (["data.batch_size=big"], ValueError, "data.batch_size='big': must be a positive number"),
    (["data.batch_size=auto"], ValueError, "data.batch_size=auto on CPU needs memory.budget"),
    (["memory.budget=-1"], ValueError, "memory.budget=-1: expected a positive size"),
    (["memory.budget=lots"], ValueError, "memory.budget=lots: expected a positive size"),
    (["memory.budget=0.5b"], ValueError, "memory.budget=0.5b: expected a positive size"),
    (["data.seed=100000000000000"], ValueError,
     "data.seed=100000000000000: must be an integer from 0 to 2**32 - 1"),
    (["logger.filename=/tmp/metrics.csv"], ValueError,
     "logger.filename='/tmp/metrics.csv': must be a path inside the run folder"),
    (["logger.filename=../metrics.csv"], ValueError,
     "logger.filename='../metrics.csv': must be a path inside the run folder"),
    (["trainer.max_steps=0"], ValueError, "trainer.max_steps=0: must be >= 1"),
    (["model._target_=nope.Net"], InstantiationException, "Error locating target 'nope.Net'"),
    (["data=cifar10", "data.root=/nonexistent"], FileNotFoundError,
     "data.root=/nonexistent: no CIFAR-10 there. Put these files in /nonexistent/cifar-10"),
    (["checkpointing=modules", "checkpointing.modules=[layer9]"], ValueError,
     "'layer9' names no module class and no module name of ResNet"),
    (["precision=fp16_pure", "precision.dtype=float8"], ValueError,
     "precision.dtype=float8: choose one of"),
    (["logger=wandb", "logger.mode=sometimes"], ValueError, "logger.mode=sometimes: choose one"),
]
if not torch.cuda.is_available():
    BAD_INPUT.append((["trainer.device=cuda"], RuntimeError, "sees no CUDA device"))


@pytest.mark.parametrize(("overrides", "error", "says"), BAD_INPUT,
                         ids=[" ".join(case[0]) for case in BAD_INPUT])
def test_bad_input_fails_before_training_and_claims_no_success(tmp_path, overrides, error, says):
    run_dir = tmp_path / "run"
    with pytest.raises(error) as raised:
        run_config(compose_train(*overrides), run_dir, {}, overrides, "bad")
    assert says in f"{raised.value}\n{raised.value.__cause__}"
    result = run_dir / "result.json"
    if result.exists():  # composed, then refused while building: recorded, never as success
        recorded = json.loads(result.read_text())
        assert recorded["status"] == "failed" and recorded["metrics"] is None
