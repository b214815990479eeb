"""parallel: how the model, its gradients and its optimizer state are placed across ranks.

`none` is one process. The others run on a process group (`memexp.distributed`): a 1-rank group
in a plain `python train.py`, N ranks under torchrun, submitit's tasks_per_node or trainer.nproc.
Each rank takes its own slice of every global batch (`TensorData.train_batches`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from memexp.distributed import env_world_size, init_process_group
from memexp.estimate_parallel import on_fake_group, reduce_in_place
from memexp.memory import SwapsParameters, host_resident
from memexp.models.blocks import Blocks, resolve_blocks
from memexp.techniques import Technique, model_device

# Normalization layers keep fp32 parameters under FSDP's half-precision all-gather: their
# running statistics are fp32 buffers, and autocast runs them in fp32 anyway.
NORMS = (_BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


class Parallel(Protocol):
    rank: int
    world_size: int
    # Runs on a process group whose hooks reduce or shard the gradients (ddp, fsdp, zero1).
    distributed: bool
    # Each rank holds shards of the parameters, gathered only inside forward (fsdp); whole
    # tensors elsewhere, as a loss that applies them itself (chunked_ce) and QLoRA need.
    shards_parameters: bool
    # Each rank steps its share of the parameters with an optimizer of its own, built by
    # ZeroRedundancyOptimizer (zero1): the optimizer must let it (partition_refused).
    partitions_optimizer: bool
    # memexp estimate can trace it: one process, or one rank on a fake process group.
    estimable: bool
    # memexp plan tries the options from the cheapest (the least communicated) up
    cost_rank: int
    found: Blocks | None  # the blocks it resolved (fsdp's units)
    changed: Mapping[str, nn.Module]  # the modules it wrapped, by name

    def apply(self, model: nn.Module, autocast_dtype: torch.dtype | None) -> nn.Module:
        """Wrap the model; `autocast_dtype` is the precision group's compute dtype, if any."""

    def optimizer(self, optim, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        """The optimizer over `params`, from an `optim` option (zero1 shards its state)."""

    def accumulating(self, active: bool) -> AbstractContextManager:
        """Around forward and backward of a micro-batch that is not the last of its step."""

    def offloaded(self) -> AbstractContextManager:
        """Around work whose tensors live in host memory under this option (the optimizer step,
        with FSDP's CPU offload); the meter counts them as `offloaded`."""

    def watched(self, model: nn.Module) -> nn.Module:
        """What the meter watches for the parameters and buffers of `model`."""

    def all_reduce_sum(self, value: Tensor) -> Tensor: ...

    def local(self, tensor: Tensor) -> Tensor:
        """This rank's part of a parameter or gradient (its shard, under FSDP)."""

    def gather(self, value: Any) -> list:
        """Every rank's `value`, in rank order (a collective: every rank calls it)."""

    def heaviest_rank(self) -> int:
        """The rank whose share of what this option partitions is the largest (built, with its
        optimizer): the rank memexp estimate reports."""


@dataclass
class NoParallel(Technique):
    """One process holds the whole model."""

    rank = 0
    world_size = 1
    distributed = False
    shards_parameters = False
    partitions_optimizer = False
    estimable = True
    cost_rank = 0  # memexp plan tries options from the cheapest: nothing communicated

    def __post_init__(self) -> None:
        if env_world_size() > 1:
            raise ValueError(
                f"parallel=none in a run of {env_world_size()} processes (torchrun, "
                "hydra.launcher.tasks_per_node or trainer.nproc): every process would train "
                "its own copy. Choose parallel=ddp, zero1 or fsdp.")

    def apply(self, model: nn.Module, autocast_dtype: torch.dtype | None) -> nn.Module:
        return model

    def optimizer(self, optim, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        return optim.build(params)

    def accumulating(self, active: bool) -> AbstractContextManager:
        return nullcontext()

    def offloaded(self) -> AbstractContextManager:
        return nullcontext()

    def watched(self, model: nn.Module) -> nn.Module:
        return model

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        return value

    def local(self, tensor: Tensor) -> Tensor:
        return tensor

    def gather(self, value: Any) -> list:
        return [value]

    def heaviest_rank(self) -> int:
        return 0


@dataclass
class _OnProcessGroup(Technique):
    """What every option on a process group shares. timeout_s bounds each collective, so that a
    rank that died or hangs fails the others soon instead of after torch's 10-30 minutes."""

    timeout_s: float = 120.0
    distributed = True
    shards_parameters = False  # each rank holds whole parameters (FSDP shards them)
    partitions_optimizer = False  # every rank steps every parameter (ZeRO1 partitions them)
    # on torch's fake process group (memexp.estimate_parallel), one rank at a time
    estimable = True
    planned = ({},)  # memexp plan --world-size N tries each, as its YAML has it

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s={self.timeout_s}: must be > 0 seconds")
        self.rank, self.world_size = init_process_group(self.timeout_s)

    def optimizer(self, optim, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        return optim.build(params)

    def offloaded(self) -> AbstractContextManager:
        return nullcontext()

    def watched(self, model: nn.Module) -> nn.Module:
        return model

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        total = value.clone()
        dist.all_reduce(total)
        return total

    def local(self, tensor: Tensor) -> Tensor:
        return tensor

    def gather(self, value: Any) -> list:
        if on_fake_group():  # it moves no data: every rank is taken to have this rank's value
            return [value] * self.world_size
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def heaviest_rank(self) -> int:
        # DDP replicates everything. fully_shard splits each parameter as torch.chunk does,
        # which gives the first ranks the largest pieces, and pads every rank's shard to rank
        # 0's size.
        return 0


@dataclass
class DDP(_OnProcessGroup):
    """DistributedDataParallel: every rank holds the whole model and optimizer; gradients are
    averaged across ranks during backward, bucket by bucket."""

    cost_rank = 1  # an all-reduce of the gradients, overlapped with backward

    def apply(self, model: nn.Module, autocast_dtype: torch.dtype | None) -> nn.Module:
        if not on_fake_group():
            self._model = nn.parallel.DistributedDataParallel(model)
            return self._model
        # memexp estimate's rank (memexp.estimate_parallel). What reads data that its fake group
        # does not move is left out, as its memory is: the check and broadcast of rank 0's
        # weights as DDP is built (before the meter starts), and the second step's rebuild of the
        # gradient buckets in the order the gradients came (the same buckets' bytes, laid out
        # again; find_unused_parameters keeps the first layout). Its gradient hook returns what
        # the group's futures do not hold.
        self._model = nn.parallel.DistributedDataParallel(model, init_sync=False,
                                                          find_unused_parameters=True)
        self._model.register_comm_hook(None, reduce_in_place)
        return self._model

    def accumulating(self, active: bool) -> AbstractContextManager:
        # Accumulate locally; the last micro-batch's backward reduces the sum once.
        return self._model.no_sync() if active else nullcontext()


@dataclass
class ZeRO1(DDP):
    """ZeRO stage 1: DDP, with the optimizer state sharded across ranks
    (torch.distributed.optim.ZeroRedundancyOptimizer); each rank steps its share of the
    parameters and broadcasts them to the others."""

    cost_rank = 2  # DDP's all-reduce, and a broadcast of the parameters after the step
    partitions_optimizer = True
    # DDP's forward and backward (it recomputes and moves what DDP does), and a broadcast more
    # a step: it saves memory, and is worth a trace only where DDP does not fit
    dominated_by = DDP
    shallow_differs = ("it gives each rank whole parameters, largest first, so which rank holds "
                       "the most state, and how much, is not the same at every depth")

    def optimizer(self, optim, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(list(params),
                                       optimizer_class=lambda shard, **_: optim.make(shard))
        # ZeRO keeps its shard's state in the inner optimizer and leaves its own `state`
        # empty; the alias lets the meter (and anyone else) see this rank's optimizer state.
        zero.state = zero.optim.state
        self._zero = zero
        return zero

    def heaviest_rank(self) -> int:
        # ZeRO assigns whole parameters, largest first, each to the rank with the fewest
        # elements so far: the ranks' shares differ by up to a parameter.
        shares = [sum(p.numel() * p.element_size() for group in groups for p in group["params"])
                  for groups in self._zero._partition_parameters()]
        return shares.index(max(shares))


class _ShardedAndGathered(SwapsParameters):
    """A unit that runs sets its gathered parameters on its modules in place of the sharded
    ones, which still exist: the meter counts both as parameters (the sharded ones would
    otherwise count as optimizer tensors, and the gathered ones as activations)."""

    def __init__(self, model: nn.Module, sharded: list[nn.Parameter]):
        super().__init__()
        self.model, self.sharded = model, sharded
        # The meter asks for both at every new peak (a thousand times a step on an 8B Llama):
        # FSDP swaps the tensors in each module's slots, never the modules, so the modules are
        # listed once instead of walked every time (nn.Module.parameters() recurses).
        self._modules_in_order = list(model.modules())

    def parameters(self, recurse: bool = True):
        held = {id(p): p for p in self.sharded}
        for module in self._modules_in_order:
            held.update((id(p), p) for p in module._parameters.values() if p is not None)
        return iter(held.values())

    def buffers(self, recurse: bool = True):
        seen = set()
        for module in self._modules_in_order:
            for buffer in module._buffers.values():
                if buffer is not None and id(buffer) not in seen:
                    seen.add(id(buffer))
                    yield buffer


@contextmanager
def _without_gradient_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass
class FSDP(_OnProcessGroup):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.
    Each block is one unit, gathered just before it runs; the root holds the rest. `blocks`
    says which modules are the blocks (memexp.models.blocks: [auto], class names or globs, as
    FSDP's ModuleWrapPolicy and Accelerate's transformer_layer_cls_to_wrap name them).

    reshard_after_forward: free each block's gathered parameters after its forward (gather
                           again in backward): less memory, more communication.
    cpu_offload:           keep the sharded parameters, their gradients and the optimizer step
                           on the host (CPUOffloadPolicy), the source's `cpu_offload=True`.
    Under precision=amp or bf16, parameters are gathered in that dtype and gradients reduced in
    fp32 (MixedPrecisionPolicy); normalization layers stay fp32."""

    cost_rank = 3  # every block's parameters gathered in forward and again in backward
    compiles_with = False  # see memexp.techniques.compile
    # DTensor shards outside forward: a loss that applies the head itself would mix them with
    # its plain activations (torch: "got mixed torch.Tensor and DTensor"), and its gradient
    # would bypass fsdp's reduce-scatter (memexp.techniques.check_loss_combination); QLoRA's
    # NF4 weights do not shard (check_combination)
    shards_parameters = True
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    blocks: list[str] = ("auto",)

    def apply(self, model: nn.Module, autocast_dtype: torch.dtype | None) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        device = model_device(model)
        offload = (CPUOffloadPolicy(pin_memory=device.type == "cuda") if self.cpu_offload
                   else OffloadPolicy())
        shard = dict(mesh=init_device_mesh(device.type, (self.world_size,)),
                     reshard_after_forward=self.reshard_after_forward, offload_policy=offload)
        if autocast_dtype is not None:
            for norm in (m for m in model.modules() if isinstance(m, NORMS)):
                fully_shard(norm, **shard)
        # Reduced in fp32 whatever the gather dtype: half-precision sums of many ranks'
        # gradients lose small contributions and can overflow.
        half = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)
        self.found = resolve_blocks(model, self.blocks, "parallel.blocks")
        for block in dict.fromkeys(self.found.modules):  # a module in several places: once
            fully_shard(block, mp_policy=half, **shard)
        self.changed = dict(zip(self.found.names, self.found.modules, strict=True))
        self._model = fully_shard(model, mp_policy=half, **shard)
        self._sharded = list(model.parameters())  # every unit is sharded until the first forward
        return self._model

    def watched(self, model: nn.Module) -> nn.Module:
        return _ShardedAndGathered(model, self._sharded)

    def accumulating(self, active: bool) -> AbstractContextManager:
        # Keep the unsharded gradients and reduce-scatter once, at the last micro-batch.
        return _without_gradient_sync(self._model) if active else nullcontext()

    def offloaded(self) -> AbstractContextManager:
        return host_resident() if self.cpu_offload else nullcontext()

    def local(self, tensor: Tensor) -> Tensor:
        return tensor.to_local()  # a DTensor
