"""loss=chunked_ce: the output head applied by the loss, a chunk of tokens at a time. The same
loss and gradients as cross-entropy on the whole logits (padding, tied weights, accumulation),
and a fraction of its memory. (Its estimate: tests/test_estimate.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_estimate import LLAMA

from memexp.data.tensors import IGNORE
from memexp.distributed import destroy_process_group
from memexp.linear_cross_entropy import linear_cross_entropy
from memexp.loss import ChunkedCrossEntropy, Kernel, kernel_on
from memexp.plan import loss_options
from memexp.trainer import Trainer

from conftest import CPU_SMALL, HF_BERT, HF_GPT2, compose_train, relative_error, step_memory

TRANSFORMER = ("model=transformer", "model.n_layers=2", "model.d_model=32", "data.vocab_size=64",
               "data.seq_len=16", "data.batch_size=4")
# Dropout off: the runs compared must draw nothing differently.
GPT2 = (*HF_GPT2, "+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0",
        "+model.config.attn_pdrop=0")


def first_step(*overrides: str) -> tuple[Trainer, float, list[torch.Tensor]]:
    """The first step's loss and every parameter's gradient (by parameter order)."""
    trainer = Trainer(compose_train("memory.track=false", "optim=sgd", *overrides))
    params = list(trainer.model.parameters())
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
# the data pads each sequence (labels -100), as data=hf_tokens does by default.
@pytest.mark.parametrize("model, reference, chunk", [
    (GPT2, "cross_entropy", 7), (GPT2, "model", 7), (LLAMA, "model", 50),
    (TRANSFORMER, "cross_entropy", 7)], ids=["gpt2 vs cross_entropy", "gpt2 vs its own loss",
                                             "llama vs its own loss", "transformer"])
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


def test_fsdp_is_refused_naming_why():
    """fsdp's parameters are DTensor shards outside forward, where chunked_ce applies the head:
    2 ranks on gloo failed with "aten.mm.default got mixed torch.Tensor and DTensor"."""
    try:
        with pytest.raises(ValueError, match="loss=chunked_ce applies the model's output head "
                                             "itself.*parallel=fsdp holds"):
            Trainer(compose_train(*TRANSFORMER, "loss=chunked_ce", "parallel=fsdp"))
    finally:  # the one-rank group fsdp joined as it was built: later tests start without one
        destroy_process_group()


@pytest.mark.parametrize("model, loss, tried", [
    (GPT2, "model", ["model", "chunked_ce"]), (TRANSFORMER, "cross_entropy",
                                               ["cross_entropy", "chunked_ce"]),
    (("model=mlp",), "cross_entropy", ["cross_entropy"]), (HF_BERT, "model", ["model"]),
    (TRANSFORMER, "mse", ["mse"])], ids=["gpt2", "transformer", "mlp", "bert", "mse"])
def test_plan_tries_chunked_ce_where_it_computes_the_same_loss(model, loss, tried):
    assert loss_options([*CPU_SMALL, *model, f"loss={loss}"], loss) == tried
