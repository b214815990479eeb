"""Memory techniques: one module per config group, one small class per option.

Every technique object has `apply(model) -> model` for its structural change; the baseline options
return the model untouched. Per-step behaviour is a context or a hook, named by the group's
protocol in its module: `precision` owns autocast, backward and the optimizer step;
`checkpointing` has a context around the forward pass; `optim` builds the optimizer; `parallel`
places the model on ranks. The trainer applies them in one fixed, commented order
(`memexp.trainer.Trainer.__init__`), and `check_combination` refuses the pairs that cannot work.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


def model_device(model: nn.Module) -> torch.device:
    """Where the model lives (techniques receive it already on its training device)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_module_names(key: str, names: list[str], model: nn.Module) -> None:
    """An unknown module name is an error that lists the valid ones."""
    valid = {name for name, _ in model.named_modules() if name}
    unknown = [name for name in names if name not in valid]
    if unknown:
        shallow = sorted(name for name in valid if name.count(".") <= 1)
        deeper = len(valid) - len(shallow)
        raise ValueError(
            f"{key}: {unknown} not in the model. Valid names: {', '.join(shallow)}"
            + (f" (and {deeper} deeper ones, from model.named_modules())" if deeper else "")
        )


def check_combination(precision, optim, parallel, bn_mode) -> None:
    """Refuse, before anything is built, the combinations that cannot work."""
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
    from memexp.techniques.bn_mode import SyncBN  # the module imports this one

    if isinstance(bn_mode, SyncBN) and not parallel.distributed:
        raise ValueError(
            "bn_mode=sync computes BatchNorm statistics over all ranks' samples, and "
            "parallel=none runs no process group. Use parallel=ddp, zero1 or fsdp (with "
            "torchrun, trainer.nproc or hydra.launcher.tasks_per_node), or bn_mode=train."
        )
