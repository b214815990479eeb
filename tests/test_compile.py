"""compile=default|reduce-overhead and checkpointing=budget (memexp.techniques.compile), and the
meter's count of a compiled model (memexp.memory.profiled).

Compiling takes a minute or more on 2 busy cores: one test compiles (the MLP, budget 0); the
others are refusals, which happen before anything compiles, and the allocator's count checked
against the live-storage tracker on an eager model."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from memexp.config import option_groups
from memexp.estimate import estimate
from memexp.memory import MemoryMeter
from memexp.trainer import Trainer

from conftest import TRAIN_PY_ENV, compose_train, max_relative_error, train_py

MLP = ("model=mlp", "data.batch_size=32")
BUDGET_0 = ("compile=default", "checkpointing=budget", "checkpointing.budget=0")


def measured_steps(trainer: Trainer, steps: int = 2) -> tuple[dict, list[torch.Tensor]]:
    """The meter's report over `steps` steps, and the first step's gradients."""
    grads: dict[int, torch.Tensor] = {}
    params = list(trainer.model.parameters())
    def keep(param: torch.Tensor, index: int) -> None:
        grads.setdefault(index, param.grad.detach().clone())  # the first step's

    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: keep(p, i))
             for i, p in enumerate(params)]
    batches = trainer.data.train_batches()
    trainer.model.train()
    with trainer.meter:
        for _ in range(steps):
            trainer.train_step(batches)
    for hook in hooks:
        hook.remove()
    return trainer.meter.report(), [grads[i] for i in range(len(params))]


def test_the_groups_options_are_listed():
    groups = option_groups().splitlines()
    assert "compile: default, none, reduce-overhead" in groups
    assert any(line.startswith("checkpointing:") and "budget" in line for line in groups)


@pytest.mark.parametrize(("overrides", "says"), [
    (("compile=default", "checkpointing=budget", "checkpointing.budget=1.5"),
     "checkpointing.budget=1.5: must be from 0 to 1"),
    (("checkpointing=budget",), "checkpointing=budget: the activation memory budget is a "
                                "setting of torch.compile's partitioner, and compile=none"),
    (("compile=default", "checkpointing=full"), "compile=default|reduce-overhead with "
                                                "checkpointing=full"),
    (("compile=default", "compile.mode=max-autotune"),
     "compile.mode=max-autotune: valid choices are default, reduce-overhead"),
])
def test_what_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        Trainer(compose_train(*MLP, *overrides))


def test_estimate_refuses_a_compiled_run_saying_why():
    with pytest.raises(ValueError, match=r"^compile=default: memexp estimate traces the eager"):
        estimate(compose_train(*MLP, *BUDGET_0))


def test_without_a_cpp_compiler_compile_is_refused(tmp_path):
    """Inductor's own lookup, pointed at nothing: CXX names the compiler it tries (g++ on PATH
    otherwise)."""
    done = subprocess.run(train_py(tmp_path, ("trainer.device=cpu", *MLP, "compile=default")),
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**TRAIN_PY_ENV, "CXX": str(tmp_path / "no-such-c++")})
    assert done.returncode != 0
    assert (f"compile: no C++ compiler found (searched {tmp_path / 'no-such-c++'}, from CXX or "
            "g++ on PATH)") in done.stdout + done.stderr


def test_the_allocators_count_is_the_trackers_on_an_eager_model():
    """What counts a compiled model (the CPU allocator's profiled events) against the live-storage
    tracker, on the same eager steps: every phase's peak, to the byte."""
    tracked, _ = measured_steps(Trainer(compose_train(*MLP)))
    trainer = Trainer(compose_train(*MLP))
    trainer.meter = MemoryMeter(torch.device("cpu"), compiled=True)
    trainer.meter.watch(trainer.model)
    trainer.meter.watch_optimizer(trainer.optimizer)
    profiled, _ = measured_steps(trainer)
    assert profiled["source"] == "cpu-allocator" and tracked["source"] == "storage-tracker"
    assert {phase: p["peak_bytes"] for phase, p in profiled["phases"].items()} == {
        phase: p["peak_bytes"] for phase, p in tracked["phases"].items()}
    assert profiled["saved_activations_bytes"] == tracked["saved_activations_bytes"]


def test_a_compiled_run_at_budget_0_saves_what_eager_saves_less_and_learns_the_same():
    """The one compiled test (about a minute on 2 busy cores): the partitioner at budget 0
    recomputes the MLP's forward in backward, so the forward leaves almost nothing alive, which
    only the allocator's count sees (under the tracker dynamo would run the model eagerly, and
    save what eager saves)."""
    eager, eager_grads = measured_steps(Trainer(compose_train(*MLP)))
    compiled, grads = measured_steps(Trainer(compose_train(*MLP, *BUDGET_0)))
    assert compiled["source"] == "cpu-allocator"
    assert compiled["saved_activations_bytes"] < eager["saved_activations_bytes"] / 10
    assert compiled["phases"]["forward"]["peak_bytes"] < eager["phases"]["forward"]["peak_bytes"]
    # fp32 sums fused in another order
    assert max_relative_error(grads, eager_grads) < 1e-4


def test_plan_says_which_options_it_cannot_search():
    """Its first lines, as it starts (an MLP at a budget its first candidate fits)."""
    from memexp.plan import plan  # (plan imports the sweep report's code)

    shown: list[str] = []
    plan([*MLP, "trainer.device=cpu", "precision=fp32", "optim=sgd", "checkpointing=none",
          "optim.accumulate=1"], "1GiB", show=shown.append)
    assert shown[1] == ("  not searched: checkpointing=budget, compile=default, "
                        "compile=reduce-overhead (memexp estimate cannot trace a compiled model: "
                        "measure them with train.py)")
