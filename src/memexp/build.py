"""Building a config group's option from its `_target_`, and the model with an error that says
why not."""

from __future__ import annotations

import os

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn


def build(node: DictConfig):
    """instantiate(node). memexp's own checks of a value or a path (ValueError,
    FileNotFoundError) already name the key and what to do: they come out as they are, not
    inside Hydra's wrapper."""
    try:
        return instantiate(node)
    except InstantiationException as error:
        if isinstance(error.__cause__, (ValueError, FileNotFoundError)):
            raise error.__cause__ from None
        raise


def build_model(node: DictConfig) -> nn.Module:
    """The model, or an error whose first line says why not: the class could not be imported,
    Hydra refused the target, or the constructor raised (its own error, and the keys given)."""
    try:
        return build(node)
    except InstantiationException as error:
        root, keys = error, sorted(k for k in node if k != "_target_")
        while root.__cause__ is not None:
            root = root.__cause__
        hint = ("\nFor your own model use `model=custom model._target_=pkg.Class` and give its "
                "arguments as +model.<key>=...")
        if isinstance(root, ImportError):
            why = f"cannot be imported ({type(root).__name__}: {root}){importable(node, root)}"
        elif root is error:  # Hydra refused the target itself
            why = " ".join(line for line in str(error).splitlines()
                           if not line.startswith("full_key:"))
        else:
            why = f"raised {type(root).__name__}: {root} (given the keys {keys})"
            why += hint if isinstance(root, TypeError) else ""
        raise InstantiationException(f"model._target_={node._target_}: {why}") from error


def importable(node: DictConfig, error: ImportError) -> str:
    """The line that makes the model's own module importable, where it is the one missing (not
    one that it imports)."""
    top = str(node._target_).split(".")[0]
    if not isinstance(error, ModuleNotFoundError) or error.name != top:
        return ""
    return (f"\nmemexp imports your modules from the directory it runs in ({os.getcwd()}) and "
            f"from PYTHONPATH: run it in the folder that holds {top}/ or {top}.py, or first "
            f"`export PYTHONPATH=/folder/holding/{top}:$PYTHONPATH`")
