"""adapter=lora|qlora (memexp.techniques.adapter): peft's LoRA on a Llama from config, against
full fine-tuning and against peft's own count; the frozen weights counted apart."""

from __future__ import annotations

import copy

import pytest
import torch

from memexp.build import build
from memexp.estimate import estimate
from memexp.loggers import NoLogger
from memexp.memory.tracker import tensor_storages
from memexp.plan import group_choices, search_space
from memexp.techniques import check_combination
from memexp.techniques.adapter import NF4_BLOCK, resolve_targets
from memexp.techniques.parallel import FSDP
from memexp.trainer import Trainer

from conftest import HF_GPT2, compose_train

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


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_the_estimate_agrees_with_the_measured_cpu_peak(adapter):
    cfg = compose_train("trainer.max_steps=2", *LLAMA, f"adapter={adapter}")
    predicted = estimate(cfg).memory
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    real = trainer.meter.report()
    assert predicted["peak_bytes"] == pytest.approx(real["peak_bytes"], rel=0.03)
    assert predicted["breakdown_at_peak"]["frozen"] == real["breakdown_at_peak"]["frozen"]


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
