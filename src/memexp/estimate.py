"""`memexp estimate`: a run's peak memory, predicted without allocating it.

The composed config's own trainer runs two optimizer steps and two evaluation batches under
`FakeTensorMode`: every tensor is metadata only (shape, dtype, device), every op runs its shape
function instead of its kernel, and the live-storage tracker that measures real CPU runs counts
the fake storages exactly as it counts real ones. Two steps, because the optimizer state that
step 1 creates is alive throughout step 2 (a CUDA estimate traces three: RESERVED_STEPS).
Nothing is allocated, so a 7B-parameter model is estimated on a laptop; the time goes into
Python dispatch, a few seconds per thousand ops.

For `target="cuda"` the ops are CUDA's own where a CUDA build of torch is installed: the
trace runs in that build's process on a fake device (memexp.cudatrace); elsewhere the CPU
kernels stand in. Either way the caching allocator's rounding is modelled
(memexp.memory.allocator), so allocated and reserved bytes are both predicted, and what no trace
shows (cuBLAS workspaces, the CUDA context) is added on lines of its own.

Before tracing, what values decide is checked for real (memexp.prechecks.dry_run): the batch's
keys, token ids and positions against every embedding, targets against the model's classes. A
config that a real run would refuse gets the same error, not a number.

The batches are real, and so is every op on them alone (_Values): what their values decide
goes as in the real run. Only what the model computes from its parameters is fake.

Where the estimate and a real run can differ:
- the model's values are unknown: a Python branch on one (`loss.item()`, a found-inf check)
  sees 0, or True for a boolean, so a fake fp16 step is never skipped; an op whose output's
  size depends on one (`nonzero` on activations) is refused, and so is a branch on a value
  drawn at random (LayerDrop's `torch.rand([]) < layerdrop`), whose way is chance: read as
  True it would skip every layer, and the estimate would fall short of every run. On a CUDA
  trace the batch's copy on the device is fake too: a Hugging Face model then builds its
  attention mask even where the batch has no padding (it never reads a fake mask);
- with the CPU stand-in, CUDA's choices are not seen: its autocast op lists, its attention
  kernels (which keep a logsumexp where a math path keeps the attention matrix), cuDNN batch
  norm, the foreach optimizers torch takes on CUDA by default (their temporaries are a list
  the size of the parameters; optim.foreach=true asks for them on any device);
- cuDNN convolution workspaces are not counted: cuDNN sizes them at run time and torch skips a
  plan whose workspace does not fit. A CUDA estimate names a size for them
  (memexp.cudatrace.ConvolutionWorkspaces): explicit GEMM's, the largest convolution's im2col
  matrix.
"""

from __future__ import annotations

import ctypes
import functools
import linecache
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class, get_object
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.optim import optimizer as torch_optimizer
from torch.utils import _foreach_utils
from torch.utils._pytree import arg_tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from memexp import cudatrace, registry
from memexp.adapters import hydra as hydra_private
from memexp.build import build, build_model
from memexp.config import config_dir, target_path
from memexp.data import synthetic_tokens
from memexp.data.tensors import Batch, Data
from memexp.estimate_moe import SHAPES, Routing, calling_frame, routing_lines
from memexp.estimate_parallel import ONE_PROCESS, FakeRank, OneProcess, check_world_size
from memexp.first_steps import first_steps
from memexp.gpus import Gpu, gpu
from memexp.loggers import NoLogger
from memexp.loss import as_loss
from memexp.memory.allocator import CachingAllocatorModel
from memexp.memory.tracker import DEVICE_OF, EagerMode, device_of
from memexp.prechecks import check_signature, dry_run
from memexp.result import CATEGORY_ORDER, mib
from memexp.steptime import StepTime, StepTimer, step_time_lines
from memexp.techniques import check_estimable
from memexp.trainer import Trainer

T = TypeVar("T")

_SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
# factory ops whose values are undefined (the model's buffers are made by them: with_storage)
_UNDEFINED = (torch.ops.aten.empty, torch.ops.aten.empty_strided)


class _Values(EagerMode):
    """Above FakeTensorMode: the batches are made for real, and every op on real tensors alone
    runs for real, so that what the batch's values decide goes as in the real run. A Hugging
    Face model skips an all-ones attention mask only where it can read it (it never reads a
    fake tensor, and would otherwise build the padded run's mask), and a loss may pick its
    labelled rows with `nonzero`. What the model computes from its (fake) parameters stays
    fake; so do the model's own new tensors (a factory op, outside `making_batches`), and a
    copy to the GPU.

    A fake tensor's value is unknown: reading one (`.item()`, `bool(t)`) gives 0, or True for a
    boolean (a finite-check passes). Any other op whose output depends on a fake tensor's
    values (`nonzero` and `unique` for their size, `equal`) is refused, naming the op and
    where the model runs it. So is reading a value drawn at random (_drawn_at_random): which
    way a branch on it goes is chance, not something a true or a 0 can stand for.

    A router's choices (topk's indices) are the exception: made for real as `routing` assumes
    them (memexp.estimate_moe), so that the experts' loop takes each one's tokens as in a run
    with that spread; and torch._grouped_mm, whose meta kernel takes bf16 only, gets a shape
    function for any float (estimate_moe.SHAPES)."""

    def __init__(self, fake: FakeTensorMode, routing: Routing):
        super().__init__()
        self.fake = fake
        self.routing = routing
        self.making_batches = False
        # the storages of fake tensors drawn at random (by id, held weakly): see
        # _drawn_at_random. Their storages, not the tensors: torch refuses to swap a module's
        # parameter (`.to()`) while a weak reference to it exists, and peft moves its adapters,
        # drawn at random by their initialiser, onto their layer's device.
        self.random = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_OF:  # a fake tensor's device (no router's choice is a fake tensor)
            return device_of(args)
        kwargs = kwargs or {}
        leaves = arg_tree_leaves(*args, **kwargs)
        try:
            if self._on_real_data(leaves):
                with unset_fake_temporarily():
                    out = func(*args, **kwargs)
                self.routing.follow(func, args, kwargs, out)
                return out
            out = self.routing.choose(func, args, kwargs,
                                      SHAPES.get(func, func)(*args, **kwargs))
            if self._integers_made_on_host(func, leaves, out):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            if self._drawn_at_random(func, args, leaves):
                for made in arg_tree_leaves(out):
                    if isinstance(made, FakeTensor):
                        self.random[made.untyped_storage()] = True
            return out
        except DataDependentOutputException as error:
            if func not in _SCALAR_READS:  # aten.equal: a Python value from two tensors
                raise ValueError(value_dependent(error.func, "what it returns")) from error
            if args[0].untyped_storage() in self.random:
                raise ValueError(random_branch(error.func)) from error
            return True if args[0].dtype == torch.bool else 0
        except DynamicOutputShapeException as error:
            if all(leaf.is_floating_point() for leaf in leaves if isinstance(leaf, FakeTensor)):
                return self._on_stand_ins(func, args, kwargs)
            raise ValueError(value_dependent(error.func, "the size of its output")) from error
        finally:
            # FakeTensorMode memoizes each output through a weak reference, and torch refuses
            # to swap a module's parameters (`model.half()`, `model.to()`) while one exists.
            # The memo only matters within one op, so it is emptied after every op.
            self.fake.fake_tensor_converter.meta_converter.tensor_memo.clear()

    def _drawn_at_random(self, func, args, leaves: list) -> bool:
        """Whether `func`'s output is a value drawn at random: a seeded random op's fresh draw
        (`torch.rand`, or an in-place fill such as `bernoulli_(p)`, whatever the tensor it fills
        held), or what ops compute from such draws alone (`torch.rand([]) < p`). Dropout's
        output is not: it is made from the model's activations too."""
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if not seeded and not len(self.random):  # nothing drawn at random to compute from
            return False
        inputs = [t for t in leaves if isinstance(t, FakeTensor)]
        if seeded:
            if func._schema.is_mutable and args:  # the tensor it fills: its values are replaced
                inputs = [t for t in inputs if t is not args[0]]
            return all(t.untyped_storage() in self.random for t in inputs)
        return bool(inputs) and all(t.untyped_storage() in self.random for t in inputs)

    def _on_real_data(self, leaves: list) -> bool:
        if any(isinstance(leaf, FakeTensor)
               or isinstance(leaf, torch.device) and leaf.type != "cpu"  # a copy to the GPU
               for leaf in leaves):
            return False
        return self.making_batches or any(isinstance(leaf, torch.Tensor) for leaf in leaves)

    def _on_stand_ins(self, func, args, kwargs):
        """An op whose output's size depends on real values only, though it takes fake floats
        (CTC's loss: the model's log-probabilities, and the lengths of the batch's labels): run
        for real on zeros of the fake tensors' shapes, its outputs made fake. The floats' values
        decide no size."""
        with unset_fake_temporarily():
            args, kwargs = tree_map_only(
                FakeTensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), (args, kwargs))
            out = func(*args, **kwargs)
        return tree_map_only(torch.Tensor, self.fake.from_tensor, out)

    @staticmethod
    def _integers_made_on_host(func, leaves: list, out) -> bool:
        """A factory op's integers on the host (positions from `torch.arange`): made for real,
        as in the run, where a Hugging Face model reads them (Whisper's decoder makes its
        position ids so, and builds a full causal mask where it cannot read that they hold one
        sequence, not several packed)."""
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):  # not a factory op
            return False
        made = [t for t in arg_tree_leaves(out) if isinstance(t, torch.Tensor)]
        return (bool(made) and func.overloadpacket not in _UNDEFINED
                and all(t.device.type == "cpu" and not t.is_floating_point()
                        and not t.is_complex() for t in made))

    def make(self, made: Callable[[], T]) -> T:
        """`made()` (a batch, or the iterator of a data set's batches), made for real: its
        factory ops too (a sample order, an index range, a loader's seed)."""
        self.making_batches = True
        try:
            return made()
        finally:
            self.making_batches = False


class _MadeForReal:
    """The batches of `made`, made for real. An iterator, not a generator: a generator would
    hold the batch it yielded last, which the run has freed by then."""

    def __init__(self, made: Iterator[Batch], values: _Values):
        self.made, self.values = made, values

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.values.make(self.made.__next__)


@dataclass
class _RealBatches:
    """`data`, its batches made for real under the trace."""

    data: Data
    values: _Values

    def __getattr__(self, name: str):  # batch_size, unit, items_per_sample
        return getattr(self.data, name)

    # The iterators are made for real too: a torch DataLoader's draws its base seed
    # (`torch.empty((), dtype=torch.int64).random_().item()`) as it starts.
    def train_batches(self, start: int = 0, rank: int = 0, world_size: int = 1) -> _MadeForReal:
        return _MadeForReal(self.values.make(
            lambda: self.data.train_batches(start, rank, world_size)), self.values)

    def eval_batches(self, rank: int = 0, world_size: int = 1) -> _MadeForReal:
        return _MadeForReal(self.values.make(lambda: self.data.eval_batches(rank, world_size)),
                            self.values)

    def first_batch(self) -> Batch:
        return self.values.make(self.data.first_batch)


def _where() -> str:
    """Where the model runs the op being dispatched: the innermost module method that called
    it ("" outside any)."""
    found = calling_frame()
    if found is None:
        return ""
    module, frame, line = found
    code = linecache.getline(frame.f_code.co_filename, line).strip()
    return (f" in {type(module).__name__}.{frame.f_code.co_name} "
            f"({frame.f_code.co_filename}, line {line}: {code})")


def random_branch(func) -> str:
    """Why a read of a value drawn at random stops the trace, and how to estimate the run."""
    return (f"{func}{_where()}: the model branches on a value drawn at random, so which way a "
            "run goes is chance and the estimate cannot follow it (read as true, LayerDrop's "
            "`torch.rand([]) < layerdrop` would skip every layer and under-report the peak). "
            "Set that probability to 0 to estimate the run in which every layer runs, the most "
            "memory: +model.config.layerdrop=0 for a Hugging Face model's LayerDrop")


def value_dependent(func, what: str) -> str:
    """Why an op stops the trace (`what` it gives depends on values), and where the model
    runs it: the innermost module method that called it."""
    return (f"{func}{_where()}: {what} depends on values the estimate does not "
            "have (it has the batch's own, on the host, and none that the model computes). "
            "Measure this run for real (python train.py with the same overrides), or configure "
            "the model so that training does not run this op (a Hugging Face model may have a "
            "+model.config key for it, as problem_type picks the loss of a classifier)")


# The config files compose_config has parsed, for every later compose in this process (plan
# composes each candidate: 0.22 s of CPU a compose without them, 0.12 s with).
_PARSED: dict = {}


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `python train.py <overrides>` would run."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        hydra_private.wrap_repository(
            GlobalHydra.instance().config_loader(),
            lambda repository: hydra_private.SharedRepository(repository, _PARSED))
        return compose("train", overrides=overrides)


class _FakeMode(FakeTensorMode):
    """FakeTensorMode with quicker cache keys, and one op more taken from the cache. torch
    caches each op's output metadata under a key made from its arguments, a plain fake tensor's
    through a TensorMetadata that is built and then flattened field by field: about 13 us a
    tensor, a fifth of a trace's time. Here such a tensor's key is one tuple of what that
    metadata is made of (its memory format and contiguity are functions of its shape and
    strides; no sparse field applies to a strided tensor), read off the tensor at once.
    Everything else is keyed as torch keys it. torch's cache is one for every mode, and a key
    made here never equals one of torch's (a list's length is a number here, a string there).

    torch never caches `_unsafe_view` (what a linear layer's matmul ends with on a 3-D input:
    360 to 680 ops of a 3-block copy of a Llama, each 0.4 ms uncached): it shares its input's
    storage, where its schema says it makes a tensor of its own, so the cache would give it
    new storage. Below autograd, where a mode runs, it is `view` (ATen's _unsafe_view is
    view's implementation; autograd above the modes still takes it as no view), which the
    cache knows to give the input's storage; so on a plain fake tensor it is dispatched as
    that, and where a view cannot be made, as itself."""

    def dispatch(self, func, types, args=(), kwargs=None):
        if func is _UNSAFE_VIEW and _plain_fake(self, args[0]):
            try:
                return super().dispatch(_VIEW, types, args, kwargs)
            except (RuntimeError, ValueError):  # not viewable: torch's own _unsafe_view says why
                pass
        return super().dispatch(func, types, args, kwargs)

    def _prep_args_for_hash(self, result: list, args, state, id_hashed_objects: list) -> None:
        if not isinstance(args, (list, tuple)):  # a dict (kwargs), or its keys and values
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)
            return
        result.append(type(args))
        result.append(len(args))
        for arg in args:
            if _plain_fake(self, arg):
                result.append((arg.dtype, arg.shape, arg.stride(), arg.device,
                               arg.storage_offset(), arg.untyped_storage().nbytes(),
                               arg.requires_grad, arg.is_conj(), arg.is_neg(),
                               arg.is_inference(), arg.is_quantized))
            elif type(arg) in _PLAIN_VALUES:  # keyed by type and value, as torch keys them
                result.append(type(arg))
                result.append(arg)
            elif type(arg) in (list, tuple):
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)


def _plain_fake(mode: FakeTensorMode, arg) -> bool:
    """Whether `arg` is a plain strided fake tensor of `mode`'s: no constant, no symbolic size."""
    return (type(arg) is FakeTensor and arg.fake_mode is mode and arg.constant is None
            and arg.layout is torch.strided and not arg._has_symbolic_sizes_strides)


_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default
# Arguments that torch's cache key takes as they are (with their type: 1 and 1.0 hash alike)
_PLAIN_VALUES = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device,
                           torch.layout, torch.memory_format))


class _FakeCudaTensorMode(_FakeMode):
    """FakeTensorMode for a CUDA trace. torch avoids device initialisation only when it sees no
    GPU; the fake device is seen, so this says it outright: constants stay fake instead of being
    copied to the device (which the fake device refuses)."""

    avoid_device_init = True


@contextmanager
def _foreach_for_fake_tensors() -> Iterator[None]:
    """Let torch pick an optimizer's implementation for fake parameters as it does for the
    plain ones they stand for. Given neither `foreach` nor `fused`, torch's optimizers take
    the foreach kernels only where every parameter's type is in its list of foreach types and
    its device has them (torch.optim.optimizer._default_to_fused_or_foreach): CUDA, not CPU.
    FakeTensor is not in that list, so a trace took the loop over parameters where the run
    on the GPU takes foreach, and missed its temporaries: AdamW's `sqrt(exp_avg_sq)` of every
    parameter at once, a parameter-sized list. DTensor puts itself in the same lists (and
    `_foreach_utils`'s, which clip_grad_norm_ reads) the same way."""
    lists = (torch_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    added = [types for types in lists if FakeTensor not in types]
    for types in added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in added:
            types.remove(FakeTensor)


class _FlopsByPhase(EagerMode):
    """FLOPs of matmuls and convolutions (torch's own formulas), by the meter's phase: backward
    includes what activation checkpointing recomputes. Also the ops each phase ran, with the
    dtype of their (first) output: which attention kernel, which optimizer ops, what autocast
    ran in half; and, for a GPU, each op priced on it (`timer`, memexp.steptime)."""

    def __init__(self, timer: StepTimer | None = None):
        super().__init__()
        self.by_phase: dict[str, int] = defaultdict(int)
        self.ops: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.phase = lambda: "other"
        self.timer = timer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_OF:  # a fake tensor's own question, no op of the run
            return device_of(args)
        kwargs = kwargs or {}
        formula, name, composite = _op_facts(func)
        if composite:
            # A composite op that reaches dispatch whole (aten.linear under inference_mode):
            # count the ops it is made of. Their tensors stay below the memory tracker.
            with self:
                return func.decompose(*args, **kwargs)
        out = func(*args, **kwargs)
        phase = self.phase()
        flops = 0 if formula is None else formula(*args, **kwargs, out_val=out)
        self.by_phase[phase] += flops
        self.ops[phase][name].add(_first_dtype(out))
        if self.timer is not None:
            self.timer.record(func, args, kwargs, out, flops, phase)
        return out


@functools.cache
def _op_facts(func) -> tuple[Callable | None, str, bool]:
    """`func`'s FLOP formula (None: it counts none), its name, and whether it is a composite
    op without one (made of other ops: CompositeImplicitAutograd), looked up once."""
    formula = flop_registry.get(func._overloadpacket)
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    composite = formula is None and (
        key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))
    return formula, str(func._overloadpacket), composite


def _first_dtype(out) -> str:
    """The dtype of an op's first tensor output ("-" for none)."""
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    tensor = next((o for o in leaves if isinstance(o, torch.Tensor)), None)
    return "-" if tensor is None else str(tensor.dtype).removeprefix("torch.")


@dataclass
class Estimate:
    memory: dict  # the shape of result.json's `memory` section
    parameters: int  # the model's parameter count
    # FLOPs of one optimizer step by phase (forward, backward, optimizer), and of one eval batch
    flops: dict[str, int]
    seconds: float  # how long the estimate took
    target: str  # "cpu" (what the tracker counts) or "cuda" (the caching allocator's view)
    # whose kernels were traced: "cpu", "cuda" (a CUDA build on the fake device), or "cpu
    # stand-in" (a CUDA estimate traced on CPU kernels: no CUDA build installed)
    trace: str = "cpu"
    gpu: str | None = None  # the memexp.gpus key of a CUDA estimate
    torch: str = torch.__version__  # the torch that traced
    # the aten ops each phase ran, with the dtypes of their first outputs ("-": no tensor out)
    ops: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # a CUDA trace's device: its name and capability, the driver libraries the trace process
    # loaded, and the CUDA runtime calls the fake device answered
    device: dict = field(default_factory=dict)
    # the rank traced, of how many (memexp.estimate_parallel); the rank its parallel option
    # says holds the most; and, where two ranks were traced, the other's rank and peak
    rank: int = 0
    world_size: int = 1
    heaviest_rank: int = 0
    other_rank: dict | None = None
    # an MoE model's routers and what the trace assumed of their choices (estimate_moe.Routing:
    # None without one); where those choices set sizes, "unbalanced" holds the peak (bytes and
    # phase) traced with an unbalanced spread
    routing: dict | None = None
    # a CUDA estimate's predicted time of one optimizer step on its GPU (memexp.steptime)
    step_time: StepTime | None = None
    # adapter=qlora: the library that held the 4-bit weights in the trace, as in the run
    # (memexp.techniques.adapter.QLoRA.backend_for); None without 4-bit weights
    quantized_by: str | None = None

    def __post_init__(self):
        if isinstance(self.step_time, dict):  # from JSON: the CUDA trace's process
            self.step_time = StepTime(**self.step_time)


# glibc's mallopt parameters (malloc.h), and the largest value it takes (an int)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _MOST = -1, -3, -4, 2**31 - 1


def keep_freed_memory() -> None:
    """Have glibc keep the blocks this process frees for its next allocations: for the
    processes of memexp estimate and plan (and the CUDA trace's process). A trace makes real
    tensors from the batch's values (an 8B Llama at seq 8192: its attention masks, 134 MB of
    booleans each, 4 a trace), and glibc maps a block above its threshold (128 KiB, at most
    32 MiB as it adapts) fresh from the kernel and unmaps it when freed, so the kernel
    zero-fills its pages again: on copies of that Llama, 3.4 s of system time in 22 s, 0.8 s
    with this; the process's peak RSS 816 MiB without, 944 MiB with. The threshold goes to
    2 GiB where glibc takes it (2.35 and later), else no block is mapped on its own (2.34 and
    earlier take no threshold above 32 MiB); freed memory stays with the process. A plan's
    `--verify` runs its plans in this process: their peaks are the allocator's counters or the
    storage tracker's, not the process's memory. A training process is left as it is. Nothing
    changes with a C library other than glibc."""
    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    if not libc.mallopt(_M_MMAP_THRESHOLD, _MOST):
        libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, _MOST)


def estimate(cfg: DictConfig, target: str = "cpu", gpu_key: str = "h100",
             world_size: int | None = None) -> Estimate:
    """Predict the peak memory of the run `cfg` describes, on a CPU or on the GPU `gpu_key`
    (memexp.gpus; for target="cuda"): of its one process, or, for a parallel option, of its
    rank with the largest peak among `world_size` ranks (trainer.nproc by default)."""
    if target not in ("cpu", "cuda"):
        raise ValueError(f"estimate target={target}: expected cpu or cuda")
    parallel = get_class(cfg.parallel._target_)
    world_size = cfg.trainer.nproc if world_size is None else world_size
    # the loss's class where it is one of conf/loss's (a user's loss is not imported here)
    loss_target = (get_object(cfg.loss._target_)
                   if cfg.loss._target_ in registry.target_names("loss") else None)
    check_estimable(parallel, world_size, loss_target)
    check_world_size(world_size)
    if not get_class(cfg.compile._target_).estimable:
        raise ValueError(
            f"compile={cfg.compile.mode}: memexp estimate traces the eager aten ops on fake "
            "tensors; Inductor's fused kernels and their buffers, and what its partitioner saves "
            "for backward (checkpointing=budget), are not in that trace, so the figure would be "
            "the eager run's. Measure it with train.py (the CPU allocator's own count), or "
            "estimate compile=none")
    python = None if target == "cpu" or torch.cuda.is_available() else cudatrace.cuda_python()
    if python is not None:  # the whole estimate, each rank's trace too, in the CUDA build
        return Estimate(**cudatrace.run(OmegaConf.to_container(cfg, resolve=True),
                                        gpu(gpu_key), python, world_size))

    def traced(routing: str) -> Estimate:
        if not parallel.distributed:
            return one_process(cfg, target, gpu_key, routing)
        return on_ranks(world_size,
                        lambda rank: one_process(cfg, target, gpu_key, routing, rank))

    result = traced("even")
    # An MoE model whose router's choices set sizes (the eager loop over experts): the even
    # spread is an assumption, and an unbalanced one is traced beside it.
    if result.routing is not None and result.routing["decides_sizes"]:
        unbalanced = traced("unbalanced")
        result.routing["unbalanced"] = {key: unbalanced.memory[key]
                                        for key in ("peak_bytes", "peak_phase")}
        result.seconds += unbalanced.seconds
    return result


def one_process(cfg: DictConfig, target: str, gpu_key: str, routing: str = "even",
                rank: OneProcess | FakeRank = ONE_PROCESS) -> Estimate:
    """The estimate of the one process, or the one `rank`, that this process is: for a GPU, on
    CUDA's kernels where this torch has them (the trace process, on its fake device), else on
    the CPU stand-in. `routing`: what an MoE router is assumed to choose (estimate_moe)."""
    if target == "cpu":
        return trace(cfg, "cpu", routing=routing, rank=rank)
    return trace(cfg, "cuda" if torch.cuda.is_available() else "cpu", gpu(gpu_key), routing,
                 rank)


# Steps traced. Two set the peak: the optimizer state that step 1 creates is alive throughout
# step 2. A CUDA estimate traces a third for the caching allocator's reserved memory: step 3 is
# the first to start from the blocks that a step with that state left behind, and later steps
# repeat its layout (Hugging Face BERT-large, seq 512, batch 4, AdamW, on the CPU stand-in:
# reserved 12,520 MiB after 2 steps, 12,704 MiB after 3, 5 and 8; allocated the same).
PEAK_STEPS, RESERVED_STEPS = 2, 3


def trace(cfg: DictConfig, kernels: str, device: Gpu | None = None,
          routing: str = "even", rank: OneProcess | FakeRank = ONE_PROCESS) -> Estimate:
    """Trace the run's first steps on `kernels` ("cpu" or "cuda"). For a GPU `device`, model
    the caching allocator and the cuBLAS workspaces, and add the CUDA context. An MoE router's
    choices are assumed as `routing` says (memexp.estimate_moe). A `rank` joins its fake
    process group once its data is known to fill every rank's batch."""
    started = time.perf_counter()
    steps = RESERVED_STEPS if device is not None else PEAK_STEPS
    cfg = steps_to_trace(cfg, kernels, steps)
    allocator = CachingAllocatorModel() if device is not None else None
    data = stand_in(cfg.data)
    rank.check_samples(data)
    check_before_tracing(cfg)
    if kernels == "cuda":
        torch.cuda.init()  # torch's per-device tables, filled from the device's answers
    fake = (_FakeCudaTensorMode if kernels == "cuda" else _FakeMode)(
        allow_non_fake_inputs=True)
    values = _Values(fake, Routing(routing))
    flops = _FlopsByPhase(None if device is None else StepTimer(device, kernels, steps))
    # The model is built on the meta device and given fake storage: initialisers skip meta
    # tensors, and some loop on values a trace does not have (nn.init.trunc_normal_ resamples
    # until no value is out of range). Values never change memory.
    with torch.device("meta"):
        model = build_model(cfg.model)
    with rank.joined(), fake, values, _foreach_for_fake_tensors(), ExitStack() as modes:
        if kernels == "cuda":  # from the first op: fully_shard pins as it shards
            modes.enter_context(cudatrace.PinnedHostMemory())
        trainer = Trainer(cfg, allocator=allocator, data=_RealBatches(data, values),
                          model=with_storage(model))
        # What the built model holds is its state, drawn at random or not (peft's adapters
        # are initialised under the trace): a read of it (Adafactor's `param.norm().item()`)
        # is a read of a weight, not a branch on chance. Only the steps' own draws count.
        values.random.clear()
        flops.phase = lambda: trainer.meter.tracker.phase
        if flops.timer is not None:  # a collective's traffic depends on the ranks
            flops.timer.world_size = trainer.parallel.world_size
        if device is not None:
            workspaces = modes.enter_context(cudatrace.CublasWorkspaces(allocator, device))
            workspaces.phase = flops.phase
            convolutions = modes.enter_context(cudatrace.ConvolutionWorkspaces())
        with flops:
            trainer.fit(NoLogger())
    memory = trainer.meter.report()
    memory["source"] = f"estimate ({'cpu' if device is None else 'cuda'})"
    if device is not None:
        memory.update(untraced_memory(memory["peak_bytes"], allocator, workspaces.total, device,
                                      trainer.parallel.world_size),
                      cudnn_workspace_bound_bytes=convolutions.largest,
                      cudnn_workspace_bound_convolution=convolutions.shape)
    per_step = {phase: flops.by_phase[phase] // steps
                for phase in ("forward", "backward", "optimizer")}
    per_step["eval"] = flops.by_phase["eval"] // 2  # two eval batches
    parameters = sum(p.numel() for p in trainer.model.parameters()) + trainer.adapter.packed()
    return Estimate(
        memory, parameters, per_step, time.perf_counter() - started,
        target="cpu" if device is None else "cuda",
        trace=kernels if device is None or kernels == "cuda" else "cpu stand-in",
        gpu=None if device is None else device.key,
        rank=trainer.parallel.rank, world_size=trainer.parallel.world_size,
        heaviest_rank=trainer.parallel.heaviest_rank(),
        ops={phase: {op: sorted(dtypes) for op, dtypes in sorted(ops.items())}
             for phase, ops in flops.ops.items()},
        routing=values.routing.record(),
        step_time=None if flops.timer is None else flops.timer.result(),
        quantized_by=trainer.adapter.quantized_by)


def with_storage(model: nn.Module) -> nn.Module:
    """`model`'s meta tensors replaced by uninitialised CPU ones (fake, under FakeTensorMode),
    keeping tied weights tied: one tensor shared by two modules (GPT-2's embedding and output
    head) gets one replacement. `Module.to_empty` would give each module its own."""
    replaced: dict[int, torch.Tensor] = {}

    def replacement(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in replaced:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype)
            replaced[id(tensor)] = (nn.Parameter(empty, tensor.requires_grad)
                                    if isinstance(tensor, nn.Parameter) else empty)
        return replaced[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = replacement(tensor)
    return model


def untraced_memory(traced_peak: int, allocator: CachingAllocatorModel, workspaces: int,
                    device: Gpu, world_size: int) -> dict:
    """A CUDA estimate's totals, with what no trace shows on lines of its own."""
    # a communicator of one rank has no peer to keep buffers for
    nccl = device.nccl_buffers.nbytes if world_size > 1 else 0
    return {
        # inside torch's allocator: torch.cuda.max_memory_allocated() and _reserved() count it
        "cublas_workspace_bytes": workspaces,
        "allocated_peak_bytes": traced_peak + workspaces,
        "reserved_peak_bytes": allocator.reserved_peak,
        # outside it: nvidia-smi counts it (memexp.gpus)
        "context_bytes": device.context.nbytes,
        "nccl_bytes": nccl,
        "device_peak_bytes": allocator.reserved_peak + device.context.nbytes + nccl,
    }


def check_before_tracing(cfg: DictConfig) -> None:
    """What a real run would refuse at its first forward pass, from values that a trace cannot
    see: the batch's keys against forward's signature, every embedding lookup (token ids, the
    position table), the targets against the model's classes, on the stand-in data's first
    batch. The model is built on the meta device: nothing is allocated. What is checked is the
    model, the loss and the data alone, each as configured: memexp plan traces many candidates
    that share them, so a process checks each set once (an error is raised again each time)."""
    _checked(*(OmegaConf.to_yaml(cfg[group], resolve=True) for group in ("model", "loss", "data")))


@functools.cache
def _checked(model_config: str, loss_config: str, data_config: str) -> None:
    with torch.device("meta"):
        model = build_model(OmegaConf.create(model_config))
    loss = as_loss(build(OmegaConf.create(loss_config)), model)
    batch = stand_in(OmegaConf.create(data_config)).first_batch()
    check_signature(model, batch, loss.passes_labels)
    dry_run(model, batch, loss)


def stand_in(data: DictConfig) -> Data:
    """The stand-in data set of `data` (stand_in_data), built once for the traces that share it:
    memexp plan traces one data set at many depths and options, and a set of 8192-token
    sequences takes a second to build. A trace only reads a data set: each epoch's order, and
    each batch, is made anew from it."""
    return _built(OmegaConf.to_yaml(stand_in_data(data)))


@functools.lru_cache(maxsize=2)  # a plan's data sets: one per micro-batch size
def _built(config: str) -> Data:
    return build(OmegaConf.create(config))


def stand_in_data(data: DictConfig) -> DictConfig:
    """The data set, generated for real: under fake tensors every op of a generator costs
    about half a millisecond. Token values never change memory, so a synthetic token set is
    drawn from 64 words (its rule table is vocabulary squared: 20 GB at 50k words); the model
    keeps its own vocabulary. Batches are made for real in this process (no loader workers),
    in pageable memory: pinning needs the device, which a CUDA trace's fake one refuses, and
    host memory is not the device's."""
    stand_in = OmegaConf.create(OmegaConf.to_container(data, resolve=True))
    if stand_in._target_ == target_path(synthetic_tokens):
        stand_in.vocab_size = min(stand_in.vocab_size, 64)
    if "num_workers" in stand_in:
        stand_in.update(num_workers=0, pin_memory=False)
    return stand_in


def steps_to_trace(cfg: DictConfig, kernels: str = "cpu", steps: int = PEAK_STEPS) -> DictConfig:
    """The run, cut to what sets its peak: `steps` steps and two eval batches, on the device whose
    kernels are traced, with nothing written. A synthetic eval set shrinks to two batches (the
    second is fetched while the first is still referenced, and every later one repeats that);
    the train set keeps its size, because the epoch's sample order is a live tensor of that
    size."""
    cfg = first_steps(cfg)
    with open_dict(cfg):
        cfg.trainer.update(device=kernels, warmup_steps=0, max_steps=steps)
        cfg.memory.update(track=True, budget=None)
        if "num_eval" in cfg.data:  # the synthetic sets (real readers have a fixed size)
            cfg.data.num_eval = min(cfg.data.num_eval, 2 * cfg.data.eval_batch_size)
    return cfg


def attention_kernels(result: Estimate) -> list[str]:
    """The attention ops the forward pass ran: the kernel torch's SDPA selector picked, or a
    math path's matmuls when there is none (then the attention matrix is kept)."""
    return sorted({op for op in result.ops.get("forward", ())
                   if op.startswith("aten._scaled_dot_product_")
                   or op.endswith(("_flash_attention_forward", "_efficient_attention_forward"))})


def optimizer_kernels(result: Estimate) -> str:
    """Which implementation the optimizer step ran, read from its ops: torch's fused kernel,
    its foreach kernels, or a loop over parameters (also torchao's 8-bit step's way)."""
    ops = result.ops.get("optimizer", ())
    if any(op.startswith("aten._fused_") for op in ops):
        return "fused kernel"
    # A foreach step updates its state and parameters in place (`_foreach_lerp_`); the trainer's
    # own finite check runs `_foreach_norm`, which is not in place.
    if any(op.startswith("aten._foreach_") and op.endswith("_") for op in ops):
        return "foreach kernels"
    return "loop over parameters"


def describe(cfg: DictConfig, result: Estimate) -> str:
    """The estimate for people: the peak, and each phase's peak by category; for CUDA also
    the trace used, the attention kernel, and what no trace shows."""
    memory = result.memory
    per_rank = " per rank" if result.world_size > 1 else ""
    lines = [f"memexp estimate for {device_label(result)}: {result.parameters / 1e6:,.1f}M "
             f"parameters, batch {cfg.data.batch_size}{per_rank} x accumulate "
             f"{cfg.optim.accumulate} ({result.seconds:.1f} s, nothing allocated)"]
    lines += rank_lines(result)
    if result.target == "cuda":
        lines += cuda_lines(result)
    else:
        lines.append(f"  peak         {mib(memory['peak_bytes'])} in {memory['peak_phase']}")
    lines += routing_lines(result.routing, memory["peak_bytes"], mib)
    lines += quantized_lines(cfg, result)
    header = f"  {'phase':<10}{'peak':>12}" + "".join(f"{c:>13}" for c in CATEGORY_ORDER)
    lines += ["", header]
    for name, phase in memory["phases"].items():
        cells = "".join(f"{mib(phase['breakdown'][c]):>13}" for c in CATEGORY_ORDER)
        lines.append(f"  {name:<10}{mib(phase['peak_bytes']):>12}{cells}")
    if not cfg.optim.in_backward:  # else each parameter's step runs in backward
        # What the step allocates and frees is in the optimizer row's `other`: with foreach
        # kernels, a list the size of the parameters (sqrt(exp_avg_sq) of each, for Adam).
        temporaries = memory["phases"]["optimizer"]["breakdown"]["other"]
        lines.append(f"  optimizer step: {optimizer_kernels(result)}, its temporaries in the "
                     f"optimizer row's other ({mib(temporaries)})")
    transfers = memory.get("transfer_bytes_per_step") or {}
    if memory.get("offloaded_peak_bytes"):  # offloading: the host's memory, and the copies
        lines.append(f"  host         {mib(memory['offloaded_peak_bytes'])} at its peak (the "
                     "offloaded column: what it held at each phase's peak); copies "
                     f"{mib(transfers.get('to_host', 0))} to it and "
                     f"{mib(transfers.get('to_device', 0))} back a step")
    flops = result.flops
    lines += ["", f"  FLOPs/step   forward {flops['forward'] / 1e9:,.2f} G, backward "
              f"{flops['backward'] / 1e9:,.2f} G (recomputation included), eval batch "
              f"{flops['eval'] / 1e9:,.2f} G"]
    if result.step_time is not None:
        lines += [""] + step_time_lines(result.step_time, cfg.optim.accumulate, result.trace)
    return "\n".join(lines)


def quantized_lines(cfg: DictConfig, result: Estimate) -> list[str]:
    """adapter=qlora: which library held the 4-bit weights in the trace. A CUDA run takes
    bitsandbytes where it is installed (adapter.backend=auto), so a CUDA estimate that traced
    torchao's says what that run would do instead."""
    if result.quantized_by is None:
        return []
    line = f"  4-bit        the adapted layers' weights in NF4 by {result.quantized_by}"
    if result.target == "cuda" and result.quantized_by == "torchao" and \
            cfg.adapter.backend == "auto":
        line += (" (bitsandbytes is not installed beside the traced torch: a CUDA run with it "
                 "would hold them in its Linear4bit, the same bytes but other temporaries; "
                 "`make cuda-estimator` installs it)")
    return [line]


def device_label(result: Estimate) -> str:
    if result.target == "cpu":
        return "CPU"
    device = gpu(result.gpu)
    return f"{device.name} ({device.key}, {device.sm})"


def cuda_lines(result: Estimate) -> list[str]:
    """Which trace was used, the attention kernel, and the totals a CUDA run's counters show,
    with what no trace shows on its own line."""
    memory, device = result.memory, gpu(result.gpu)
    if result.trace == "cuda":
        trace_line = (f"CUDA ops: torch {result.torch} on a fake {device.sm} device "
                      "(memexp.fakecuda)")
    else:
        trace_line = (f"CPU stand-in: torch {result.torch}'s CPU kernels, as no CUDA build of "
                      "torch was found (`make cuda-estimator` installs one): CUDA's own "
                      "choices are not seen")
    attention = attention_kernels(result)
    workspaces = memory["cublas_workspace_bytes"]
    lines = [f"  trace        {trace_line}"]
    if attention:
        lines.append(f"  attention    {', '.join(attention)}")
    lines += [
        f"  peak         {mib(memory['peak_bytes']):>10}  in {memory['peak_phase']}: traced "
        "tensors, in the caching allocator's blocks",
        f"  + cuBLAS     {mib(workspaces):>10}  workspaces of the threads that call cuBLAS "
        f"({mib(device.cublas_workspace.nbytes)} each on {device.sm}, + "
        f"{mib(device.cublaslt_workspace.nbytes)} for cublasLt; memexp.gpus)",
        f"  = allocated  {mib(memory['allocated_peak_bytes']):>10}  compare "
        "torch.cuda.max_memory_allocated()",
        f"  reserved     {mib(memory['reserved_peak_bytes']):>10}  compare "
        "torch.cuda.max_memory_reserved()",
        f"  + context    {mib(memory['context_bytes']):>10}  the CUDA context (outside "
        f"torch's allocator), {device.context.source}",
    ]
    if memory["nccl_bytes"]:
        lines.append(f"  + NCCL       {mib(memory['nccl_bytes']):>10}  NCCL's buffers for the "
                     f"rank's communicator (outside torch's allocator), "
                     f"{device.nccl_buffers.source}")
    lines += [
        f"  = device     {mib(memory['device_peak_bytes']):>10}  compare nvidia-smi; the "
        f"{device.key} has {mib(device.memory)}",
    ]
    return lines + uncounted_lines(memory)


def uncounted_lines(memory: dict) -> list[str]:
    """What a CUDA estimate does not count, and a size for it where one can be given."""
    # The allocator model follows CUDACachingAllocator.cpp's default rules; what it cannot
    # follow, read there, is named (memexp.memory.allocator).
    lines = ["  not counted  in reserved, the holes left by workspaces that kernels allocate for "
             "one call (cuDNN's), and by the allocator's choice among free blocks of one size "
             "(by address; the model's, by segment age)"]
    bound, convolution = (memory["cudnn_workspace_bound_bytes"],
                          memory["cudnn_workspace_bound_convolution"])
    if bound:
        lines.append(
            f"  not counted  cuDNN's convolution workspaces, each allocated for one call: up "
            f"to {mib(bound)} if cuDNN's algorithm needs no more than explicit GEMM's (the "
            f"im2col matrix of the largest convolution, {convolution}); allocated and reserved "
            "can grow by as much")
    return lines


def on_ranks(world_size: int, traced: Callable[[FakeRank], Estimate]) -> Estimate:
    """`traced(rank)` for the rank of `world_size` with the largest peak: rank 0, or the rank
    its parallel option says holds more (then both are traced)."""
    first = traced(FakeRank(0, world_size))
    if first.heaviest_rank == 0:
        return first
    other = traced(FakeRank(first.heaviest_rank, world_size))
    heaviest, lighter = sorted((other, first), key=lambda result: result.memory["peak_bytes"],
                               reverse=True)
    heaviest.seconds = first.seconds + other.seconds
    heaviest.other_rank = {"rank": lighter.rank, "peak_bytes": lighter.memory["peak_bytes"]}
    return heaviest


def rank_lines(result: Estimate) -> list[str]:
    """Which rank the estimate is of, and why that one (none for one process)."""
    if result.world_size == 1:
        return []
    line = (f"  rank         {result.rank} of {result.world_size}, traced on torch's fake process "
            "group (memory only: its collectives move no data)")
    if result.other_rank is None:
        return [line, "               no rank holds more: the ranks differ only where torch "
                      "partitions unevenly, and none does more than rank 0"]
    other = result.other_rank
    return [line, f"               the largest of the two ranks traced: its parallel option gives "
                  f"rank {result.heaviest_rank} the most state (rank {other['rank']}'s peak: "
                  f"{mib(other['peak_bytes'])})"]
