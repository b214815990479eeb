"""bn_mode: how BatchNorm layers behave while the rest of the model trains.

Every option is structural (`apply(model, sample_forward)`, where `sample_forward(model)` runs
the model on one sample of the first batch, for the options that must see it run); `changed`
names the modules it changed, which must run in the first forward pass
(memexp.prechecks.FirstForward). Frozen BatchNorms keep their module names, parameters and
state_dict: their class is swapped for a subclass whose `train()` leaves them in eval mode, so
`model.train()` cannot undo the choice.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memexp.models.blocks import replace_module, resolve_blocks
from memexp.techniques import Technique

log = logging.getLogger("memexp")

SampleForward = Callable[[nn.Module], object]


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
class TrainBN(Technique):
    """BatchNorm as PyTorch defines it: batch statistics, running statistics updated."""

    baseline = True
    planned = ({},)
    needs_process_group = False
    changes_math = None  # see memexp.techniques
    accumulation_changes_math = (
        "BatchNorm normalizes each micro-batch of data.batch_size / optim.accumulate samples by "
        "its own statistics, not the whole batch by the batch's")

    def apply(self, model: nn.Module, sample_forward: SampleForward) -> nn.Module:
        return model


@dataclass
class EvalBN(Technique):
    """Running statistics frozen, affine weight and bias still trained: the usual transfer-learning
    setting (MMDetection's `norm_eval`, the paper's "Eval" mode)."""

    needs_process_group = False
    changes_math = ("BatchNorm normalizes with running statistics that stay frozen, never "
                    "learned (a model trained from scratch keeps mean 0 and variance 1: nothing "
                    "is normalized)")
    accumulation_changes_math = None  # no batch statistics

    def apply(self, model: nn.Module, sample_forward: SampleForward) -> nn.Module:
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
        del folded
        grad_folded, grad_shift = grad_folded.float(), grad_shift.float()
        # d/dw of w*s is s; d/ds collects from w*s and from shift = (b - mean)*s + beta. No
        # weight-sized temporary (the folded weight is freed, the sum over w*grad is a batched
        # dot product, grad_folded is scaled in place): where the weights outweigh the
        # activations (small images, wide late stages) each would raise the peak.
        grad_scale = (torch.bmm(grad_folded.flatten(1).unsqueeze(1),
                                weight.float().flatten(1).unsqueeze(2)).view(-1)
                      - grad_shift * mean.float())
        grad_weight = grad_folded.mul_(scale.view(per_channel))
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


# PyTorch's own forwards: the fold replaces the conv's forward and makes the BatchNorm's a
# pass-through, so a subclass that changes either (weight standardization, padding computed per
# input, an activation inside the norm as timm's BatchNormAct2d) would lose what it adds.
_CONV_FORWARDS = (nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)


def _foldable_conv(module: nn.Module) -> bool:
    return (isinstance(module, _ConvNd) and type(module).forward in _CONV_FORWARDS
            and module.padding_mode == "zeros" and not isinstance(module.padding, str))


def _foldable_norm(module: nn.Module) -> bool:
    return (isinstance(module, _BatchNorm) and type(module).forward is _BatchNorm.forward
            and module.track_running_stats)


@dataclass(eq=False)
class _ConvOutput:
    conv: str
    tensor: weakref.ref
    norms: list[str] = field(default_factory=list)  # the BatchNorms that took it as input
    read_elsewhere: bool = False  # by any other op: a view, an in-place change, a residual add


class _Consumers(TorchDispatchMode):
    """Who reads each output of the hooked convs during one forward pass: the hooked BatchNorms
    that take that very tensor as their input (module hooks), and any other op (this mode sees
    every op's arguments). Tensors are told apart by identity, held weakly."""

    def __init__(self, convs: dict[str, nn.Module], norms: dict[str, nn.Module]):
        super().__init__()
        self.live: dict[int, _ConvOutput] = {}
        self.outputs: list[_ConvOutput] = []
        self.inputs: dict[str, list[str | None]] = {name: [] for name in norms}
        self.reading: _ConvOutput | None = None  # the conv output the running BatchNorm takes
        self.handles = [conv.register_forward_hook(self._conv_ran(name))
                        for name, conv in convs.items()]
        for name, norm in norms.items():
            self.handles += [norm.register_forward_pre_hook(self._norm_starts(name)),
                             norm.register_forward_hook(self._norm_ends)]

    def _output(self, tensor: object) -> _ConvOutput | None:
        output = self.live.get(id(tensor))
        return output if output is not None and output.tensor() is tensor else None

    def _conv_ran(self, name: str):
        def hook(module: nn.Module, args, output: Tensor) -> None:
            self.live[id(output)] = _ConvOutput(name, weakref.ref(output))
            self.outputs.append(self.live[id(output)])
        return hook

    def _norm_starts(self, name: str):
        def hook(module: nn.Module, args) -> None:
            self.reading = self._output(args[0])
            if self.reading is not None:
                self.reading.norms.append(name)
            self.inputs[name].append(self.reading and self.reading.conv)
        return hook

    def _norm_ends(self, module: nn.Module, args, output: Tensor) -> None:
        self.reading = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":  # prim ops read metadata (a fake tensor's device)
            for leaf in tree_leaves((args, kwargs)):
                output = self._output(leaf)
                if output is not None and output is not self.reading:
                    output.read_elsewhere = True
        return func(*args, **(kwargs or {}))

    def pairs(self) -> list[tuple[str, str]]:
        """(conv, BatchNorm) where every call of the conv fed the BatchNorm alone, and every call
        of the BatchNorm took the conv's output."""
        consumers: dict[str, set[str | None]] = {}
        for output in self.outputs:
            only = len(output.norms) == 1 and not output.read_elsewhere
            consumers.setdefault(output.conv, set()).add(output.norms[0] if only else None)
        return [(conv, norm) for conv, norms in consumers.items() if len(norms) == 1
                for norm in norms if norm is not None and set(self.inputs[norm]) == {conv}]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def conv_bn_pairs(model: nn.Module, sample_forward: SampleForward) -> list[tuple[str, str]]:
    """(conv, BatchNorm) names, in module order, where the BatchNorm takes the conv's output
    tensor itself as its input and nothing else reads that output: what folding the BatchNorm
    into the conv leaves unchanged. The candidates are every conv and BatchNorm in the module
    tree a fold can take, wherever they sit (HF's ResNetConvLayer, an nn.Sequential, a block's
    conv1 and bn1, timm's deep stem and the bn1 after it); `sample_forward` runs the model once,
    in eval mode without gradients, and shows which pairs hold. No tracing: torch.fx refuses
    most Hub models (data-dependent checks, dynamic control flow)."""
    modules = dict(model.named_modules())
    consumers = _Consumers({n: m for n, m in modules.items() if _foldable_conv(m)},
                           {n: m for n, m in modules.items() if _foldable_norm(m)})
    training = {module: module.training for module in modules.values()}
    try:
        with consumers, torch.no_grad():
            sample_forward(model.eval())
    finally:
        consumers.remove()
        for module, mode in training.items():
            module.training = mode
    order = {name: i for i, name in enumerate(modules)}
    return sorted(consumers.pairs(), key=lambda pair: order[pair[0]])


@dataclass
class EfficientEvalBN(Technique):
    """Eval-mode BatchNorm folded into the conv before it on every forward: the Efficient
    Conv-BN "Tune" mode (You et al., ICLR 2024; MMEngine's `efficient_conv_bn_eval`). Same
    outputs and gradients as bn_mode=eval, but no conv output is saved for backward.

    `modules` restricts the fold to those parts of the model (MMEngine's "[backbone]"); every
    other BatchNorm is frozen as in bn_mode=eval."""

    modules: list[str] = ()
    needs_process_group = False
    planned = ({},)
    changes_math = EvalBN.changes_math  # the same outputs and gradients
    accumulation_changes_math = None

    def apply(self, model: nn.Module, sample_forward: SampleForward) -> nn.Module:
        if self.modules:
            self.found = resolve_blocks(model, self.modules, "bn_mode.modules")
        norms = batchnorms(model)
        if not norms:
            raise ValueError(f"bn_mode=efficient_eval: {type(model).__name__} has no BatchNorm")
        pairs = [(c, n) for c, n in conv_bn_pairs(model, sample_forward)
                 if self._selected(c) and self._selected(n)]
        if not pairs:
            convs = [m for m in model.modules() if isinstance(m, _ConvNd)]
            raise ValueError(
                f"bn_mode=efficient_eval found no conv->BatchNorm pair to fold in "
                f"{type(model).__name__} (modules={list(self.modules)}): "
                f"{sum(_foldable_norm(m) for _, m in norms)} of its {len(norms)} BatchNorms can "
                "be folded (running statistics kept, BatchNorm's own forward) and "
                f"{sum(map(_foldable_conv, convs))} of its {len(convs)} convolutions (the "
                "forward of nn.Conv1d/2d/3d, zero padding given as numbers), and in a forward "
                "pass on one sample no such BatchNorm took such a conv's output as its input "
                "with nothing else reading it. bn_mode=eval computes the same, without the "
                "saving")
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
        holders = Counter(type(model.get_submodule(conv_name.rpartition(".")[0])).__name__
                          for conv_name, _ in pairs)
        log.info("bn_mode=efficient_eval: folded %d of %d BatchNorms into their convs (%s)",
                 len(pairs), len(norms), ", ".join(f"{c} x{n}" for c, n in holders.items()))
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
class SyncBN(Technique):
    """SyncBatchNorm: batch statistics over all ranks' samples, so N ranks normalize as one
    process with N times the batch would. Needs parallel=ddp|zero1|fsdp (check_combination)."""

    needs_process_group = True
    changes_math = None  # normalizes N ranks as one process with N times the batch
    accumulation_changes_math = TrainBN.accumulation_changes_math

    def apply(self, model: nn.Module, sample_forward: SampleForward) -> nn.Module:
        norms = batchnorms(model)
        if not norms:
            _no_batchnorm("sync", model)
        for _, norm in norms:
            norm.__class__ = CrossRankBatchNorm  # same parameters, buffers and state_dict
        self.changed = dict(norms)
        return model


@dataclass
class GroupNormBN(Technique):
    """Every BatchNorm replaced by GroupNorm (statistics per sample over channel groups): results
    no longer depend on the batch size, so gradient accumulation matches a large batch. Each
    layer gets the largest number of groups <= `groups` that divides its channels."""

    groups: int = 32
    needs_process_group = False
    changes_math = "every BatchNorm becomes a GroupNorm: another normalization, another model"
    accumulation_changes_math = None  # statistics per sample

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"bn_mode.groups={self.groups}: must be >= 1")

    def apply(self, model: nn.Module, sample_forward: SampleForward) -> nn.Module:
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
