"""Memory techniques: one module per config group, one small class per option.

Every technique object has `apply(model) -> model` for its structural change; the baseline options
return the model untouched. Per-step behaviour is a context or a hook, named by the group's
protocol in its module: `precision` owns autocast, backward and the optimizer step;
`checkpointing` has a context around the forward pass; `optim` builds the optimizer; `parallel`
places the model on ranks. The trainer applies them in one fixed, commented order
(`memexp.trainer.Trainer.__init__`), and `check_combination` refuses the pairs that cannot work,
reading each option's capability attributes.

`changes_math` (precision, optim, bn_mode and checkpointing options) says whether an option
changes what is learned: None where it keeps the math, else a sentence saying how it changes it,
which `memexp plan` prints and ranks such options apart by. The criterion: an option keeps the
math when the run computes the same function with the same update rule, and differs from fp32
only by rounding within a step, which the next step does not inherit (autocast and TF32 products
accumulated in fp32, recomputation, offloading, the loss scaler's skipped steps). It changes the
math when it changes the model's function (frozen BatchNorm statistics, GroupNorm for
BatchNorm), the update rule (another optimizer), or keeps state that carries from step to step
in a lossy form (parameters updated in half precision without fp32 master weights, 8-bit
optimizer moments): those errors add up over training. bn_mode options also say what gradient
accumulation changes with them (`accumulation_changes_math`): BatchNorm's batch statistics then
come from each micro-batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import nn

from memexp import registry
from memexp.models.blocks import Blocks


def model_device(model: nn.Module) -> torch.device:
    """Where the model lives (techniques receive it already on its training device)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


# What an option changed when it changed nothing (a shared, read-only mapping).
NOTHING: Mapping[str, nn.Module] = MappingProxyType({})


class Technique:
    """What every technique option says of itself, by default as a class that changes nothing;
    an option that resolves blocks or changes modules sets `found` and `changed` as it applies
    itself."""

    # the blocks it resolved (memexp.models.blocks), if it resolves any
    found: Blocks | None = None
    # the modules it changed, by name: each must run in the first forward pass
    # (memexp.prechecks.FirstForward)
    changed: Mapping[str, nn.Module] = NOTHING
    # the option of its group that a run's baseline takes (memexp.baseline): one a group
    baseline: ClassVar[bool] = False
    # the arguments `memexp plan` tries the class with, each matched against its options' YAML
    # (memexp.registry.planned): () none of them, ({},) every one
    planned: ClassVar[tuple[Mapping[str, object], ...]] = ()
    # whether it works only under torch.compile (checkpointing=budget), and whether it works
    # under it at all: dynamo must trace what it does to the forward pass (check_combination)
    needs_compile: ClassVar[bool] = False
    compiles_with: ClassVar[bool] = True
    # whether memexp estimate can trace it (plan searches only what it can estimate, and lists
    # the rest as not searched)
    estimable: ClassVar[bool] = True
    # why memexp plan cannot take its estimate from copies of the model with fewer blocks
    # (memexp.depth), which then traces it whole; None where it can
    shallow_differs: ClassVar[str | None] = None
    # the option of its group that memexp plan ranks before it on a CPU estimate whatever their
    # peaks (the same recomputation, bytes moved and micro-batches, less communication): where
    # that one fits with every other option the same, this one is left out untraced
    # (memexp.settle); None where no option is
    dominated_by: ClassVar[type | None] = None


def check_combination(precision, optim, parallel, bn_mode, checkpointing, compile, adapter,
                      device: torch.device, checkpoint_every: int = 0) -> None:
    """Refuse, before anything is built, the combinations that cannot work. Every rule reads
    the options' capability attributes (`needs_all_grads`, `in_backward`, `distributed`, ...),
    so what works with what is stated on the classes and checked here only."""
    if optim.in_backward and optim.accumulate > 1:
        raise ValueError(
            f"optim.in_backward=true with optim.accumulate={optim.accumulate}: stepping inside "
            "backward uses each gradient at once, so gradients cannot accumulate over "
            "micro-batches. Use one or the other."
        )
    if optim.in_backward and optim.keep_grads:
        raise ValueError("optim.in_backward=true with optim.keep_grads=true: stepping inside "
                         "backward frees each gradient as it is used. Use one or the other.")
    if optim.in_backward and precision.needs_all_grads:
        raise ValueError(
            "optim.in_backward=true steps each parameter inside backward, as soon as its "
            "gradient exists; the chosen precision needs every gradient at once before the step "
            "(float16 loss scaling in precision=amp, or precision.master_weights=true). "
            "Use precision=fp32, bf16 or bf16_pure, or optim.in_backward=false."
        )
    if optim.in_backward and parallel.distributed:
        raise ValueError(
            "optim.in_backward=true steps each parameter as soon as its gradient exists, before "
            "parallel=ddp|zero1|fsdp has reduced (or sharded) it across ranks. Use "
            "parallel=none, or optim.in_backward=false."
        )
    if bn_mode.needs_process_group and not parallel.distributed:
        raise ValueError(
            "bn_mode=sync computes BatchNorm statistics over all ranks' samples, and "
            "parallel=none runs no process group. Use parallel=ddp, zero1 or fsdp (with "
            "torchrun, trainer.nproc or hydra.launcher.tasks_per_node), or bn_mode=train."
        )
    if precision.needs_cuda and device.type != "cuda":
        name = "|".join(registry.options_of("precision", type(precision)))
        why = registry.stated(type(precision), "cuda_reason",
                              "TF32 is a tensor-core mode of NVIDIA GPUs")
        raise ValueError(
            f"precision={name} needs a CUDA device ({why}); this run is on {device}. On CPU use "
            "precision=fp32, amp or bf16."
        )
    if adapter.quantized and parallel.shards_parameters:
        raise ValueError(
            "adapter=qlora with parallel=fsdp: FSDP2 shards each 4-bit weight's inner tensors "
            "along their first dimension, which fails where a layer's NF4 scales do not divide "
            "among the ranks (torchao: 'quantization_factor.numel() not divisible by 2' on a "
            "small Llama). Use parallel=ddp or zero1 (the 4-bit base weights are small), or "
            "adapter=lora.")
    if parallel.shards_parameters and optim.shards_refused:
        name = "|".join(registry.options_of("optim", type(optim)))
        whole = "parallel=ddp" if optim.partition_refused else "parallel=ddp or zero1"
        raise ValueError(
            f"optim={name} with parallel=fsdp: {optim.shards_refused} Use {whole} with it, or "
            "optim=adamw, adam or sgd with fsdp.")
    if parallel.partitions_optimizer and optim.partition_refused:
        name = "|".join(registry.options_of("optim", type(optim)))
        raise ValueError(f"optim={name} with parallel=zero1: {optim.partition_refused} Use "
                         "parallel=ddp with it, or another optimizer with zero1.")
    check_offload(optim, precision, parallel, device)
    check_compile(compile, checkpointing, parallel)
    if checkpoint_every and parallel.distributed:
        raise ValueError(
            "trainer.checkpoint_every with a parallel option: checkpoints of sharded and "
            "replicated runs are not supported yet. Use trainer.checkpoint_every=0, or "
            "parallel=none.")


def check_offload(optim, precision, parallel, device: torch.device) -> None:
    """optim.offload=cpu's rules: a step on the host, from gradients copied there one at a time
    as backward completes them, of one process's parameters."""
    if optim.offload != "cpu":
        return
    if device.type != "cuda":
        raise ValueError(
            f"optim.offload=cpu on {device}: it moves the optimizer's state (and, with "
            "optim.offload_gradients, the gradients) from the GPU's memory to the host's, and a "
            "CPU run's device is the host: one memory, so nothing would move, and a split "
            "between them would be pretended (torchao's CPUOffloadOptimizer runs on CUDA only). "
            "Estimate it for a GPU: memexp estimate <overrides> optim.offload=cpu --target cuda "
            "(traced on the CUDA build's fake device: `make cuda-estimator`), or measure it on "
            "one")
    if precision.needs_all_grads:
        raise ValueError(
            "optim.offload=cpu copies each gradient to the host as backward completes it and "
            "steps there; the chosen precision needs every gradient at once on the device first "
            "(float16 loss scaling in precision=amp, or precision.master_weights=true). Use "
            "precision=fp32, bf16 or bf16_pure, or optim.offload=none.")
    if parallel.distributed:
        raise ValueError(
            "optim.offload=cpu steps one process's parameters on its host (torchao's "
            "CPUOffloadOptimizer, for single-GPU training); parallel=ddp|zero1|fsdp reduce or "
            "shard the gradients across ranks. Use parallel=none with it, or parallel=fsdp "
            "parallel.cpu_offload=true (FSDP's own host step).")


def check_compile(compile, checkpointing, parallel) -> None:
    """The compile group's rules (memexp.techniques.compile): what needs it, and what it cannot
    trace."""
    name = "|".join(registry.options_of("checkpointing", type(checkpointing)))
    if checkpointing.needs_compile and not compile.compiles:
        raise ValueError(
            f"checkpointing={name}: the activation memory budget is a setting of torch.compile's "
            "partitioner, and compile=none runs eager autograd, which it does not change. Use "
            "compile=default (or reduce-overhead) with it, or another checkpointing option.")
    if not compile.compiles:
        return
    if not checkpointing.compiles_with:
        raise ValueError(
            f"compile=default|reduce-overhead with checkpointing={name}: its wrappers run Python "
            "around every recomputation or saved tensor (BatchNorm statistics kept, the meter "
            "told, host copies), which dynamo does not trace: those blocks would fall back to "
            "eager, unmeasured as compiled. Use checkpointing=budget (compile's own "
            "recomputation) or none.")
    if not parallel.compiles_with:
        raise ValueError(
            "compile=default|reduce-overhead with parallel=fsdp: FSDP2's per-unit hooks would cut "
            "the whole-model graph at every block; a compiled FSDP model is compiled block by "
            "block before fully_shard (as torchtitan does), which memexp does not build yet. "
            "Use parallel=ddp, zero1 or none, or compile=none.")


def check_loss_combination(loss, parallel) -> None:
    """check_combination's rules on the loss, which is built after the model (it may take over
    the model's head: memexp.loss.as_loss), before the parallel option wraps the model. `loss`
    and `parallel` may be the options or their classes (which state what the rules read); a
    user's loss (None: a class not imported) states nothing."""
    if registry.stated(loss, "applies_params", False) and parallel.shards_parameters:
        raise ValueError(
            f"{loss.key} applies the model's output head itself, outside the model's forward, "
            "and parallel=fsdp holds the head's weight as this rank's shard there (gathered "
            "only inside forward). Use parallel=ddp or zero1, or loss=cross_entropy with fsdp")


def check_estimable(parallel_class: type, world_size: int, loss_target=None) -> None:
    """memexp estimate traces one process, or one rank of `world_size` (memexp.estimate_parallel):
    read from the classes (the parallel option's and the loss's `loss_target`), since building
    a parallel option joins a process group."""
    if world_size < 1:
        raise ValueError(f"--world-size {world_size}: must be >= 1")
    if world_size > 1 and not parallel_class.distributed:
        raise ValueError(f"--world-size {world_size} with parallel=none: every rank would train "
                         "its own copy. Choose parallel=ddp, zero1 or fsdp")
    # what train.py refuses, for its reason, before what the trace cannot do
    check_loss_combination(loss_target, parallel_class)
    if world_size > 1 and registry.stated(loss_target, "applies_params", False):
        raise ValueError(
            f"{loss_target.key} --world-size {world_size}: the rank's trace builds DDP with "
            "find_unused_parameters=True on its fake process group, which marks the output "
            "head's weight ready twice when the loss applies it outside forward. Estimate it "
            "with --world-size 1 (the loss's memory per rank is the same), or measure the ranks "
            "with train.py")
    if not parallel_class.estimable:
        raise ValueError(f"parallel._target_={parallel_class.__module__}."
                         f"{parallel_class.__qualname__}: memexp estimate does not trace it "
                         "(its class says `estimable = False`); measure it with train.py")
