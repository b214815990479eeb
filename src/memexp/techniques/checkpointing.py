"""checkpointing: which activations are kept for backward, recomputed, or moved off the device.

`apply(model)` wraps the chosen parts of the model in place; `context()` is entered around every
forward pass (only `offload` without a scope uses it). Which modules are the blocks is decided by
memexp.models.blocks (`checkpointing.blocks=[auto]`, class names or module-name globs); each
option keeps what it found in `found` and the modules it changed in `changed`, which must run in
the first forward pass (memexp.prechecks.FirstForward).
"""

from __future__ import annotations

import difflib
import logging
import weakref
from collections import Counter
from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.weak import WeakIdKeyDictionary

from memexp.memory import host_resident, recomputing
from memexp.models.blocks import (
    Blocks,
    Wrapper,
    replace_module,
    resolve_blocks,
    whole_sequential,
)
from memexp.techniques import Technique, model_device

log = logging.getLogger("memexp")


class Checkpointing(Protocol):
    found: Blocks | None  # the blocks it resolved, if it resolves any
    changed: Mapping[str, nn.Module]  # the modules it wrapped, by name

    def apply(self, model: nn.Module) -> nn.Module: ...

    def context(self) -> AbstractContextManager:
        """Around the forward pass."""


@contextmanager
def _recomputation(module: nn.Module):
    """The context of a checkpointed forward pass run again during backward."""
    # BatchNorm in train mode would fold the same batch into its running statistics a second
    # time; recomputation normalizes with batch statistics anyway, so restoring them is exact.
    norms = [m for m in module.modules()
             if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [(m, [b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)])
             for m in norms]
    try:
        with recomputing():
            yield
    finally:  # also when checkpoint stops the recomputation early, by raising, once it has all
        with torch.no_grad():
            for norm, buffers in saved:
                for live, kept in zip((norm.running_mean, norm.running_var,
                                       norm.num_batches_tracked), buffers, strict=True):
                    live.copy_(kept)


def _contexts(module: nn.Module):
    return nullcontext(), _recomputation(module)


@contextmanager
def _all_of(*contexts: AbstractContextManager):
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _selective_contexts(module: nn.Module, policy: OpPolicy):
    """Per-op selective checkpointing's pair of contexts (each call: a fresh cache and mm
    count), the recomputation's also keeping BatchNorm's statistics as they were."""
    one_call = policy.for_one_call(type(module).__name__)
    forward, recompute = create_selective_checkpoint_contexts(one_call)
    one_call.cache = forward.storage
    return forward, _all_of(_recomputation(module), recompute)


class Checkpointed(Wrapper):
    """Runs `inner` under non-reentrant activation checkpointing: only its inputs are kept for
    backward (and, with a `policy`, the outputs of the ops it saves), and its forward is run
    again during backward, with the RNG state of the first run (dropout masks match) and
    without touching BatchNorm running statistics twice."""

    def __init__(self, inner: nn.Module, policy: OpPolicy | None = None):
        super().__init__(inner)
        self._contexts = (partial(_contexts, inner) if policy is None
                          else partial(_selective_contexts, inner, policy))

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=self._contexts, **kwargs)


def wrap_each(model: nn.Module, names: list[str], wrap, key: str) -> dict[str, nn.Module]:
    """Put `wrap(module)` in the place of each named module (one wrapper for a module named in
    several places); the wrappers, by name. `key` is the option that named them."""
    wrappers: dict[int, nn.Module] = {}
    for name in names:
        module = model.get_submodule(name)
        if type(module).forward is nn.Module.forward:
            raise ValueError(
                f"{key}: {name!r} is a {type(module).__name__}, a container with no forward of "
                "its own: the model's forward calls the modules inside it, which a wrapper "
                f"around the container would not reach. Select those modules: {key}="
                f"['{name}.*'], or [auto]")
        if id(module) not in wrappers:
            wrappers[id(module)] = wrap(module)
        replace_module(model, name, wrappers[id(module)])
    return {name: model.get_submodule(name) for name in names}


@dataclass
class NoCheckpointing(Technique):
    """Keep every activation autograd saves: the baseline."""

    baseline = True
    planned = ({},)
    cost_rank = 0  # memexp plan tries options from the cheapest: nothing recomputed or moved
    changes_math = None  # see memexp.techniques

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


@dataclass
class CheckpointBlocks(Technique):
    """Checkpoint every `every`-th block, from the first: `every=1` (the `full` option)
    checkpoints them all, `every=2` (`selective`) half of them. `blocks` says which modules are
    the blocks (memexp.models.blocks)."""

    every: int = 1
    blocks: list[str] = ("auto",)
    cost_rank = 2  # recomputes whole blocks
    compiles_with = False  # Checkpointed's context (check_combination)
    planned = ({"every": 1},)  # full; selective saves less than full for the same kind of cost
    changes_math = None  # recomputed as first computed (its RNG state, BatchNorm's statistics)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpointing.every={self.every}: must be >= 1")

    def apply(self, model: nn.Module) -> nn.Module:
        self.found = resolve_blocks(model, self.blocks, "checkpointing.blocks")
        self.changed = wrap_each(model, self.found.names[::self.every], Checkpointed,
                                 "checkpointing.blocks")
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


# torchtitan's "op" mode (SelectiveAC in torchtitan/distributed/activation_checkpoint.py,
# 2026-08): keep the outputs of the ops that are expensive to recompute, and recompute the rest:
# the pointwise ops, norms and softmaxes, whose outputs are as large as a matmul's but cost a
# small share of its FLOPs. Saved: the partitioner's compute-intensive ops (torch's
# get_default_op_list(), as of torch 2.13: the matmuls, convolutions and fused attention
# kernels), `linear`, every SDPA variant, `max.default` (float8's scale) and `topk` (MoE
# routing, which could pick other experts when recomputed). Added here: SDPA's CPU kernel, which
# torchtitan, training on GPUs, does not list. Left out: its collectives (reduce_scatter,
# all_to_all of tensor and expert parallelism), which never run inside memexp's blocks.
TORCHTITAN_SAVE = (
    "mm", "addmm", "bmm", "linear", "_scaled_mm", "convolution", "convolution_backward",
    "upsample_bilinear2d", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward", "_efficient_attention_forward",
    "_scaled_dot_product_flash_attention_for_cpu", "max.default", "topk",
)
# ... except every second call of these in each block, recomputed to balance memory against
# compute (torchtitan counts aten.mm and aten.linear only: GPT-2's Conv1D projections are
# addmm, all saved).
TORCHTITAN_ALTERNATE = ("mm", "linear")


def aten_ops(names: list[str], key: str) -> frozenset:
    """The aten operators `names` name: `mm` (every overload) or `max.default` (that one)."""
    ops = set()
    for name in names:
        base, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, base, None)
        if packet is None or overload and overload not in packet.overloads():
            known = sorted({op.removeprefix("aten::") for op in
                            torch._C._dispatch_get_all_op_names() if op.startswith("aten::")})
            close = difflib.get_close_matches(name, known, n=5) or ["none"]
            raise ValueError(
                f"{key}: {name!r} is not an aten operator (`name` or `name.overload`, as "
                f"torch.ops.aten names it); close to it: {', '.join(close)}. "
                f"torchtitan's list: [{','.join(TORCHTITAN_SAVE)}]")
        ops.update([packet] if not overload else [getattr(packet, overload)])
    return frozenset(ops)


@dataclass(frozen=True)
class OpPolicy:
    """Which op outputs a checkpointed block keeps: those of `save` (aten packets or single
    overloads), except every second call of `alternate` in each block call, and except an
    output the block then writes to in place (_OneCall)."""

    save: frozenset
    alternate: frozenset
    # (block class, kept op, the op that wrote to its output): logged once
    logged: set = field(default_factory=set, compare=False)

    def for_one_call(self, block: str) -> _OneCall:
        """The policy of one call of a block of class `block`."""
        return _OneCall(self, block)


def written(func, args, kwargs) -> list[Tensor]:
    """The tensors `func` writes to in place (`div_`'s self, an `out=`), by its schema."""
    if not isinstance(func, torch._ops.OpOverload):  # a higher-order operator: none
        return []
    found = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = (args[index] if index < len(args) and not argument.kwarg_only
                     else kwargs.get(argument.name))
            found += [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]
    return found


class _OneCall:
    """`policy` over one call of a checkpointed block (of class `block`): the outputs of the
    save list's ops are kept, but not one that the block then writes to in place. Mixtral's
    router divides topk's output in place (`router_top_value /= ...`): kept, it would come back
    at recomputation already divided, and divided again (torch refuses a changed cache entry at
    backward: "Tensor cached during selective activation checkpoint has been mutated"). So where
    a kept output is written to, its op is recomputed instead: its entry in `cache` (the forward
    context's, torch's own) is marked for recomputation, and the run logs why, once a block
    class. The policy is called after each op, with its output, and counts the calls of each op
    as torch's cache indexes them."""

    def __init__(self, policy: OpPolicy, block: str):
        self.policy, self.block = policy, block
        self.alternated = 0
        self.calls: Counter = Counter()
        self.kept = WeakIdKeyDictionary()  # a kept output's storage -> (op, its call's index)
        self.cache: dict | None = None

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        index = self.calls[func]
        self.calls[func] += 1
        for tensor in written(func, args, kwargs):
            kept = self.kept.pop(tensor.untyped_storage(), None)
            if kept is not None:
                self.recompute(*kept, func)
        # a higher-order operator (flex_attention) has no overloads
        packet = func.overloadpacket if isinstance(func, torch._ops.OpOverload) else func
        save, alternate = self.policy.save, self.policy.alternate
        saved = func in save or packet in save
        if func in alternate or packet in alternate:
            self.alternated += 1
            saved = saved and self.alternated % 2 == 1
        if not saved:
            return CheckpointPolicy.PREFER_RECOMPUTE
        for tensor in tree_flatten(ctx.op_output)[0]:
            if isinstance(tensor, Tensor):
                self.kept[tensor.untyped_storage()] = (func, index)
        return CheckpointPolicy.MUST_SAVE

    def recompute(self, func, index: int, writer) -> None:
        self.cache[func][index] = torch_checkpoint._RECOMPUTE
        if (self.block, func, writer) not in self.policy.logged:
            self.policy.logged.add((self.block, func, writer))
            log.info("checkpointing=selective_ops: in %s, %s writes in place to the output of "
                     "%s, which the save list keeps; kept, it would come back changed at "
                     "recomputation, so %s is recomputed there instead", self.block, writer,
                     func, func)


@dataclass
class CheckpointOps(Technique):
    """Per-op selective checkpointing (torch's create_selective_checkpoint_contexts, torchtitan's
    "op" mode) in every block: the outputs of the `save` ops are kept for backward, every other
    op is run again, except every second call of an `alternate` op, recomputed too. Defaults:
    torchtitan's lists (TORCHTITAN_SAVE); `blocks` as for `full`."""

    save: list[str] = TORCHTITAN_SAVE
    alternate: list[str] = TORCHTITAN_ALTERNATE
    blocks: list[str] = ("auto",)
    cost_rank = 1  # recomputes the cheap ops only: tried before whole blocks
    compiles_with = False  # Checkpointed's context, as CheckpointBlocks
    planned = ({},)
    changes_math = None  # recomputed as first computed; the saved outputs are the same tensors

    def __post_init__(self) -> None:
        self.policy = OpPolicy(aten_ops(self.save, "checkpointing.save"),
                               aten_ops(self.alternate, "checkpointing.alternate"))

    def apply(self, model: nn.Module) -> nn.Module:
        self.found = resolve_blocks(model, self.blocks, "checkpointing.blocks")
        self.changed = wrap_each(model, self.found.names,
                                 lambda module: Checkpointed(module, self.policy),
                                 "checkpointing.blocks")
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


@dataclass
class CheckpointModules(Technique):
    """Checkpoint the named submodules, like MMEngine's
    `activation_checkpointing=['layer1', 'layer2']`; class names and globs work too."""

    modules: list[str]
    cost_rank = 2
    compiles_with = False
    changes_math = None

    def apply(self, model: nn.Module) -> nn.Module:
        if not self.modules:
            raise ValueError("checkpointing=modules needs the modules to checkpoint: "
                             "checkpointing.modules=[name,...]")
        self.found = resolve_blocks(model, self.modules, "checkpointing.modules")
        self.changed = wrap_each(model, self.found.names, Checkpointed,
                                 "checkpointing.modules")
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


@dataclass
class CheckpointSequential(Technique):
    """`torch.utils.checkpoint.checkpoint_sequential`'s scheme, the source's "split the training
    process": the blocks, which must be all of one nn.Sequential that forward calls whole, are
    cut into `segments` runs of consecutive blocks, and every run but the last is checkpointed
    as one unit. (Built from `checkpoint` per run rather than by calling checkpoint_sequential,
    which cannot pass the context that keeps BatchNorm statistics right.)"""

    segments: int = 2
    blocks: list[str] = ("auto",)
    cost_rank = 2
    compiles_with = False
    changes_math = None

    def apply(self, model: nn.Module) -> nn.Module:
        self.found = found = resolve_blocks(model, self.blocks, "checkpointing.blocks")
        name = whole_sequential(model, found, "checkpointing.blocks")
        if not 1 <= self.segments <= len(found.modules):
            raise ValueError(f"checkpointing.segments={self.segments}: must be between 1 and "
                             f"the model's {len(found.modules)} blocks")
        size = len(found.modules) // self.segments
        runs = [nn.Sequential(*found.modules[i * size:(i + 1) * size])
                for i in range(self.segments - 1)]
        rest = found.modules[(self.segments - 1) * size:]
        replace_module(model, name, nn.Sequential(*(Checkpointed(run) for run in runs), *rest))
        # The container itself must run: a forward that loops over it or indexes it would not
        # reach the runs as they are now.
        self.changed = {name or "(the model)": model.get_submodule(name)}
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


class Offloaded(Wrapper):
    """Runs `inner` with the tensors it saves for backward moved to host memory (`offload`)."""

    def __init__(self, inner: nn.Module, offload: OffloadActivations):
        super().__init__(inner)
        object.__setattr__(self, "_offload", offload)  # a reference, not a submodule

    def forward(self, *args, **kwargs):
        with self._offload.hooks():
            return self.inner(*args, **kwargs)


@dataclass
class OffloadActivations(Technique):
    """Move every tensor autograd saves for backward to host memory (pinned on CUDA, so the copy
    back can overlap) and bring it back when backward needs it: the mechanism of
    `torch.autograd.graph.save_on_cpu`. Parameters are saved in place, not copied: they stay on
    the device anyway. `blocks` limits it to what those modules save (null: the whole forward
    pass, loss included)."""

    pin_memory: bool = True
    blocks: list[str] | None = None
    cost_rank = 3  # moves bytes to the host and back
    compiles_with = False  # saved-tensor hooks
    planned = ({},)
    changes_math = None  # brought back as they were

    def apply(self, model: nn.Module) -> nn.Module:
        self._watch(model)
        if self.blocks is not None:
            self.found = resolve_blocks(model, self.blocks, "checkpointing.blocks")
            self.changed = wrap_each(model, self.found.names,
                                     lambda module: Offloaded(module, self),
                                     "checkpointing.blocks")
        return model

    def _watch(self, model: nn.Module) -> None:
        """Where the copies come back to, and the parameters, which are never copied."""
        self._device = model_device(model)
        self._pin = self.pin_memory and self._device.type == "cuda"
        # By weak reference: a storage freed since (fully_shard's shards replace the parameters
        # it is given) leaves its id to another, an activation's maybe, which must still move.
        self._parameters = {id(storage): weakref.ref(storage)
                            for storage in (p.untyped_storage() for p in model.parameters())}

    def context(self) -> AbstractContextManager:
        return self.hooks() if self.blocks is None else nullcontext()

    def hooks(self) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor):
        storage = tensor.untyped_storage()
        parameter = self._parameters.get(id(storage))
        if parameter is not None and parameter() is storage:
            return tensor
        with host_resident():
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                               pin_memory=self._pin)
            host.copy_(tensor, non_blocking=self._pin)
        return tensor.device, host

    def _unpack(self, packed):
        if isinstance(packed, Tensor):
            return packed
        device, host = packed
        # copy=True: on a CPU run too, backward gets a device copy, as it would on a GPU.
        return host.to(device, non_blocking=self._pin, copy=True)


@dataclass
class CheckpointOffload(OffloadActivations):
    """Full checkpointing whose saved block inputs go to the host (Unsloth's offloaded gradient
    checkpointing): every block is checkpointed as by `full`, and the one thing a checkpoint
    keeps for backward, the block's input, waits in host memory (pinned on CUDA) instead of on
    the device, and comes back when backward runs the block again. Only the inputs that carry a
    gradient move, the hidden states that flow from block to block; what the model passes to
    every block beside them (a mask, a rotary table) stays where it is. On CUDA each copy to the
    host runs on a second stream, after the compute stream has made its tensor, so the next
    blocks run meanwhile; the copy back waits for it, on the compute stream. `blocks` as for
    `full`."""

    blocks: list[str] = ("auto",)
    cost_rank = 4  # recomputes whole blocks and moves their inputs to the host and back
    planned = ({},)

    def apply(self, model: nn.Module) -> nn.Module:
        self._watch(model)
        self._stream = (torch.cuda.Stream(self._device) if self._device.type == "cuda"
                        else None)
        self._held: list[tuple[Tensor, torch.cuda.Event]] = []  # the last copy's, until the next
        self.found = resolve_blocks(model, self.blocks, "checkpointing.blocks")
        # The offload's hooks outside the checkpoint's own, which keep nothing of what runs
        # inside: the one thing they see saved is what the checkpoint keeps to run the block
        # again, its inputs.
        self.changed = wrap_each(model, self.found.names,
                                 lambda module: Offloaded(Checkpointed(module), self),
                                 "checkpointing.blocks")
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()

    def _pack(self, tensor: Tensor):
        if not tensor.requires_grad:
            return tensor
        if self._stream is None:
            return super()._pack(tensor)
        compute = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            packed = super()._pack(tensor)
        if isinstance(packed, Tensor):  # a parameter: kept in place
            return packed
        copied = self._stream.record_event()
        # The device tensor is held until the next copy starts, and the compute stream waits
        # for this one then: the caching allocator cannot give its memory to another tensor
        # before the copy has read it. (record_stream would say so to the allocator, tensor by
        # tensor; a fake tensor's, in an estimate, reaches the real allocator.)
        self._release(compute)
        self._held = [(tensor, copied)]
        return (*packed, copied)

    def _release(self, compute: torch.cuda.Stream) -> None:
        for _, copied in self._held:
            compute.wait_event(copied)
        self._held = []

    def _unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 3:
            device, host, copied = packed
            compute = torch.cuda.current_stream(device)
            self._release(compute)
            compute.wait_event(copied)
            packed = device, host
        return super()._unpack(packed)


@dataclass
class MemoryBudget(Technique):
    """torch.compile's activation memory budget (`torch._functorch.config.
    activation_memory_budget`): AOTAutograd's partitioner keeps at most `budget` of the bytes it
    would otherwise save for backward, choosing what to recompute by a knapsack over the ops'
    runtime; 1 recomputes nothing beyond compile's own choice, 0 as much as it can. Measured
    peaks need not fall monotonically with it (pytorch/pytorch#197838). Needs compile: the
    budget means nothing to eager autograd."""

    budget: float = 0.5
    needs_compile = True
    estimable = False  # as compile
    cost_rank = 1  # recomputes
    changes_math = None  # recomputed as first computed

    def __post_init__(self) -> None:
        if not 0 <= self.budget <= 1:
            raise ValueError(f"checkpointing.budget={self.budget}: must be from 0 to 1")

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def context(self) -> AbstractContextManager:
        # Scoped to this run's forward passes, where dynamo compiles and AOTAutograd partitions
        # (the backward graph is cut out of the joint graph then): another run in the process,
        # or the next model compiled, keeps torch's default.
        return torch._functorch.config.patch(activation_memory_budget=self.budget)
