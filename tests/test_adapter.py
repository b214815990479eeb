"""adapter=lora|qlora (memexp.techniques.adapter): peft's LoRA on a Llama from config, against
full fine-tuning and against peft's own count; the frozen weights counted apart."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memexp.build import build
from memexp.estimate import estimate
from memexp.loggers import NoLogger
from memexp.memory.tracker import tensor_storages
from memexp.plan import group_choices, plan, search_space
from memexp.techniques import check_combination
from memexp.techniques.adapter import NF4_BLOCK, resolve_targets
from memexp.techniques.parallel import FSDP
from memexp.trainer import Trainer

from conftest import HF_GPT2, compose_train, needs_cuda_build, step_memory

peft = pytest.importorskip("peft")

LLAMA = ("model=hf", "model.arch=llama", "model.task=causal_lm", "+model.config.hidden_size=64",
         "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=4",
         "+model.config.intermediate_size=128", "+model.config.vocab_size=256",
         "data.seq_len=32", "data.batch_size=4", "data.num_train=32", "data.num_eval=8",
         "data.padding=0")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def built(*overrides: str) -> Trainer:
    return Trainer(compose_train("trainer.max_steps=2", *LLAMA, *overrides))


def nbytes(tensors) -> int:
    storages = {id(s): s for t in tensors for s in tensor_storages(t)}
    return sum(s.nbytes() for s in storages.values())


def logits(trainer: Trainer) -> torch.Tensor:
    batch = trainer.to_device(trainer.data.first_batch())
    with torch.no_grad():
        return trainer.forward(batch).logits


def test_lora_starts_as_the_model_trains_only_its_adapters_and_counts_them_apart():
    base, lora = built(), built("adapter=lora", "optim=adamw")
    # auto took every attention and MLP projection of both blocks, nothing else
    assert sorted(lora.adapter.changed) == sorted(
        f"model.layers.{i}.{part}.{name}" for i in range(2)
        for part, names in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:]))
        for name in names)
    # B starts at zero: the same function as the base model, to the bit
    assert torch.equal(logits(lora), logits(base))
    # as many trainable parameters as peft's own wrapper counts
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS)
    theirs, _ = peft.get_peft_model(copy.deepcopy(base.model), config).get_nb_trainable_parameters()
    trained = [p for p in lora.model.parameters() if p.requires_grad]
    frozen = [p for p in lora.model.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in trained) == theirs
    before = [p.detach().clone() for p in frozen]
    metrics = lora.fit(NoLogger())
    assert all(torch.equal(a, b) for a, b in zip(before, frozen, strict=True))
    assert metrics.losses[1] != metrics.losses[0]  # the adapters did train
    # gradients and AdamW's two moments for the adapters only; the frozen weights apart
    memory = lora.meter.report()
    step = memory["phases"]["optimizer"]["breakdown"]
    assert step["frozen"] == nbytes(frozen)
    assert step["params"] == nbytes([*trained, *lora.model.buffers()])
    assert memory["grads_peak_bytes"] == nbytes(trained)
    assert step["optimizer"] == 2 * nbytes(trained) + 4 * len(trained)  # moments + step counts


def test_qlora_stores_the_projections_in_nf4_within_its_rounding():
    base, qlora = built(), built("adapter=qlora")
    from torchao.quantization import NF4Tensor

    for name in qlora.adapter.changed:
        weight = qlora.model.get_submodule(name).base_layer.weight
        assert isinstance(weight, NF4Tensor) and not weight.requires_grad
        original = base.model.get_submodule(name).weight.detach()
        # NF4's levels are at most 0.3038 of a block's absmax apart (between -1 and -0.6962):
        # rounding moves a weight by half that at most, plus the 8-bit rounding of the absmax
        error = (weight.get_original_weight() - original).reshape(-1, NF4_BLOCK).abs()
        absmax = original.reshape(-1, NF4_BLOCK).abs().amax(dim=1, keepdim=True)
        assert (error <= 0.16 * absmax).all()
    # the frozen bytes are the 4-bit projections and the rest at fp32 (embeddings, norms, head)
    frozen = [p for p in qlora.model.parameters() if not p.requires_grad]
    quantized = sum(p.numel() for p in frozen if isinstance(p, NF4Tensor))
    # 4 bits a weight and an 8-bit absmax a block of 64: 0.516 bytes; the absmaxes' own scales
    # and NF4's table of 16 levels add more in layers this small
    stored = nbytes(p for p in frozen if isinstance(p, NF4Tensor))
    assert 0.516 * quantized < stored < 0.6 * quantized
    qlora.fit(NoLogger())
    step = qlora.meter.report()["phases"]["optimizer"]["breakdown"]
    assert step["frozen"] == nbytes(frozen)


@pytest.mark.parametrize("shape", [(128, 128), (256, 512)], ids=["one scale block", "eight"])
def test_a_traced_qlora_gives_each_weight_of_a_shape_the_layout_quantising_it_gives(shape):
    """Under an estimate's fake tensors each weight of one shape after the first gets the
    first's layout (memexp.techniques.adapter._like): every inner tensor as quantising that
    weight itself makes it (shape, strides, offset, dtype, its storage's size: a single scale
    block's factor is a strided view of a larger storage), on storage of its own."""
    from torchao.quantization import to_nf4

    from memexp.estimate import _FakeMode
    from memexp.techniques.adapter import quantize_torchao

    def layout(tensor) -> list[tuple]:
        inner = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]
        return [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())
                for t in inner]

    layouts = {}
    with _FakeMode():
        linears = [torch.nn.Linear(shape[1], shape[0], bias=False) for _ in range(3)]
        quantized = [quantize_torchao(f"layer{n}", linear, layouts).weight
                     for n, linear in enumerate(linears)]
        scalers = min(256, shape[0] * shape[1] // NF4_BLOCK)
        own = to_nf4(torch.empty(shape), NF4_BLOCK, scalers)
    assert len(layouts) == 1
    assert all(layout(weight) == layout(own) for weight in quantized)
    storages = [storage for weight in quantized for storage in tensor_storages(weight)]
    assert len({storage._cdata for storage in storages}) == len(storages) == 3 * 5


@pytest.mark.parametrize("adapter, precision", [("lora", "bf16_pure"), ("qlora", "bf16")])
def test_the_adapters_compose_with_checkpointing_precision_and_accumulation(adapter, precision):
    """Checkpointing recomputes the same losses; accumulation over half-batches gives the whole
    batch's (no padding: each micro-batch weighs its tokens alike); bf16 (pure, or autocast)
    trains the same losses to bf16's rounding."""
    plain = built(f"adapter={adapter}").fit(NoLogger()).losses
    full = built(f"adapter={adapter}", "checkpointing=full").fit(NoLogger()).losses
    assert full == pytest.approx(plain, rel=1e-6)
    halves = built(f"adapter={adapter}", "optim.accumulate=2", "data.batch_size=2")
    assert halves.fit(NoLogger()).losses == pytest.approx(plain, rel=1e-5)
    losses = built(f"adapter={adapter}", f"precision={precision}").fit(NoLogger()).losses
    assert losses == pytest.approx(plain, rel=0.02)


# The 8B Llama's LoRA question of issue 39, on a small Llama: bf16 autocast, whose frozen
# weights are stored in bf16 (precision.frozen=compute), chunked_ce and full checkpointing.
EIGHT_B = ("precision=bf16", "loss=chunked_ce", "checkpointing=full")


@pytest.mark.parametrize("adapter, options", [
    ("lora", ("precision=fp32",)), ("qlora", ("precision=fp32",)), ("lora", EIGHT_B),
    ("qlora", EIGHT_B), ("qlora", ("precision=bf16_pure",))],
    ids=["lora-fp32", "qlora-fp32", "lora-bf16", "qlora-bf16", "qlora-bf16_pure"])
def test_the_estimate_is_the_measured_cpu_run_to_the_byte(adapter, options):
    """Every phase's peak and categories. QLoRA under bf16_pure was estimated unquantized:
    `model.to(bfloat16)` swapped each fake NF4Tensor for a dense bf16 weight (here 230,016 B
    frozen, LoRA's figure, where the run counted 114,488). The frozen weights are 4-bit codes
    with their scales (QLoRA's projections) and the rest in the precision's compute dtype: fp32,
    or bf16 under bf16 autocast as under bf16_pure; the adapters train in fp32 under autocast."""
    cfg = compose_train("trainer.max_steps=2", *LLAMA, f"adapter={adapter}", *options)
    predicted = estimate(cfg).memory
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    real = trainer.meter.report()
    assert predicted["phases"] == real["phases"]
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    quantized = [p for p in frozen if is_traceable_wrapper_subclass(p)]
    assert {p.dtype for p in frozen if not is_traceable_wrapper_subclass(p)} == {
        trainer.precision.compute_dtype}
    pure = "precision=bf16_pure" in options
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {
        torch.bfloat16 if pure else torch.float32}
    assert predicted["breakdown_at_peak"]["frozen"] == nbytes(frozen)
    if adapter == "qlora":
        assert 0.516 < nbytes(quantized) / sum(p.numel() for p in quantized) < 0.6


def test_the_plan_is_the_run_to_the_byte_with_frozen_weights_in_bf16():
    """The 8B question's LoRA plan, on a decoder of 2 blocks (traced whole; from copies with
    fewer blocks as from a whole trace: tests/test_plan.py): the run measures its figures,
    every phase to the byte; its frozen weights (LayerNorms, the embeddings and the head
    included) 2 bytes each."""
    overrides = ["model=transformer", "model.n_layers=2", "model.d_model=32", "model.n_heads=2",
                 "data.seq_len=16", "data.batch_size=2", "data.num_train=8", "data.num_eval=4",
                 "trainer.max_steps=2", "adapter=lora", *EIGHT_B, "optim=adamw",
                 "optim.accumulate=1"]
    [planned] = plan(overrides, "1GiB")
    trainer = Trainer(compose_train(*overrides))
    trainer.fit(NoLogger())
    assert planned.estimate.memory["phases"] == trainer.meter.report()["phases"]
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert planned.estimate.memory["breakdown_at_peak"]["frozen"] == 2 * sum(
        p.numel() for p in frozen)


def test_a_frozen_tied_weight_is_stored_once_in_bf16():
    """GPT-2's output head is its word embedding: under precision=bf16 it is stored in bf16 and
    stays tied, in the run and in the estimate, which would count an untied copy twice; the
    LayerNorms take their bf16 weights beside the bf16 inputs the embeddings now give them."""
    cfg = compose_train("trainer.max_steps=2", *HF_GPT2, "adapter=lora", "precision=bf16",
                        "loss=chunked_ce")
    trainer = Trainer(cfg)
    model = trainer.model
    embedding = model.transformer.wte.weight
    assert len([p for _, p in model.named_parameters(remove_duplicate=False)
                if p is embedding]) == 2  # the embedding and the head's weight
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    predicted = estimate(cfg).memory
    trainer.fit(NoLogger())
    assert predicted["phases"] == trainer.meter.report()["phases"]


def test_bf16_pure_leaves_the_nf4_weights_as_they_are():
    """`model.to(bfloat16)` dequantised each NF4Tensor and set the dense copy as its `.data`:
    the 4-bit tensors stayed, beside 2 bytes a weight that nothing read and the meter, which
    counts a tensor subclass by its inner tensors, never saw."""
    fp32, pure = built("adapter=qlora"), built("adapter=qlora", "precision=bf16_pure")
    for name in pure.adapter.changed:
        weight = pure.model.get_submodule(name).base_layer.weight
        before = fp32.model.get_submodule(name).base_layer.weight
        assert torch.equal(weight.quantized_data, before.quantized_data)
        with pytest.raises(RuntimeError, match="invalid python storage"):  # no data of its own
            torch.Tensor.untyped_storage(weight).data_ptr()
    # the other weights are cast, the adapters too
    assert {p.dtype for p in pure.model.parameters()
            if not is_traceable_wrapper_subclass(p)} == {torch.bfloat16}
    assert pure.fit(NoLogger()).losses == pytest.approx(fp32.fit(NoLogger()).losses, rel=0.02)


def blocks_of(nbytes: int) -> int:
    """`nbytes` in the CUDA caching allocator's blocks (multiples of 512 bytes)."""
    return -(-nbytes // 512) * 512


@needs_cuda_build
def test_a_cuda_estimate_holds_qlora_s_weights_as_bitsandbytes_does():
    """A CUDA run picks bitsandbytes' Linear4bit where it is installed (the CUDA build's venv
    has it): its Params4bit cannot hold a fake tensor, and the trace stopped there. Traced now
    on bitsandbytes' own quantize_4bit, each 4-bit weight counted frozen with the scales it
    keeps beside it (its QuantState), each tensor in the allocator's blocks; under bf16 the
    other frozen weights in bf16, and the adapters in fp32, which peft had made in the 4-bit
    layer's compute dtype."""
    cfg = compose_train("trainer.max_steps=2", *LLAMA, "adapter=qlora", "precision=bf16")
    result = estimate(cfg, target="cuda", gpu_key="a10g")
    assert (result.trace, result.quantized_by) == ("cuda", "bitsandbytes")
    # its codes are a parameter of bytes, two weights in each: counted as weights
    model = Trainer(cfg).model
    assert result.parameters == sum(p.numel() for p in model.parameters())
    assert result.memory["breakdown_at_peak"]["params"] == sum(  # and the buffers
        blocks_of(4 * p.numel()) for p in model.parameters() if p.requires_grad) + sum(
        blocks_of(b.nbytes) for b in model.buffers())

    def nf4(weights: int) -> int:  # codes, 8-bit absmax per 64, NF4's table, the absmaxes'
        # offset, their fp32 absmax per 256 and the 256 values of their 8-bit code
        return sum(map(blocks_of, (weights // 2, weights // 64, 16 * 4, 4,
                                   4 * -(-weights // (64 * 256)), 256 * 4)))
    block = 4 * nf4(64 * 64) + 3 * nf4(64 * 128)
    unquantized = 2 * blocks_of(256 * 64 * 2) + 5 * blocks_of(64 * 2)  # bf16 embeddings, head
    assert result.memory["breakdown_at_peak"]["frozen"] == 2 * block + unquantized  # and norms


def test_chunked_ce_s_loss_holds_no_copy_of_the_head():
    """Under autocast, loss=chunked_ce casts a head kept in fp32 (precision.frozen=fp32) to bf16
    once for all its chunks. That copy is the head's, filed as autocast's cast of it is in the
    model's own forward (activations), not in "loss": on an 8B Llama at seq 2048 (bf16, QLoRA
    or LoRA) it was 1.0 GiB of the forward's 1.20 GiB "loss", beside 0.2 GiB of one chunk's
    logits. A frozen head stored in bf16 (precision.frozen=compute) needs no copy."""
    def forward(frozen: str) -> dict:
        return step_memory(*LLAMA, "adapter=lora", "precision=bf16", "loss=chunked_ce",
                           "loss.chunk_tokens=8", "model.config.vocab_size=4096",
                           f"precision.frozen={frozen}")["phases"]["forward"]["breakdown"]

    fp32 = forward("fp32")
    copy = 4096 * 64 * 2  # the head (vocabulary x hidden) in bf16: 512 KiB
    # one chunk's logits in bf16 and fp32 (8 x 4096 x 6 B) and the hidden states' gradient
    # (4 x 32 x 64 fp32): 224 KiB, and a few small tensors
    assert 224 * 1024 <= fp32["loss"] < 240 * 1024 < copy
    assert fp32["activations"] > copy
    # the copy gone, and the rest of the activations in bf16 (154 KiB less here)
    assert fp32["activations"] - forward("compute")["activations"] > copy


def test_the_estimate_reads_adapters_drawn_at_random_as_weights():
    """peft draws the adapters' initial values under the trace; Adafactor reads their norm
    (`param.norm().item()`). That is a weight's value, not a branch on chance: estimated (`memexp
    plan experiment=gpt_1b` stopped at optim=adafactor adapter=lora), and as measured."""
    cfg = compose_train("trainer.max_steps=2", *LLAMA, "adapter=lora", "optim=adafactor")
    predicted = estimate(cfg).memory
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    assert predicted["peak_bytes"] == pytest.approx(trainer.meter.report()["peak_bytes"],
                                                    rel=0.03)


def test_target_modules_are_refused_where_they_name_nothing():
    with pytest.raises(ValueError, match=r"'qproj' names no Linear layer of LlamaForCausalLM\. "
                       r"Valid names: down_proj, gate_proj, k_proj, lm_head, o_proj"):
        built("adapter=lora", "adapter.target_modules=[qproj]")
    # auto finds no attention in the MLP's blocks: refused, naming its layers, never a run
    # without adapters
    with pytest.raises(ValueError, match=r"adapter.target_modules=\[auto\] found no attention or "
                       r"MLP projections in MLP: its blocks \(Sequential x4 in blocks\) .* "
                       r"from: 0, 1, head"):
        Trainer(compose_train("model=mlp", "adapter=lora"))
    # GPT-2's Conv1D projections are found too (and turned into Linear layers for NF4)
    model = Trainer(compose_train(*HF_GPT2)).model
    assert sorted({n.rpartition(".")[2] for n in resolve_targets(model, ["auto"])}) == [
        "c_attn", "c_fc", "c_proj"]


def test_plan_tries_the_adapters_where_auto_finds_layers_to_adapt():
    llama = compose_train(*LLAMA)
    assert search_space(llama, group_choices(list(LLAMA)), {}).space["adapter"] == [
        "none", "lora", "qlora"]
    mlp = search_space(compose_train("model=mlp"), group_choices(["model=mlp"]), {})
    assert mlp.space["adapter"] == ["none"]
    assert mlp.left_out["adapter"] == {
        name: "adapter.target_modules=[auto] finds no layers to adapt in the model"
        for name in ("lora", "qlora")}


def test_qlora_is_refused_with_fsdp_before_anything_is_built():
    """Seen on this Llama with 2 ranks: FSDP2 cannot shard torchao's NF4 weights whose scales
    do not divide among the ranks. (LoRA with fsdp, and QLoRA with ddp, train.)"""
    cfg = compose_train(*LLAMA, "adapter=qlora")
    with pytest.raises(ValueError, match=r"adapter=qlora with parallel=fsdp: .* Use "
                                         r"parallel=ddp or zero1"):
        check_combination(build(cfg.precision), build(cfg.optim), FSDP, build(cfg.bn_mode),
                          build(cfg.checkpointing), build(cfg.compile), build(cfg.adapter),
                          torch.device("cpu"))
