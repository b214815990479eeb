"""The trainer: builds one run from a composed config, applies the techniques, trains, measures.

What other modules share with it lives beside it: building options (memexp.build), the device
(memexp.device), running out of memory (memexp.out_of_memory), the run's first steps
(memexp.first_steps) and the baseline timed beside the run (memexp.paired)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from tqdm import tqdm

from memexp import checkpoint
from memexp.baseline import BASELINE_GROUPS, baseline_config
from memexp.build import build, build_model
from memexp.data import Batch, Data
from memexp.data.tensors import IGNORE, map_batch, map_inputs
from memexp.device import free_cached_memory, pick_device
from memexp.errors import abbreviated
from memexp.loss import Outputs, as_loss, call_model, shares
from memexp.memory import LossBoundary, MemoryMeter, computing_loss
from memexp.memory.allocator import CachingAllocatorModel
from memexp.memory.sizes import parse_size
from memexp.models import LOADED
from memexp.out_of_memory import OutOfMemory, is_out_of_memory
from memexp.paired import PairedBaseline, Unpaired
from memexp.prechecks import (
    FirstForward,
    check_loss,
    check_reached,
    check_signature,
    check_trainable,
)
from memexp.progress import progress_lines
from memexp.techniques import check_combination, check_loss_combination
from memexp.timing import MachineLoad, step_timing

log = logging.getLogger("memexp")
SNAPSHOTS = "memory"  # memory.snapshot's files, in the run folder


class NonFiniteLoss(RuntimeError):
    """The run diverged (status `nan`): trainer.max_bad_steps steps had a NaN or infinite loss or
    gradients (none of which touched the weights), or its final weights are not finite."""


def validate(trainer: DictConfig) -> None:
    """Out-of-range trainer keys, before anything is built."""
    minimum = {"max_steps": 1, "eval_every": 0, "warmup_steps": 0, "log_every": 1,
               "max_bad_steps": 1, "checkpoint_every": 0, "keep_checkpoints": 1, "nproc": 1}
    for key, least in minimum.items():
        if trainer[key] < least:
            raise ValueError(f"trainer.{key}={trainer[key]}: must be >= {least}")
    if trainer.threads is not None and trainer.threads < 1:
        raise ValueError(f"trainer.threads={trainer.threads}: must be >= 1 (or null: torch's "
                         "own choice)")
    # torch.manual_seed's range (it takes a negative seed as its 64-bit two's complement)
    if not -2**63 <= trainer.seed < 2**64:
        raise ValueError(f"trainer.seed={abbreviated(str(trainer.seed))}: must be an integer "
                         "from -2**63 to 2**64 - 1")


def memory_budget(memory: DictConfig) -> int | None:
    """memory.budget in bytes, or None."""
    return None if memory.budget is None else parse_size(memory.budget, "memory.budget")


def snapshot_folder(memory: DictConfig, run_dir: Path | None) -> Path | None:
    """Where memory.snapshot writes, or None."""
    if not memory.snapshot:
        return None
    if run_dir is None:
        raise ValueError("memory.snapshot=true needs a run folder to write the snapshot in")
    return run_dir / SNAPSHOTS


@dataclass
class Metrics:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    # steps run under the storage tracker (memory measured, time slowed), and the share of the
    # machine other processes took while the others ran (memexp.timing)
    measured_steps: list[int] = field(default_factory=list)
    others_cpu_share: float | None = None
    # [step, seconds] of the baseline's step beside each paired step (PairedBaseline), and why
    # the run has none where it has none
    baseline_step_times: list[list] = field(default_factory=list)
    unpaired: str | None = None
    eval_accuracy: float | None = None
    # steps the GradScaler skipped (inf/NaN gradients), and steps with a non-finite loss or
    # gradients (memexp skipped them)
    skipped_steps: int = 0
    bad_steps: int = 0
    resumed_from: list[int] = field(default_factory=list)


def non_finite(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Whether any of `tensors` holds a NaN or an infinity, as a 0-d bool tensor on `device`,
    read by no host sync here: the largest magnitude of each, in one fused kernel per device and
    dtype (not their norm, which overflows where none of them does). A sparse gradient is
    checked by its values; an empty tensor (a rank's empty shard) holds none."""
    values = [t._values() if t.is_sparse else t for t in tensors]
    values = [v for v in values if v.numel()]
    if not values:
        return torch.zeros((), dtype=torch.bool, device=device)
    largest = torch.stack(torch._foreach_norm(values, math.inf))
    return largest.isfinite().all().logical_not().to(device)


def nothing_to_wait_for() -> None:
    """A CPU's ops have ended when they return."""


def numpy_random_state() -> dict:
    """numpy's global random state, as a checkpoint loaded with weights_only holds it (its key
    as a tensor)."""
    state = np.random.get_state(legacy=False)
    return {**state, "state": {**state["state"],
                               "key": torch.from_numpy(state["state"]["key"].astype(np.int64))}}


def set_numpy_random_state(state: dict) -> None:
    key = state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**state, "state": {**state["state"], "key": key}})


class Trainer:
    """Build with `Trainer(cfg, run_dir)`, train with `fit()`; the meter is `trainer.meter`.
    Checkpoints need a run folder (they live in `<run_dir>/checkpoints`). Estimates pass an
    `allocator` model, `data` built outside their fake tensors, and the `model`, uninitialised
    (memexp.estimate.trace)."""

    def __init__(self, cfg: DictConfig, run_dir: Path | None = None,
                 allocator: CachingAllocatorModel | None = None, data: Data | None = None,
                 model: nn.Module | None = None):
        self.cfg = cfg
        validate(cfg.trainer)
        if cfg.trainer.checkpoint_every and run_dir is None:
            raise ValueError("trainer.checkpoint_every needs a run folder to keep checkpoints in")
        self.checkpoints = run_dir / checkpoint.FOLDER if run_dir is not None else None
        if cfg.trainer.threads is not None:
            torch.set_num_threads(cfg.trainer.threads)
        self.device = pick_device(cfg.trainer.device)
        # CUDA runs kernels asynchronously: a step waits for its own, so that its time is its own
        # and not the next step's (an estimate's fake CUDA device runs nothing).
        self.wait_for_device = (functools.partial(torch.cuda.synchronize, self.device)
                                if self.device.type == "cuda" and allocator is None
                                else nothing_to_wait_for)
        torch.manual_seed(cfg.trainer.seed)
        # numpy's too: some models draw from it in training (wav2vec2's and HuBERT's
        # SpecAugment masks); numpy takes seeds below 2**32
        np.random.seed(torch.initial_seed() % 2**32)
        self.data: Data = build(cfg.data) if data is None else data
        self.precision = build(cfg.precision)
        self.checkpointing = build(cfg.checkpointing)
        self.bn_mode = build(cfg.bn_mode)
        self.parallel = build(cfg.parallel)
        self.optim = build(cfg.optim)
        self.compile = build(cfg.compile)
        self.adapter = build(cfg.adapter)
        check_combination(self.precision, self.optim, self.parallel, self.bn_mode,
                          self.checkpointing, self.compile, self.adapter, self.device,
                          cfg.trainer.checkpoint_every)

        model = build_model(cfg.model) if model is None else model
        # After the model: loss=model weighs micro-batches as the model's own loss reduces its
        # batch (memexp.reduction.REDUCTIONS: a CTC head's mean or sum).
        self.loss = as_loss(build(cfg.loss), model)
        check_loss_combination(self.loss, self.parallel)
        # What loading model.pretrained reported (memexp.models.hf), for the record; None
        # where no weights were loaded.
        self.model_load = LOADED.get(model)
        first = self.data.first_batch()
        check_signature(model, first, self.loss.passes_labels)
        # The techniques, in this order:
        # 1. BatchNorm changes first: they need the model's raw Conv->BN structure, and may run
        #    it on a sample (on the host, before it moves: one sample keeps that cheap).
        sample = map_batch(first, lambda tensor: tensor[:1])
        model = self.bn_mode.apply(model, functools.partial(
            call_model, batch=sample, passes_labels=self.loss.passes_labels))
        # 2. The adapter (LoRA) while the layers are the model's own, before checkpointing and
        #    parallel wrap them, and on the host: QLoRA's base weights reach the device already
        #    in 4 bits (bitsandbytes quantises them as they move), to compute in the precision's
        #    dtype. Its adapters are then cast, wrapped and sharded with the rest.
        model = self.adapter.apply(model, self.device, self.precision.compute_dtype)
        # 3. Onto the device; precision casts parameters (pure half; autocast the frozen ones)
        #    before anything keeps a reference to them, and learns the device type for autocast.
        model = self.precision.apply(model.to(self.device))
        # 4. Checkpointing wraps blocks, which parallel wrappers then treat as units.
        model = self.checkpointing.apply(model)
        # 5. Compile traces the model as precision and checkpointing left it (cast parameters;
        #    autocast and checkpointing=budget are read when the first forward pass compiles),
        #    and goes inside the parallel wrapper: DDP's gradient hooks stay eager around the
        #    compiled model (FSDP2 is refused: memexp.techniques.compile).
        model = self.compile.apply(model)
        # 6. Parallel wrappers (DDP, FSDP) go outermost; FSDP gathers parameters in the
        #    precision's compute dtype.
        self.model = self.parallel.apply(model, self.precision.autocast_dtype)
        # The optimizer reads what it needs from the model as it will train (optim=muon: which
        # weights it steps, found in the blocks), before the blocks are recorded below.
        self.model = self.optim.apply(self.model)
        # Read at every step's end (their gradients) and the run's (their values): the same
        # objects throughout (FSDP's are the shards).
        self.parameters = list(self.model.parameters())
        self.trainable = sum(p.requires_grad for p in self.parameters)
        check_trainable(self.trainable)  # an optimizer over no parameter fails less clearly
        # The blocks the techniques resolved (memexp.models.blocks), for the record; and after
        # the first forward pass, every module a technique changed must have run.
        self.blocks = {group: option.found.summary() for group, option in self._changing()
                       if option.found is not None}
        for group, summary in self.blocks.items():
            log.info("%s: blocks %s x%d", group, summary["class"], summary["count"])
        self.first_forward = FirstForward(model, {group: option.changed
                                                  for group, option in self._changing()},
                                          lookups=not self.compile.compiles)
        # 7. The meter's gradient hooks before the optimizer's (optim.in_backward has its own).
        #    FSDP's CPU offload keeps the (sharded) parameters in host memory.
        self.meter = MemoryMeter(
            self.device, track=cfg.memory.track, budget=memory_budget(cfg.memory),
            snapshot_to=snapshot_folder(cfg.memory, run_dir),
            snapshot_entries=cfg.memory.snapshot_max_entries,
            warmup_steps=cfg.trainer.warmup_steps, allocator=allocator,
            measure_steps=cfg.memory.measure_steps, compiled=self.compile.compiles)
        with self.parallel.offloaded():
            self.meter.watch(self.parallel.watched(self.model), self.adapter.kept_apart())
        # 8. The optimizer last, over the parameters as they now are (or their master copies);
        #    zero1 shards its state across ranks.
        self.optimizer = self.parallel.optimizer(self.optim,
                                                 self.precision.parameters(self.model))
        with self.optim.offloaded():  # optim.offload=cpu: its host tensors
            self.meter.watch_optimizer(self.optimizer)
        self.empty_cache_at = cfg.memory.empty_cache  # a str enum: "never", "step" or "eval"
        self.metrics = Metrics()
        # The first step checks what every later one takes for granted (its loss and outputs).
        self.first_step = True
        # What the run continues from, loaded as it is built: before app.record_run writes
        # anything, so that a rerun that cannot continue leaves its folder as it was.
        self.resumed = self.load_checkpoint()
        # Off a terminal, where tqdm's bar is hidden: a progress line every few seconds.
        self.progress = progress_lines(cfg.trainer.max_steps,
                                       cfg.trainer.progress and self.parallel.rank == 0)

    def _changing(self) -> list[tuple[str, object]]:
        """The options that may resolve blocks and change modules, by group."""
        return [("bn_mode", self.bn_mode), ("adapter", self.adapter),
                ("checkpointing", self.checkpointing), ("parallel", self.parallel),
                ("optim", self.optim)]

    def to_device(self, batch: Batch) -> Batch:
        batch = map_batch(batch, lambda t: t.to(self.device, non_blocking=True))
        return map_inputs(batch, self.precision.cast_inputs)

    def forward(self, batch: Batch) -> Outputs:
        return call_model(self.model, batch, self.loss.passes_labels)

    def compute_loss(self, outputs: Outputs, batch: Batch) -> Tensor:
        """The loss, whose memory (forward and backward, down to the logits) the meter counts
        as the loss's own category, where the loss computes it from the logits itself."""
        if not self.loss.reads_logits:  # the model's own loss, or one of the user's
            return self.loss(outputs, batch)
        with computing_loss():
            if outputs.logits is not None and outputs.logits.requires_grad:
                outputs.logits = LossBoundary.apply(outputs.logits, False)
            loss = self.loss(outputs, batch)
            return LossBoundary.apply(loss, True) if loss.requires_grad else loss

    def train_step(self, batches: Iterator[Batch]) -> float:
        """One optimizer step over `optim.accumulate` micro-batches; returns the mean loss."""
        accumulate, meter, losses = self.optim.accumulate, self.meter, []
        # Every micro-batch is fetched first: each weighs by its share of the step's items
        # (memexp.loss.shares), which takes counting them all.
        micros = [next(batches) for _ in range(accumulate)]
        weights = shares(self.loss, micros) if accumulate > 1 else [1.0]
        for micro in range(accumulate):
            batch, micros[micro] = self.to_device(micros[micro]), None
            with self.parallel.accumulating(micro < accumulate - 1):
                with (meter.phase("forward"), self.precision.autocast(),
                      self.checkpointing.context()):
                    outputs = self.forward(batch)
                    if self.first_step:
                        self.loss.check(outputs, batch)
                    loss = self.compute_loss(outputs, batch)
                    del outputs  # the logits go as soon as the loss no longer needs them
                    if self.first_step:
                        check_loss(loss, self.loss.key)
                    # Weigh for accumulation; skipped at k=1, where the extra autograd node
                    # would only cost time (x * 1 == x bitwise).
                    loss = loss * weights[micro] if accumulate > 1 else loss
                # Autograd keeps what backward needs; holding the batch longer costs memory.
                del batch
                with meter.phase("backward"):
                    self.precision.backward(loss)
            losses.append(loss.detach())
        # With FSDP's CPU offload the step runs on the host, where its state lives.
        with meter.phase("optimizer"), self.parallel.offloaded():
            total, finite = self.outcome(losses)
            self.first_step = False
            if finite:
                # A step skipped for non-finite gradients (fp16 loss scaling) is counted.
                self.metrics.skipped_steps += not self.precision.step(self.optimizer)
            else:
                # A NaN or infinity never reaches the weights, and its gradients do not outlive
                # the step (the optimizer's zero_grad below does not see them where it updates
                # master copies); fit() stops after max_bad_steps.
                self.metrics.bad_steps += 1
                self.model.zero_grad(set_to_none=not self.optim.keep_grads)
            # Free the gradients now: no need for this memory until the next backward
            # (optim.keep_grads zeroes them in place instead, as torch < 2.0 did).
            self.optimizer.zero_grad(set_to_none=not self.optim.keep_grads)
        meter.end_step()
        self.wait_for_device()
        return total

    def outcome(self, losses: list[Tensor]) -> tuple[float, bool]:
        """The step's loss, the mean over all ranks' samples (the global batch's loss), and
        whether it and the step's gradients are finite. One host sync reads both, the one the
        loss took anyway; summed over ranks, they are the same on every rank, so that all take
        the same decisions about a non-finite step. The first step checks that the loss gave a
        parameter a gradient."""
        grads = [self.parallel.local(p.grad) for p in self.parameters if p.grad is not None]
        # optim.in_backward stepped each parameter, and checked its gradient, inside backward
        # (optim.offload_gradients checked each before it left the device); a GradScaler
        # checks them itself.
        in_backward = self.optim.grads_leave_in_backward
        if self.first_step:
            check_reached(bool(grads) or in_backward and self.optimizer.reached, self.loss.key,
                          self.trainable)
        checked = [] if self.precision.scales_loss or in_backward else [
            non_finite(grads, self.device)]
        values = self.parallel.all_reduce_sum(torch.stack([*losses, *checked])).tolist()
        # A float: no graph outlives its step.
        total = sum(value / self.parallel.world_size for value in values[:len(losses)])
        bad = any(values[len(losses):]) or in_backward and self.optimizer.non_finite
        return total, math.isfinite(total) and not bad

    @torch.inference_mode()
    def evaluate(self, batches: int | None = None) -> float | None:
        """Accuracy over the eval set (its first `batches` batches); None where the loss has no
        notion of it (regression)."""
        self.model.eval()
        # (correct, counted, outside the model's classes) stays on the device until the end: no
        # host sync per batch.
        totals = torch.zeros(3, device=self.device, dtype=torch.long)
        classes = None
        with self.meter.phase("eval"), self.precision.autocast():
            for batch in itertools.islice(
                    self.data.eval_batches(self.parallel.rank, self.parallel.world_size), batches):
                batch = self.to_device(batch)
                hits = self.loss.hits(self.forward(batch), batch)
                if hits is not None:
                    totals += torch.stack(hits[:3])
                    classes = hits.classes
        self.model.train()
        correct, counted, outside = self.parallel.all_reduce_sum(totals).tolist()
        if outside:  # they would count as misses
            # (a rank that had no eval batch knows no classes, and raises alike)
            valid = f"0 to {classes - 1}" if classes is not None else "the model's classes"
            raise ValueError(
                f"data: {outside} of the eval set's targets name no class of the model: valid "
                f"targets are {valid}, and {IGNORE} (not counted). Match the eval data's labels "
                "(data.eval, data.eval_split) to the model's head (model)")
        return correct / counted if counted else None

    def fit(self, logger) -> Metrics:
        trainer = self.cfg.trainer
        # Plain ints: reading a DictConfig in the loop would cost tens of microseconds a step.
        max_steps, eval_every, log_every, checkpoint_every, max_bad_steps = (
            int(trainer[key]) for key in
            ("max_steps", "eval_every", "log_every", "checkpoint_every", "max_bad_steps"))
        start = step = self.resume()
        metrics = self.metrics  # after resume(), which brings back the earlier steps' metrics
        batches = self.data.train_batches(start * self.optim.accumulate, self.parallel.rank,
                                          self.parallel.world_size)
        self.model.train()
        # tqdm: hidden off a terminal (disable=None), and until the run is a few seconds old.
        bar = tqdm(total=max_steps, initial=start, disable=None if trainer.progress else True,
                   delay=3, unit="step", leave=False)
        out_of_memory, load, evaluated = None, MachineLoad(), False
        pairing: PairedBaseline | Unpaired = Unpaired("the run ended before its first step")
        try:
            with self.meter, bar:
                # The baseline beside the timed steps, once memory is measured (memexp.baseline).
                pairing = self.pair_with_baseline(max_steps - start)
                load.start()
                for step in range(start + 1, max_steps + 1):
                    measured, counted = self.meter.tracking, self.meter.measuring
                    with pairing.beside(step):
                        started = time.perf_counter()
                        loss = self.train_step(batches)
                        metrics.step_times.append(time.perf_counter() - started)
                    metrics.measured_steps += [step] if measured else []
                    metrics.losses.append(loss)
                    if pairing.holds_memory and self.step_timing()["paired"].get("settled"):
                        pairing.settled()  # the ratio is known well enough: the rest run alone
                    if metrics.bad_steps >= max_bad_steps:
                        raise NonFiniteLoss(
                            f"{metrics.bad_steps} steps with a non-finite loss or gradients (the "
                            f"last at step {step}, loss {loss}); "
                            f"trainer.max_bad_steps={max_bad_steps}")
                    self.release_cached_memory("step")
                    bar.update()
                    self.progress.step(step, loss)
                    last = step == max_steps
                    if last or (eval_every and step % eval_every == 0):
                        metrics.eval_accuracy = self.evaluate()
                        self.release_cached_memory("eval")
                        evaluated |= counted
                    if last or step % log_every == 0:
                        bar.set_postfix(loss=f"{loss:.3f}")
                        logger.log(step, self.step_metrics())
                    if checkpoint_every and (last or step % checkpoint_every == 0):
                        self.save_checkpoint(step)
                    if counted and not last and step - start == self.meter.measure_steps:
                        self.stop_measuring(evaluated)
                        pairing = self.pair_with_baseline(max_steps - step)
                        load.start()  # what the timed steps shared the machine with
            self.check_weights()
            metrics.others_cpu_share = load.others_share(sum(self.parallel.gather(load.own_cpu())))
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            first_line = str(error).strip().splitlines()[0]
            if pairing.holds_memory:  # the run might fit alone: say so
                first_line += (" (with its baseline beside it, for timing.paired_steps: "
                               "timing.paired_steps=0 runs it alone)")
            out_of_memory = OutOfMemory(first_line, self.meter.last_phase, step)
        finally:
            # Why the run has no paired ratio, or stopped pairing early; and the baseline's
            # memory goes now, whatever ended the run.
            metrics.unpaired, pairing = pairing.why, None
        # Outside the except block, as the PyTorch FAQ advises: the error's traceback, and with
        # it the failed step's tensors, are gone, so the memory can really be given back.
        if out_of_memory is not None:
            del batches  # the data stream too: a raised error keeps this frame's locals alive
            self.optimizer.zero_grad(set_to_none=True)
            free_cached_memory(self.device)
            raise out_of_memory
        return metrics

    @torch.no_grad()
    def check_weights(self) -> None:
        """A run is ok only if its final weights are finite: no step lets a NaN or infinite
        gradient reach them, but an update can still overflow. On every rank, which all raise
        alike. Only the trained ones: frozen weights (adapter=lora, qlora's 4-bit ones) are
        never updated."""
        trained = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        local = [self.parallel.local(p) for _, p in trained]
        # One parameter at a time: after the meter's last phase CUDA's counters still count
        # (its idle phase), and a fused check's workspace grows with their number.
        found = torch.zeros((), dtype=torch.long, device=self.device)
        for tensor in local:
            found += non_finite([tensor], self.device)
        if not self.parallel.all_reduce_sum(found).item():
            return
        names = [name for (name, _), tensor in zip(trained, local, strict=True)
                 if non_finite([tensor], self.device).item()]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise NonFiniteLoss(
            f"the final weights are not finite: NaN or infinite values in "
            f"{shown or 'the shards of another rank'}, though no step let a NaN or infinite loss "
            "or gradient reach them: an update overflowed (a lower optim.lr, or a precision "
            "with more range)")

    def stop_measuring(self, evaluated: bool) -> None:
        """Memory has been measured on the first steps (memory.measure_steps): measure an
        evaluation too if none ran yet (its accuracy is not the run's), then turn the tracker
        off, so that the steps after run at full speed for their step time."""
        if not evaluated:
            # Two batches: the second is fetched while the first is still referenced, and every
            # later one repeats that (the last may be smaller), so their peak is the eval's.
            self.evaluate(batches=2)
            self.release_cached_memory("eval")
        self.meter.pause()

    def pair_with_baseline(self, steps_left: int) -> PairedBaseline | Unpaired:
        """The run's baseline beside its next timing.paired_steps steps (of `steps_left`), or why
        there is none."""
        paired_steps = self.cfg.timing.paired_steps
        # a resumed run may have paired steps already
        steps = min(paired_steps - len(self.metrics.baseline_step_times), steps_left)
        config = baseline_config(OmegaConf.to_container(self.cfg, resolve=True,
                                                        enum_to_str=True))
        if config is None:
            return Unpaired("the run is its own baseline")
        if steps <= 0:
            return Unpaired(f"timing.paired_steps={paired_steps}")
        if self.parallel.world_size > 1:
            return Unpaired("a run of several ranks: its baseline would need ranks of its own")
        if self.meter.tracking:  # until memory is measured, if it ever is (fit() asks again)
            return Unpaired("every step of the run measured memory (memory.measure_steps, "
                            "memory.budget, memory.snapshot), and a baseline beside the run "
                            "would count in it")
        why = self.meter.stop_counting()  # CUDA's counters stand aside while the baseline runs
        if why is not None:
            return Unpaired(why)
        log.info("timing: %d steps run beside the run's baseline (%s at their baseline options, "
                 "data.batch_size=%s, optim.accumulate=1), built in this process",
                 steps, ", ".join(BASELINE_GROUPS), config["data"]["batch_size"])
        return PairedBaseline(config, steps, self.metrics.baseline_step_times, self.meter,
                              Trainer)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        cuda = self.device.type == "cuda"
        state = {
            "step": step,
            "config": checkpoint.fingerprint(self.cfg),  # what a resumed run must match
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "precision": self.precision.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": numpy_random_state(),
                    "cuda": torch.cuda.get_rng_state_all() if cuda else []},
            "metrics": dataclasses.asdict(self.metrics),
        }
        return checkpoint.save(self.checkpoints, step, state, self.cfg.trainer.keep_checkpoints)

    def load_checkpoint(self) -> tuple[Path, int, dict] | None:
        """trainer.resume=auto: load the newest checkpoint of this run folder that loads (a
        requeued or rerun job) into the model, the optimizer, the precision and the metrics, if
        this run can continue it (else ResumeRefused): this run's config wrote it, with steps
        left, and it loads into this run (not a model whose code has changed since, nor metrics
        of another memexp version). Returns its path, step and random states, for resume(), or
        None. trainer.resume=never starts the folder over instead."""
        if self.checkpoints is None:
            return None
        if self.cfg.trainer.resume != "auto":
            # They are the checkpoints of the run whose record this one replaces. Left here, a
            # later rerun would continue one of them, or take this run's record for theirs.
            checkpoint.remove_all(self.checkpoints)
            return None
        found = checkpoint.load_newest(self.checkpoints)
        if found is None:
            return None
        path, state = found
        checkpoint.check_resumable(path, state, self.cfg)
        try:
            self.metrics = Metrics(**state["metrics"])
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.precision.load_state_dict(state["precision"])
            random_states = state["rng"]
            if "numpy" not in random_states:  # written before numpy's state was kept
                raise KeyError("the checkpoint has no rng.numpy")
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            if is_out_of_memory(error):  # it would load where there is room: not a refusal
                raise
            raise checkpoint.ResumeRefused(
                f"{path} was written by this run's config, but it does not load into this "
                f"run: {type(error).__name__}: {error}\nThe model's code has changed since, or "
                "another memexp version wrote it; a run continued from it would record two "
                f"runs as one. {checkpoint.WHAT_TO_DO}") from error
        return path, state["step"], random_states

    def resume(self) -> int:
        """Continue from the checkpoint that load_checkpoint() loaded: its random states go back
        now, at the start of fit(), so that nothing drawn since the run was built moves them.
        Returns the step it ends, or 0."""
        if self.resumed is None:
            return 0
        path, step, random_states = self.resumed
        torch.set_rng_state(random_states["torch"])
        random.setstate(random_states["python"])
        set_numpy_random_state(random_states["numpy"])
        if random_states["cuda"]:
            torch.cuda.set_rng_state_all(random_states["cuda"])
        self.metrics.resumed_from.append(step)
        log.info("resumed from %s (step %d)", path, step)
        return step

    # -- memory --------------------------------------------------------------------------------
    def release_cached_memory(self, point: str) -> None:
        """memory.empty_cache: give cached blocks back at this point (source tips 10 and 13)."""
        if self.empty_cache_at == point:
            free_cached_memory(self.device)

    # -- reporting -----------------------------------------------------------------------------
    def step_metrics(self) -> dict[str, float | None]:
        """The same keys every step; None where a value is not known (yet)."""
        return {
            "loss": self.metrics.losses[-1],
            "step_time_s": self.metrics.step_times[-1],
            "memory_bytes": self.meter.live_bytes(),
            "eval_accuracy": self.metrics.eval_accuracy,
        }

    def step_timing(self) -> dict:
        """The `timing` part of result.json's metrics (memexp.timing), of the steps so far."""
        metrics = self.metrics
        return step_timing(metrics.step_times, metrics.measured_steps,
                           self.cfg.trainer.warmup_steps, metrics.others_cpu_share,
                           metrics.baseline_step_times, metrics.unpaired,
                           self.cfg.timing.paired_spread)

    def summary_metrics(self) -> dict:
        """The `metrics` section of result.json (also of a run that stopped early)."""
        metrics = self.metrics
        timing = self.step_timing() if metrics.step_times else None
        step_time = timing["step_time_s"] if timing else None
        items = (self.data.batch_size * self.optim.accumulate * self.parallel.world_size
                 * self.data.items_per_sample)
        last = metrics.losses[-10:]
        return {
            "final_loss": sum(last) / len(last) if last else None,
            "eval_accuracy": metrics.eval_accuracy,
            "throughput": items / step_time if step_time else None,
            "throughput_unit": f"{self.data.unit}/s",
            "step_time_s": step_time,
            "timing": timing,
            "steps": len(metrics.losses),
            "skipped_steps": metrics.skipped_steps,
            "bad_steps": metrics.bad_steps,
            "resumed_from": metrics.resumed_from,
            "loss_scale": self.precision.loss_scale(),
            "losses": metrics.losses,
        }
