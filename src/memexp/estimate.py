"""`memexp estimate`: a run's peak memory, predicted without allocating it.

The composed config's own trainer runs two optimizer steps and two evaluation batches under
`FakeTensorMode`: every tensor is metadata only (shape, dtype, device), every op runs its shape
function instead of its kernel, and the live-storage tracker that measures real CPU runs counts
the fake storages exactly as it counts real ones. Two steps, because the optimizer state that
step 1 creates is alive throughout step 2. Nothing is allocated, so a 7B-parameter model is
estimated on a laptop; the time goes into Python dispatch, a few seconds per thousand ops.

Before tracing, what values decide is checked for real (memexp.prechecks.dry_run): the batch's
keys, token ids and positions against every embedding, targets against the model's classes. A
config that a real run would refuse gets the same error, not a number.

Where the estimate and a real run can differ:
- values are unknown: a Python branch on a tensor's value (`loss.item()`, a found-inf check)
  sees 0, or True for a boolean, so a fake fp16 step is never skipped;
- on CUDA, kernels may keep different workspaces than the CPU kernels traced here, and the
  caching allocator rounds every block; `target="cuda"` models that rounding
  (memexp.memory.allocator), so allocated and reserved bytes are both predicted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from memexp.config import config_dir, target_path
from memexp.data import synthetic_tokens
from memexp.loggers import NoLogger
from memexp.loss import as_loss
from memexp.memory.allocator import CachingAllocatorModel
from memexp.prechecks import check_signature, dry_run
from memexp.result import CATEGORY_ORDER, mib
from memexp.techniques import check_estimable
from memexp.trainer import Trainer, build, build_model, first_steps

_SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


class _UnknownValues(TorchDispatchMode):
    """Above FakeTensorMode: what a fake tensor's value would be is unknown, so reading one
    (`.item()`, `bool(t)`) gives 0, or True for a boolean (a finite-check passes)."""

    def __init__(self, fake: FakeTensorMode):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func not in _SCALAR_READS:
                raise
            return True if args[0].dtype == torch.bool else 0
        finally:
            # FakeTensorMode memoizes each output through a weak reference, and torch refuses
            # to swap a module's parameters (`model.half()`, `model.to()`) while one exists.
            # The memo only matters within one op, so it is emptied after every op.
            self.fake.fake_tensor_converter.meta_converter.tensor_memo.clear()


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `python train.py <overrides>` would run."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=overrides)


class _FlopsByPhase(TorchDispatchMode):
    """FLOPs of matmuls and convolutions (torch's own formulas), by the meter's phase: backward
    includes what activation checkpointing recomputes."""

    def __init__(self):
        super().__init__()
        self.by_phase: dict[str, int] = defaultdict(int)
        self.phase = lambda: "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = flop_registry.get(func._overloadpacket)
        if formula is None and func is not torch.ops.prim.device.default:
            # A composite op that reaches dispatch whole (aten.linear under inference_mode):
            # count the ops it is made of. Their tensors stay below the memory tracker.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.by_phase[self.phase()] += formula(*args, **kwargs, out_val=out)
        return out


@dataclass
class Estimate:
    memory: dict  # the shape of result.json's `memory` section
    parameters: int  # the model's parameter count
    # FLOPs of one optimizer step by phase (forward, backward, optimizer), and of one eval batch
    flops: dict[str, int]
    seconds: float  # how long the estimate took
    target: str  # "cpu" (what the tracker counts) or "cuda" (the caching allocator's view)


def estimate(cfg: DictConfig, target: str = "cpu") -> Estimate:
    """Predict the peak memory of the run `cfg` describes, on a CPU or a CUDA device."""
    if target not in ("cpu", "cuda"):
        raise ValueError(f"estimate target={target}: expected cpu or cuda")
    check_estimable(get_class(cfg.parallel._target_))
    started = time.perf_counter()
    cfg = steps_to_trace(cfg)
    allocator = CachingAllocatorModel() if target == "cuda" else None
    data = build(stand_in_data(cfg.data))
    check_before_tracing(cfg, data)
    fake, flops = FakeTensorMode(allow_non_fake_inputs=True), _FlopsByPhase()
    with fake, _UnknownValues(fake):
        trainer = Trainer(cfg, allocator=allocator, data=data)
        flops.phase = lambda: trainer.meter.tracker.phase
        with flops:
            trainer.fit(NoLogger())
    memory = trainer.meter.report()
    memory["source"] = f"estimate ({target})"
    if allocator is not None:
        memory["reserved_peak_bytes"] = allocator.reserved_peak
    # Two training steps and two eval batches were traced.
    per_step = {phase: flops.by_phase[phase] // 2
                for phase in ("forward", "backward", "optimizer", "eval")}
    parameters = sum(p.numel() for p in trainer.model.parameters())
    return Estimate(memory, parameters, per_step, time.perf_counter() - started, target)


def check_before_tracing(cfg: DictConfig, data) -> None:
    """What a real run would refuse at its first forward pass, from values that a trace cannot
    see: the batch's keys against forward's signature, every embedding lookup (token ids, the
    position table), the targets against the model's classes. The model is built on the meta
    device: nothing is allocated."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    loss = as_loss(build(cfg.loss))
    batch = data.first_batch()
    check_signature(model, batch, loss.passes_labels)
    dry_run(model, batch, loss)


def stand_in_data(data: DictConfig) -> DictConfig:
    """The data set, generated for real: under fake tensors every op of a generator costs
    about half a millisecond. Token values never change memory, so a synthetic token set is
    drawn from 64 words (its rule table is vocabulary squared: 20 GB at 50k words); the model
    keeps its own vocabulary. Batches are made in this process (no loader workers)."""
    stand_in = OmegaConf.create(OmegaConf.to_container(data, resolve=True))
    if stand_in._target_ == target_path(synthetic_tokens):
        stand_in.vocab_size = min(stand_in.vocab_size, 64)
    if "num_workers" in stand_in:
        stand_in.num_workers = 0
    return stand_in


def steps_to_trace(cfg: DictConfig) -> DictConfig:
    """The run, cut to what sets its peak: two steps and two eval batches, on the CPU kernels,
    with nothing written. A synthetic eval set shrinks to two batches (the second is fetched
    while the first is still referenced, and every later one repeats that); the train set keeps
    its size, because the epoch's sample order is a live tensor of that size."""
    cfg = first_steps(cfg)
    with open_dict(cfg):
        cfg.trainer.update(device="cpu", warmup_steps=0)
        cfg.memory.update(track=True, budget=None)
        if "num_eval" in cfg.data:  # the synthetic sets (real readers have a fixed size)
            cfg.data.num_eval = min(cfg.data.num_eval, 2 * cfg.data.eval_batch_size)
    return cfg


def describe(cfg: DictConfig, result: Estimate) -> str:
    """The estimate for people: the peak, and each phase's peak by category."""
    memory = result.memory
    device = "a CUDA device (caching allocator modelled)" if result.target == "cuda" else "CPU"
    lines = [f"memexp estimate for {device}: {result.parameters / 1e6:,.1f}M parameters, "
             f"batch {cfg.data.batch_size} x accumulate {cfg.optim.accumulate} "
             f"({result.seconds:.1f} s, nothing allocated)",
             f"  peak         {mib(memory['peak_bytes'])} in {memory['peak_phase']}"]
    if result.target == "cuda":
        lines.append(f"  reserved     {mib(memory['reserved_peak_bytes'])} (allocator segments)")
    header = f"  {'phase':<10}{'peak':>12}" + "".join(f"{c:>13}" for c in CATEGORY_ORDER)
    lines += ["", header]
    for name, phase in memory["phases"].items():
        cells = "".join(f"{mib(phase['breakdown'][c]):>13}" for c in CATEGORY_ORDER)
        lines.append(f"  {name:<10}{mib(phase['peak_bytes']):>12}{cells}")
    flops = result.flops
    lines += ["", f"  FLOPs/step   forward {flops['forward'] / 1e9:,.2f} G, backward "
              f"{flops['backward'] / 1e9:,.2f} G (recomputation included), eval batch "
              f"{flops['eval'] / 1e9:,.2f} G"]
    return "\n".join(lines)
