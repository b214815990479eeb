"""Any model, any data, any loss: HF transformers and plain user modules through every
block-level technique with no adapter, the block resolver, the output contract, loss=model, and
the checks that refuse what cannot run."""

from __future__ import annotations

import functools
import itertools
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_estimate import LLAMA

from memexp.app import run_config
from memexp.build import build, build_model
from memexp.estimate import estimate
from memexp.loggers import NoLogger
from memexp.models.blocks import resolve_blocks
from memexp.result import summary
from memexp.trainer import Trainer

from conftest import HF_BERT as BERT
from conftest import (
    HF_DATA,
    REPO,
    Background,
    Ran,
    compose_train,
    early,
    first_step_gradients,
    relative_error,
    step_memory,
    train,
)
from conftest import HF_GPT2 as GPT2

# A plain module with no `blocks`: its layers in an nn.ModuleList that forward loops over.
USER = ("model=custom", "model._target_=user_models.LayerStack", "data=tokens",
        "data.batch_size=4", "data.num_train=32", "data.num_eval=8", "data.seq_len=16")
MODELS = {"gpt2": GPT2, "bert": BERT, "user": USER}
STEPS = 2


@functools.cache
def baseline_losses(model: str) -> tuple[float, ...]:
    return tuple(train(*MODELS[model], steps=STEPS)[1].losses)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", ["checkpointing=full", "checkpointing=selective",
                                     "checkpointing=offload", "checkpointing=selective_ops"])
def test_checkpointing_gives_the_losses_of_none_with_no_adapter(model, variant):
    losses = train(*MODELS[model], variant, steps=STEPS)[1].losses
    assert losses == pytest.approx(baseline_losses(model), rel=1e-6)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", [("precision=bf16",), ("optim.accumulate=4",
                                                           "data.batch_size=1")])
def test_precision_and_accumulation_run(model, variant):
    metrics = train(*MODELS[model], *variant, steps=STEPS)[1]
    assert len(metrics.losses) == STEPS and all(torch.isfinite(torch.tensor(metrics.losses)))


# Larger than the tiny configs above, so that activations dominate the peak.
GPT2_WIDER = ("model=hf", "model.arch=gpt2", "+model.config.n_layer=4", "+model.config.n_embd=64",
              "+model.config.n_head=4", "+model.config.vocab_size=64", "data.batch_size=8",
              "data.seq_len=64", "data.num_train=32", "data.num_eval=8")
BERT_WIDER = ("model=hf", "model.arch=bert", "model.task=sequence_classification",
              "+model.config.num_hidden_layers=4", "+model.config.hidden_size=64",
              "+model.config.num_attention_heads=4", "+model.config.intermediate_size=256",
              "+model.config.vocab_size=64", "data.batch_size=8", "data.seq_len=64",
              "data.num_train=32", "data.num_eval=8")


@pytest.mark.parametrize("model", [GPT2_WIDER, BERT_WIDER], ids=["gpt2", "bert"])
def test_full_checkpointing_measures_as_the_librarys_own(model):
    ours = step_memory(*model, "checkpointing=full")
    theirs = step_memory(*model, "model.gradient_checkpointing=true")
    none = step_memory(*model)
    assert ours["peak_bytes"] == pytest.approx(theirs["peak_bytes"], rel=0.01)
    assert ours["saved_activations_bytes"] == pytest.approx(theirs["saved_activations_bytes"],
                                                            rel=0.01)
    assert ours["saved_activations_bytes"] < 0.5 * none["saved_activations_bytes"]


def test_auto_finds_the_blocks_of_hf_and_memexp_models():
    found = {name: resolve_blocks(build_model(compose_train(*overrides).model), ["auto"],
                                  "checkpointing.blocks").summary()
             for name, overrides in {"gpt2": GPT2, "bert": BERT, "user": USER,
                                     "resnet": ("model=resnet",),
                                     "transformer": ("model=transformer",)}.items()}
    assert found == {"gpt2": {"class": "GPT2Block", "count": 2},
                     "bert": {"class": "BertLayer", "count": 2},
                     "user": {"class": "Layer", "count": 3},
                     "resnet": {"class": "BasicBlock", "count": 8},
                     "transformer": {"class": "Block", "count": 4}}


def test_the_summary_and_result_json_name_the_blocks(tmp_path):
    overrides = [*GPT2, "checkpointing=full", "parallel=fsdp", "trainer.max_steps=1",
                 "logger=none"]
    result = run_config(compose_train(*overrides), tmp_path, {"checkpointing": "full"},
                        overrides, "test")
    assert result["status"] == "ok"
    blocks = {"class": "GPT2Block", "count": 2}
    assert result["techniques"]["blocks"] == {"checkpointing": blocks, "parallel": blocks}
    assert "blocks       GPT2Block x2 (checkpointing)" in summary(result, tmp_path)


@pytest.mark.parametrize("model", [GPT2, BERT], ids=["gpt2", "bert"])
def test_the_models_own_loss_equals_cross_entropy_on_its_logits(model):
    own = train(*model, "loss=model", steps=STEPS)[1]
    ours = train(*model, "loss=cross_entropy", steps=STEPS)[1]
    assert own.losses == pytest.approx(ours.losses, rel=1e-6)
    assert own.eval_accuracy == ours.eval_accuracy is not None


def test_a_copy_of_the_blocks_that_forward_never_calls_fails_the_run():
    with pytest.raises(RuntimeError) as raised:
        train("model=custom", "model._target_=user_models.CopiedBlocks", *USER[2:],
              "checkpointing=full", "checkpointing.blocks=[blocks.*]")
    message = str(raised.value)
    assert "checkpointing: none of the 3 modules it changed ran" in message
    assert "blocks.0, blocks.1, blocks.2" in message


def test_sequential_is_refused_where_forward_loops_over_the_blocks():
    with pytest.raises(ValueError, match=r"sequential cuts one nn.Sequential.*GPT2Block x2 in "
                                         r"transformer.h.*ModuleList"):
        Trainer(compose_train(*GPT2, "checkpointing=sequential"))


def test_a_sequence_longer_than_the_position_table_is_refused_by_run_and_estimate():
    cfg = compose_train(*GPT2, "model.config.n_positions=16", "trainer.max_steps=1")
    says = r"transformer.wpe \(nn.Embedding with 16 rows\) is looked up at index 31.*position"
    with pytest.raises(ValueError, match=says):
        Trainer(cfg).fit(NoLogger())
    with pytest.raises(ValueError, match=says):
        estimate(cfg)


def test_token_ids_past_the_vocabulary_are_refused_naming_the_batch_key():
    cfg = compose_train(*GPT2, "data.vocab_size=100", "trainer.max_steps=1")
    says = r"transformer.wte \(nn.Embedding with 64 rows\).*the batch's 'input_ids'"
    with pytest.raises(ValueError, match=says):
        estimate(cfg)
    with pytest.raises(ValueError, match=says):
        Trainer(cfg).fit(NoLogger())


def test_batch_keys_must_fit_the_forward_signature():
    cfg = compose_train("model=custom", "model._target_=user_models.LayerStack", "data=hf_tokens")
    with pytest.raises(ValueError, match=r"takes no \['input_ids', 'attention_mask'\]"):
        Trainer(cfg)
    with pytest.raises(ValueError, match=r"takes no \['input_ids', 'attention_mask'\]"):
        estimate(cfg)


def test_the_loader_gives_the_same_losses_with_worker_processes():
    data = ("data=dataset", "data.train._target_=user_models.Tokens", "data.batch_size=4",
            "model=custom", "model._target_=user_models.LayerStack", "optim=adamw")
    alone = train(*data, steps=3)[1].losses
    workers = train(*data, "data.num_workers=2", steps=3)[1].losses
    assert workers == alone


def test_a_loss_of_ones_own_and_mse():
    half = train(*USER, "loss=custom", "loss._target_=user_models.half_cross_entropy")[1]
    full = train(*USER)[1]
    assert half.losses[0] == pytest.approx(full.losses[0] / 2, rel=1e-6)
    assert half.eval_accuracy is None  # a callable of one's own reports no accuracy


@pytest.mark.parametrize(("overrides", "says"), [
    (("checkpointing=full", "checkpointing.blocks=[NoSuchClass]"),
     r"'NoSuchClass' names no module class.*Classes that repeat: .*GPT2Block x2"),
    (("checkpointing=full", "checkpointing.blocks=[decoder.layers.*]"),
     r"'decoder.layers.\*' names no module.*Module names .*: transformer, .*lm_head"),
    (("model.arch=nope",), r"model.arch=nope: not a transformers architecture.* bert, .*gpt2"),
    (("model.task=translation",), r"task=translation: choose one of causal_lm"),
], ids=["class", "glob", "arch", "task"])
def test_bad_input_names_the_key_and_the_choices(overrides, says):
    with pytest.raises(ValueError, match=says):
        Trainer(compose_train(*GPT2, *overrides))


def test_hf_local_reads_a_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"input_ids": [[i % 64] * 32 for i in range(16)], "labels": [[i % 64] * 32
                                                                           for i in range(16)]}
    split = datasets.Dataset.from_dict(rows)
    datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "tokens"))
    metrics = train(*GPT2[:8], "data=hf_local", f"data.path={tmp_path / 'tokens'}",
                    "data.columns=[input_ids,labels]", "data.batch_size=4", steps=2)[1]
    assert len(metrics.losses) == 2 and metrics.eval_accuracy is not None
    with pytest.raises(ValueError, match=r"data.columns: \['attention_mask'\] not in"):
        train(*GPT2[:8], "data=hf_local", f"data.path={tmp_path / 'tokens'}")
    # parquet files by split: the same batches
    for name in ("train", "test"):
        split.to_parquet(str(tmp_path / f"{name}.parquet"))
    files = (f"+data.data_files={{train: {tmp_path / 'train.parquet'}, "
             f"test: {tmp_path / 'test.parquet'}}}")
    from_files = compose_train(*GPT2[:8], "data=hf_local", "data.path=null", files,
                               "data.columns=[input_ids,labels]", "data.batch_size=4")
    batch = build(from_files.data).first_batch()
    assert torch.equal(batch["input_ids"], build(compose_train(
        *GPT2[:8], "data=hf_local", f"data.path={tmp_path / 'tokens'}",
        "data.columns=[input_ids,labels]", "data.batch_size=4").data).first_batch()["input_ids"])


def test_pretrained_loads_a_local_folder_and_says_what_is_missing(tmp_path):
    model = build_model(compose_train(*GPT2).model)
    model.save_pretrained(tmp_path / "gpt2")
    loaded = build_model(compose_train(*GPT2, f"model.pretrained={tmp_path / 'gpt2'}").model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    with pytest.raises(FileNotFoundError, match=r"model.pretrained=.*no config.json there"):
        build_model(compose_train(*GPT2, f"model.pretrained={tmp_path / 'none'}").model)


@pytest.fixture(scope="module")
def gpt2_folders(tmp_path_factory) -> dict:
    """save_pretrained folders of the tiny GPT-2: whole, and with all but 4 of its tensors
    deleted from model.safetensors."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("pretrained")
    for name in ("whole", "partial"):
        build_model(compose_train(*GPT2).model).save_pretrained(root / name)
    weights = root / "partial" / "model.safetensors"
    tensors = load_file(weights)
    save_file({key: tensors[key] for key in sorted(tensors)[:4]}, weights,
              metadata={"format": "pt"})
    return {"whole": root / "whole", "partial": root / "partial", "total": len(tensors)}


def test_pretrained_weights_that_do_not_fill_the_model_are_refused(gpt2_folders):
    partial = f"model.pretrained={gpt2_folders['partial']}"
    missing = gpt2_folders["total"] - 4 + 1  # and lm_head, tied to the missing embedding
    with pytest.raises(ValueError, match=rf"{partial}: {missing} tensors missing from the folder "
                       r"\(left at random\): lm_head.weight, .* and \d+ more\..*"
                       r"model.pretrained_strict=false"):
        build_model(compose_train(*GPT2, partial).model)
    # a head the task adds to a checkpoint without it: missing too, and said so
    with pytest.raises(ValueError, match=r": 1 tensor missing .*: score.weight\. A head that "
                       r"model.task=sequence_classification adds"):
        build_model(compose_train(*GPT2, f"model.pretrained={gpt2_folders['whole']}",
                                  "model.task=sequence_classification").model)
    # another vocabulary: the embedding is of another shape (transformers' own error would
    # only point at its log)
    with pytest.raises(ValueError, match=r": 1 tensor of another shape in the folder \(left at "
                       r"random\): transformer.wte.weight: folder \(64, 32\), model \(80, 32\)\. "
                       r"To train"):
        build_model(compose_train(*GPT2, f"model.pretrained={gpt2_folders['whole']}",
                                  "model.config.vocab_size=80").model)


def test_weights_allowed_to_miss_are_in_result_json_and_the_summary(gpt2_folders, tmp_path):
    overrides = [*GPT2, f"model.pretrained={gpt2_folders['partial']}",
                 "model.pretrained_strict=false", "trainer.max_steps=1", "logger=none"]
    result = run_config(compose_train(*overrides), tmp_path, {}, overrides, "test")
    assert result["status"] == "ok"
    load = json.loads((tmp_path / "result.json").read_text())["model_load"]
    assert load["pretrained"] == str(gpt2_folders["partial"])
    assert len(load["missing_keys"]) == gpt2_folders["total"] - 4 + 1
    assert load["unexpected_keys"] == load["mismatched_keys"] == []
    assert (f"weights      {gpt2_folders['partial']}: {len(load['missing_keys'])} tensors "
            "missing from the folder (left at random): lm_head.weight") in summary(result, tmp_path)
    # a whole folder: recorded as such
    overrides = [*GPT2, f"model.pretrained={gpt2_folders['whole']}", "trainer.max_steps=1",
                 "logger=none"]
    result = run_config(compose_train(*overrides), tmp_path / "whole", {}, overrides, "test")
    assert result["model_load"]["missing_keys"] == []
    assert "every tensor of the model loaded" in summary(result, tmp_path / "whole")


def test_a_config_key_the_architecture_does_not_know_is_refused(gpt2_folders):
    says = (r"model.config.num_layers: GPT2Config has no key num_layers .* Did you mean "
            r"n_layer, num_labels, num_hidden_layers\? .* \+model.config_extra.num_layers=")
    with pytest.raises(ValueError, match=says):
        build_model(compose_train(*GPT2, "+model.config.num_layers=1").model)
    with pytest.raises(ValueError, match=says):  # over a folder's config as well
        build_model(compose_train(*GPT2, f"model.pretrained={gpt2_folders['whole']}",
                                  "+model.config.num_layers=1").model)
    # forced: set as given
    forced = build_model(compose_train(*GPT2, "+model.config_extra.num_layers=1").model)
    assert forced.config.num_layers == 1 and forced.config.n_layer == 2


@pytest.mark.parametrize(("arch", "task", "keys", "reads"), [
    # an alias of its attribute_map, and what its token head reads with hasattr
    ("gpt2", "token_classification", {"num_hidden_layers": 1, "classifier_dropout": 0.2},
     {"n_layer": 1, "classifier_dropout": 0.2}),
    ("bert", "sequence_classification",
     {"problem_type": "regression", "num_labels": 1, "pad_token_id": 1},
     {"problem_type": "regression", "num_labels": 1, "pad_token_id": 1}),
    # rope_theta: converted into rope_parameters, as a folder's config.json would have it
    ("llama", "causal_lm", {"rope_theta": 500000.0, "num_key_value_heads": 2},
     {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
      "num_key_value_heads": 2}),
    # keys the class lacks and its modeling code reads with getattr (DeBERTa-v3's config.json)
    ("deberta-v2", "sequence_classification",
     {"position_buckets": 256, "share_att_key": True, "norm_rel_ebd": "layer_norm"},
     {"position_buckets": 256, "share_att_key": True, "norm_rel_ebd": "layer_norm"}),
    ("t5", "base", {"num_layers": 1, "attn_implementation": "eager"},
     {"num_layers": 1, "_attn_implementation": "eager"}),
    ("vit", "image_classification", {"image_size": 32, "num_labels": 10},
     {"image_size": 32, "num_labels": 10}),
], ids=["gpt2", "bert", "llama", "deberta-v2", "t5", "vit"])
def test_config_keys_of_real_architectures_are_taken(arch, task, keys, reads):
    overrides = [f"model.arch={arch}", f"model.task={task}",
                 *(f"+model.config.{k}={json.dumps(v)}" for k, v in keys.items())]
    with torch.device("meta"):  # the full-size model's structure only
        config = build_model(compose_train("model=hf", *overrides).model).config
    assert {key: getattr(config, key) for key in reads} == reads


def readme_commands(model: str) -> list[list[str]]:
    """The overrides of each `python train.py model=<model> ...` line in the README's "Your own
    model" section, as a shell would split them."""
    section = (REPO / "README.md").read_text().split("\n## Your own model")[1].split("\n## ")[0]
    return [shlex.split(line, comments=True)[2:] for line in section.splitlines()
            if line.startswith(f"python train.py model={model} ")]


@pytest.mark.parametrize("model", ["hf", "timm"])
def test_the_readmes_model_commands_compose_as_written(model):
    commands = readme_commands(model)
    assert len(commands) == 3
    for overrides in commands:
        compose_train(*overrides)


def test_the_readmes_timm_commands_run(tmp_path, monkeypatch):
    import timm
    from safetensors.torch import save_file

    # The README's weights file, under a home of the test's own.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "weights").mkdir()
    weights = timm.create_model("resnet50", num_classes=10).state_dict()
    save_file(weights, str(tmp_path / "weights" / "resnet50.safetensors"))
    for overrides in readme_commands("timm"):
        built = Trainer(compose_train(*overrides, "trainer.max_steps=1", "data.batch_size=2",
                                      "data.image_size=32", "data.num_train=4",
                                      "data.num_eval=2"))
        if "checkpointing=full" in overrides:
            assert built.checkpointing.found.summary()["count"] > 1
        if any(o.startswith("model.pretrained=") for o in overrides):
            assert torch.equal(built.model.state_dict()["conv1.weight"], weights["conv1.weight"])
        assert len(built.fit(NoLogger()).losses) == 1


def test_hf_config_keys_stay_as_documented():
    """model=hf's keys, as other tools (the CUDA estimate shim) spell them."""
    cfg = compose_train("model=hf", "model.arch=gpt2", "model.task=causal_lm",
                        "+model.config.n_layer=4")
    assert OmegaConf.to_container(cfg.model.config) == {"use_cache": False, "n_layer": 4}
    assert cfg.data.task == "causal_lm" and cfg.loss.shift is True


# Two imports in a new process (nothing imported before them), in one: a Hugging Face model
# built with logging set up as a run's is, then beside timm and its torchvision.
FRESH_PROCESS = f"""
import logging, sys
logging.basicConfig(level=logging.INFO)
from memexp.estimate import compose_config
from memexp.build import build_model
build_model(compose_config({list(GPT2)!r}).model)
print("-- built --", file=sys.stderr, flush=True)
from transformers import LlamaConfig
model = build_model(compose_config({list(LLAMA)!r}).model)
assert isinstance(model.config, LlamaConfig)
import timm, torchvision
timm.create_model('convnext_atto', num_classes=10)
"""


@early()
def fresh_process(folder: Path) -> Ran:
    return Ran(folder, Background([sys.executable, "-c", FRESH_PROCESS], folder, dict(os.environ),
                                  timeout=300))


def test_a_hugging_face_model_builds_without_torchaos_import_noise(fresh_process):
    # transformers' modeling code imports torchao where it is installed (the lowbit extra is):
    # with logging set up as a run's is, its import warnings (CUDA libraries a CPU torch cannot
    # load, no Triton, torch's Enum deprecation) are not the user's to act on.
    _, done = fresh_process
    assert "-- built --" in done.stderr, done.stderr
    built = done.stderr.split("-- built --")[0]
    assert "torchao" not in built and "register_constant" not in built, built


def test_model_hf_builds_beside_timm_and_its_torchvision(fresh_process):
    # The timm extra brings PyPI's torchvision, whose compiled ops do not load beside the CPU
    # torch; transformers imports torchvision wherever it is installed, so this import failed
    # (`operator torchvision::nms does not exist`).
    _, done = fresh_process
    assert done.returncode == 0, done.stderr


# Encoder-decoders (model.task=seq2seq_lm), at unequal depths, and causal_lm refused where
# transformers' class for it is an encoder-decoder's decoder alone.
T5 = ("model=hf", "model.arch=t5", "model.task=seq2seq_lm", "+model.config.d_model=32",
      "+model.config.d_ff=64", "+model.config.num_layers=2", "+model.config.num_decoder_layers=1",
      "+model.config.num_heads=2", "+model.config.d_kv=16", "+model.config.vocab_size=64",
      *HF_DATA)
BART_3_2 = ("model=hf", "model.arch=bart", "model.task=seq2seq_lm",
            "+model.config.encoder_layers=3", "+model.config.decoder_layers=2",
            "+model.config.d_model=32", "+model.config.encoder_attention_heads=2",
            "+model.config.decoder_attention_heads=2", "+model.config.encoder_ffn_dim=64",
            "+model.config.decoder_ffn_dim=64", "+model.config.vocab_size=64",
            "+model.config.max_position_embeddings=64", *HF_DATA)
# Pegasus and Marian: BART's keys, at 2+1 layers; Marian's pad and decoder start id (58100, its
# class's vocabulary's last) brought within the small vocabulary
BART_LIKE = (*(f"+model.config.{key}={value}" for key, value in {
    "encoder_layers": 2, "decoder_layers": 1, "d_model": 32, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "vocab_size": 64, "max_position_embeddings": 64}.items()), *HF_DATA)
PEGASUS = ("model=hf", "model.arch=pegasus", "model.task=seq2seq_lm", *BART_LIKE)
MARIAN = ("model=hf", "model.arch=marian", "model.task=seq2seq_lm", *BART_LIKE,
          "+model.config.pad_token_id=63", "+model.config.decoder_start_token_id=63")
ENCODER_DECODERS = {"t5": T5, "bart": BART_3_2, "pegasus": PEGASUS, "marian": MARIAN}


@pytest.mark.parametrize(("model", "eos", "pad"), [("t5", 1, 0), ("bart", 2, 1)])
def test_seq2seq_lm_sequences_end_in_the_models_eos_and_pad_with_its_pad_id(model, eos, pad):
    batch = build(compose_train(*ENCODER_DECODERS[model]).data).first_batch()
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    ends = mask.sum(1) - 1
    assert (ids[torch.arange(len(ids)), ends] == eos).all() and (ids[mask == 0] == pad).all()
    assert (mask == 0).any()  # padded, as data.padding=0.25 asks
    assert torch.equal(labels, ids.masked_fill(mask == 0, -100))
    # a config with no end-of-sequence id: named, with the key to set
    with pytest.raises(ValueError, match=r"data.task=seq2seq_lm: the synthetic batches hold "
                                         r"the model's eos_token_id \(ending each sequence\), "
                                         r".* not one id: set \+model.config.eos_token_id"):
        build(compose_train(*ENCODER_DECODERS[model], "+model.config.eos_token_id=null").data)


@functools.cache
def seq2seq_run(model: str, checkpointing: str) -> tuple[tuple[float, ...], dict, int]:
    """Two steps of the encoder-decoder `model`: its losses, the blocks found, its peak."""
    trainer, metrics = train(*ENCODER_DECODERS[model], f"checkpointing={checkpointing}", steps=2)
    return tuple(metrics.losses), trainer.blocks, trainer.meter.report()["peak_bytes"]


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("model", ENCODER_DECODERS)
def test_seq2seq_lm_checkpoints_encoder_and_decoder_with_equal_losses_and_is_estimated(
        model, checkpointing):
    losses, blocks, peak = seq2seq_run(model, checkpointing)
    predicted = estimate(compose_train("trainer.max_steps=2", *ENCODER_DECODERS[model],
                                       f"checkpointing={checkpointing}")).memory
    assert predicted["peak_bytes"] == pytest.approx(peak, rel=0.03)
    if checkpointing == "full":  # both sides' blocks, at their unequal depths
        assert blocks == {"checkpointing": {
            "t5": {"class": "T5Block", "count": 3},
            "bart": {"class": "BartEncoderLayer, BartDecoderLayer", "count": 5},
            "pegasus": {"class": "PegasusEncoderLayer, PegasusDecoderLayer", "count": 3},
            "marian": {"class": "MarianEncoderLayer, MarianDecoderLayer", "count": 3}}[model]}
        assert losses == seq2seq_run(model, "none")[0] and len(losses) == 2


def test_ids_that_a_smaller_vocabulary_leaves_behind_are_refused_naming_them():
    """MarianConfig's pad and decoder start id are 58100: with vocab_size=64 the build failed on
    torch's `Padding_idx must be within num_embeddings`, and with the pad id alone set, the
    decoder's first lookup was blamed on a position table."""
    marian = MARIAN[:-2]
    with pytest.raises(ValueError, match=r"model.config.vocab_size=64: MarianConfig's "
                                         r"pad_token_id=58100, decoder_start_token_id=58100 are "
                                         r"past its vocabulary of 64 \(ids 0 to 63\)"):
        build_model(compose_train(*marian).model)
    with pytest.raises(ValueError, match=r"decoder_start_token_id=58100 is past .* set "
                                         r"\+model.config.decoder_start_token_id=\.\.\. within"):
        build(compose_train(*marian, "+model.config.pad_token_id=63").data)


def test_auto_takes_the_decoders_blocks_beside_a_deeper_encoders():
    def auto(*overrides: str) -> dict:
        with torch.device("meta"):
            model = build_model(compose_train(*overrides).model)
        return resolve_blocks(model, ["auto"], "checkpointing.blocks").summary()

    # masked_lm: BartForConditionalGeneration, as seq2seq_lm
    assert auto(*BART_3_2, "model.task=masked_lm") == {
        "class": "BartEncoderLayer, BartDecoderLayer", "count": 5}
    # stages side by side are not an encoder and a decoder: RegNet's squeeze-excitation layers,
    # in each stage beside its conv layers, stay out
    assert auto("model=hf", "model.arch=regnet", "model.task=image_classification") == {
        "class": "RegNetConvLayer", "count": 66}


def test_t5s_decoder_start_id_is_its_pad_id_unless_set():
    def config(*overrides: str):
        with torch.device("meta"):
            return build_model(compose_train(*T5, *overrides).model).config

    assert config().decoder_start_token_id == 0  # T5's class has none
    assert config("+model.config.decoder_start_token_id=3").decoder_start_token_id == 3


@pytest.mark.parametrize(("arch", "says"), [
    ("whisper", r"model.task=causal_lm: transformers' causal_lm class for model.arch=whisper, "
                r"WhisperForCausalLM, is the decoder of the encoder-decoder "
                r"WhisperForConditionalGeneration alone: a text-only decoder, with no encoder.* "
                r"The whole model: model.task=speech_seq2seq\. Its tasks: speech_seq2seq, base$"),
    ("bart", r"BartForCausalLM, is the decoder of the encoder-decoder "
             r"BartForConditionalGeneration alone: .* The whole model: model.task=masked_lm or "
             r"seq2seq_lm\. Its tasks: masked_lm, seq2seq_lm, sequence_classification, base$"),
])
def test_causal_lm_is_refused_where_it_is_an_encoder_decoders_decoder_alone(arch, says):
    with pytest.raises(ValueError, match=says):
        build_model(compose_train("model=hf", f"model.arch={arch}").model)


def test_a_task_the_architecture_lacks_is_refused_naming_those_it_has():
    with pytest.raises(ValueError, match=r"model.task=masked_lm: transformers has no masked_lm "
                                         r"head for model.arch=t5; its tasks: seq2seq_lm, "
                                         r"sequence_classification, token_classification, base"):
        build_model(compose_train(*T5, "model.task=masked_lm").model)


# -- audio: Whisper (speech_seq2seq) and wav2vec2 (ctc), from small configs --------------------
# Whisper's token ids (vocab 64) run past its decoder's position table (32 rows), which its
# positional embedding only slices by the labels' length: the lookup check must not take the
# one for the other.
WHISPER = ("model=hf", "model.arch=whisper", "model.task=speech_seq2seq",
           *(f"+model.config.{key}={value}" for key, value in {
               "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
               "encoder_attention_heads": 2, "decoder_attention_heads": 2,
               "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 64,
               "num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 32,
               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
               "decoder_start_token_id": 3}.items()), *HF_DATA)
# SpecAugment (mask_time_prob 0.05) draws its masks from numpy; LayerDrop is off, since the
# estimate refuses a branch on a random draw (test_layerdrop_is_refused_by_the_estimate).
WAV2VEC2 = ("model=hf", "model.arch=wav2vec2", "model.task=ctc",
            *(f"+model.config.{key}={value}" for key, value in {
                "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                "intermediate_size": 64, "conv_dim": "[16,16]", "conv_kernel": "[5,3]",
                "conv_stride": "[4,2]", "num_conv_pos_embeddings": 16,
                "num_conv_pos_embedding_groups": 4, "vocab_size": 32, "layerdrop": 0}.items()),
            *HF_DATA)
AUDIO = {"whisper": WHISPER, "wav2vec2": WAV2VEC2}


@pytest.mark.parametrize("model", AUDIO)
def test_audio_models_train_and_checkpoint_their_layers_at_the_losses_of_none(model):
    none = train(*AUDIO[model], steps=STEPS)[1].losses
    trainer, full = train(*AUDIO[model], "checkpointing=full", steps=STEPS)
    assert full.losses == none  # bitwise: wav2vec2's SpecAugment masks are seeded too
    assert trainer.blocks["checkpointing"] == {
        "whisper": {"class": "WhisperEncoderLayer, WhisperDecoderLayer", "count": 4},
        "wav2vec2": {"class": "Wav2Vec2EncoderLayer", "count": 2}}[model]


@pytest.mark.parametrize(("model", "checkpointing"), [("whisper", "full"), ("wav2vec2", "none")])
def test_the_estimate_of_audio_models_is_their_measured_peak(model, checkpointing):
    cfg = compose_train("trainer.max_steps=2", *AUDIO[model], f"checkpointing={checkpointing}")
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    real = trainer.meter.report()["peak_bytes"]
    # exact for Whisper: its decoder's positions, made with torch.arange, are real under the
    # trace, so it skips the causal mask as the run does; CTC's loss runs on stand-ins
    assert estimate(cfg).memory["peak_bytes"] == pytest.approx(real, rel=0 if model == "whisper"
                                                               else 1e-4)


# HuBERT and WavLM as published (wav2vec2's layout): a convolutional feature encoder of 7 layers
# (a convolution, its norm and activation each: 6 of one class), then the transformer layers.
def speech_model(arch: str, layers: int) -> tuple[str, ...]:
    return ("model=hf", f"model.arch={arch}", "model.task=ctc", *(
        f"+model.config.{key}={value}" for key, value in {
            "hidden_size": 32, "num_hidden_layers": layers, "num_attention_heads": 2,
            "intermediate_size": 64, "conv_dim": "[16,16,16,16,16,16,16]",
            "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
            "vocab_size": 32, "layerdrop": 0}.items()), *HF_DATA)


@pytest.mark.parametrize("arch", ["hubert", "wavlm", "wav2vec2"])
def test_auto_finds_the_encoder_layers_of_speech_models_at_any_depth(arch):
    """With 6 or fewer encoder layers, auto took the feature encoder's 6 conv layers (the larger
    group): checkpointing=full wrapped them, and selective_ops measured as none. Layers of
    single ops outside every group of nested layers are not the blocks."""
    names = {"hubert": "HubertEncoderLayer", "wavlm": "WavLMEncoderLayer",
             "wav2vec2": "Wav2Vec2EncoderLayer"}
    for layers in (2, 4, 6):
        with torch.device("meta"):
            model = build_model(compose_train(*speech_model(arch, layers)).model)
        found = resolve_blocks(model, ["auto"], "checkpointing.blocks")
        assert found.summary() == {"class": names[arch], "count": layers}
        assert found.names == [f"{arch}.encoder.layers.{i}" for i in range(layers)]


# wav2vec2's dropouts and SpecAugment off: a micro-batch draws other masks than the batch.
WAV2VEC2_EXACT = (*WAV2VEC2, *(f"+model.config.{key}=0" for key in (
    "hidden_dropout", "activation_dropout", "attention_dropout", "feat_proj_dropout",
    "final_dropout", "mask_time_prob")))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_accumulation_of_a_ctc_loss_is_the_batch_for_either_reduction(reduction):
    """CTC's sum (wav2vec2's default) is the micro-batches' sum; its mean is over the samples,
    each sample's loss over its own label count. Weighed by their labels as a mean over them,
    the gradients were 0.50 (sum) and 0.018 (mean) off the batch's (1.8e-07, 1.5e-07 now)."""
    model = (*WAV2VEC2_EXACT, f"+model.config.ctc_loss_reduction={reduction}")
    _, large = first_step_gradients(*model, "data.batch_size=4")
    trainer, accumulated = first_step_gradients(*model, "data.batch_size=2", "optim.accumulate=2")
    micros = list(itertools.islice(trainer.data.train_batches(), 2))
    assert len({int((batch["labels"] != -100).sum()) for batch in micros}) > 1  # they differ
    # all gradients together: the attention's key biases have none to speak of (about 1e-11)
    assert relative_error(torch.cat([g.flatten() for g in accumulated]),
                          torch.cat([g.flatten() for g in large])) <= 1e-5


def test_a_ctc_loss_that_is_not_one_number_is_refused():
    with pytest.raises(ValueError, match=r"model.config.ctc_loss_reduction=none: choose mean "
                                         r".* or sum"):
        build_model(compose_train(*WAV2VEC2, "+model.config.ctc_loss_reduction=none").model)


def test_layerdrop_is_refused_by_the_estimate():
    """wav2vec2's default LayerDrop (0.1) skips a layer where `torch.rand([]) < layerdrop`: read
    as true, every layer would be skipped and the estimate would fall 62% short of a run.
    Refused, naming the cause and the key that estimates the run where every layer runs."""
    cfg = compose_train("trainer.max_steps=1", *WAV2VEC2[:-len(HF_DATA)],
                        "model.config.layerdrop=0.1", *HF_DATA)
    with pytest.raises(ValueError, match=r"Wav2Vec2Encoder.forward .*: the model branches on a "
                                         r"value drawn at random.*\+model.config.layerdrop=0"):
        estimate(cfg)


def test_synthetic_audio_follows_the_models_config():
    whisper = build(compose_train(*WHISPER).data).first_batch()
    assert whisper["input_features"].shape == (4, 16, 64)  # mel bins x 2 max_source_positions
    labels = whisper["labels"]
    lengths = (labels != -100).sum(1)
    assert labels.shape == (4, 32) and (labels[range(4), lengths - 1] == 2).all()  # eos
    wav2vec2 = build(compose_train(*WAV2VEC2).data).first_batch()
    # 32 frames: 4 * (2 * 31 + 3 - 1) + 5 samples back through the conv layers
    assert wav2vec2["input_values"].shape == (4, 261)
    counted = wav2vec2["labels"][wav2vec2["labels"] != -100]
    assert wav2vec2["labels"].shape == (4, 10) and counted.min() > 2 and counted.max() < 32
    assert labels.dtype == wav2vec2["labels"].dtype == torch.int64  # token ids, not floats
    with pytest.raises(ValueError, match=r"data.seq_len=40: WhisperConfig takes transcripts of "
                                         r"at most max_target_positions=32"):
        build(compose_train(*WHISPER, "data.seq_len=40").data)


def test_hf_local_audio_features(tmp_path):
    """The columns a dataset of real features needs: Whisper's input_features and labels,
    wav2vec2's input_values and labels (-100 where padded)."""
    datasets = pytest.importorskip("datasets")
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(4, 32, (8, 10), generator=generator)
    labels[:, 8:] = -100
    rows = {"whisper": {"input_features": torch.randn(8, 16, 64, generator=generator).tolist(),
                        "labels": torch.cat([labels[:, :8], torch.full((8, 1), 2)], 1).tolist()},
            "wav2vec2": {"input_values": torch.randn(8, 261, generator=generator).tolist(),
                         "labels": labels.tolist()}}
    for model, columns in rows.items():
        split = datasets.Dataset.from_dict(columns)
        datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / model))
        metrics = train(*AUDIO[model][:-len(HF_DATA)], "data=hf_local",
                        f"data.path={tmp_path / model}", f"data.columns=[{','.join(columns)}]",
                        "data.batch_size=4", steps=2)[1]
        assert len(metrics.losses) == 2 and all(torch.isfinite(torch.tensor(metrics.losses)))


# BART's learned positions take the token ids for their shape and look up arange + 2: the
# lookup check sees those positions, not the ids (a vocabulary larger than the table is fine).
BART = ("model=hf", "model.arch=bart", "model.task=masked_lm",
        *(f"+model.config.{key}={value}" for key, value in {
            "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
            "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "vocab_size": 128, "max_position_embeddings": 40}.items()),
        *HF_DATA)


def test_an_embedding_is_checked_on_the_indices_it_looks_up():
    assert len(train(*BART)[1].losses) == 1
    cfg = compose_train(*BART, "data.seq_len=48", "trainer.max_steps=1")
    says = (r"model.encoder.embed_positions \(nn.Embedding with 42 rows\) is looked up at "
            r"index 49.*computed by the model from the batch")
    with pytest.raises(ValueError, match=says):
        Trainer(cfg).fit(NoLogger())
    with pytest.raises(ValueError, match=says):
        estimate(cfg)
