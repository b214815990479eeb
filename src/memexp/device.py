"""Which device a run trains on, and giving its cached memory back."""

from __future__ import annotations

import gc

import torch


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "trainer.device=cuda, but this process sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}). "
            "Use trainer.device=cpu or trainer.device=auto."
        )
    return torch.device(requested)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def free_cached_memory(device: torch.device) -> None:
    """Collect what is unreachable and give the device's cached blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
