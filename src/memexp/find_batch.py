"""The largest batch that fits: `data.batch_size=auto` and `memexp find-batch`.

Each probe builds the configured run at one batch size and trains two steps and an evaluation
(step 2 is the first with optimizer state alive). The batch doubles from 1 until a probe runs out
of memory, then a binary search between the last fit and the first failure finds the exact
limit. "Fits" means the device (CUDA) or `memory.budget` (any device; on CPU the live-storage
tracker enforces it). After an OOM everything the probe held is freed, outside the `except`
block, and the device counters are reset, so the next probe starts clean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from omegaconf import DictConfig

from memexp.build import build
from memexp.device import device_name, free_cached_memory, pick_device
from memexp.distributed import env_world_size
from memexp.first_steps import first_steps
from memexp.loggers import NoLogger
from memexp.out_of_memory import is_out_of_memory
from memexp.result import mib
from memexp.trainer import Trainer


@dataclass
class BatchSearch:
    batch_size: int  # the largest that fits
    limit: str  # what it must fit in
    probes: list[dict] = field(default_factory=list)  # {batch_size, fits, peak_bytes}

    def as_dict(self) -> dict:
        return asdict(self)


def find_batch_size(cfg: DictConfig,
                    show: Callable[[str], None] = lambda line: None) -> BatchSearch:
    """The search; `show` gets a line for each probe as it ends."""
    if env_world_size() > 1:
        raise ValueError("data.batch_size=auto with several ranks: each would search alone. "
                         "Find it with one process (memexp find-batch), then set data.batch_size")
    device = pick_device(cfg.trainer.device)
    if cfg.memory.budget is None and device.type != "cuda":
        raise ValueError("data.batch_size=auto on CPU needs memory.budget (the size of the "
                         "device to fill, such as memory.budget=16GiB): a CPU has no fixed limit")
    limit = (f"memory.budget={cfg.memory.budget}" if cfg.memory.budget is not None
             else f"{device_name(device)} ({torch.cuda.mem_get_info(device)[1] / 2**30:.1f} GiB)")
    search = BatchSearch(0, limit)
    largest = len(build(with_batch_size(cfg, 1).data).train) // cfg.optim.accumulate

    def fits(batch_size: int) -> bool:
        peak = probe(with_batch_size(cfg, batch_size), device)
        search.probes.append({"batch_size": batch_size, "fits": peak is not None,
                              "peak_bytes": peak})
        show(f"  batch {batch_size:>6}: {mib(peak) if peak is not None else 'out of memory'}")
        return peak is not None

    if not fits(1):
        raise ValueError(f"data.batch_size=auto: not even batch 1 fits in {limit}")
    good, bad = 1, None
    while bad is None and good < largest:  # double
        trial = min(2 * good, largest)
        good, bad = (trial, None) if fits(trial) else (good, trial)
    while bad is not None and bad - good > 1:  # bisect
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    search.batch_size = good
    return search


def with_batch_size(cfg: DictConfig, batch_size: int) -> DictConfig:
    """`cfg` as a probe: its first two steps at this batch size."""
    trial = first_steps(cfg)
    set_batch_size(trial, batch_size)
    return trial


def set_batch_size(cfg: DictConfig, batch_size: int) -> None:
    """data.batch_size, and data.eval_batch_size where it follows it: in a composed config it is
    `${.batch_size}` and follows by itself; in a resolved one (train.py's jobs are resolved
    before they run) it has become "auto" too."""
    cfg.data.batch_size = batch_size
    if cfg.data.eval_batch_size == "auto":
        cfg.data.eval_batch_size = batch_size


def probe(cfg: DictConfig, device: torch.device) -> int | None:
    """The peak of two steps at cfg's batch size, or None when they ran out of memory."""
    peak = None
    try:
        peak = two_steps(cfg)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
    # Out of the except block the probe's frames and tensors are unreachable: give them back.
    free_cached_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def two_steps(cfg: DictConfig) -> int:
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    return trainer.meter.report()["peak_bytes"]
