"""Training checkpoints: written atomically, read newest-valid first.

A checkpoint is written to a temporary file in its folder, flushed to disk, then renamed over
its final name (`os.replace` is atomic): a process killed mid-write leaves a stray temporary file
and every earlier checkpoint intact. Reading skips any file that does not load.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from memexp.atomic import atomic_file

log = logging.getLogger("memexp")
NAME = re.compile(r"step_(\d+)\.pt")


def save(folder: Path, step: int, state: dict, keep: int) -> Path:
    path = folder / f"step_{step:08d}.pt"
    with atomic_file(path, "wb") as f:
        torch.save(state, f)
    for old in checkpoints(folder)[keep:]:
        old.unlink()
    return path


def checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints, newest first."""
    found = [p for p in folder.glob("step_*.pt") if NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(NAME.fullmatch(p.name).group(1)), reverse=True)


def load_newest(folder: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads, or None. Tensors load on CPU."""
    for path in checkpoints(folder) if folder.is_dir() else []:
        try:
            return path, torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # truncated or corrupt: try the one before
            log.warning("checkpoint %s does not load (%s); trying an older one", path, error)
    return None
