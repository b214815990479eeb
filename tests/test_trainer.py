"""The trainer on the real configs: determinism, devices, and what a step leaves behind."""

from __future__ import annotations

import pytest
import torch

from memexp.device import pick_device

from conftest import train


def small_run(*overrides):
    return train("model.width=8", "data.batch_size=16", *overrides, steps=6)


def test_same_seed_gives_bitwise_identical_losses_and_weights():
    first, a = small_run()
    second, b = small_run()
    assert a.losses == b.losses  # exact float equality, every step
    for p, q in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)
    _, c = small_run("trainer.seed=1")
    assert a.losses != c.losses


def test_memory_tracking_does_not_change_the_math():
    _, tracked = small_run("memory.track=true")
    _, untracked = small_run("memory.track=false")
    assert tracked.losses == untracked.losses


def test_no_graph_outlives_its_step():
    trainer, metrics = small_run()
    assert all(isinstance(loss, float) for loss in metrics.losses)
    # After training only the model is alive (SGD keeps no state): no graph, activations or
    # batches held by a stored loss.
    model_bytes = sum(t.numel() * t.element_size()
                      for t in [*trainer.model.parameters(), *trainer.model.buffers()])
    assert trainer.meter.tracker.current == model_bytes


def test_a_run_reports_memory_metrics_and_accuracy():
    trainer, metrics = small_run()
    summary = trainer.summary_metrics()
    assert summary["throughput_unit"] == "samples/s" and summary["throughput"] > 0
    assert 0 <= summary["eval_accuracy"] <= 1
    assert summary["steps"] == 6 and len(summary["losses"]) == 6
    memory = trainer.meter.report()
    params = sum(p.numel() * 4 for p in trainer.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in trainer.model.buffers())
    assert memory["breakdown_at_peak"]["params"] == params + buffers
    assert memory["peak_phase"] in {"forward", "backward"}


def test_device_auto_picks_cpu_without_cuda_and_cuda_request_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert pick_device("auto").type == "cpu"
    with pytest.raises(RuntimeError, match="trainer.device=cuda.*no CUDA device"):
        pick_device("cuda")
