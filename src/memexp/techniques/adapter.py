"""adapter: train low-rank adapters beside frozen weights (LoRA), or beside 4-bit ones (QLoRA),
through peft.

`apply(model, device)` freezes the model's weights and injects the adapters in place
(`peft.inject_adapter_in_model`: the model keeps its own class, so its loss, its blocks and its
output head stay where the other techniques look for them). Gradients and optimizer state then
exist for the adapters only; the meter counts the frozen weights apart ("frozen").

Which modules are adapted: `target_modules=[auto]` takes the attention and MLP projections: the
Linear layers (and transformers' Conv1D, GPT-2's) inside the blocks memexp.models.blocks
resolves, where a block holds an attention module (by its class's name or its own: a
transformer's layers, not an MLP's or a ResNet's). The embeddings and the output head sit
outside the blocks and stay frozen, as in the LoRA and QLoRA papers. Explicit names match a
module's name or its last parts, as peft matches them (`q_proj` is every `*.q_proj`).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from memexp.models.blocks import Blocks, all_named_modules, replace_module, resolve_blocks
from memexp.techniques import Technique

log = logging.getLogger("memexp")

AUTO = "auto"
# NF4's blocks: 64 weights share an absmax scale, as in the QLoRA paper; the scales themselves
# are quantised to 8 bits in blocks of up to 256 (double quantisation).
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


class Adapter(Protocol):
    found: Blocks | None  # the adapted modules
    changed: Mapping[str, nn.Module]  # the modules the adapters went into, by name
    quantized: bool  # the frozen weights are stored in 4 bits

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module: ...


def linear_classes() -> tuple[type, ...]:
    """The layers peft's LoRA adapts here: nn.Linear, and transformers' Conv1D (GPT-2's
    projections, a Linear with its weight transposed) where transformers is installed."""
    if importlib.util.find_spec("transformers") is None:
        return (nn.Linear,)
    from transformers.pytorch_utils import Conv1D

    return nn.Linear, Conv1D


def linear_names(model: nn.Module) -> dict[str, nn.Module]:
    linear = linear_classes()
    return {name: module for name, module in all_named_modules(model).items()
            if isinstance(module, linear)}


def is_attention(name: str, module: nn.Module) -> bool:
    """An attention module, by its class's name or its own (GPT2Attention, LlamaAttention,
    BertSelfAttention, timm's Attention, memexp's CausalSelfAttention; `attn`, `self_attn`)."""
    return ("attention" in type(module).__name__.lower()
            or name.rpartition(".")[2].lower().endswith(("attn", "attention")))


def resolve_targets(model: nn.Module, spec: list[str]) -> dict[str, nn.Module]:
    """The modules `adapter.target_modules` names, by full name; a refusal naming the valid
    names where it names none (or `auto` finds none)."""
    linear = linear_names(model)
    valid = ", ".join(sorted({name.rpartition(".")[2] for name in linear})) or "none"
    if list(spec) == [AUTO]:
        try:
            blocks = resolve_blocks(model, [AUTO], "adapter.target_modules")
        except ValueError as error:
            raise ValueError(
                f"adapter.target_modules=[auto] found no attention or MLP projections in "
                f"{type(model).__name__}: it takes the Linear layers inside the repeated blocks, "
                f"and {error}. Name the layers to adapt: adapter.target_modules=[...], from: "
                f"{valid}") from None
        layers = [block for block, module in zip(blocks.names, blocks.modules, strict=True)
                  if any(is_attention(name, inner) for name, inner in module.named_modules())]
        found = {name: module for name, module in linear.items()
                 if any(name.startswith(f"{block}.") for block in layers)}
        if not found:
            raise ValueError(
                f"adapter.target_modules=[auto] found no attention or MLP projections in "
                f"{type(model).__name__}: its blocks ({blocks.describe()}) hold no attention "
                f"module with Linear layers beside it. Name the layers to adapt: "
                f"adapter.target_modules=[...], from: {valid}")
        return found
    found = {}
    for entry in spec:
        matched = {name: module for name, module in linear.items()
                   if name == entry or name.endswith(f".{entry}")}
        if not matched:
            raise ValueError(
                f"adapter.target_modules: {entry!r} names no Linear layer of "
                f"{type(model).__name__}" + (" (auto stands alone: [auto])" if entry == AUTO
                                             else "")
                + f". Valid names: {valid} (or [auto])")
        found.update(matched)
    return found


def peft_or_refuse(option: str):
    if importlib.util.find_spec("peft") is None:
        raise ValueError(f"adapter={option} needs peft, which is not installed: "
                         "pip install 'memexp[lora]'")
    import peft

    return peft


@dataclass
class NoAdapter(Technique):
    """Train every weight: the baseline."""

    baseline = True
    planned = ({},)
    cost_rank = 0
    changes_math = None
    quantized = False

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model


@dataclass
class LoRA(Technique):
    """Freeze the weights and train, beside each adapted layer W, a product B·A of rank `r`
    scaled by alpha / r (Hu et al., 2021): W x + (alpha / r) B A dropout(x). B starts at zero,
    so the model starts as it was. `dropout` > 0 keeps a dropped-out copy of every adapted
    layer's input for backward (peft#1514), beside the input the frozen layer keeps."""

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: list[str] = (AUTO,)
    planned = ({},)
    cost_rank = 0
    changes_math = ("only low-rank adapters train; the model's own weights stay as they are "
                    "(a low-rank update, not full fine-tuning)")
    quantized = False

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"adapter.r={self.r}: must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"adapter.dropout={self.dropout}: must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("adapter.target_modules=[]: name the layers to adapt, or [auto]")

    def option(self) -> str:
        return "lora"

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        peft = peft_or_refuse(self.option())
        targets = resolve_targets(model, self.target_modules)
        names = list(targets)
        targets = self.prepare(model, targets, device)
        config = peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                                 target_modules=names, bias="none")
        # freezes every weight but the adapters' (peft's _mark_only_adapters_as_trainable)
        model = peft.inject_adapter_in_model(config, model)
        self.changed = {name: model.get_submodule(name) for name in names}
        self.found = Blocks(names, [targets[name] for name in names])
        leaves = ", ".join(dict.fromkeys(name.rpartition(".")[2] for name in names))
        log.info("adapter: %s r=%d on %d layers (%s)%s", self.option(), self.r, len(names),
                 leaves, self.stored())
        return model

    def prepare(self, model: nn.Module, targets: dict[str, nn.Module],
                device: torch.device) -> dict[str, nn.Module]:
        """The layers as peft is to adapt them (QLoRA quantises them first)."""
        return targets

    def stored(self) -> str:
        return ""


@dataclass
class QLoRA(LoRA):
    """LoRA over 4-bit NF4 base weights (Dettmers et al., 2023): every adapted layer's weight
    is stored as NF4 (blocks of 64 with a quantised absmax each, 0.129x fp32's bytes) and
    dequantised in its forward and backward. The other weights (embeddings, norms, the output
    head) stay as they are. `backend`: bitsandbytes' Linear4bit where the run is on CUDA,
    torchao's NF4Tensor elsewhere (auto), or either by name."""

    backend: str = AUTO
    changes_math = ("only low-rank adapters train, over base weights rounded to 4-bit NF4 (the "
                    "model's function changes by NF4's rounding)")
    quantized = True
    BACKENDS = (AUTO, "bitsandbytes", "torchao")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in self.BACKENDS:
            raise ValueError(f"adapter.backend={self.backend}: valid choices are "
                             f"{', '.join(self.BACKENDS)}")

    def option(self) -> str:
        return "qlora"

    def backend_for(self, device: torch.device) -> str:
        if self.backend != AUTO:
            name = self.backend
        else:
            # bitsandbytes' 4-bit matmul is a CUDA kernel; on CPU it falls back to a slow path,
            # and torchao's NF4 (plain torch ops) runs anywhere.
            name = ("bitsandbytes" if device.type == "cuda"
                    and importlib.util.find_spec("bitsandbytes") is not None else "torchao")
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"adapter=qlora adapter.backend={name}: {name} is not installed "
                             f"(pip install {name}); adapter.backend={AUTO} picks what runs")
        return name

    def prepare(self, model: nn.Module, targets: dict[str, nn.Module],
                device: torch.device) -> dict[str, nn.Module]:
        self._backend = self.backend_for(device)
        quantize = quantize_bitsandbytes if self._backend == "bitsandbytes" else quantize_torchao
        prepared = {}
        for name, module in targets.items():
            linear = as_linear(module)
            prepared[name] = quantize(name, linear)
            if prepared[name] is not module:
                replace_module(model, name, prepared[name])
        return prepared

    def stored(self) -> str:
        return f", base weights in NF4 by {self._backend}"


def as_linear(module: nn.Module) -> nn.Linear:
    """`module` as an nn.Linear computing the same function: transformers' Conv1D holds its
    weight transposed (in x out), which neither 4-bit backend takes."""
    if isinstance(module, nn.Linear):
        return module
    weight = module.weight.detach()
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=module.bias is not None,
                       device="meta")
    linear.weight = nn.Parameter(weight.t().contiguous())
    if module.bias is not None:
        linear.bias = module.bias
    return linear


def quantize_torchao(name: str, linear: nn.Linear) -> nn.Linear:
    """The layer's weight as torchao's NF4Tensor, frozen (F.linear dequantises it)."""
    from torchao.quantization import to_nf4

    weight = linear.weight.detach()
    blocks = weight.numel() // NF4_BLOCK
    if weight.numel() % NF4_BLOCK:
        raise ValueError(f"adapter=qlora: {name}'s weight {tuple(weight.shape)} does not split "
                         f"into NF4's blocks of {NF4_BLOCK}. Leave it out of "
                         "adapter.target_modules, or use adapter=lora")
    # Double quantisation takes the scales in blocks that divide their number: 256, as in the
    # paper, where the layer's size allows it, else the largest divisor below.
    scalers = max(size for size in range(1, NF4_SCALER_BLOCK + 1) if blocks % size == 0)
    linear.weight = nn.Parameter(to_nf4(weight, NF4_BLOCK, scalers), requires_grad=False)
    return linear


def quantize_bitsandbytes(name: str, linear: nn.Linear) -> nn.Module:
    """bitsandbytes' Linear4bit in the layer's place; its weight is quantised as the model
    moves onto the device."""
    import bitsandbytes as bnb

    weight = linear.weight.detach()
    quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features,
                                  bias=linear.bias is not None, compute_dtype=weight.dtype,
                                  quant_type="nf4", device="meta")
    quantized.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        quantized.bias = linear.bias
    return quantized
