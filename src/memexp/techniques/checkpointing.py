"""checkpointing: which activations are kept for backward, recomputed, or moved off the device.

`apply(model)` wraps the chosen parts of the model; `context()` is entered around every forward
pass (only `offload` uses it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from memexp.memory import host_resident, recomputing
from memexp.models import blocks_of
from memexp.techniques import check_module_names, model_device


class Checkpointing(Protocol):
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


class Checkpointed(nn.Module):
    """Runs `inner` under non-reentrant activation checkpointing: only its inputs are kept for
    backward, and its forward is run again during backward, with the RNG state of the first run
    (dropout masks match) and without touching BatchNorm running statistics twice."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=partial(_contexts, self.inner), **kwargs)


@dataclass
class NoCheckpointing:
    """Keep every activation autograd saves: the baseline."""

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


@dataclass
class CheckpointBlocks:
    """Checkpoint every `every`-th block of `model.blocks`, from the first: `every=1` (the `full`
    option) checkpoints them all, `every=2` (`selective`) half of them."""

    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpointing.every={self.every}: must be >= 1")

    def apply(self, model: nn.Module) -> nn.Module:
        blocks = blocks_of(model)
        for index in range(0, len(blocks), self.every):
            blocks[index] = Checkpointed(blocks[index])
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


@dataclass
class CheckpointModules:
    """Checkpoint the named submodules, like MMEngine's
    `activation_checkpointing=['layer1', 'layer2']`."""

    modules: list[str]

    def apply(self, model: nn.Module) -> nn.Module:
        if not self.modules:
            raise ValueError("checkpointing=modules needs the modules to checkpoint: "
                             "checkpointing.modules=[name,...]")
        check_module_names("checkpointing.modules", list(self.modules), model)
        for name in self.modules:
            inside = [other for other in self.modules if name.startswith(other + ".")]
            if inside:
                raise ValueError(f"checkpointing.modules: {name!r} is inside {inside[0]!r}; "
                                 "name each region once")
        for name in self.modules:
            parent, _, attribute = name.rpartition(".")
            owner = model.get_submodule(parent)
            owner.register_module(attribute, Checkpointed(owner.get_submodule(attribute)))
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


@dataclass
class CheckpointSequential:
    """`torch.utils.checkpoint.checkpoint_sequential`'s scheme, the source's "split the training
    process": `model.blocks` is cut into `segments` runs of consecutive blocks, and every run but
    the last is checkpointed as one unit. (Built from `checkpoint` per run rather than by calling
    checkpoint_sequential, which cannot pass the context that keeps BatchNorm statistics right.)"""

    segments: int = 2

    def apply(self, model: nn.Module) -> nn.Module:
        blocks = blocks_of(model)
        if not 1 <= self.segments <= len(blocks):
            raise ValueError(f"checkpointing.segments={self.segments}: must be between 1 and "
                             f"the model's {len(blocks)} blocks")
        size = len(blocks) // self.segments
        runs = [nn.Sequential(*blocks[i * size:(i + 1) * size]) for i in range(self.segments - 1)]
        rest = list(blocks[(self.segments - 1) * size:])
        model.blocks = nn.Sequential(*(Checkpointed(run) for run in runs), *rest)
        return model

    def context(self) -> AbstractContextManager:
        return nullcontext()


@dataclass
class OffloadActivations:
    """Move every tensor autograd saves for backward to host memory (pinned on CUDA, so the copy
    back can overlap) and bring it back when backward needs it: the mechanism of
    `torch.autograd.graph.save_on_cpu`. Parameters are saved in place, not copied: they stay on
    the device anyway."""

    pin_memory: bool = True

    def apply(self, model: nn.Module) -> nn.Module:
        self._device = model_device(model)
        self._pin = self.pin_memory and self._device.type == "cuda"
        self._parameters = {id(p.untyped_storage()) for p in model.parameters()}
        return model

    def context(self) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor):
        if id(tensor.untyped_storage()) in self._parameters:
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
