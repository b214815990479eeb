"""precision: mixed precision trains like fp32, the GradScaler skips bad steps, and the memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memexp.techniques.precision import Autocast, cast
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


def test_autocast_stores_frozen_weights_in_its_dtype_but_batchnorm_s():
    """precision=bf16 stores the weights that do not train in bf16 (precision.frozen=compute),
    the trained ones and the buffers in fp32; precision.frozen=fp32 keeps them all fp32. A
    frozen BatchNorm keeps fp32 weights: in bf16, beside its fp32 running statistics, its op
    fails."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        layers[:2].requires_grad_(False)  # the first Linear and the BatchNorm
        return layers

    stored = Autocast(dtype="bfloat16").apply(model())
    assert [p.dtype for p in stored.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 4
    assert {b.dtype for b in stored.buffers() if b.is_floating_point()} == {torch.float32}
    kept = Autocast(dtype="bfloat16", frozen="fp32").apply(model())
    assert {p.dtype for p in kept.parameters()} == {torch.float32}
    x = torch.randn(16, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stored(x).sum().backward()
    cast(stored, torch.bfloat16, stored[1].parameters())  # its weights, not its statistics
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stored(x)


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_float8_on_cpu_is_refused_with_its_reason():
    """Float8 matmuls need an NVIDIA GPU of compute capability 8.9 or above; the refusal says so
    and how to estimate it (tests/test_optim.py traces it on the fake H100)."""
    with pytest.raises(ValueError, match=r"precision=float8 needs a CUDA device \(its matmuls "
                                         r"run in float8 .* compute capability 8\.9"):
        Trainer(compose_train("precision=float8", "trainer.device=cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU of compute capability 8.9 or above")
def test_float8_trains_as_bf16_on_a_gpu():
    """The blocks' linears become torchao's Float8Linear, and 40 steps land within 2% of
    bf16's loss (as amp's and bf16's of fp32's); the head stays an nn.Linear."""
    from torchao.float8.float8_linear import Float8Linear

    llama = ("model=hf", "model.arch=llama", "model.task=causal_lm",
             "+model.config.num_hidden_layers=2", "+model.config.hidden_size=256",
             "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=2",
             "+model.config.intermediate_size=512", "+model.config.vocab_size=1024",
             "data.seq_len=128", "data.batch_size=8", "trainer.device=cuda",
             "memory.track=false")
    _, bf16 = train(*llama, "precision=bf16", steps=40)
    trainer, float8 = train(*llama, "precision=float8", steps=40)
    assert sum(isinstance(m, Float8Linear) for m in trainer.model.modules()) == 2 * 7
    assert type(trainer.model.lm_head) is torch.nn.Linear
    assert sum(float8.losses[-10:]) / 10 == pytest.approx(sum(bf16.losses[-10:]) / 10, rel=0.02)
