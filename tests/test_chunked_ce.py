"""loss=chunked_ce: the output head applied by the loss, a chunk of tokens at a time. The same
loss and gradients as cross-entropy on the whole logits (padding, tied weights, accumulation, a
step the model takes after its head, an adapter on the head), and a fraction of its memory.
(Its estimate: tests/test_estimate.py; every causal LM of transformers:
tests/test_chunked_ce_models.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_estimate import LLAMA, measured

from memexp import cli
from memexp.data.tensors import IGNORE
from memexp.distributed import destroy_process_group
from memexp.estimate import estimate
from memexp.linear_cross_entropy import linear_cross_entropy
from memexp.loss import ChunkedCrossEntropy, Kernel, kernel_on
from memexp.plan import loss_options
from memexp.techniques.parallel import FSDP
from memexp.trainer import Trainer

from conftest import (
    CPU_SMALL,
    HF_BERT,
    HF_DATA,
    HF_GPT2,
    compose_train,
    relative_error,
    step_memory,
)

TRANSFORMER = ("model=transformer", "model.n_layers=2", "model.d_model=32", "data.vocab_size=64",
               "data.seq_len=16", "data.batch_size=4")
# Dropout off: the runs compared must draw nothing differently.
GPT2 = (*HF_GPT2, "+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0",
        "+model.config.attn_pdrop=0")
# Gemma 2 soft-caps its logits after its head, tanh(x / cap) * cap: at its default cap of 30
# random logits barely reach it, at 2 every one does (tests/test_chunked_ce_models.py: Cohere's
# scale and Granite's divisor, on every architecture that has one).
GEMMA2 = ("model=hf", "model.arch=gemma2", "model.task=causal_lm", "+model.config.hidden_size=32",
          "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=2",
          "+model.config.num_key_value_heads=1", "+model.config.head_dim=16",
          "+model.config.intermediate_size=64", "+model.config.vocab_size=128",
          "+model.config.final_logit_softcapping=2.0", *HF_DATA)
# Inkling slices its logits to the first unpadded_vocab_size classes after its head: a step no
# chunk of rows can take (the classes are the chunk's columns).
INKLING = ("model=hf", "model.arch=inkling_text", "model.task=causal_lm",
           "+model.config.vocab_size=128", "+model.config.hidden_size=64",
           "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=4",
           "+model.config.num_key_value_heads=4", "+model.config.head_dim=16",
           "+model.config.intermediate_size=128", "+model.config.moe_intermediate_size=32",
           "+model.config.n_routed_experts=4", "+model.config.num_experts_per_tok=2",
           "+model.config.unpadded_vocab_size=100", "data.vocab_size=100", "data.seq_len=16",
           "data.batch_size=2", "data.num_train=4", "data.num_eval=2")


def first_step(*overrides: str) -> tuple[Trainer, float, list[torch.Tensor]]:
    """The first step's loss and every trained parameter's gradient (by parameter order)."""
    trainer = Trainer(compose_train("memory.track=false", "optim=sgd", *overrides))
    params = [param for param in trainer.model.parameters() if param.requires_grad]
    grads: dict[int, torch.Tensor] = {}
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(
            lambda p, index=index: grads.__setitem__(index, p.grad.detach().clone()))
    trainer.model.train()
    loss = trainer.train_step(trainer.data.train_batches())
    return trainer, loss, [grads[index] for index in range(len(params))]


def test_the_function_equals_cross_entropy_with_ignored_targets_and_a_bias():
    """fp32, a last chunk shorter than the others, a third of the targets -100."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    bias = torch.randn(300, requires_grad=True)
    targets = torch.randint(0, 300, (2, 37))
    targets[torch.rand(2, 37) < 0.33] = IGNORE
    chunked = linear_cross_entropy(hidden, weight, bias, targets, 10)
    expected = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, 1), targets.flatten())
    assert chunked.item() == pytest.approx(expected.item(), rel=1e-6)
    ours = torch.autograd.grad(chunked * 0.5, (hidden, weight, bias))
    theirs = torch.autograd.grad(expected * 0.5, (hidden, weight, bias))
    for mine, reference in zip(ours, theirs, strict=True):
        assert relative_error(mine, reference) < 1e-5


# GPT-2's head is tied to its embedding (the gradient reaches it from both), Llama's is its own;
# the data pads each sequence (labels -100), as data=hf_tokens does by default. Gemma 2 takes
# its soft cap after the head: chunked_ce takes it on each chunk (before: the cap went onto the
# hidden states, and step 1's loss was 4.867715 against 4.872900).
@pytest.mark.parametrize("model, reference, chunk", [
    (GPT2, "cross_entropy", 7), (GPT2, "model", 7), (LLAMA, "model", 50),
    (TRANSFORMER, "cross_entropy", 7), (GEMMA2, "model", 7)],
    ids=["gpt2 vs cross_entropy", "gpt2 vs its own loss", "llama vs its own loss", "transformer",
         "gemma2 soft cap vs its own loss"])
def test_loss_and_every_gradient_equal_the_whole_logits(model, reference, chunk):
    _, expected, expected_grads = first_step(*model, f"loss={reference}")
    trainer, loss, grads = first_step(*model, "loss=chunked_ce", f"loss.chunk_tokens={chunk}")
    assert loss == pytest.approx(expected, rel=1e-6)
    assert len(grads) == len(expected_grads)
    for grad, reference_grad in zip(grads, expected_grads, strict=True):
        assert relative_error(grad, reference_grad) < 1e-5
    if "model.arch=gpt2" in model:  # still tied, through the deferred head
        model_ = trainer.model
        assert model_.lm_head.weight is model_.transformer.wte.weight


def test_the_step_after_the_head_is_estimated_as_it_runs(caplog):
    """What Gemma 2 takes after its head, on each chunk, under the estimate's fake tensors as in
    the run, in autocast's bf16 as the model took it: the same bytes, and the step named."""
    cfg = compose_train("trainer.max_steps=2", *GEMMA2, "loss=chunked_ce",
                        "loss.chunk_tokens=16", "precision=bf16")
    with caplog.at_level("INFO", logger="memexp"):
        real = measured(cfg)
    predicted = estimate(cfg).memory
    assert (predicted["peak_bytes"], predicted["breakdown_at_peak"]) == (
        real["peak_bytes"], real["breakdown_at_peak"])
    assert ("loss=chunked_ce: after its output head, the model's forward takes "
            "torch.Tensor.div, torch.tanh, torch.Tensor.mul on the logits" in caplog.text)


def test_accumulated_micro_batches_weigh_by_their_labels():
    """Two padded micro-batches of 2 make the gradient of one batch of 4 (labels counted)."""
    _, expected, expected_grads = first_step(*GPT2, "loss=cross_entropy")
    _, loss, grads = first_step(*GPT2, "loss=chunked_ce", "optim.accumulate=2",
                                "data.batch_size=2")
    assert loss == pytest.approx(expected, rel=1e-6)
    for grad, reference_grad in zip(grads, expected_grads, strict=True):
        assert relative_error(grad, reference_grad) < 1e-5


def test_accuracy_is_the_whole_logits_argmax():
    accuracies = [Trainer(compose_train(*TRANSFORMER, f"loss={loss}")).evaluate()
                  for loss in ("cross_entropy", "chunked_ce")]
    assert accuracies[0] is not None and accuracies[1] == accuracies[0]


def test_the_loss_s_memory_falls_eightfold():
    """The loss category: the logits' log-softmax and gradients against one chunk's logits and
    the head's weight gradient (at a 4096-token vocabulary, 256 tokens)."""
    wide = (*GPT2, "model.config.vocab_size=4096", "data.seq_len=64")
    whole = step_memory(*wide, "loss=cross_entropy")
    chunked = step_memory(*wide, "loss=chunked_ce", "loss.chunk_tokens=16")
    loss, chunked_loss = (r["breakdown_at_peak"]["loss"] for r in (whole, chunked))
    assert chunked_loss * 8 <= loss
    assert chunked["peak_bytes"] < 0.5 * whole["peak_bytes"]


@pytest.mark.parametrize("model, says", [
    (("model=mlp",), "MLP is neither a Hugging Face model"),
    (HF_BERT, "BertForSequenceClassification has none")])
def test_a_model_without_an_output_head_is_refused(model, says):
    with pytest.raises(ValueError, match=f"loss=chunked_ce .*{says}"):
        Trainer(compose_train(*model, "loss=chunked_ce"))


def test_liger_on_a_cpu_says_why_and_runs_the_torch_kernel(caplog):
    with caplog.at_level("INFO", logger="memexp"):
        trainer = Trainer(compose_train(*TRANSFORMER, "loss=chunked_ce", "loss.impl=liger",
                                        "trainer.max_steps=1", "memory.track=false"))
        trainer.model.train()
        trainer.train_step(trainer.data.train_batches())
    assert "loss.impl=liger unavailable (" in caplog.text
    assert "using loss.impl=torch" in caplog.text
    assert trainer.loss.kernel.value == "torch"
    # as train.py builds it, from a resolved config: the value, not the enum
    assert ChunkedCrossEntropy(impl="liger").impl is Kernel.liger
    assert "loss=chunked_ce: output head head (Linear 32 -> 64, bias False)" in caplog.text



# Devices as objects only: the reasons come before any package is looked for or GPU touched.
@pytest.mark.parametrize("kernel, device, dtype, says", [
    (Kernel.liger, "cpu", torch.float32, "need a CUDA device, and this run is on cpu"),
    (Kernel.cce, "cpu", torch.bfloat16, "need a CUDA device, and this run is on cpu"),
    (Kernel.cce, "cuda", torch.float32, "take bf16 or fp16, and the head's matmul is "
                                        "torch.float32: precision=amp|bf16")])
def test_a_kernel_that_cannot_run_says_why_and_the_torch_kernel_runs(kernel, device, dtype,
                                                                     says):
    used, why = kernel_on(kernel, torch.device(device), dtype)
    assert used is Kernel.torch
    assert says in why
    assert kernel_on(Kernel.torch, torch.device(device), dtype) == (Kernel.torch, None)


def test_fsdp_is_refused_naming_why_by_the_run_and_the_estimate(capsys):
    """fsdp's parameters are DTensor shards outside forward, where chunked_ce applies the head:
    2 ranks on gloo failed with "aten.mm.default got mixed torch.Tensor and DTensor". The
    estimate of 2 ranks says the same (before: a reason of DDP's, which fsdp does not use)."""
    says = ("loss=chunked_ce applies the model's output head itself, outside the model's "
            "forward, and parallel=fsdp holds the head's weight as this rank's shard there")
    try:
        with pytest.raises(ValueError, match=says):
            Trainer(compose_train(*TRANSFORMER, "loss=chunked_ce", "parallel=fsdp"))
    finally:  # the one-rank group fsdp joined as it was built: later tests start without one
        destroy_process_group()
    assert FSDP.shards_parameters
    assert cli.main(["estimate", *CPU_SMALL, *TRANSFORMER, "loss=chunked_ce", "parallel=fsdp",
                     "--world-size", "2"]) == 2
    assert f"memexp estimate: {says}" in capsys.readouterr().err


# The adapter on GPT-2's head goes where the model names it (before: `[lm_head]` was refused,
# offering `inner`, and `[inner, ...]` ran with the head's adapter never trained: step 2 4.164027
# against 4.164112, optimizer state 16,400 B against 22,552 B).
def test_an_adapter_on_the_head_trains_as_under_the_model_s_own_loss():
    lora = (*GPT2, "adapter=lora", "adapter.target_modules=[lm_head,c_attn]", "optim=adamw")
    runs = {}
    for loss, options in (("model", ()), ("chunked_ce", ("loss.chunk_tokens=7",))):
        trainer, first, grads = first_step(*lora, f"loss={loss}", *options)
        second = trainer.train_step(trainer.data.train_batches(1))
        state = sum(value.nbytes for group in trainer.optimizer.state.values()
                    for value in group.values() if isinstance(value, torch.Tensor))
        runs[loss] = (first, second, state, grads, trainer.evaluate())
    (first, second, state, grads, accuracy), expected = runs["chunked_ce"], runs["model"]
    assert (first, second) == pytest.approx(expected[:2], rel=1e-6)
    assert state == expected[2]  # the head's A and B among the trained
    assert len(grads) == len(expected[3])
    for grad, reference_grad in zip(grads, expected[3], strict=True):
        assert relative_error(grad, reference_grad) < 1e-5
    assert accuracy == expected[4]


def test_the_adapter_names_the_head_as_the_model_does():
    with pytest.raises(ValueError, match=r"'inner' names no Linear layer of GPT2LMHeadModel. "
                                         r"Valid names: c_attn, c_fc, c_proj, lm_head \(or"):
        Trainer(compose_train(*GPT2, "adapter=lora", "adapter.target_modules=[inner]",
                              "loss=chunked_ce"))


def test_a_step_after_the_head_that_no_chunk_can_take_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"loss=chunked_ce: after its output head lm_head, "
                                         r"InklingForCausalLM's forward takes "
                                         r"torch.Tensor.__getitem__ on the logits, which makes "
                                         r"a tensor of shape \(2, 16, 100\) from logits of "
                                         r"shape \(2, 16, 128\)"):
        trainer = Trainer(compose_train(*INKLING, "loss=chunked_ce", "memory.track=false"))
        trainer.train_step(trainer.data.train_batches())


@pytest.mark.parametrize("model, loss, tried", [
    (GPT2, "model", ["model", "chunked_ce"]), (TRANSFORMER, "cross_entropy",
                                               ["cross_entropy", "chunked_ce"]),
    (("model=mlp",), "cross_entropy", ["cross_entropy"]), (HF_BERT, "model", ["model"]),
    (TRANSFORMER, "mse", ["mse"]), (INKLING, "model", ["model"])],
    ids=["gpt2", "transformer", "mlp", "bert", "mse", "inkling slicing its classes"])
def test_plan_tries_chunked_ce_where_it_computes_the_same_loss(model, loss, tried):
    assert loss_options([*CPU_SMALL, *model, f"loss={loss}"], loss) == tried
