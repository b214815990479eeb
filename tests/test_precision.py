"""precision: mixed precision trains like fp32, the GradScaler skips bad steps, and the memory."""

from __future__ import annotations

import pytest
import torch

from memexp.trainer import NonFiniteLoss, Trainer

from conftest import compose_train, step_memory, train

TOKENS = ("model=transformer", "model.n_layers=2", "model.d_model=64")


@pytest.mark.parametrize("precision", ["amp", "bf16"])
def test_mixed_precision_loss_lands_within_2_percent_of_fp32(precision):
    _, fp32 = train(*TOKENS, "memory.track=false", steps=40)
    trainer, mixed = train(*TOKENS, f"precision={precision}", "memory.track=false", steps=40)
    baseline = sum(fp32.losses[-10:]) / 10
    assert sum(mixed.losses[-10:]) / 10 == pytest.approx(baseline, rel=0.02)
    assert mixed.losses != fp32.losses  # low precision really ran


def test_grad_scaler_skips_a_step_with_inf_gradients_and_leaves_the_weights():
    trainer = Trainer(compose_train("model=mlp", "precision=amp", "memory.track=false"))
    inputs, targets = trainer.to_device(next(trainer.data.train_batches()))
    inputs[0, 0, 0, 0] = float("inf")  # a real overflow, carried through forward and backward
    before = [p.detach().clone() for p in trainer.model.parameters()]
    scale = trainer.precision._scaler.get_scale()
    with trainer.precision.autocast():
        loss = trainer.loss(trainer.forward((inputs, targets)), (inputs, targets))
    trainer.precision.backward(loss)
    assert not trainer.precision.step(trainer.optimizer)
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
    assert trainer.precision._scaler.get_scale() < scale  # backed off for the next step


def test_skipped_steps_are_counted():
    trainer, metrics = train("model=mlp", "precision=amp", "memory.track=false", steps=3)
    # The first fp16 steps overflow at the initial scale of 65536 on this model.
    assert trainer.summary_metrics()["skipped_steps"] == metrics.skipped_steps >= 1


@pytest.mark.parametrize("master_weights", [False, True])
def test_pure_half_trains_and_master_weights_stay_fp32(master_weights):
    trainer, metrics = train(*TOKENS, "precision=fp16_pure", "optim=sgd",
                             f"precision.master_weights={master_weights}", steps=3)
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())
    updated = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in updated} == {torch.float32 if master_weights else torch.float16}
    assert all(torch.isfinite(torch.tensor(metrics.losses)))


def test_pure_fp16_adam_diverges_without_master_weights():
    # The source's warning (tip 8): model.half() with Adam "may report an error". Adam's eps of
    # 1e-8 is below fp16's smallest number, so the update divides by zero: the weights it leaves
    # are not finite, and the run is not ok.
    with pytest.raises(NonFiniteLoss, match="the final weights are not finite.*overflowed"):
        train(*TOKENS, "precision=fp16_pure", "optim=adamw", steps=3)
    _, master = train(*TOKENS, "precision=fp16_pure", "optim=adamw",
                      "precision.master_weights=true", steps=3)
    assert all(torch.isfinite(torch.tensor(master.losses)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_tf32_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="precision=tf32 needs a CUDA device"):
        Trainer(compose_train("precision=tf32", "trainer.device=cpu"))


# -- effect: the meter ---------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("model", [("model.width=8", "data.batch_size=8"), TOKENS],
                         ids=["resnet", "transformer"])
def test_mixed_precision_activations_are_at_most_70_percent_of_fp32(model, precision):
    fp32 = step_memory(*model)["activations_peak_bytes"]
    mixed = step_memory(*model, f"precision={precision}")["activations_peak_bytes"]
    assert mixed <= 0.70 * fp32


def test_bf16_pure_halves_parameter_and_gradient_bytes_exactly():
    # The transformer has no buffers, so parameter bytes are the parameters alone.
    full = step_memory(*TOKENS)["phases"]["optimizer"]["breakdown"]
    half = step_memory(*TOKENS, "precision=bf16_pure")["phases"]["optimizer"]["breakdown"]
    assert half["params"] * 2 == full["params"]
    assert half["grads"] * 2 == full["grads"]


def test_master_weights_are_optimizer_memory():
    at_step = step_memory(*TOKENS, "precision=bf16_pure", "precision.master_weights=true",
                          "optim=sgd")["phases"]["optimizer"]["breakdown"]
    # SGD keeps no state: the optimizer's memory is the fp32 copy, twice the bf16 parameters.
    assert at_step["optimizer"] == 2 * at_step["params"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_amp_lowers_peak_allocated_on_cuda():
    fp32 = step_memory("trainer.device=cuda", "model.width=32", "data.batch_size=64")
    amp = step_memory("trainer.device=cuda", "model.width=32", "data.batch_size=64",
                      "precision=amp")
    assert amp["peak_bytes"] < fp32["peak_bytes"]


@pytest.mark.parametrize(("precision", "noted"), [("bf16", True), ("fp32", False)])
def test_a_half_precision_run_on_a_cpu_says_its_times_do_not_carry_over(tmp_path, caplog,
                                                                        precision, noted):
    from memexp.app import run_config

    overrides = ["model=mlp", "model.hidden=16", "data.batch_size=8", "data.num_eval=16",
                 "logger=none", "trainer.max_steps=1", f"precision={precision}"]
    with caplog.at_level("INFO", logger="memexp"):
        run_config(compose_train(*overrides), tmp_path, {}, overrides, "half")
    note = "note: half precision on a CPU, where its kernels are emulated or slow: these step " \
           "times do not carry over to a GPU"
    assert (note in caplog.text) == noted
