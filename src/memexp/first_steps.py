"""A run cut to its first steps: what estimates and batch-size probes train."""

from __future__ import annotations

from omegaconf import DictConfig, open_dict


def first_steps(cfg: DictConfig) -> DictConfig:
    """`cfg` cut to its first two steps (step 2 is the first with optimizer state alive) and
    an evaluation, writing nothing and timing no baseline: what estimates and batch-size probes
    run."""
    short = cfg.copy()
    with open_dict(short):
        short.trainer.update(max_steps=2, eval_every=0, checkpoint_every=0, resume="never",
                             progress=False)
        short.memory.update(snapshot=False, measure_steps=None)
        short.timing.paired_steps = 0
    return short
