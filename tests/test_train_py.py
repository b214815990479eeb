"""train.py as a user runs it: a subprocess smoke run, result.json's schema, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_train_py

pytestmark = pytest.mark.slow

SMOKE = ["debug=fast", "model.width=8", "data.batch_size=16", "trainer.device=cpu"]
BREAKDOWN = {"params", "grads", "optimizer", "activations", "other"}


def test_smoke_run_writes_a_complete_result(tmp_path):
    done = run_train_py(tmp_path, *SMOKE)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())

    assert result["status"] == "ok" and result["error"] is None
    assert result["techniques"] == {"precision": "fp32", "checkpointing": "none", "optim": "sgd",
                                    "parallel": "none", "bn_mode": "train"}
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


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("precision=bogus", ["precision/bogus", "Available options in 'precision'", "fp32"]),
        ("trainer.max_steps=abc", ["trainer.max_steps", "could not be converted to Integer"]),
    ],
)
def test_bad_input_exits_nonzero_and_claims_no_success(tmp_path, override, says):
    done = run_train_py(tmp_path, *SMOKE, override)
    assert done.returncode != 0
    for fragment in says:
        assert fragment in done.stderr
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_request_without_a_gpu_fails_and_records_it(tmp_path):
    done = run_train_py(tmp_path, *SMOKE[:-1], "trainer.device=cuda")
    assert done.returncode != 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "failed"
    assert "trainer.device=cuda" in result["error"]
