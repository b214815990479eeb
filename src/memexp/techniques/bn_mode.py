"""bn_mode: how BatchNorm layers behave while the rest of the model trains.

Every option is structural (`apply(model)`); `changed` names the modules it changed, which must
run in the first forward pass (memexp.prechecks.FirstForward). Frozen BatchNorms keep their
module names, parameters and state_dict: their class is swapped for a subclass whose `train()`
leaves them in eval mode, so `model.train()` cannot undo the choice.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from memexp.models.blocks import replace_module, resolve_blocks
from memexp.techniques import NOTHING

log = logging.getLogger("memexp")


def batchnorms(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def _always_eval(self: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(self, False)


@functools.cache
def _frozen_class(cls: type) -> type:
    return type(f"Frozen{cls.__name__}", (cls,), {"train": _always_eval})


def freeze_statistics(norm: _BatchNorm) -> None:
    """Normalize with the running statistics and never update them; weight and bias still train."""
    norm.__class__ = _frozen_class(type(norm))
    norm.train(False)


def _no_batchnorm(option: str, model: nn.Module) -> None:
    warnings.warn(f"bn_mode={option}: {type(model).__name__} has no BatchNorm layer; "
                  "nothing to change", stacklevel=3)


@dataclass
class TrainBN:
    """BatchNorm as PyTorch defines it: batch statistics, running statistics updated."""

    found = None
    changed = NOTHING
    baseline = True
    needs_process_group = False
    changes_math = None  # see memexp.techniques
    accumulation_changes_math = (
        "BatchNorm normalizes each micro-batch of data.batch_size / optim.accumulate samples by "
        "its own statistics, not the whole batch by the batch's")

    def apply(self, model: nn.Module) -> nn.Module:
        return model


@dataclass
class EvalBN:
    """Running statistics frozen, affine weight and bias still trained: the usual transfer-learning
    setting (MMDetection's `norm_eval`, the paper's "Eval" mode)."""

    found = None
    changed = NOTHING
    baseline = False
    needs_process_group = False
    changes_math = ("BatchNorm normalizes with running statistics that stay frozen, never "
                    "learned (a model trained from scratch keeps mean 0 and variance 1: nothing "
                    "is normalized)")
    accumulation_changes_math = None  # no batch statistics

    def apply(self, model: nn.Module) -> nn.Module:
        norms = batchnorms(model)
        if not norms:
            _no_batchnorm("eval", model)
        for _, norm in norms:
            freeze_statistics(norm)
        self.changed = dict(norms)
        return model


class _FoldedConvBN(torch.autograd.Function):
    """conv(x, w * s) + (b - mean) * s + beta, with s = gamma / sqrt(var + eps) per channel.

    Saves x and the per-channel 1/sqrt(var + eps); w, b, gamma and mean are parameters and
    buffers, kept anyway. The folded weight is recomputed in backward: MMEngine's fold saves it,
    a weight-sized copy per conv that costs more than it saves at small batch. An eval-mode
    BatchNorm after a conv would save the conv's whole output; nothing here does.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, gamma, beta, mean, var, eps, stride, padding, dilation,
                groups):
        inv_std = torch.rsqrt(var.float() + eps)
        scale = gamma.float() * inv_std
        shift = beta.float() - mean.float() * scale
        if bias is not None:
            shift = shift + bias.float() * scale
        # Under autocast the conv runs in the autocast dtype, as an unfolded conv would.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x = x.to(dtype)
        per_channel = (-1, *[1] * (weight.dim() - 1))
        folded = (weight.float() * scale.view(per_channel)).to(dtype)
        with torch.autocast(device, enabled=False):
            out = torch.ops.aten.convolution(x, folded, shift.to(dtype), stride, padding,
                                             dilation, False, [0] * (weight.dim() - 2), groups)
        ctx.save_for_backward(x, weight, bias, gamma, mean, inv_std)
        ctx.conv = (stride, padding, dilation, groups)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, gamma, mean, inv_std = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        scale = gamma.float() * inv_std
        per_channel = (-1, *[1] * (weight.dim() - 1))
        folded = (weight.float() * scale.view(per_channel)).to(x.dtype)
        grad_x, grad_folded, grad_shift = torch.ops.aten.convolution_backward(
            grad_out.to(x.dtype), x, folded, [folded.shape[0]], stride, padding, dilation, False,
            [0] * (weight.dim() - 2), groups, [ctx.needs_input_grad[0], True, True],
        )
        grad_folded, grad_shift = grad_folded.float(), grad_shift.float()
        # d/dw of w*s is s; d/ds collects from w*s and from shift = (b - mean)*s + beta.
        grad_weight = grad_folded * scale.view(per_channel)
        grad_scale = (grad_folded * weight.float()).flatten(1).sum(1) - grad_shift * mean.float()
        grad_bias = None
        if bias is not None:
            grad_scale = grad_scale + grad_shift * bias.float()
            grad_bias = (grad_shift * scale).to(bias.dtype)
        return (grad_x, grad_weight.to(weight.dtype), grad_bias,
                (grad_scale * inv_std).to(gamma.dtype), grad_shift.to(gamma.dtype),
                None, None, None, None, None, None, None)


def _conv_with_norm(self: _ConvNd, x: Tensor) -> Tensor:
    norm = self._folded_norm
    gamma = norm.weight if norm.affine else torch.ones_like(norm.running_var)
    beta = norm.bias if norm.affine else torch.zeros_like(norm.running_mean)
    return _FoldedConvBN.apply(x, self.weight, self.bias, gamma, beta, norm.running_mean,
                               norm.running_var, norm.eps, self.stride, self.padding,
                               self.dilation, self.groups)


def _pass_through(self: nn.Module, x: Tensor) -> Tensor:
    return x


@functools.cache
def _folded_conv_class(cls: type) -> type:
    return type(f"{cls.__name__}WithFoldedBN", (cls,), {"forward": _conv_with_norm})


@functools.cache
def _folded_norm_class(cls: type) -> type:
    return type(f"FoldedInto{cls.__name__}", (cls,),
                {"forward": _pass_through, "train": _always_eval})


def _foldable(conv: nn.Module, norm: nn.Module) -> bool:
    return (isinstance(conv, _ConvNd) and not conv.transposed and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str) and isinstance(norm, _BatchNorm)
            and norm.track_running_stats)


def conv_bn_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(conv, BatchNorm) names where the BatchNorm is the conv's only consumer. Found by tracing
    the model with torch.fx; for models fx cannot trace, by scanning nn.Sequential containers."""
    modules = dict(model.named_modules())
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as error:  # dynamic control flow and the like
        warnings.warn(f"bn_mode=efficient_eval: torch.fx cannot trace {type(model).__name__} "
                      f"({type(error).__name__}); looking for conv->BatchNorm pairs inside "
                      "nn.Sequential containers only", stacklevel=3)
        return [(f"{name}.{a}".lstrip("."), f"{name}.{b}".lstrip("."))
                for name, seq in modules.items() if isinstance(seq, nn.Sequential)
                for (a, conv), (b, norm) in itertools.pairwise(seq.named_children())
                if _foldable(conv, norm)]
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    pairs = []
    for node in graph.nodes:
        source = node.args[0] if node.args else None
        if (node.op == "call_module" and isinstance(source, torch.fx.Node)
                and source.op == "call_module" and len(source.users) == 1
                and calls[source.target] == calls[node.target] == 1
                and _foldable(modules[source.target], modules[node.target])):
            pairs.append((source.target, node.target))
    return pairs


@dataclass
class EfficientEvalBN:
    """Eval-mode BatchNorm folded into the conv before it on every forward: the Efficient
    Conv-BN "Tune" mode (You et al., ICLR 2024; MMEngine's `efficient_conv_bn_eval`). Same
    outputs and gradients as bn_mode=eval, but no conv output is saved for backward.

    `modules` restricts the fold to those parts of the model (MMEngine's "[backbone]"); every
    other BatchNorm is frozen as in bn_mode=eval."""

    modules: list[str] = ()
    found = None
    changed = NOTHING
    baseline = False
    needs_process_group = False
    changes_math = EvalBN.changes_math  # the same outputs and gradients
    accumulation_changes_math = None

    def apply(self, model: nn.Module) -> nn.Module:
        if self.modules:
            self.found = resolve_blocks(model, self.modules, "bn_mode.modules")
        norms = batchnorms(model)
        if not norms:
            raise ValueError(f"bn_mode=efficient_eval: {type(model).__name__} has no BatchNorm")
        pairs = [(c, n) for c, n in conv_bn_pairs(model) if self._selected(c)]
        if not pairs:
            raise ValueError(f"bn_mode=efficient_eval found no conv->BatchNorm pair to fold in "
                             f"{type(model).__name__} (modules={list(self.modules)})")
        folded = {norm for _, norm in pairs}
        for name, norm in norms:
            if name not in folded:
                freeze_statistics(norm)
        for conv_name, norm_name in pairs:
            conv, norm = model.get_submodule(conv_name), model.get_submodule(norm_name)
            conv.__class__ = _folded_conv_class(type(conv))
            object.__setattr__(conv, "_folded_norm", norm)  # a reference, not a submodule
            norm.__class__ = _folded_norm_class(type(norm))
            norm.train(False)
        self.changed = {conv_name: model.get_submodule(conv_name) for conv_name, _ in pairs}
        log.info("bn_mode=efficient_eval: folded %d of %d BatchNorms into their convs",
                 len(pairs), len(norms))
        return model

    def _selected(self, name: str) -> bool:
        return self.found is None or any(name == m or name.startswith(m + ".")
                                         for m in self.found.names)


class CrossRankBatchNorm(_BatchNorm):
    """Synchronized BatchNorm on any device: batch statistics over every rank's samples, from
    two differentiable all-reduces (the mean, then the variance around it, more exact than
    E[x^2] - E[x]^2). nn.SyncBatchNorm's kernels are CUDA-only, and DDP refuses it on CPU.
    Eval mode normalizes with the running statistics, as BatchNorm does."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)
        from torch.distributed.nn.functional import all_reduce

        dims, shape = [0, *range(2, input.dim())], (1, -1, *[1] * (input.dim() - 2))
        count = torch.tensor(float(input.numel() // input.shape[1]), device=input.device)
        dist.all_reduce(count)
        x = input.float()  # statistics in fp32 (half-precision sums overflow), as cuDNN's
        mean = all_reduce(x.sum(dims)) / count
        centered = x - mean.view(shape)
        var = all_reduce((centered * centered).sum(dims)) / count
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (self.momentum if self.momentum is not None
                          else 1.0 / self.num_batches_tracked.item())
                self.running_mean.lerp_(mean, factor)
                self.running_var.lerp_(var * count / (count - 1), factor)
        return out.to(input.dtype)


@dataclass
class SyncBN:
    """SyncBatchNorm: batch statistics over all ranks' samples, so N ranks normalize as one
    process with N times the batch would. Needs parallel=ddp|zero1|fsdp (check_combination)."""

    found = None
    changed = NOTHING
    baseline = False
    needs_process_group = True
    changes_math = None  # normalizes N ranks as one process with N times the batch
    accumulation_changes_math = TrainBN.accumulation_changes_math

    def apply(self, model: nn.Module) -> nn.Module:
        norms = batchnorms(model)
        if not norms:
            _no_batchnorm("sync", model)
        for _, norm in norms:
            norm.__class__ = CrossRankBatchNorm  # same parameters, buffers and state_dict
        self.changed = dict(norms)
        return model


@dataclass
class GroupNormBN:
    """Every BatchNorm replaced by GroupNorm (statistics per sample over channel groups): results
    no longer depend on the batch size, so gradient accumulation matches a large batch. Each
    layer gets the largest number of groups <= `groups` that divides its channels."""

    groups: int = 32
    found = None
    changed = NOTHING
    baseline = False
    needs_process_group = False
    changes_math = "every BatchNorm becomes a GroupNorm: another normalization, another model"
    accumulation_changes_math = None  # statistics per sample

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"bn_mode.groups={self.groups}: must be >= 1")

    def apply(self, model: nn.Module) -> nn.Module:
        norms = batchnorms(model)
        if not norms:
            _no_batchnorm("group_norm", model)
        for name, norm in norms:
            channels = norm.num_features
            groups = max(g for g in range(1, min(self.groups, channels) + 1) if channels % g == 0)
            replacement = nn.GroupNorm(groups, channels, eps=norm.eps, affine=norm.affine)
            if norm.affine:
                with torch.no_grad():
                    replacement.weight.copy_(norm.weight)
                    replacement.bias.copy_(norm.bias)
            replace_module(model, name, replacement)
        self.changed = {name: model.get_submodule(name) for name, _ in norms}
        return model
