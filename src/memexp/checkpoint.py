"""Training checkpoints: written atomically, read newest-valid first, resumed only by the config
that wrote them.

A checkpoint is written to a temporary file in its folder, flushed to disk, then renamed over
its final name (`os.replace` is atomic): a process killed mid-write leaves a stray temporary file
and every earlier checkpoint intact. Reading skips any file that does not load.

Each checkpoint carries its run's config fingerprint (`fingerprint`): a run resumes from it only
when its own fingerprint is the same, so that what it records is what it trained.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from memexp import errors
from memexp.atomic import atomic_file

log = logging.getLogger("memexp")
FOLDER = "checkpoints"  # a run's checkpoints, in its run folder
NAME = re.compile(r"step_(\d+)\.pt")

# The keys a rerun may change and still resume: how long the run goes on, and how it reports
# along the way; and trainer.threads, which changes only the order of a step's sums (a local
# sweep picks it from the cores that other work leaves free: a rerun on a busier machine must
# still resume). None of them changes what is measured. Everything else (the model, data,
# optimizer and its hyperparameters, the techniques, seeds, the device, trainer.warmup_steps
# and eval_every, memory.*) is the fingerprint. A key listed here covers
# the keys under it.
RUN_LENGTH_KEYS = ("trainer.max_steps", "trainer.checkpoint_every", "trainer.keep_checkpoints",
                   "trainer.resume", "trainer.log_every", "trainer.progress", "trainer.threads",
                   "logger", "report")


class ResumeRefused(errors.Refused, ValueError):
    """A rerun in a run folder whose checkpoint it must not continue from."""


def fingerprint(config: DictConfig | dict) -> dict[str, Any]:
    """The resolved config as flat `a.b.c: value` pairs, less RUN_LENGTH_KEYS."""
    plain = (OmegaConf.to_container(config, resolve=True, enum_to_str=True)
             if isinstance(config, DictConfig) else config)
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if is_run_length_key(name):
                continue
            if isinstance(value, dict):
                walk(value, f"{name}.")
            else:
                flat[name] = value

    walk(plain, "")
    return flat


def fingerprint_against(state: dict, config: DictConfig | dict) -> dict[str, Any]:
    """`config`'s fingerprint, where data.batch_size=auto (and an eval batch size that follows
    it) stands for the size that the checkpoint's run found: the rerun searches again, and
    Trainer.resume checks the size it finds against the checkpoint's."""
    mine, saved = fingerprint(config), state.get("config") or {}
    for key in ("data.batch_size", "data.eval_batch_size"):
        if mine.get(key) == "auto" and key in saved:
            mine[key] = saved[key]
    return mine


def is_run_length_key(name: str) -> bool:
    return any(name == key or name.startswith(f"{key}.") for key in RUN_LENGTH_KEYS)


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: checkpoint <value>, now <value>` for every fingerprint key that differs."""
    missing = "(absent)"
    return [f"{key}: checkpoint {saved.get(key, missing)!r}, now {current.get(key, missing)!r}"
            for key in sorted(saved.keys() | current.keys())
            if saved.get(key, missing) != current.get(key, missing)]


WHAT_TO_DO = ("To measure anew, start over in this folder with trainer.resume=never, or give "
              "the run its own folder (hydra.run.dir=... or hydra.sweep.dir=...).")


def check_resumable(path: Path, state: dict, config: DictConfig | dict) -> None:
    """Raise ResumeRefused unless a run of `config` can continue from checkpoint `state`: the
    config that wrote it (the keys that differ are named), with steps left to train."""
    saved = state.get("config")
    if saved is None:
        changed = ["the checkpoint has no config fingerprint (written by an older memexp)"]
    else:
        changed = differences(saved, fingerprint_against(state, config))
    if changed:
        shown = "\n  ".join(changed[:12] + ([f"... and {len(changed) - 12} more"]
                                            if len(changed) > 12 else []))
        raise ResumeRefused(
            f"{path} was written by another config, so this run cannot continue from it (what "
            f"it would record is not what it trained). These keys differ:\n  {shown}\n"
            f"Rerun with the checkpoint's values to continue it. {WHAT_TO_DO}")
    max_steps = config["trainer"]["max_steps"]
    if state["step"] >= max_steps:
        raise ResumeRefused(
            f"{path} is at step {state['step']}, and trainer.max_steps={max_steps}: a run "
            "resumed from it would train nothing, and its record would measure nothing. Raise "
            f"trainer.max_steps to train on. {WHAT_TO_DO}")


def save(folder: Path, step: int, state: dict, keep: int) -> Path:
    """Write step `step`'s checkpoint; keep it and the `keep - 1` newest before it. Any
    checkpoint of a later step is from an earlier run in this folder, never this one's (a run
    started with trainer.resume=never, or resumed from an older checkpoint): it goes too, so
    that the folder holds one run's history and rotation never deletes what was just written."""
    path = folder / f"step_{step:08d}.pt"
    try:
        with atomic_file(path, "wb") as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as error:
        # torch's zip writer may report a failed write (a full disk) as "unexpected pos ...";
        # the OS's own error is then its context.
        cause = error if isinstance(error, OSError) else error.__context__
        if not isinstance(cause, OSError):
            raise
        raise OSError(cause.errno, f"checkpoint {path} could not be written: "
                                   f"{cause.strerror or cause}") from error
    older = [p for p in checkpoints(folder) if step_of(p) < step]
    for old in [p for p in checkpoints(folder) if step_of(p) > step] + older[keep - 1:]:
        old.unlink()
    return path


def remove_all(folder: Path) -> None:
    """Remove every checkpoint in `folder` (none where there is no folder)."""
    for path in checkpoints(folder) if folder.is_dir() else []:
        path.unlink(missing_ok=True)  # missing_ok: the ranks of one run remove the same files


def step_of(path: Path) -> int:
    return int(NAME.fullmatch(path.name).group(1))


def checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints, newest first."""
    found = [p for p in folder.glob("step_*.pt") if NAME.fullmatch(p.name)]
    return sorted(found, key=step_of, reverse=True)


def load_newest(folder: Path, mmap: bool = False) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads, or None. Tensors load on CPU; with `mmap`, they stay
    in the file until read (cheap, for a look at the step and the fingerprint)."""
    for path in checkpoints(folder) if folder.is_dir() else []:
        try:
            return path, torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as error:  # truncated or corrupt: try the one before
            log.warning("checkpoint %s does not load (%s); trying an older one", path, error)
    return None
