"""The config groups and their options, found once, in conf/ and the classes it names.

A group is a folder of conf/ that the root config's defaults list names (conf/train.yaml), an
option is a YAML file in it, and each option names what builds it in `_target_`. Whatever lists
groups or options reads them here: the schemas (memexp.config), a result's techniques
(memexp.result), the groups a run's baseline resets (memexp.baseline), the search space of
`memexp plan` and the lighter optimizers it also tries. What such a list chooses is stated on
the classes (`baseline`, `planned`, `lighter`). Adding a technique is one class and one YAML
file.

Below every other module of memexp: it imports none of them, and finds the targets by name.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml
from hydra.utils import get_object

# Where a group's targets live when its options are memory techniques (result.json's
# "techniques", the report's columns).
TECHNIQUES = "memexp.techniques."
UNSET = "???"  # an option whose target the user names (model=custom, loss=custom)


def config_dir() -> Path:
    """`conf/` next to the package (wheel) or at the repository root (editable install)."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "conf", package.parents[1] / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"memexp's conf/ folder is neither in {package} nor in the repo root")


@functools.cache
def options(group: str) -> dict[str, dict]:
    """Each option of `group` by name, as its YAML file holds it, in the order of the names."""
    folder = config_dir() / group
    return {path.stem: yaml.safe_load(path.read_text()) or {}
            for path in sorted(folder.glob("*.yaml"))}


@functools.cache
def groups() -> tuple[str, ...]:
    """The groups, in the order of the root config's defaults list: those whose options build
    an object. The overlays (experiment, debug) and Hydra's own groups are not groups here."""
    defaults = yaml.safe_load((config_dir() / "train.yaml").read_text())["defaults"]
    named = [next(iter(entry)) for entry in defaults if isinstance(entry, dict)]
    return tuple(group for group in named if (config_dir() / group).is_dir()
                 and all("_target_" in option for option in options(group).values()))


def target_names(group: str) -> tuple[str, ...]:
    """The targets `group`'s options name, each once, by the options' order."""
    named = (option["_target_"] for option in options(group).values())
    return tuple(dict.fromkeys(name for name in named if name != UNSET))


@functools.cache
def targets(group: str) -> tuple:
    """The classes (or functions) that build `group`'s options."""
    return tuple(get_object(name) for name in target_names(group))


@functools.cache
def techniques() -> tuple[str, ...]:
    """The groups whose options are memory techniques (memexp.techniques), by the defaults
    list's order."""
    return tuple(group for group in groups()
                 if all(name.startswith(TECHNIQUES) for name in target_names(group)))


def target_path(target) -> str:
    return f"{target.__module__}.{target.__qualname__}"


def options_of(group: str, target) -> list[str]:
    """The options of `group` that `target` builds."""
    path = target_path(target)
    return [name for name, option in options(group).items() if option["_target_"] == path]


def stated(target, attribute: str, default):
    """What a class states for these lists (`baseline`, `planned`), or `default` where it states
    nothing: memory techniques (memexp.techniques.Technique) state both; a loss class or a
    model's builder needs to only where `memexp plan` is to try its options."""
    return getattr(target, attribute, default)


def baseline_option(group: str) -> str | None:
    """The option of a group that its class marks `baseline` (a run's baseline takes it), or
    None where the group has none."""
    for target in targets(group):
        if stated(target, "baseline", False):
            return options_of(group, target)[0]
    return None


def planned(group: str) -> list[str]:
    """The options of a group that `memexp plan` tries: those whose YAML has the arguments of
    one of their class's `planned`; the group's baseline option first. An option whose target
    the user names (???) is never planned."""
    chosen = [name for name, option in options(group).items()
              if option["_target_"] != UNSET and any(
                  wanted.items() <= option.items()
                  for wanted in stated(get_object(option["_target_"]), "planned", ()))]
    return sorted(chosen, key=lambda name: name != baseline_option(group))
