"""The real configs: every group option composes and builds; bad input fails at compose time."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from memexp import registry
from memexp.config import config_dir

from conftest import compose_train, write_tiny_cifar10, write_tiny_mnist

GROUPS = ["model", "data", "optim", "precision", "checkpointing", "parallel", "bn_mode", "loss",
          "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def required_overrides(group: str, option: str, tmp_path: Path) -> list[str]:
    """The keys an option needs from the user (its `???` values), and a small size where its
    default is one that takes seconds to build (GPT-2's 124M random weights: 14 s)."""
    if (group, option) == ("model", "hf"):
        return ["+model.config.n_layer=1", "+model.config.n_embd=32", "+model.config.n_head=2"]
    if option == "cifar10":
        return [f"data.root={write_tiny_cifar10(tmp_path)}", "data.batch_size=8"]
    if option == "mnist":
        return [f"data.root={write_tiny_mnist(tmp_path)}", "data.batch_size=8"]
    if (group, option) == ("checkpointing", "modules"):
        return ["checkpointing.modules=[blocks.0]"]
    if option == "dataset":
        return ["data.train._target_=user_models.Tokens"]
    if option == "hf_local":
        import datasets

        split = datasets.Dataset.from_dict({"input_ids": [[1, 2]] * 8, "labels": [[2, 3]] * 8})
        datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "hf"))
        return [f"data.path={tmp_path / 'hf'}", "data.columns=[input_ids,labels]"]
    return []


@pytest.mark.parametrize(
    ("group", "option"),
    [(g, o) for g in GROUPS for o in options(g) if o != "custom"],
)
def test_every_group_option_composes_and_instantiates(group, option, tmp_path):
    cfg = compose_train(f"{group}={option}", *required_overrides(group, option, tmp_path))
    node = cfg[group]
    assert instantiate(node) is not None
    # The YAML names the same target as the schema it extends, so typos are caught against
    # the real constructor.
    extended = registry.options(group)[option]["defaults"][0].split("@")[0].lstrip("/")
    assert node._target_ == ConfigStore.instance().load(f"{extended}.yaml").node._target_


def test_custom_model_takes_any_target():
    cfg = compose_train("model=custom", "model._target_=torch.nn.Linear",
                        "+model.in_features=4", "+model.out_features=2")
    assert instantiate(cfg.model).out_features == 2


def test_transformer_brings_its_data_and_optimizer():
    cfg = compose_train("model=transformer")
    assert cfg.data._target_.endswith("synthetic_tokens")
    assert cfg.optim._target_.endswith("AdamW")
    overridden = compose_train("model=transformer", "optim=sgd")
    assert overridden.optim._target_.endswith("SGD")


def test_the_defaults_list_covers_every_group():
    defaults = OmegaConf.to_container(OmegaConf.load(config_dir() / "train.yaml").defaults)
    named = {next(iter(entry)) for entry in defaults if isinstance(entry, dict)}
    assert set(GROUPS) | {"experiment", "debug"} <= named


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("trainer.max_steps=abc", ["full_key: trainer.max_steps", "converted to Integer"]),
        ("trainer.max_stepz=3", ["full_key: trainer.max_stepz", "not in 'TrainerConfig'"]),
        ("trainer.device=gpu", ["trainer.device", "expected one of [auto, cpu, cuda]"]),
        ("data.num_train=big", ["full_key: data.num_train", "converted to Integer"]),
        ("memory.track=maybe", ["full_key: memory.track", "not a valid bool"]),
        ("model.widht=3", ["full_key: model.widht", "not in 'ResNetSchema'"]),
        ("optim.lr=fast", ["full_key: optim.lr", "converted to Float"]),
        ("memory.empty_cache=sometimes", ["memory.empty_cache",
                                          "expected one of [never, step, eval]"]),
        ("checkpointing=full checkpointing.every=often", ["full_key: checkpointing.every"]),
    ],
)
def test_typos_and_wrong_types_fail_before_training_naming_the_key(override, says):
    with pytest.raises(ConfigCompositionException) as raised:
        compose_train(*override.split())
    text = f"{raised.value}\n{raised.value.__cause__}"
    for fragment in says:
        assert fragment in text


def test_unknown_group_option_lists_the_valid_ones():
    with pytest.raises(ConfigCompositionException) as raised:
        compose_train("precision=bogus")
    message = str(raised.value)
    assert "precision/bogus" in message
    for option in options("precision"):
        assert option in message
