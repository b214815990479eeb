"""model=timm: any network from PyTorch Image Models, through `timm.create_model`.

    python train.py model=timm model.name=resnet34

timm models are plain nn.Modules that return logits, so every technique reaches them through
the generic path (block-level ones find their blocks with the resolver). timm is memexp's `timm`
extra, which the Makefile installs; it imports torchvision, whose compiled ops need not load
(memexp.torchvision_ops). Where timm is missing or does not import, building one is a clear error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from memexp.models import plain


def timm_model(name: str, num_classes: int, in_channels: int = 3, pretrained: str | None = None,
               kwargs: dict | None = None) -> nn.Module:
    """`timm.create_model(name, num_classes=..., in_chans=...)`, random weights; `pretrained` is
    a local weights file (never downloaded); `kwargs` go to create_model (drop_rate, ...)."""
    try:
        import timm
    except Exception as error:  # not installed, or its torchvision failing beside this torch
        # from None: the model builder reports the innermost cause, which would be timm's
        # import error alone, as if memexp.models.timm could not be imported.
        raise RuntimeError(
            f"model=timm needs timm, which does not import here ({type(error).__name__}: "
            f"{error}). Install memexp's timm extra, as make install does, in {sys.executable} "
            f"(-m pip install -e '.[timm]' torch=={torch.__version__.split('+')[0]}: torch "
            "again, so that pip keeps this torch), or give the network as model=custom "
            "model._target_=pkg.Class") from None
    extra = plain(kwargs)
    if pretrained is not None:
        weights = Path(pretrained).expanduser()  # timm opens the path as given: no ~
        if not weights.is_file():
            raise FileNotFoundError(f"model.pretrained={pretrained}: no weights file there "
                                    "(a .safetensors or .pth state dict); nothing is downloaded")
        extra.update(pretrained=True, pretrained_cfg_overlay={"file": str(weights)})
    if name not in timm.list_models():
        raise ValueError(f"model.name={name}: not a timm model; timm.list_models() has "
                         f"{', '.join(timm.list_models()[:50])}, ...")
    return timm.create_model(name, num_classes=num_classes, in_chans=in_channels, **extra)
