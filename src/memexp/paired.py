"""A run's baseline, timed beside the run's own steps in the same process (memexp.baseline)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from memexp.device import free_cached_memory, pick_device
from memexp.memory import MemoryMeter
from memexp.out_of_memory import is_out_of_memory

log = logging.getLogger("memexp")


@contextmanager
def random_state_kept(device: torch.device) -> Iterator[None]:
    """What runs inside leaves the process's random state (torch's, the device's, Python's,
    numpy's) as it found it."""
    state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(state)
        np.random.set_state(numpy_state)


class Unpaired:
    """No baseline beside the run's steps; `why` says why not."""

    holds_memory = False

    def __init__(self, why: str):
        self.why = why

    def beside(self, step: int) -> AbstractContextManager:
        return nullcontext()


class PairedBaseline:
    """The run's baseline (memexp.baseline), built in the run's process once its memory is
    measured. Each of the run's next `steps` steps runs beside a step of the baseline's, the
    baseline first on even steps and second on odd ones, so that their times see the same
    machine at the same moments; the baseline's go to `times` as [step, seconds]. Neither
    touches the other's random state: the run's losses and weights are those it has alone.
    A baseline that fails (runs out of memory beside the run), or would leave the run too
    little of the device, is dropped, and `why` says why. The run's `meter` counts nothing while
    the baseline holds memory, and again once it is gone."""

    def __init__(self, config: dict, steps: int, times: list[list], meter: MemoryMeter,
                 trainer: Callable[[DictConfig], object]):
        """`trainer(cfg)` builds the baseline's trainer (memexp.trainer.Trainer, which makes
        its PairedBaseline: it is handed in, not imported)."""
        self.steps, self.times, self.why, self.meter = steps, times, None, meter
        self.make_trainer = trainer
        self.trainer = None
        self.dropped = False
        cfg = OmegaConf.create(config)
        self.device = pick_device(cfg.trainer.device)
        cfg.trainer.update(checkpoint_every=0, resume="never", progress=False, eval_every=0)
        cfg.memory.update(track=False, budget=None, snapshot=False, measure_steps=None)
        self._run(lambda: self._build(cfg))

    def _build(self, cfg: DictConfig) -> None:
        # Building a trainer seeds torch: the run's own random state is put back afterwards.
        with random_state_kept(self.device):
            self.trainer = self.make_trainer(cfg)
            self.trainer.meter.count_nothing()  # as the run's steps beside it count nothing
            self.batches = self.trainer.data.train_batches()
            self.trainer.model.train()
            # Its first steps allocate what later ones reuse, as the run's did: not timed.
            for _ in range(max(cfg.trainer.warmup_steps, 2)):
                self.trainer.train_step(self.batches)
        crowded = self.meter.crowded()
        if crowded is not None:
            self.why = f"the baseline was dropped before its first timed step: {crowded}"

    @contextmanager
    def beside(self, step: int) -> Iterator[None]:
        """The baseline's step before or after the block, by turns."""
        first = step % 2 == 0
        if first:
            self._run(lambda: self._step(step))
        yield
        if not first:
            self._run(lambda: self._step(step))

    def _step(self, step: int) -> None:
        if self.dropped:
            return
        with random_state_kept(self.device):
            started = time.perf_counter()
            self.trainer.train_step(self.batches)
            self.times.append([step, time.perf_counter() - started])
        self.steps -= 1
        if self.steps == 0:
            self._drop()

    def _run(self, work) -> None:
        try:
            work()
        except Exception as error:  # the run's own measurements stand; the pairing does not
            what = "ran out of memory" if is_out_of_memory(error) else "failed"
            first_line = (str(error).strip().splitlines() or [""])[0]
            self.why = f"the baseline {what} beside the run: {type(error).__name__}: {first_line}"
        if self.why is not None and not self.dropped:
            log.warning("timing: %s; the step time ratio is left to the report", self.why)
            self._drop()  # outside the except block: the error's frames no longer hold tensors

    @property
    def holds_memory(self) -> bool:
        return not self.dropped

    def settled(self) -> None:
        """The median ratio's confidence interval is within timing.paired_spread
        (memexp.timing.paired_timing): no more pairs are needed."""
        log.info("timing: the ratio to the baseline settled after %d pairs", len(self.times))
        self._drop()

    def _drop(self) -> None:
        self.trainer = self.batches = None
        self.dropped = True
        free_cached_memory(self.device)
        self.meter.resume_counting()
