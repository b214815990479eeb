"""Lets `import torchvision` work where torchvision's compiled ops cannot load.

The Makefile installs torch 2.13.0's CPU build, and the only torchvision for it on PyPI (0.28.0,
which the timm extra brings) is built against torch's CUDA build: its C++ library needs
libtorch_cuda.so and does not load. torchvision then runs in its pure-Python mode, except that its
fake kernels for `nms` and `qnms` are registered unguarded, on ops that only that library defines,
so `import torchvision` fails with `operator torchvision::nms does not exist` (pytorch/vision#9337).
That breaks timm, which imports torchvision, and transformers, which imports it wherever it is
installed (`from transformers import LlamaConfig` included), so model=hf too.

Declaring the two ops, with no kernel, lets the import through. Calling a compiled op (nms,
roi_align, image decoding) still raises torchvision's own "Couldn't load custom C++ ops"; timm's
networks call none of them.

It runs at `import torch`, from torch's entry points for out-of-tree extensions ("torch.backends" in
pyproject.toml), because transformers imports torchvision before any memexp code would run.
TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns it off, with all such extensions.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import torch

# The declarations last as long as this object: torch drops a Library's definitions when it is
# collected.
_declared: list[torch.library.Library] = []


def declare_missing_ops() -> None:
    """Declare torchvision's `nms` and `qnms` where torchvision is installed and its compiled
    library does not load here; do nothing elsewhere."""
    spec = importlib.util.find_spec("torchvision")  # finds the package without importing it
    if spec is None:
        return
    folder = Path(spec.submodule_search_locations[0])
    # The file torchvision's own import loads first (torchvision.extension): `_C` up to 0.28,
    # `_C_stable` (built on torch's stable ABI) from 0.29. Where it loads, its ops are real, and
    # torchvision's loading it again is a no-op; declaring them as well would abort the process
    # when torchvision registers them (a duplicate definition).
    for path in (folder / f"{name}{suffix}" for name in ("_C", "_C_stable")
                 for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        if path.is_file():
            try:
                torch.ops.load_library(path)
                return
            except OSError:  # built for another torch (or its CUDA build)
                break
    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):  # their schemas, as torchvision's C++ library defines them
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _declared.append(library)
