"""model=hf: any Hugging Face transformers architecture, built from its config (random weights,
nothing downloaded), or from a local `save_pretrained` folder.

    python train.py model=hf model.arch=gpt2 model.task=causal_lm +model.config.n_layer=4

transformers is imported only when such a model is built.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
from pathlib import Path

from torch import nn

from memexp.models import LOADED, plain
from memexp.quiet import quiet_torchao_import
from memexp.reduction import REDUCTIONS, Reduction

# model.task -> (the Auto class that adds the task's head, the name of its architecture table in
# transformers.models.auto.modeling_auto)
TASKS = {
    "causal_lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "masked_lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "seq2seq_lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "sequence_classification": ("AutoModelForSequenceClassification",
                                "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token_classification": ("AutoModelForTokenClassification",
                             "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "image_classification": ("AutoModelForImageClassification",
                             "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    # audio: log-mel input_features to text (Whisper), and raw input_values to characters by
    # CTC (wav2vec2, HuBERT); data=hf_tokens shapes its features by the model's config
    "speech_seq2seq": ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "ctc": ("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES"),
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
}


# model.task=ctc: transformers' CTC heads reduce torch's ctc_loss over the batch as their
# config's ctc_loss_reduction says, which the class's default sets to a sum for wav2vec2, HuBERT
# and others, and to a mean for WavLM, SEW and others
CTC_REDUCTIONS = {"mean": Reduction.SAMPLES, "sum": Reduction.SUM}


def own_loss_reduction(task: str, built) -> Reduction:
    """How the `task` model of config `built` reduces its loss over a batch."""
    if task != "ctc":
        return Reduction.LABELS
    if built.ctc_loss_reduction not in CTC_REDUCTIONS:
        raise ValueError(
            f"model.config.ctc_loss_reduction={built.ctc_loss_reduction}: choose mean (each "
            "sample's loss over its label count, then the batch's mean, as fine-tuning sets it) "
            "or sum (over the batch's samples): a step trains on one number")
    return CTC_REDUCTIONS[built.ctc_loss_reduction]


def known_architectures() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


# transformers' tables of whole encoder-decoder models, text and speech
ENCODER_DECODER_TABLES = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                          "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES")


def decoder_alone(arch: str) -> tuple[str, str] | None:
    """(its causal_lm class, its encoder-decoder class) where `arch`'s causal_lm class is the
    decoder of an encoder-decoder alone (WhisperForCausalLM, BartForCausalLM): an encoder-decoder
    table names another class for `arch`. None where the causal_lm class is the whole model."""
    from transformers.models.auto import modeling_auto

    decoder = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(arch)
    wholes = [getattr(modeling_auto, table).get(arch) for table in ENCODER_DECODER_TABLES]
    whole = next((name for name in wholes if name not in (None, decoder)), None)
    return (decoder, whole) if decoder and whole else None


def tasks_of(arch: str) -> list[str]:
    """The tasks `arch` has a head for; not causal_lm where that is its decoder alone."""
    from transformers.models.auto import modeling_auto

    return [task for task, (_, table) in TASKS.items() if arch in getattr(modeling_auto, table)
            and not (task == "causal_lm" and decoder_alone(arch))]


def check_choice(arch: str, task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"model.task={task}: choose one of {', '.join(TASKS)}")
    known = known_architectures()
    if arch not in known:
        close = difflib.get_close_matches(arch, known, n=5)
        raise ValueError(
            f"model.arch={arch}: not a transformers architecture (transformers "
            f"{_version()})." + (f" Did you mean {', '.join(close)}?" if close else "")
            + f" The {len(known)} known architectures: {', '.join(known)}")
    parts = decoder_alone(arch) if task == "causal_lm" else None
    if parts:
        from transformers.models.auto import modeling_auto

        decoder, whole = parts
        wholes = [other for other, (_, table) in TASKS.items()
                  if getattr(modeling_auto, table).get(arch) == whole]
        raise ValueError(
            f"model.task=causal_lm: transformers' causal_lm class for model.arch={arch}, "
            f"{decoder}, is the decoder of the encoder-decoder {whole} alone: a text-only "
            "decoder, with no encoder, and the run would measure part of the model. "
            + (f"The whole model: model.task={' or '.join(wholes)}. " if wholes else "")
            + f"Its tasks: {', '.join(tasks_of(arch)) or 'none'}")
    if task not in tasks_of(arch):
        raise ValueError(f"model.task={task}: transformers has no {task} head for "
                         f"model.arch={arch}; its tasks: {', '.join(tasks_of(arch)) or 'none'}")


def _version() -> str:
    import transformers

    return transformers.__version__


def hf_model(arch: str, task: str, config: dict | None = None, config_extra: dict | None = None,
             pretrained: str | None = None, pretrained_strict: bool = True,
             gradient_checkpointing: bool = False) -> nn.Module:
    """The `task` model of architecture `arch` (a transformers model_type: gpt2, bert, llama...).

    config:      keys of that architecture's config class (n_layer, hidden_size, ...), over its
                 defaults; use_cache=false by default in training (a KV cache only holds memory
                 there, and a checkpointed block's recomputation would extend it twice). A key
                 that neither the class nor its model's code knows is refused (`config_keys`)
    config_extra: keys set on the config as given, unchecked: for a key that code of your own
                 reads from the config
    pretrained:  a local folder written by `save_pretrained` (config.json and the weights),
                 loaded with local_files_only; `config` keys still apply
    pretrained_strict: refuse weights that do not fill the model exactly (tensors missing from
                 the folder, unused or of another shape); false: train on them, and the run's
                 record says which (`model_load`)
    gradient_checkpointing: the library's own gradient checkpointing (`library_checkpointing`),
                 non-reentrant, to compare with memexp's checkpointing (use one or the other)"""
    # before anything heavy: a task the architecture lacks is refused naming those it has
    check_choice(arch, task)
    import transformers

    # transformers' modeling code imports torchao where it is installed: once, quietly, here
    with quiet_torchao_import():
        import transformers.modeling_utils  # noqa: F401

    auto = getattr(transformers, TASKS[task][0])
    built = hf_config(arch, config, config_extra, pretrained)
    refuse_unknown_keys(built, plain(config), auto)
    if built.is_encoder_decoder and getattr(built, "decoder_start_token_id", None) is None:
        # The decoder's inputs are the labels shifted right after this id. T5's config class
        # has none (its published config.json files set the pad id, which transformers' own
        # error advises): a model built from the class alone would fail on its first labels.
        built.decoder_start_token_id = built.pad_token_id
    reduction = own_loss_reduction(task, built)
    if pretrained is None:
        model = auto.from_config(built)
    else:
        folder = Path(pretrained).expanduser()
        # Shapes that differ are reported with the rest rather than raised: transformers'
        # own error points at its log.
        model, loading = auto.from_pretrained(folder, config=built, local_files_only=True,
                                              ignore_mismatched_sizes=True,
                                              output_loading_info=True)
        load = load_report(pretrained, loading)
        if pretrained_strict and load_warnings(load):
            head = (f" A head that model.task={task} adds to a checkpoint without it is "
                    "missing this way too." if load["missing_keys"] else "")
            raise ValueError(
                f"model.pretrained={pretrained}: {load_warnings(load)}.{head} To train on these "
                "weights as they are, model.pretrained_strict=false (the run's result.json "
                "then lists them under model_load)")
        LOADED[model] = load
    REDUCTIONS[model] = reduction
    if gradient_checkpointing:
        library_checkpointing(model)
    return model


def library_checkpointing(model: nn.Module) -> None:
    """Turn on transformers' own checkpointing, non-reentrant, under the name the installed
    release gives it: `activation_checkpointing_enable` since a release after 5.18 (the old
    name then warns, and goes in v6), `gradient_checkpointing_enable` up to 5.18, each with
    its keyword argument named alike. The library's base class is asked, not the model."""
    from transformers import PreTrainedModel

    kwargs = {"use_reentrant": False}
    if "activation_checkpointing_enable" in vars(PreTrainedModel):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def hf_config(arch: str, config: dict | None, config_extra: dict | None,
              pretrained: str | None):
    """The config `arch`'s model is built from: its class's defaults, or model.pretrained's
    config.json, with model.config's keys and config_extra's over them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    overrides, config_class = {**plain(config), **plain(config_extra)}, CONFIG_MAPPING[arch]
    if pretrained is None:
        built = config_class(**overrides)
    else:
        # The keys go in with the saved ones, as they do without a folder: from_pretrained's
        # own overrides are set after the config is built, where what follows from them
        # (Qwen2's layer_types from num_hidden_layers) is not recomputed, and a key the class
        # converts (rope_theta) is dropped.
        built = config_class.from_dict({**saved_config(arch, pretrained, config_class),
                                        **overrides})
    refuse_ids_past_vocabulary(built, overrides)
    return built


def saved_config(arch: str, pretrained: str, config_class: type) -> dict:
    """model.pretrained's config.json, of `arch`."""
    folder = Path(pretrained).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model.pretrained={pretrained}: no config.json there. Put a folder written by "
            "`model.save_pretrained(folder)` (config.json and model.safetensors) there; "
            "nothing is downloaded")
    saved, _ = config_class.get_config_dict(folder, local_files_only=True)
    if saved.get("model_type") != arch:
        raise ValueError(f"model.pretrained={pretrained} holds a {saved.get('model_type')} "
                         f"model, but model.arch={arch}")
    return saved


def refuse_ids_past_vocabulary(built, overrides: dict) -> None:
    """The ids a model looks up of its own accord, at or past its vocabulary, where model.config
    set them or vocab_size: its pad_token_id (transformers builds its embeddings with it as
    their `padding_idx`, and memexp's synthetic data pads with it: the build fails on an
    assertion) and an encoder-decoder's decoder_start_token_id (its decoder's first input).
    MarianConfig's are 58100, which vocab_size=64 leaves behind. A config as published is left
    to transformers, which only warns of such ids."""
    # read as transformers' own check reads them, from the config's keys: a vision config has
    # neither a vocabulary nor a pad id, and T5's no decoder_start_token_id (hf_model sets it)
    text, keys = built.get_text_config(decoder=True).to_dict(), built.to_dict()
    vocab = text.get("vocab_size")
    ids = {"pad_token_id": text.get("pad_token_id"),
           "decoder_start_token_id": keys.get("decoder_start_token_id")
           if built.is_encoder_decoder else None}
    past = {name: value for name, value in ids.items() if value is not None and vocab is not None
            and value >= vocab and ("vocab_size" in overrides or name in overrides)}
    if past:
        key = "vocab_size" if "vocab_size" in overrides else next(iter(past))
        settings = " and ".join(f"+model.config.{name}=..." for name in past)
        raise ValueError(
            f"model.config.{key}={overrides[key]}: {type(built).__name__}'s "
            f"{', '.join(f'{name}={value}' for name, value in past.items())} "
            f"{'is' if len(past) == 1 else 'are'} past its vocabulary of {vocab} (ids 0 to "
            f"{vocab - 1}), and the model looks {'it' if len(past) == 1 else 'them'} up: set "
            f"{settings} within it, or a larger vocab_size")


def config_keys(config_class: type, auto: type) -> set[str]:
    """The keys model.config may set: those of the architecture's config class (the fields of
    its default config, the aliases of its attribute_map, its constructor's arguments), and
    those its model's code reads where the class has none: with getattr or hasattr (DeBERTa-v2's
    position_buckets, GPT-2's classifier_dropout), or as an attribute (T5's
    decoder_start_token_id, which its published config.json files set)."""
    # the module of the class that `auto` builds for this config (all of its heads live there);
    # where transformers is installed without its sources, only the class's own keys count (a
    # key its code reads is then refused, with how to give it: config_extra)
    try:
        source = inspect.getsource(sys.modules[auto._model_mapping[config_class].__module__])
    except (OSError, TypeError):
        source = ""
    read = re.findall(r"(?:(?:getattr|hasattr)\(\s*[\w.]*config\w*\s*,\s*[\"']|\bconfig\.)(\w+)",
                      source)
    return {*config_class().to_dict(), *config_class.attribute_map,
            *inspect.signature(config_class).parameters, *read}


def refuse_unknown_keys(built, overrides: dict, auto: type) -> None:
    """transformers keeps a key its config class neither defines nor converts as a loose
    attribute, read by nothing: a misspelt n_layer would measure the default model."""
    known = config_keys(type(built), auto)
    loose = [key for key in overrides if key in vars(built) and key not in known]
    if loose:
        key, others = loose[0], "".join(f", nor {other}" for other in loose[1:])
        close = difflib.get_close_matches(key, sorted(known), n=3)
        raise ValueError(
            f"model.config.{key}: {type(built).__name__} has no key {key}{others} (transformers "
            f"{_version()} would keep it unread, and the run would measure the model without "
            "it)." + (f" Did you mean {', '.join(close)}?" if close else "")
            + f" To set a key that code of your own reads, give it as +model.config_extra.{key}="
            f"... Its keys: {', '.join(sorted(k for k in known if not k.startswith('_')))}")


# What loading model.pretrained reported, by kind, as the record says it.
LOAD_WARNINGS = {"missing_keys": "missing from the folder (left at random)",
                 "unexpected_keys": "in the folder that the model has not (unused)",
                 "mismatched_keys": "of another shape in the folder (left at random)"}


def load_report(pretrained: str, loading: dict) -> dict:
    """from_pretrained's loading info (output_loading_info=True), for result.json."""
    mismatched = [f"{key}: folder {tuple(saved)}, model {tuple(model)}"
                  for key, saved, model in loading["mismatched_keys"]]
    return {"pretrained": pretrained, "missing_keys": sorted(loading["missing_keys"]),
            "unexpected_keys": sorted(loading["unexpected_keys"]),
            "mismatched_keys": sorted(mismatched)}


def load_warnings(load: dict, shown: int = 4) -> str:
    """The record's load warnings in a line: by kind, their count and the first few; "" when
    every tensor loaded."""
    return "; ".join(
        f"{len(load[kind])} tensor{'s' * (len(load[kind]) != 1)} {what}: "
        + ", ".join(load[kind][:shown])
        + (f" and {len(load[kind]) - shown} more" if len(load[kind]) > shown else "")
        for kind, what in LOAD_WARNINGS.items() if load[kind])
