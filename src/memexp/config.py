"""Structured-config schemas, so that a typo or a wrong type fails at compose time, naming the key.

- The root schema (`train_schema`) types the `trainer` and `memory` keys.
- Every group option (`conf/<group>/<name>.yaml`) extends a schema generated from the signature of
  its `_target_` (`schema/<group>/<Target>`): the constructor is the single definition of a
  technique's keys, and `model.widht=3` or `checkpointing.every=abc` fail before anything runs.
  The groups and their targets are those conf/ names (memexp.registry).

Importing this module registers the schemas: whatever composes a config imports `config_dir`
from here.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from memexp import registry
from memexp.registry import config_dir, target_path


class Device(str, enum.Enum):
    auto = "auto"  # CUDA when there is one, else CPU
    cpu = "cpu"
    cuda = "cuda"


class Resume(str, enum.Enum):
    auto = "auto"  # continue from the newest valid checkpoint in the run folder, if there is one
    never = "never"


@dataclass
class TrainerConfig:
    # optimizer steps to run (each takes optim.accumulate micro-batches)
    max_steps: int = 200
    # evaluate every this many steps; 0 evaluates once, at the end
    eval_every: int = 0
    # seeds model initialisation and dropout; data order has its own data.seed
    seed: int = 0
    device: Device = Device.auto
    # first steps left out of step time and throughput (allocator and cache warm-up)
    warmup_steps: int = 3
    # logger rows every this many steps
    log_every: int = 10
    # a progress bar on terminals, for runs longer than a few seconds
    progress: bool = True
    # steps with a non-finite loss (skipped: they never touch the weights) before the run stops
    # with status nan
    max_bad_steps: int = 3
    # a checkpoint every this many steps and at the last, in <run dir>/checkpoints; 0: none
    checkpoint_every: int = 0
    # how many checkpoints to keep, newest first
    keep_checkpoints: int = 2
    # auto: a run whose folder has a checkpoint (a requeued or rerun job) continues from it
    resume: Resume = Resume.auto
    # torch's intra-op threads; unset: torch's own choice (one per core, or OMP_NUM_THREADS). A
    # local sweep sets it for its jobs from the cores other processes leave free at its start:
    # a thread that shares its core with another process holds up every op (memexp_launcher)
    threads: Optional[int] = None  # noqa: UP045 (OmegaConf needs Optional)
    # processes a plain `python train.py` starts on this machine (ranks of parallel=ddp|zero1|
    # fsdp); under torchrun or hydra.launcher.tasks_per_node leave it at 1
    nproc: int = 1


class EmptyCache(str, enum.Enum):
    never = "never"
    step = "step"  # after every optimizer step
    eval = "eval"  # after every evaluation


@dataclass
class MemoryConfig:
    # track live tensor storage: the category breakdown, and the totals on CPU; false runs the
    # loop at full speed (CUDA totals still come from the device counters)
    track: bool = True
    # free cached memory (gc.collect, and torch.cuda.empty_cache on CUDA) at these points: the
    # source's tips 10 and 13. It lowers reserved memory, not the peak allocated.
    empty_cache: EmptyCache = EmptyCache.never
    # pretend the device has this size (16GiB, 16GB, 500MiB): CUDA through the per-process
    # memory fraction; on CPU the tracker raises torch.OutOfMemoryError once live tensor bytes
    # pass it. The run then ends with status oom, its peak and the phase, as on such a device.
    budget: Optional[str] = None  # noqa: UP045 (OmegaConf needs Optional)
    # a memory snapshot in <run dir>/memory/ at the end of the run and on an OOM: CUDA's
    # allocator history (memory_snapshot.pickle, for pytorch.org/memory_viz), or on CPU a
    # timeline of live bytes by category (memory_timeline.png and .csv)
    snapshot: bool = False
    # the most events a snapshot keeps (CUDA allocator history entries, CPU timeline points)
    snapshot_max_entries: int = 100_000
    # memory is measured on this many first steps (and one evaluation), with the tracker on; the
    # steps after them run without it and give the step time. null: every step (memory.budget
    # and memory.snapshot on CPU always measure every step)
    measure_steps: Optional[int] = 10  # noqa: UP045 (OmegaConf needs Optional)


@dataclass
class TimingConfig:
    # the first this many timed steps (those after memory.measure_steps) each run beside a step
    # of the run's baseline (memexp.baseline), built in the same process, the two by turns first:
    # their time ratio then sees the same machine at the same moments. 0: none (the report then
    # divides the median step times of separate runs, which carry each process's speed)
    paired_steps: int = 40
    # ... or fewer: the pairing stops once a 90% confidence interval of the step-by-step ratios'
    # median (distribution-free, from memexp.timing.MIN_PAIRS = 5 pairs on) is within this
    # fraction of it on either side. A ratio whose pairs ran out first is marked uncertain (`?`)
    # in the report
    paired_spread: float = 0.1


@dataclass
class ReportConfig:
    # a device size such as 12GiB or 16GB: the sweep report names the fastest and the most
    # accurate configs that fit in it
    budget: Optional[str] = None  # noqa: UP045 (OmegaConf needs Optional)


@dataclass
class TrainConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    # the groups: each holds one option, built from its `_target_`
    data: Any = MISSING
    model: Any = MISSING
    optim: Any = MISSING
    precision: Any = MISSING
    checkpointing: Any = MISSING
    compile: Any = MISSING
    parallel: Any = MISSING
    bn_mode: Any = MISSING
    adapter: Any = MISSING
    loss: Any = MISSING
    logger: Any = MISSING


def _config_type(hint):
    """The nearest type OmegaConf can validate; `Any` where it has none."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            # OmegaConf understands Optional[X], not X | None.
            return typing.Optional[_config_type(options[0])]  # noqa: UP045
        return Any
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return list[_config_type(args[0])] if args else list
    if hint in (int, float, bool, str) or (inspect.isclass(hint) and issubclass(hint, enum.Enum)):
        return hint
    return Any


def schema_of(target) -> type:
    """A dataclass with `_target_` and one typed field per constructor argument of `target`."""
    init = target.__init__ if inspect.isclass(target) else target
    hints = typing.get_type_hints(init)
    fields: list = [("_target_", str, field(default=target_path(target)))]
    for name, param in inspect.signature(target).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            default = field(default=MISSING)
        elif isinstance(param.default, (list, tuple)):
            default = field(default_factory=lambda value=param.default: list(value))
        else:
            default = field(default=param.default)
        fields.append((name, _config_type(hints.get(name, Any)), default))
    return dataclasses.make_dataclass(f"{target.__name__}Schema", fields)


def register() -> None:
    # `${memexp.equals:a,b}`: a config value that follows another (loss.shift follows model.task)
    if not OmegaConf.has_resolver("memexp.equals"):
        OmegaConf.register_new_resolver("memexp.equals", lambda a, b: a == b)
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group in registry.groups():
        for target in registry.targets(group):
            store.store(group=f"schema/{group}", name=target.__name__, node=schema_of(target))


def option_groups() -> str:
    """`group: option, ...` for every group in conf/ (`--help` lists them)."""
    folders = sorted(p for p in config_dir().iterdir() if p.is_dir() and p.name != "hydra")
    return "\n".join(f"{folder.name}: {', '.join(sorted(f.stem for f in folder.glob('*.yaml')))}"
                     for folder in folders)


register()
OmegaConf.register_new_resolver("memexp_groups", option_groups, replace=True)
