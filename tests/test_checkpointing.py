"""checkpointing: same gradients as `none`, BatchNorm updated once, and the memory it saves."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._functorch.partitioners import get_default_op_list
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from memexp.app import run_config
from memexp.build import build
from memexp.estimate import estimate
from memexp.techniques.checkpointing import TORCHTITAN_SAVE, CheckpointOps
from memexp.trainer import Trainer

from conftest import (
    HF_DATA,
    compose_train,
    first_step_gradients,
    max_relative_error,
    step_memory,
    train,
)

# Dropout on, so a recomputation that drew new random numbers would change the gradients.
TRANSFORMER = ("model=transformer", "model.n_layers=4", "model.dropout=0.1", "data.batch_size=8")
# BatchNorm in train mode, recomputed in backward.
RESNET = ("model=resnet", "model.width=8", "data.batch_size=8")
VARIANTS = [
    ["checkpointing=full"],
    ["checkpointing=selective", "checkpointing.every=2"],
    ["checkpointing=modules", "checkpointing.modules=[blocks.1,blocks.3]"],
    ["checkpointing=sequential", "checkpointing.segments=2"],
    ["checkpointing=offload"],
    ["checkpointing=selective_ops"],
    ["checkpointing=full_offload"],
]


@pytest.mark.parametrize("model", [TRANSFORMER, RESNET], ids=["transformer", "resnet"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0].split("=")[1])
def test_same_gradients_as_no_checkpointing(model, variant):
    _, baseline = first_step_gradients(*model)
    _, checkpointed = first_step_gradients(*model, *variant)
    assert max_relative_error(checkpointed, baseline) <= 1e-6


def running_statistics(trainer: Trainer) -> list[torch.Tensor]:
    return [buffer.clone() for module in trainer.model.modules() if isinstance(module, _BatchNorm)
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "offload" not in v[0]],
                         ids=lambda v: v[0].split("=")[1])
def test_batchnorm_running_statistics_are_updated_exactly_once(variant):
    baseline, _ = first_step_gradients(*RESNET)
    checkpointed, _ = first_step_gradients(*RESNET, *variant)
    for kept, expected in zip(running_statistics(checkpointed), running_statistics(baseline),
                              strict=True):
        assert torch.equal(kept, expected)
    counts = [m.num_batches_tracked.item() for m in checkpointed.model.modules()
              if isinstance(m, _BatchNorm)]
    assert counts and set(counts) == {1}


def test_unknown_module_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as raised:
        Trainer(compose_train(*RESNET, "checkpointing=modules", "checkpointing.modules=[layer9]"))
    message = str(raised.value)
    assert "checkpointing.modules" in message and "layer9" in message
    assert "blocks.0" in message and "stem" in message


def test_nested_module_names_and_an_empty_list_are_refused():
    with pytest.raises(ValueError, match="'blocks.1' is inside 'blocks'"):
        Trainer(compose_train(*RESNET, "checkpointing=modules",
                              "checkpointing.modules=[blocks,blocks.1]"))
    with pytest.raises(ValueError, match="needs the modules to checkpoint"):
        Trainer(compose_train(*RESNET, "checkpointing=modules", "checkpointing.modules=[]"))


def test_block_options_say_what_to_name_when_no_blocks_repeat():
    with pytest.raises(ValueError, match="checkpointing.blocks=.auto. found no repeated blocks"):
        Trainer(compose_train("model=custom", "model._target_=torch.nn.Flatten",
                              "checkpointing=full"))


@pytest.mark.parametrize("segments", [0, 9])
def test_sequential_segments_must_fit_the_blocks(segments):
    with pytest.raises(ValueError, match="checkpointing.segments"):
        Trainer(compose_train(*RESNET, "checkpointing=sequential",
                              f"checkpointing.segments={segments}"))


# -- effect: the meter's activation bytes --------------------------------------------------------
# Eight layers: at the backward peak, full checkpointing holds every block's input plus one
# block recomputed, so the ratio tends to 1/n_layers plus a little. At the default four layers
# it is about 0.28 (see BENCHMARKS.md).
DEEP_TRANSFORMER = ("model=transformer", "model.n_layers=8", "data.batch_size=16")


@functools.cache
def deep_memory(*variant: str) -> dict:
    return step_memory(*DEEP_TRANSFORMER, *variant)


def test_full_checkpointing_keeps_at_most_a_fifth_of_the_activations():
    none = deep_memory()["activations_peak_bytes"]
    full = deep_memory("checkpointing=full")["activations_peak_bytes"]
    selective = deep_memory("checkpointing=selective",
                            "checkpointing.every=2")["activations_peak_bytes"]
    assert full <= 0.20 * none
    assert full < selective < none


def test_selective_ops_keeps_the_matmul_outputs_between_none_and_full():
    """torchtitan's op list keeps each block's matmul and attention outputs (every second
    projection's recomputed): in this transformer 0.69 of what `none` saves, against full's
    0.08 (the blocks' inputs). Saving no op at all is full checkpointing, to the byte."""
    none, full = deep_memory(), deep_memory("checkpointing=full")
    ops = deep_memory("checkpointing=selective_ops")
    for key in ("saved_activations_bytes", "activations_peak_bytes"):
        assert full[key] < ops[key] < none[key]
    assert 0.5 <= ops["saved_activations_bytes"] / none["saved_activations_bytes"] <= 0.85
    nothing = deep_memory("checkpointing=selective_ops", "checkpointing.save=[]")
    assert nothing["saved_activations_bytes"] == full["saved_activations_bytes"]


def test_selective_ops_policy_saves_every_second_mm_and_every_listed_op():
    """Each block call counts its own mm calls (torchtitan's rule): the 1st, 3rd, ... are kept.
    Ops outside the list (GELU, softmax, a norm) are recomputed."""
    aten = torch.ops.aten
    policy = CheckpointOps().policy
    context = SelectiveCheckpointContext(is_recompute=False)
    for _ in range(2):  # a fresh count each call
        decide = policy.for_one_call("Block")
        decisions = [decide(context, op) for op in (aten.mm.default, aten.addmm.default,
                                                    aten.mm.default, aten.gelu.default,
                                                    aten.mm.default, aten.bmm.default)]
        assert decisions == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SAVE,
                             CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE,
                             CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SAVE]
    # `max.default` names one overload: max.dim (values and indices) is recomputed
    assert decide(context, aten.max.default) == CheckpointPolicy.MUST_SAVE
    assert decide(context, aten.max.dim) == CheckpointPolicy.PREFER_RECOMPUTE
    # torchtitan's list holds torch's compute-intensive ops, as its own does
    assert {str(op) for op in get_default_op_list().compute_intensive_ops} <= {
        f"aten.{name}" for name in TORCHTITAN_SAVE}


def test_selective_ops_refuses_an_unknown_op_naming_close_ones():
    with pytest.raises(ValueError) as raised:
        build(compose_train("checkpointing=selective_ops",
                            "checkpointing.save=[mmm,bmm]").checkpointing)
    message = str(raised.value)
    assert message.startswith("checkpointing.save: 'mmm' is not an aten operator")
    assert "close to it: mm," in message and "torchtitan's list: [mm,addmm,bmm," in message
    with pytest.raises(ValueError, match="checkpointing.alternate: 'mm.bogus'"):
        build(compose_train("checkpointing=selective_ops",
                            "checkpointing.alternate=[mm.bogus]").checkpointing)


# precision's autocast and accumulation's micro-batches; FSDP2 on one rank, its units the
# checkpointed blocks
@pytest.mark.parametrize("variant", [("precision=bf16", "optim.accumulate=2"), ("parallel=fsdp",)],
                         ids=["bf16 accumulate", "fsdp"])
def test_selective_ops_composes_as_full_checkpointing_does(variant):
    small = ("model=transformer", "model.n_layers=2", "model.dropout=0.1", "data.batch_size=8")
    losses = train(*small, *variant, "checkpointing=selective_ops", steps=2)[1].losses
    assert losses == pytest.approx(train(*small, *variant, steps=2)[1].losses, rel=1e-6)


def test_offload_leaves_no_saved_activation_on_the_device():
    none = step_memory(*DEEP_TRANSFORMER)
    offload = step_memory(*DEEP_TRANSFORMER, "checkpointing=offload")
    saved = none["saved_activations_bytes"]
    # What autograd keeps for backward now lives on the host: only the 4-byte loss stays.
    assert offload["saved_activations_bytes"] <= 0.01 * saved
    assert offload["offloaded_peak_bytes"] == pytest.approx(saved, rel=0.10)
    assert offload["activations_peak_bytes"] < 0.5 * none["activations_peak_bytes"]
    # The host copies are their own category, outside the device peak.
    forward = offload["phases"]["forward"]
    assert forward["breakdown"]["offloaded"] > 0
    assert forward["peak_bytes"] == sum(v for k, v in forward["breakdown"].items()
                                        if k != "offloaded")


def test_offload_moves_a_tensor_whose_storage_took_a_replaced_parameter_s_place():
    """The offload saves a parameter in place. A parameter replaced after it was applied
    (fully_shard replaces each with its shard) frees its storage, and Python hands the freed
    storage object's id to the next one made: a tensor saved for backward on that storage is
    an activation, and moves to the host. (Before: it stayed on the device, or not, by where
    Python put the object, so that FSDP's estimates with checkpointing=offload changed with
    what the process had traced before.)"""
    model = torch.nn.Linear(8, 8)
    offload = build(compose_train("checkpointing=offload").checkpointing)
    offload.apply(model)
    assert offload._pack(model.weight) is model.weight  # a parameter: saved in place
    freed = id(model.weight.untyped_storage())
    model.weight = torch.nn.Parameter(torch.zeros(8, 8))  # the old storage goes
    for _ in range(1000):  # Python reuses a freed object's memory for the next of its size
        tensor = torch.ones(8, 8)
        if id(tensor.untyped_storage()) == freed:
            break
    else:
        pytest.fail("no storage took the freed one's id: nothing to check")
    packed = offload._pack(tensor)
    assert isinstance(packed, tuple) and torch.equal(offload._unpack(packed), tensor)


def test_full_offload_moves_each_blocks_input_to_the_host_and_back():
    """Full checkpointing keeps each block's input on the device; full_offload keeps it on the
    host instead, every byte of it: the saved activations fall by exactly the blocks' inputs,
    (layers x batch x sequence x width, fp32), which the host holds, and which a step copies
    there and back. Same gradients as `none` (test_same_gradients_as_no_checkpointing)."""
    full, offloaded = deep_memory("checkpointing=full"), deep_memory("checkpointing=full_offload")
    cfg = compose_train(*DEEP_TRANSFORMER)
    inputs = (cfg.model.n_layers * cfg.data.batch_size * cfg.data.seq_len * cfg.model.d_model
              * 4)
    assert full["saved_activations_bytes"] - offloaded["saved_activations_bytes"] == inputs
    assert offloaded["offloaded_peak_bytes"] == inputs
    assert offloaded["transfer_bytes_per_step"] == {"to_host": inputs, "to_device": inputs}
    assert full["transfer_bytes_per_step"] == {"to_host": 0, "to_device": 0}


# -- user models: shared slots, torch's own encoder, containers, tied block classes --------------
TOKENS = ("data=tokens", "data.batch_size=4", "data.num_train=16", "data.num_eval=8",
          "data.seq_len=16")
LAYERS = ("model=custom", "model._target_=user_models.LayerStack", *TOKENS)
SHARED = ("model=custom", "model._target_=user_models.SharedLayer", *TOKENS)
ENCODER = ("model=custom", "model._target_=user_models.Encoder", *TOKENS)


def test_a_module_in_two_slots_is_checkpointed_at_each():
    built = Trainer(compose_train(*SHARED, "checkpointing=full"))
    assert built.checkpointing.found.summary() == {"class": "Layer", "count": 3}
    # Three calls of two modules save what three distinct blocks save, not a third call's
    # insides as well.
    shared = step_memory(*SHARED, "checkpointing=full")["saved_activations_bytes"]
    distinct = step_memory(*LAYERS, "checkpointing=full")["saved_activations_bytes"]
    assert shared == distinct
    _, baseline = first_step_gradients(*SHARED)
    _, checkpointed = first_step_gradients(*SHARED, "checkpointing=full")
    assert max_relative_error(checkpointed, baseline) <= 1e-6


def test_checkpointing_runs_and_estimates_torchs_transformer_encoder():
    # nn.TransformerEncoder's forward reads self.layers[0].self_attn through the wrapper.
    losses = train(*ENCODER, "checkpointing=full", steps=2)[1].losses
    assert losses == pytest.approx(train(*ENCODER, steps=2)[1].losses, rel=1e-6)
    assert estimate(compose_train(*ENCODER, "checkpointing=full")).memory["peak_bytes"] > 0


def test_bf16_evaluates_torchs_transformer_encoder_under_the_meter():
    trainer, metrics = train(*ENCODER, "precision=bf16")
    assert trainer.meter.report()["phases"]["eval"]["peak_bytes"] > 0  # measured, not skipped
    assert metrics.eval_accuracy is not None
    assert torch.backends.mha.get_fastpath_enabled()  # as it was before


@pytest.mark.parametrize("overrides", [
    ("checkpointing=full", "checkpointing.blocks=[*]"),
    ("checkpointing=modules", "checkpointing.modules=[layers]"),
    ("checkpointing=offload", "checkpointing.blocks=[layers]"),
], ids=["star", "modules", "offload"])
def test_a_container_with_no_forward_is_refused_naming_what_to_select(overrides):
    key = overrides[1].partition("=")[0]
    with pytest.raises(ValueError, match=rf"{key}: 'layers' is a ModuleList, a container with no "
                                         rf"forward.*{key}=\['layers\.\*'\]"):
        Trainer(compose_train(*LAYERS, *overrides))


BART = ("model=hf", "model.arch=bart", "model.task=masked_lm", "+model.config.encoder_layers=2",
        "+model.config.decoder_layers=2", "+model.config.d_model=32",
        "+model.config.encoder_attention_heads=2", "+model.config.decoder_attention_heads=2",
        "+model.config.encoder_ffn_dim=64", "+model.config.decoder_ffn_dim=64",
        "+model.config.vocab_size=64", "+model.config.max_position_embeddings=64", *HF_DATA)


def test_auto_takes_every_tied_group_of_blocks(tmp_path):
    overrides = [*BART, "checkpointing=full", "trainer.max_steps=1", "logger=none"]
    result = run_config(compose_train(*overrides), tmp_path, {"checkpointing": "full"},
                        overrides, "test")
    assert result["status"] == "ok"
    assert result["techniques"]["blocks"]["checkpointing"] == {
        "class": "BartEncoderLayer, BartDecoderLayer", "count": 4}
    both = step_memory(*BART, "checkpointing=full",
                       "checkpointing.blocks=[BartEncoderLayer,BartDecoderLayer]")
    assert result["memory"]["saved_activations_bytes"] == both["saved_activations_bytes"]
