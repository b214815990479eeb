"""parallel=ddp|zero1|fsdp on real torch.distributed (gloo, CPU): 2 ranks launched by torchrun,
trainer.nproc and submitit's tasks_per_node, against one process on the same global batch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose_train, job, train

TESTS = Path(__file__).resolve().parent
# A small MLP whose layers are of similar size (so ZeRO's greedy partition is near-even); Adam,
# so that the optimizer holds state; 8 samples per rank, 16 per global batch.
MLP = ["debug=fast", "model=mlp", "model.hidden=64", "model.depth=6", "data.image_size=8",
       "optim=adam", "data.num_eval=64", "trainer.max_steps=4"]
PER_RANK, GLOBAL = "data.batch_size=8", "data.batch_size=16"
FAST_FAIL = "parallel.timeout_s=30"


def ranks_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(TESTS), "HYDRA_FULL_ERROR": "0",
            "WANDB_MODE": "offline"}


def torchrun(cwd: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               str(REPO / "train.py"), "trainer.device=cpu", "trainer.progress=false", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=ranks_env())


def nproc2(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`python train.py trainer.nproc=2 ...`: the run's result.json. (conftest.job runs the
    same ranks without train.py's own process, where its output and time-out do not matter.)"""
    done = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp_path / 'run'}",
         "trainer.nproc=2", "trainer.device=cpu", "trainer.progress=false", *overrides],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=ranks_env())
    return done, json.loads((tmp_path / "run" / "result.json").read_text())


def resident(report: dict, phase: str = "optimizer") -> int:
    """Parameter, gradient and optimizer-state bytes on the device at a phase's peak."""
    breakdown = report["phases"][phase]["breakdown"]
    return breakdown["params"] + breakdown["grads"] + breakdown["optimizer"]


def max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def one_process():
    """The reference: one process, the global batch of 16."""
    trainer, metrics = train(*MLP, GLOBAL, steps=4)
    return trainer.meter.report(), metrics


@pytest.mark.slow
def test_ddp_under_torchrun_matches_one_process_in_one_output_folder(tmp_path, one_process):
    done = torchrun(tmp_path, *MLP, PER_RANK, "parallel=ddp", FAST_FAIL)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "runs").iterdir())
    assert len(runs) == 1, runs  # not one per rank
    result = json.loads((runs[0] / "result.json").read_text())
    assert result["status"] == "ok" and result["env"]["world_size"] == 2
    assert max_difference(result["metrics"]["losses"], one_process[1].losses) <= 1e-5
    assert result["metrics"]["eval_accuracy"] == pytest.approx(one_process[1].eval_accuracy)
    memory = result["memory"]
    assert len(memory["per_rank"]) == 2 and memory["rank"] in (0, 1)
    assert memory["peak_bytes"] == max(r["peak_bytes"] for r in memory["per_rank"])
    # DDP replicates: each rank holds everything one process holds.
    for report in memory["per_rank"]:
        assert resident(report) == resident(one_process[0])


@pytest.mark.slow
def test_fsdp_matches_one_process_and_shards_params_grads_and_state(tmp_path, one_process,
                                                                   caplog):
    with caplog.at_level(logging.INFO, logger="memexp"):
        result = job(tmp_path / "run", "trainer.nproc=2", *MLP, PER_RANK, "parallel=fsdp",
                     FAST_FAIL)
    assert max_difference(result["metrics"]["losses"], one_process[1].losses) <= 1e-5
    single = resident(one_process[0])
    for report in result["memory"]["per_rank"]:
        assert resident(report) <= 0.55 * single
    assert "per rank" in caplog.text  # the summary the parent process prints


@pytest.mark.slow
def test_zero1_under_submitit_tasks_shards_the_optimizer_state(tmp_path, one_process):
    sweep_dir = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={sweep_dir}",
         "hydra.launcher.tasks_per_node=2", "trainer.device=cpu", *MLP, PER_RANK,
         "parallel=zero1", FAST_FAIL],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=ranks_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((sweep_dir / "0" / "result.json").read_text())
    assert result["status"] == "ok" and result["env"]["world_size"] == 2
    assert max_difference(result["metrics"]["losses"], one_process[1].losses) <= 1e-5
    state = [r["phases"]["optimizer"]["breakdown"]["optimizer"]
             for r in result["memory"]["per_rank"]]
    single = one_process[0]["phases"]["optimizer"]["breakdown"]["optimizer"]
    assert sum(state) == single  # every parameter's state, exactly once
    for share in state:
        assert 0.4 <= share / single <= 0.6  # ZeRO partitions whole parameters, greedily


def test_fsdp_cpu_offload_counts_parameters_as_host_resident():
    """World size 1, in this process: the sharded parameters and the optimizer step live on
    the host, so the device breakdown has no parameters or optimizer state."""
    kept, kept_metrics = train(*MLP, GLOBAL, "parallel=fsdp", steps=2)
    off, off_metrics = train(*MLP, GLOBAL, "parallel=fsdp", "parallel.cpu_offload=true",
                             steps=2)
    assert off_metrics.losses == kept_metrics.losses  # the same math
    kept_report, off_report = kept.meter.report(), off.meter.report()
    kept_step = kept_report["phases"]["optimizer"]["breakdown"]
    off_step = off_report["phases"]["optimizer"]["breakdown"]
    params = list(kept.model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert kept_step["params"] == param_bytes
    # Adam: two moments per parameter, and a 4-byte step count per tensor.
    assert kept_step["optimizer"] == 2 * param_bytes + 4 * len(params)
    assert kept_step["offloaded"] == 0 and kept_report["offloaded_peak_bytes"] == 0
    assert off_step["params"] == 0 and off_step["optimizer"] == 0  # MLP: no buffers
    assert off_step["offloaded"] == param_bytes
    # On the host at once: the parameters, Adam's two moments, and the step's temporaries.
    assert off_report["offloaded_peak_bytes"] >= 3 * param_bytes


def test_one_process_fsdp_under_amp_runs():
    """The headline `python train.py precision=amp parallel=fsdp`: a 1-rank group, fp16
    all-gathers, fp32 gradient reduction, a loss scale."""
    trainer, metrics = train(*MLP, GLOBAL, "precision=amp", "parallel=fsdp", steps=2)
    assert all(loss == loss for loss in metrics.losses)
    assert trainer.parallel.world_size == 1


@pytest.mark.slow
def test_sync_batchnorm_under_ddp_matches_one_process_on_the_global_batch(tmp_path):
    resnet = ["debug=fast", "model.width=4", "data.num_eval=64", "trainer.max_steps=3",
              "memory.track=false"]
    _, reference = train(*resnet, GLOBAL, steps=3)
    result = job(tmp_path / "run", "trainer.nproc=2", *resnet, PER_RANK, "parallel=ddp",
                 "bn_mode=sync", FAST_FAIL)
    # Batch statistics over both ranks' 8 samples: the single process's 16, step by step.
    assert max_difference(result["metrics"]["losses"], reference.losses) <= 1e-5


@pytest.mark.slow
def test_a_failing_rank_is_named_in_result_json_with_its_traceback(tmp_path):
    # Rank 0's collectives would wait an hour for the dead rank: that the run ends at all (within
    # nproc2's time-out) shows it did not wait.
    done, result = nproc2(tmp_path, "debug=fast", "model=custom", "model._target_=chaos.Chaos",
                          "+model.mode=raise", "+model.rank=1", "parallel=ddp", PER_RANK,
                          "parallel.timeout_s=3600")
    assert done.returncode != 0
    assert result["status"] == "failed" and result["failed_rank"] == 1
    assert "chaos: this job raises" in result["error"]  # rank 1's, not "connection closed"
    assert "failed rank  1" in done.stdout + done.stderr


@pytest.mark.slow
def test_multirun_under_torchrun_is_refused(tmp_path):
    done = torchrun(tmp_path, "-m", "parallel=ddp", nproc=1)
    assert done.returncode != 0
    assert "-m/--multirun under torchrun" in done.stderr
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(("overrides", "says"), [
    (["parallel=fsdp", "optim.in_backward=true"], "optim.in_backward=true"),
    (["parallel=zero1", "optim.in_backward=true"], "parallel=ddp|zero1|fsdp"),
    (["bn_mode=sync"], "bn_mode=sync"),
    (["parallel=ddp", "trainer.checkpoint_every=2"], "trainer.checkpoint_every"),
    (["parallel=ddp", "parallel.timeout_s=0"], "parallel.timeout_s=0"),
    (["trainer.nproc=0"], "trainer.nproc=0: must be >= 1"),
])
def test_bad_parallel_input_is_refused_naming_the_key(overrides, says, tmp_path):
    from memexp.trainer import Trainer

    with pytest.raises(ValueError, match=says.replace("|", r"\|")):
        Trainer(compose_train(*MLP, *overrides), tmp_path)

