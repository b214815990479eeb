"""The memory meter against exact arithmetic: it must be true before anything relies on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memexp.memory import LiveStorageTracker, MemoryMeter
from memexp.memory.allocator import CachingAllocatorModel

MIB = 2**20


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> dict:
    """One training step under the meter, phases as the trainer marks them. The loss is a plain
    sum, which keeps nothing for backward, so the only activations are the model's own."""
    meter = MemoryMeter(torch.device("cpu"))
    meter.watch(model)
    meter.watch_optimizer(optimizer)
    with meter:
        with meter.phase("forward"):
            loss = model(inputs).sum()
        with meter.phase("backward"):
            loss.backward()
        with meter.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return meter.report()


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(
    ("make_optimizer", "state_per_param", "states_plus"),
    [
        (lambda p: torch.optim.Adam(p, lr=1e-3), 2.0, 4.0),
        (lambda p: torch.optim.SGD(p, lr=0.1), 0.0, 2.0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1.0, 3.0),
    ],
    ids=["adam", "sgd", "sgd_momentum"],
)
def test_model_states_match_exact_arithmetic(make_optimizer, state_per_param, states_plus):
    torch.manual_seed(0)
    model = nn.Linear(4096, 4096)
    report = one_step(model, make_optimizer(model.parameters()), torch.randn(8, 4096))
    size = param_bytes(model)
    at_step = report["phases"]["optimizer"]["breakdown"]
    assert at_step["params"] == size
    assert at_step["grads"] == size
    # Adam keeps a 4-byte `step` scalar per parameter tensor besides exp_avg and exp_avg_sq.
    assert at_step["optimizer"] == pytest.approx(state_per_param * size, rel=0.01, abs=64)
    states = at_step["params"] + at_step["grads"] + at_step["optimizer"]
    assert states == pytest.approx(states_plus * size, rel=0.01)


def test_activations_are_what_forward_leaves_for_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    report = one_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(256, 1024))
    forward = report["phases"]["forward"]["breakdown"]
    act = 256 * 1024 * 4
    # Forward's peak comes with the loss: the ReLU output (kept for ReLU and the second Linear's
    # backward) and the logits are alive, plus the 4-byte scalar loss.
    assert forward["activations"] == 2 * act + 4
    assert forward["params"] == param_bytes(model)
    assert forward["grads"] == 0


def test_views_are_not_counted_twice_and_frees_are_seen():
    tracker = LiveStorageTracker()
    with tracker:
        base = torch.zeros(1024, 1024)
        views = [base.view(-1), base[:10], base.t(), base.reshape(1024, 1024)]
        assert tracker.current == 4 * MIB
        del base, views
        assert tracker.current == 0
        torch.ones(256, 1024)  # a temporary: allocated and freed at once
    assert tracker.current == 0
    assert tracker.peaks["other"].peak_bytes == 4 * MIB


def test_a_storage_resized_in_place_is_counted_at_its_new_size():
    # FSDP2 frees each block's gathered parameters with storage.resize_(0) and regrows them for
    # the next gather: no op is dispatched for it. The allocator model gives the block back.
    allocator = CachingAllocatorModel()
    tracker = LiveStorageTracker(allocator=allocator)
    torchs_own = torch.UntypedStorage.resize_
    with tracker:
        gathered = torch.empty(1024, 1024)
        assert (tracker.current, allocator.allocated) == (4 * MIB, 4 * MIB)
        gathered.untyped_storage().resize_(0)
        assert (tracker.current, allocator.allocated) == (0, 0)
        gathered.untyped_storage().resize_(2 * MIB)
        assert (tracker.current, allocator.allocated) == (2 * MIB, 2 * MIB)
    assert tracker.peaks["other"].peak_bytes == 4 * MIB
    assert torch.UntypedStorage.resize_ is torchs_own  # outside a tracker, torch's own


def test_registered_tensors_are_counted_once():
    weight = torch.randn(512, 512)
    tracker = LiveStorageTracker()
    tracker.track(weight)
    with tracker:
        _ = weight.t()  # an op viewing a pre-existing storage must not add it again
        tracker.track(weight)
    assert tracker.current == weight.numel() * 4


def test_peak_phase_is_the_phase_that_held_the_peak():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 4096), nn.ReLU(), nn.Linear(4096, 512))
    report = one_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(512, 512))
    phases = report["phases"]
    assert report["peak_phase"] == max(phases, key=lambda name: phases[name]["peak_bytes"])
    assert report["peak_bytes"] == phases[report["peak_phase"]]["peak_bytes"]
    breakdown = report["breakdown_at_peak"]
    assert sum(v for k, v in breakdown.items() if k != "offloaded") == report["peak_bytes"]


def test_tracking_off_measures_nothing_on_cpu():
    meter = MemoryMeter(torch.device("cpu"), track=False)
    model = nn.Linear(8, 8)
    meter.watch(model)
    meter.watch_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with meter, meter.phase("forward"):
        model(torch.randn(2, 8)).sum().backward()
    report = meter.report()
    assert report["tracked"] is False
    assert report["peak_bytes"] is None and report["phases"] == {}
