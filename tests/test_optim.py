"""optim: accumulation is a large batch, the step in backward is the regular step, and memory."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from memexp.trainer import Trainer

from conftest import (
    HF_GPT2,
    compose_train,
    first_step_gradients,
    max_relative_error,
    step_memory,
    train,
)

MLP = ("model=mlp", "model.hidden=128")
TOKENS = ("model=transformer", "model.n_layers=2", "model.d_model=64")
RESNET = ("model=resnet", "model.width=8")


@pytest.mark.parametrize("model", [MLP, TOKENS], ids=["mlp", "transformer"])
def test_accumulation_gives_the_gradient_of_the_large_batch(model):
    # Micro-batches k of size B/k are consecutive slices of the batch of size B.
    _, large = first_step_gradients(*model, "data.batch_size=32")
    _, accumulated = first_step_gradients(*model, "data.batch_size=8", "optim.accumulate=4")
    assert max_relative_error(accumulated, large) <= 1e-5


NO_DROPOUT = ("+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0",
              "+model.config.attn_pdrop=0")


@pytest.mark.parametrize("loss", ["model", "cross_entropy"])
def test_accumulation_of_padded_sequences_weighs_micro_batches_by_their_tokens(loss):
    """Micro-batches of padded sequences count different numbers of tokens, and each loss is a
    mean over its own: weighed equally, GPT-2's gradient was 6.2e-2 off the large batch's."""
    model = (*HF_GPT2, *NO_DROPOUT, f"loss={loss}", "data.padding=0.5")
    _, large = first_step_gradients(*model, "data.batch_size=8")
    trainer, accumulated = first_step_gradients(*model, "data.batch_size=2", "optim.accumulate=4")
    micros = list(itertools.islice(trainer.data.train_batches(), 4))
    assert len({trainer.loss.items(batch) for batch in micros}) > 1  # the tokens do differ
    assert max_relative_error(accumulated, large) <= 1e-5


def test_batchnorm_breaks_the_equivalence_and_group_norm_restores_it():
    """BatchNorm normalizes each micro-batch with its own statistics, so accumulating four
    batches of 8 is not one batch of 32 (the source's ResNet-34 table: 73.85 vs 73.25);
    GroupNorm's statistics are per sample, so bn_mode=group_norm is exact again."""
    _, large = first_step_gradients(*RESNET, "data.batch_size=32")
    _, accumulated = first_step_gradients(*RESNET, "data.batch_size=8", "optim.accumulate=4")
    assert max_relative_error(accumulated, large) > 1e-2
    _, large = first_step_gradients(*RESNET, "bn_mode=group_norm", "data.batch_size=32")
    _, accumulated = first_step_gradients(*RESNET, "bn_mode=group_norm", "data.batch_size=8",
                                          "optim.accumulate=4")
    assert max_relative_error(accumulated, large) <= 1e-5


@pytest.mark.parametrize("optim", ["adamw", "sgd_momentum", "adafactor"])
def test_stepping_in_backward_gives_the_regular_parameters(optim):
    regular, _ = train(*MLP, f"optim={optim}", "memory.track=false", steps=2)
    in_backward, _ = train(*MLP, f"optim={optim}", "optim.in_backward=true",
                           "memory.track=false", steps=2)
    for p, q in zip(in_backward.model.parameters(), regular.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_in_backward_with_accumulation_is_refused_before_training():
    with pytest.raises(ValueError, match="in_backward=true with optim.accumulate=2"):
        Trainer(compose_train(*MLP, "optim.in_backward=true", "optim.accumulate=2"))


def test_in_backward_with_fp16_loss_scaling_is_refused_before_training():
    with pytest.raises(ValueError, match="needs every gradient at once"):
        Trainer(compose_train(*MLP, "optim.in_backward=true", "precision=amp"))


@pytest.mark.parametrize(("override", "names"), [("optim.lr=-1", "optim.lr=-1"),
                                                 ("optim.accumulate=0", "optim.accumulate=0")])
def test_out_of_range_values_name_the_key(override, names):
    with pytest.raises(ValueError, match=names):
        Trainer(compose_train(override))


def test_adamw_8bit_keeps_about_two_bytes_of_state_per_parameter():
    report = step_memory(*MLP, "optim=adamw_8bit", steps=2)
    at_step = report["phases"]["optimizer"]["breakdown"]
    parameters = at_step["params"] / 4
    assert 1.9 <= at_step["optimizer"] / parameters <= 2.2


def test_adamw_8bit_without_torchao_is_a_clear_error_not_a_fallback():
    # A real failed import: the module is blocked in a fresh interpreter.
    code = (
        "import sys; sys.modules['torchao'] = None\n"
        "from memexp.techniques.optim import AdamW8bit\n"
        "import torch\n"
        "AdamW8bit(lr=1e-3).build([torch.nn.Parameter(torch.zeros(2))])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "optim=adamw_8bit needs torchao's AdamW8bit" in done.stderr


def test_torchao_imports_without_the_warnings_a_user_cannot_act_on():
    # Logging set up as a run's (Hydra's) is: without the filters, four warnings come out here
    # (two CUDA libraries, no Triton, torch's Enum deprecation).
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from memexp.techniques.optim import AdamW8bit\n"
            "AdamW8bit(lr=1e-3).optimizer_class()\n"
            "assert not logging.getLogger('torchao').filters  # only while importing\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and done.stdout == ""


# -- effect: the meter ---------------------------------------------------------------------------
@pytest.mark.parametrize(("optim", "bytes_per_param"),
                         [("sgd", 0), ("sgd_momentum", 4), ("adam", 8), ("adamw", 8)])
def test_optimizer_state_per_parameter(optim, bytes_per_param):
    at_step = step_memory(*MLP, f"optim={optim}")["phases"]["optimizer"]["breakdown"]
    parameters = at_step["params"] / 4  # the MLP has no buffers
    # Adam also keeps a 4-byte step counter per parameter tensor: under 1% here.
    assert at_step["optimizer"] / parameters == pytest.approx(bytes_per_param, rel=0.01, abs=1e-9)


def test_adafactor_state_on_two_dimensional_weights():
    trainer, _ = train(*MLP, "optim=adafactor", "memory.track=false")
    weights = [p for p in trainer.model.parameters() if p.dim() == 2]
    state = sum(t.numel() * t.element_size() for p in weights
                for t in trainer.optimizer.state[p].values() if isinstance(t, torch.Tensor))
    assert state / sum(p.numel() for p in weights) <= 0.1
    at_step = step_memory(*MLP, "optim=adafactor")["phases"]["optimizer"]["breakdown"]
    assert at_step["optimizer"] / (at_step["params"] / 4) <= 0.1  # biases included


def test_in_backward_never_holds_all_gradients():
    regular = step_memory(*MLP, "optim=adamw")
    in_backward = step_memory(*MLP, "optim=adamw", "optim.in_backward=true")
    trainer = Trainer(compose_train(*MLP))
    sizes = [p.numel() * p.element_size() for p in trainer.model.parameters()]
    assert regular["grads_peak_bytes"] == sum(sizes)
    # At most the largest gradient plus the one autograd is producing next to it.
    assert in_backward["grads_peak_bytes"] <= max(sizes) + sorted(sizes)[-2]
    assert in_backward["phases"]["optimizer"]["breakdown"]["grads"] == 0


def test_accumulation_cuts_activations_to_a_quarter():
    whole = step_memory(*RESNET, "data.batch_size=32")["activations_peak_bytes"]
    quarter = step_memory(*RESNET, "data.batch_size=8", "optim.accumulate=4")
    assert quarter["activations_peak_bytes"] == pytest.approx(whole / 4, rel=0.15)


def test_optimizer_step_temporaries_loop_foreach_and_fused():
    """AdamW's step: the per-parameter loop holds temporaries of one parameter (two of the
    largest), the foreach kernels a list the size of all of them, the fused kernel none."""
    sizes = [p.numel() * p.element_size() for p in Trainer(compose_train(*MLP)).model.parameters()]

    def temporaries(option: str) -> int:
        memory = step_memory(*MLP, "optim=adamw", option)
        return memory["phases"]["optimizer"]["breakdown"]["other"]

    assert temporaries("optim.foreach=false") <= 2 * max(sizes) + 64 * 1024
    assert temporaries("optim.foreach=true") >= sum(sizes)
    assert temporaries("optim.fused=true") <= 64 * 1024


def test_keep_grads_holds_gradients_through_the_next_forward_with_the_same_losses():
    sizes = [p.numel() * p.element_size() for p in Trainer(compose_train(*MLP)).model.parameters()]
    freed = step_memory(*MLP, "optim=adamw", steps=2)["phases"]["forward"]["breakdown"]
    kept = step_memory(*MLP, "optim=adamw", "optim.keep_grads=true", steps=2)
    assert freed["grads"] == 0
    assert kept["phases"]["forward"]["breakdown"]["grads"] == sum(sizes)
    # zeroed in place, then accumulated into: 0 + g == g, so the math is the same, bitwise
    assert train(*MLP, "optim=adamw", steps=3)[1].losses == train(
        *MLP, "optim=adamw", "optim.keep_grads=true", steps=3)[1].losses
    with pytest.raises(ValueError, match="optim.keep_grads=true"):
        Trainer(compose_train(*MLP, "optim.in_backward=true", "optim.keep_grads=true"))
