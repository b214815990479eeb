"""optim: accumulation is a large batch, the step in backward is the regular step, and memory."""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys

import pytest
import torch

from memexp.build import build_model
from memexp.estimate import compose_config, estimate
from memexp.trainer import Trainer

from conftest import (
    HF_GPT2,
    compose_train,
    first_step_gradients,
    max_relative_error,
    needs_cuda_build,
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


# The MLP at 16 px: its first layer (768 x 128) and its blocks (128 x 128) are quantized, its
# biases (under 4096 values) keep fp32 moments in torchao's optimizers.
SMALL_MLP = (*MLP, "data.image_size=16", "data.batch_size=32")
STEPS = 6


@functools.cache
def adamw_steps() -> tuple[dict, list[float]]:
    """AdamW's memory and losses over STEPS steps of SMALL_MLP, all measured (the tracker runs
    torchao's steps eagerly: compiled on 2 CPU cores, each took 15-55 s)."""
    trainer, metrics = train(*SMALL_MLP, "optim=adamw", f"memory.measure_steps={STEPS}",
                             steps=STEPS)
    return trainer.meter.report(), metrics.losses


@pytest.mark.parametrize(("optim", "low", "high"), [
    ("adamw_bf16", 4.0, 4.0),  # two bf16 moments: exactly half of AdamW's 8 bytes
    ("adamw_4bit", 1.0, 1.2),  # half a byte a moment, an fp32 scale per 128 values
    ("adamw_fp8", 1.9, 2.2),  # a byte a moment (e4m3), an fp32 scale per 256 values
])
def test_adam_state_in_fewer_bits_keeps_its_bytes_and_learns_as_adamw(optim, low, high):
    """Effect: the optimizer's state per parameter, as the meter finds it in the optimizer's
    own tensors. Correctness: these change the math (their changes_math says how); after STEPS
    steps the loss (of the last 3) has come down as AdamW's, within a quarter of AdamW's
    progress. Except
    fp8's, which diverges here (torchao 0.18's AdamWFp8, on CPU and CUDA alike: the same
    Python): within a block of 256 values, e4m3 holds about 2**17 of dynamic range, which a
    second moment, a squared gradient, outgrows: it rounds to 0 where the first moment does
    not, and the update m / (sqrt(v) + eps) comes out thousands of times AdamW's."""
    (adamw, adamw_losses), (trainer, metrics) = adamw_steps(), train(
        *SMALL_MLP, f"optim={optim}", f"memory.measure_steps={STEPS}", steps=STEPS)
    at_step = trainer.meter.report()["phases"]["optimizer"]["breakdown"]
    assert low <= at_step["optimizer"] / (at_step["params"] / 4) <= high
    assert at_step["params"] == adamw["phases"]["optimizer"]["breakdown"]["params"]
    assert trainer.optim.changes_math
    progress = adamw_losses[0] - last(adamw_losses)
    assert progress > 0.1 * adamw_losses[0]
    if optim == "adamw_fp8":
        assert last(metrics.losses) > 10 * adamw_losses[0]
    else:
        assert abs(last(metrics.losses) - last(adamw_losses)) <= 0.25 * progress


def last(losses: list[float]) -> float:
    """The mean of the last 3 steps' losses: each step's batch is another."""
    return sum(losses[-3:]) / 3


def test_adamw_8bit_keeps_about_two_bytes_of_state_per_parameter():
    report = step_memory(*MLP, "optim=adamw_8bit", steps=2)
    at_step = report["phases"]["optimizer"]["breakdown"]
    parameters = at_step["params"] / 4
    assert 1.9 <= at_step["optimizer"] / parameters <= 2.2


def test_muon_steps_the_blocks_weights_with_one_buffer_and_adamw_the_rest(caplog):
    """The split is read once from the model, the MLP's 4 blocks (Linear and ReLU), and logged:
    Muon keeps one momentum buffer for each of their weights, AdamW two moments (and a step
    count) for everything else, and the meter's optimizer bytes are exactly those tensors'.
    Another optimizer (changes_math): its loss comes down, more slowly over the first steps
    than AdamW's (here by 0.18 in 6 steps, AdamW's by 0.42: its updates are scaled to 0.2 of
    lr in RMS, where AdamW's first ones are about lr on every weight)."""
    with caplog.at_level("INFO", logger="memexp"):
        trainer, metrics = train(*SMALL_MLP, "optim=muon", f"memory.measure_steps={STEPS}",
                                 steps=STEPS)
    assert "optim=muon: Muon on 4 2-D weights of Sequential x4 in blocks (65,536 parameters, " \
           "40%); AdamW on 8 others" in caplog.text
    muon, adamw = trainer.optimizer.optimizers
    weights = [block[0].weight for block in trainer.model.blocks]
    assert [p for group in muon.param_groups for p in group["params"]] == weights
    assert all(list(state) == ["momentum_buffer"] for state in muon.state.values())
    rest = [p for group in adamw.param_groups for p in group["params"]]
    at_step = trainer.meter.report()["phases"]["optimizer"]["breakdown"]
    assert at_step["optimizer"] == (4 * sum(p.numel() for p in weights)
                                    + 8 * sum(p.numel() for p in rest) + 4 * len(rest))
    assert trainer.optim.changes_math
    _, adamw_losses = adamw_steps()
    assert adamw_losses[0] - last(metrics.losses) >= 0.25 * (adamw_losses[0] - last(adamw_losses))


def test_bf16_state_takes_adamws_first_step_exactly():
    """Its moments are used in fp32 before they are rounded: the first update is torch's
    AdamW's, bit for bit; rounded stochastically from then on, the second is not."""
    regular, _ = train(*MLP, "optim=adamw", "memory.track=false", steps=1)
    bf16, _ = train(*MLP, "optim=adamw_bf16", "memory.track=false", steps=1)
    for p, q in zip(bf16.model.parameters(), regular.model.parameters(), strict=True):
        assert torch.equal(p, q)
    state = bf16.optimizer.state[next(bf16.model.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


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


# -- offload: the host's memory, on a GPU ---------------------------------------------------------
def test_offload_on_a_cpu_run_is_refused_not_pretended():
    """On a CPU run the host is the device: nothing would move, and a split of one memory into
    device and host would be made up."""
    few = (*MLP, "data.num_train=64", "data.num_eval=16")
    with pytest.raises(ValueError, match="a CPU run's device is the host: one memory"):
        Trainer(compose_train(*few, "optim.offload=cpu"))
    with pytest.raises(ValueError, match="optim.offload_gradients=true with optim.accumulate=2"):
        Trainer(compose_train(*few, "optim.offload=cpu", "optim.offload_gradients=true",
                              "optim.accumulate=2"))


# 2 Llama blocks of width 64: q, o and the MLP's weights have 4096 values or more (stepped on the
# host), k and v (32 x 64) fewer (kept on the device, with the norms).
TINY_LLAMA = ("model=hf", "model.arch=llama", "model.task=causal_lm",
              "+model.config.num_hidden_layers=2", "+model.config.hidden_size=64",
              "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=2",
              "+model.config.intermediate_size=128", "+model.config.vocab_size=256",
              "data.seq_len=32", "data.batch_size=2")


@needs_cuda_build
@pytest.mark.cudabuild
def test_the_gpu_only_options_on_the_fake_h100():
    """optim.offload=cpu with offload_gradients, checkpointing=full_offload and precision=float8,
    in one trace on the CUDA build's fake H100 (each is refused on CPU, or moves nothing there):
    the device keeps the optimizer state and the gradients of the parameters under 4096 values
    only; the host holds an fp32 copy, a gradient and AdamW's two moments of every other (16
    bytes a value) and the blocks' inputs; a step copies exactly those gradients and the blocks'
    inputs to the host, and those parameters and inputs back; the blocks' linears cast to
    float8 (e4m3 forward, e5m2 for gradients)."""
    cfg = compose_config([*TINY_LLAMA, "optim=adamw", "optim.offload=cpu",
                          "optim.offload_gradients=true", "checkpointing=full_offload",
                          "precision=float8"])
    result = estimate(cfg, "cuda", "h100")
    with torch.device("meta"):
        sizes = [p.numel() for p in build_model(cfg.model).parameters()]
    host, device = sum(n for n in sizes if n >= 4096), sum(n for n in sizes if n < 4096)
    inputs = 2 * 2 * 32 * 64 * 4  # two blocks' fp32 hidden states
    memory = result.memory
    assert memory["transfer_bytes_per_step"] == {"to_host": 4 * host + inputs,
                                                 "to_device": 4 * host + inputs}
    assert memory["offloaded_peak_bytes"] >= 16 * host + inputs
    at_step = memory["phases"]["optimizer"]["breakdown"]
    rounding = 512 * len(sizes)  # the caching allocator's blocks
    assert 8 * device <= at_step["optimizer"] <= 8 * device + rounding
    assert 4 * device <= at_step["grads"] <= 4 * device + rounding
    assert "float8_e4m3fn" in result.ops["forward"]["aten._to_copy"]
    assert "float8_e5m2" in result.ops["backward"]["aten._to_copy"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_steps_as_adamw_on_the_device_and_frees_its_state():
    """On a GPU: the host's fused AdamW gives the device AdamW's parameters (to fp32 rounding),
    and the device's allocated peak drops by at least the state (8 bytes a parameter)."""
    on_device, _ = train(*MLP, "trainer.device=cuda", "optim=adamw", steps=3)
    on_host, _ = train(*MLP, "trainer.device=cuda", "optim=adamw", "optim.offload=cpu",
                       "optim.fused=true", steps=3)
    for p, q in zip(on_host.model.parameters(), on_device.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    state = 8 * sum(p.numel() for p in on_device.model.parameters())
    assert (on_device.meter.report()["peak_bytes"] - on_host.meter.report()["peak_bytes"]
            >= 0.9 * state)


def test_muon_is_refused_with_zero1_whose_optimizer_gets_parameter_groups():
    """ZeroRedundancyOptimizer builds each rank's optimizer from parameter groups, and Muon
    picks its weights by tensor: it found none of them in the groups, and the rank stepped
    everything with AdamW, silently (seen: zero1's estimate with Muon held more optimizer
    state than ddp's). train.py and the plan refuse the combination, naming what to use."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from memexp.estimate_parallel import fake_rank
    from memexp.plan import refusal
    from memexp.techniques.optim import Muon

    model = build_model(compose_config(list(SMALL_MLP)).model)
    muon = Muon()
    muon.apply(model)
    with fake_rank(0, 1):  # what ZeRO would build from Muon, were it let
        zero = ZeroRedundancyOptimizer(list(model.parameters()),
                                       optimizer_class=lambda shard, **_: muon.make(shard))
    assert type(zero.optim) is torch.optim.AdamW
    why = refusal(compose_config([*SMALL_MLP, "optim=muon", "parallel=zero1",
                                  "trainer.nproc=2"]), "cpu", 2)
    assert why.startswith("optim=muon with parallel=zero1: ZeroRedundancyOptimizer builds one "
                          "optimizer over each rank's share")
    assert why.endswith("Use parallel=ddp with it, or another optimizer with zero1.")
    assert refusal(compose_config([*SMALL_MLP, "optim=muon", "parallel=ddp",
                                   "trainer.nproc=2"]), "cpu", 2) is None
    # and FSDP's refusal of Muon names ddp alone
    assert refusal(compose_config([*SMALL_MLP, "optim=muon", "parallel=fsdp",
                                   "trainer.nproc=2"]), "cpu", 2).endswith(
        "Use parallel=ddp with it, or optim=adamw, adam or sgd with fsdp.")
