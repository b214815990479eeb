"""model=hf: any Hugging Face transformers architecture, built from its config (random weights,
nothing downloaded), or from a local `save_pretrained` folder.

    python train.py model=hf model.arch=gpt2 model.task=causal_lm +model.config.n_layer=4

transformers is imported only when such a model is built.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from torch import nn

from memexp.models import plain
from memexp.quiet import quiet_torchao_import

# model.task -> (the Auto class that adds the task's head, the name of its architecture table in
# transformers.models.auto.modeling_auto)
TASKS = {
    "causal_lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "masked_lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "sequence_classification": ("AutoModelForSequenceClassification",
                                "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token_classification": ("AutoModelForTokenClassification",
                             "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "image_classification": ("AutoModelForImageClassification",
                             "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
}


def known_architectures() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def tasks_of(arch: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    return [task for task, (_, table) in TASKS.items() if arch in getattr(modeling_auto, table)]


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
    if task not in tasks_of(arch):
        raise ValueError(f"model.task={task}: transformers has no {task} head for "
                         f"model.arch={arch}; its tasks: {', '.join(tasks_of(arch)) or 'none'}")


def _version() -> str:
    import transformers

    return transformers.__version__


def hf_model(arch: str, task: str, config: dict | None = None, pretrained: str | None = None,
             gradient_checkpointing: bool = False) -> nn.Module:
    """The `task` model of architecture `arch` (a transformers model_type: gpt2, bert, llama...).

    config:      keys of that architecture's config class (n_layer, hidden_size, ...), over its
                 defaults; use_cache=false by default in training (a KV cache only holds memory
                 there, and a checkpointed block's recomputation would extend it twice)
    pretrained:  a local folder written by `save_pretrained` (config.json and the weights),
                 loaded with local_files_only; `config` keys still apply
    gradient_checkpointing: the library's own gradient checkpointing (`activation_checkpointing_
                 enable()`, formerly gradient_checkpointing_enable), non-reentrant, to compare
                 with memexp's checkpointing (use one or the other)"""
    import transformers

    # transformers' modeling code imports torchao where it is installed: once, quietly, here
    with quiet_torchao_import():
        import transformers.modeling_utils  # noqa: F401

    check_choice(arch, task)
    overrides = plain(config)
    auto = getattr(transformers, TASKS[task][0])
    if pretrained is None:
        model = auto.from_config(transformers.AutoConfig.for_model(arch, **overrides))
    else:
        folder = Path(pretrained).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"model.pretrained={pretrained}: no config.json there. Put a folder written by "
                "`model.save_pretrained(folder)` (config.json and model.safetensors) there; "
                "nothing is downloaded")
        loaded = transformers.AutoConfig.from_pretrained(folder, local_files_only=True,
                                                         **overrides)
        if loaded.model_type != arch:
            raise ValueError(f"model.pretrained={pretrained} holds a {loaded.model_type} model, "
                             f"but model.arch={arch}")
        model = auto.from_pretrained(folder, config=loaded, local_files_only=True)
    if gradient_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    return model
