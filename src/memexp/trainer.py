"""The trainer: builds one run from a composed config, applies the techniques, trains, measures."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor, nn
from tqdm import tqdm

from memexp.data import Batch, TensorData
from memexp.memory import MemoryMeter
from memexp.techniques import check_combination


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


def build(node: DictConfig):
    """instantiate(node). A ValueError from the target is memexp's own check of a value, and
    already names the key and what is allowed: it comes out as it is, not inside Hydra's wrapper."""
    try:
        return instantiate(node)
    except InstantiationException as error:
        if isinstance(error.__cause__, ValueError):
            raise error.__cause__ from None
        raise


def build_model(node: DictConfig) -> nn.Module:
    try:
        return build(node)
    except InstantiationException as error:
        raise InstantiationException(
            f"{error}\nmodel._target_={node._target_} could not be built with the keys "
            f"{sorted(k for k in node if k != '_target_')}. For your own model use "
            "`model=custom model._target_=pkg.Class` and give its arguments as +model.<key>=..."
        ) from error


@dataclass
class Metrics:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    eval_accuracy: float | None = None


class Trainer:
    """Build with `Trainer(cfg)`, train with `fit()`; `memory_report()` reads the meter."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.device = pick_device(cfg.trainer.device)
        torch.manual_seed(cfg.trainer.seed)
        self.data: TensorData = build(cfg.data)
        self.precision = build(cfg.precision)
        self.checkpointing = build(cfg.checkpointing)
        self.bn_mode = build(cfg.bn_mode)
        self.parallel = build(cfg.parallel)
        self.optim = build(cfg.optim)
        check_combination(self.precision, self.optim, self.parallel)

        # The techniques, in this order:
        model = build_model(cfg.model)
        # 1. BatchNorm changes first: they need the model's raw Conv->BN structure.
        model = self.bn_mode.apply(model)
        # 2. Onto the device; precision casts parameters (pure half) before anything keeps a
        #    reference to them, and learns the device type for autocast.
        model = self.precision.apply(model.to(self.device))
        # 3. Checkpointing wraps blocks, which parallel wrappers then treat as units.
        model = self.checkpointing.apply(model)
        # 4. Parallel wrappers (DDP, FSDP) go outermost.
        self.model = self.parallel.apply(model)
        # 5. The meter's gradient hooks before the optimizer's (optim.in_backward has its own).
        self.meter = MemoryMeter(self.device, track=cfg.memory.track)
        self.meter.watch(self.model)
        # 6. The optimizer last, over the parameters as they now are (or their master copies).
        self.optimizer = self.optim.build(self.precision.parameters(self.model))
        self.meter.watch_optimizer(self.optimizer)
        self.empty_cache_at = cfg.memory.empty_cache  # a str enum: "never", "step" or "eval"
        self.skipped_steps = 0

    def to_device(self, batch: Batch) -> Batch:
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)
        return self.precision.cast_inputs(inputs), targets

    def loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    def train_step(self, batches: Iterator[Batch]) -> float:
        """One optimizer step over `optim.accumulate` micro-batches; returns the mean loss."""
        accumulate, meter, total = self.optim.accumulate, self.meter, 0.0
        for micro in range(accumulate):
            batch = self.to_device(next(batches))
            with self.parallel.accumulating(micro < accumulate - 1):
                with (meter.phase("forward"), self.precision.autocast(),
                      self.checkpointing.context()):
                    loss = self.loss(*batch)
                    # Scale for accumulation; skipped at k=1, where the extra autograd node
                    # would only cost time (x / 1 == x bitwise).
                    loss = loss / accumulate if accumulate > 1 else loss
                # Autograd keeps what backward needs; holding the batch longer costs memory.
                del batch
                with meter.phase("backward"):
                    self.precision.backward(loss)
            total += loss.item()  # a float: no graph outlives its step
        with meter.phase("optimizer"):
            # A step skipped for non-finite gradients (fp16 loss scaling) is counted, not silent.
            self.skipped_steps += not self.precision.step(self.optimizer)
            # Free the gradients now: no need for this memory until the next backward.
            self.optimizer.zero_grad(set_to_none=True)
        return total

    @torch.inference_mode()
    def evaluate(self) -> float:
        self.model.eval()
        # Counts stay on the device until the end: no host sync per batch.
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        count = 0
        with self.meter.phase("eval"), self.precision.autocast():
            for batch in self.data.eval_batches(self.parallel.rank, self.parallel.world_size):
                inputs, targets = self.to_device(batch)
                correct += (self.model(inputs).argmax(-1) == targets).sum()
                count += targets.numel()
        self.model.train()
        totals = self.parallel.all_reduce_sum(
            torch.stack([correct, torch.tensor(count, device=self.device)]))
        return (totals[0] / totals[1]).item()

    def fit(self, logger) -> Metrics:
        metrics = Metrics()
        # Plain ints: reading a DictConfig in the loop would cost tens of microseconds a step.
        max_steps, eval_every, log_every = (int(self.cfg.trainer[key]) for key in
                                            ("max_steps", "eval_every", "log_every"))
        batches = self.data.train_batches(0, self.parallel.rank, self.parallel.world_size)
        self.model.train()
        # tqdm: hidden off a terminal (disable=None), and until the run is a few seconds old.
        bar = tqdm(total=max_steps, disable=None if self.cfg.trainer.progress else True,
                   delay=3, unit="step", leave=False)
        with self.meter, bar:
            for step in range(1, max_steps + 1):
                started = time.perf_counter()
                loss = self.train_step(batches)
                metrics.step_times.append(time.perf_counter() - started)
                metrics.losses.append(loss)
                self.release_cached_memory("step")
                bar.update()
                last = step == max_steps
                if last or (eval_every and step % eval_every == 0):
                    metrics.eval_accuracy = self.evaluate()
                    self.release_cached_memory("eval")
                if last or step % log_every == 0:
                    bar.set_postfix(loss=f"{loss:.3f}")
                    logger.log(step, self.step_metrics(metrics))
        return metrics

    def release_cached_memory(self, point: str) -> None:
        """memory.empty_cache: give cached blocks back at this point (source tips 10 and 13)."""
        if self.empty_cache_at == point:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def step_metrics(self, metrics: Metrics) -> dict[str, float | None]:
        """The same keys every step; None where a value is not known (yet)."""
        return {
            "loss": metrics.losses[-1],
            "step_time_s": metrics.step_times[-1],
            "memory_bytes": self.meter.live_bytes(),
            "eval_accuracy": metrics.eval_accuracy,
        }

    def summary_metrics(self, metrics: Metrics) -> dict:
        """The `metrics` section of result.json."""
        timed = metrics.step_times[self.cfg.trainer.warmup_steps:] or metrics.step_times
        step_time = statistics.median(timed)
        items = (self.data.batch_size * self.optim.accumulate * self.parallel.world_size
                 * self.data.items_per_sample)
        last = metrics.losses[-10:]
        return {
            "final_loss": sum(last) / len(last),
            "eval_accuracy": metrics.eval_accuracy,
            "throughput": items / step_time,
            "throughput_unit": f"{self.data.unit}/s",
            "step_time_s": step_time,
            "steps": len(metrics.losses),
            "skipped_steps": self.skipped_steps,
            "loss_scale": self.precision.loss_scale(),
            "losses": metrics.losses,
        }
