"""adapter: train low-rank adapters beside frozen weights (LoRA), or beside 4-bit ones (QLoRA),
through peft.

`apply(model, device, compute_dtype)` freezes the model's weights and injects the adapters in
place (`peft.inject_adapter_in_model`: the model keeps its own class, so its loss, its blocks and
its output head stay where the other techniques look for them). Gradients and optimizer state
then exist for the adapters only (in fp32); the meter counts the frozen weights apart
("frozen"), which precision stores (memexp.techniques.precision: bf16 under bf16 autocast).

Which modules are adapted: `target_modules=[auto]` takes the attention and MLP projections: the
Linear layers (and transformers' Conv1D, GPT-2's) inside the blocks memexp.models.blocks
resolves, where a block holds an attention module (by its class's name or its own: a
transformer's layers, not an MLP's or a ResNet's). The embeddings and the output head sit
outside the blocks and stay frozen, as in the LoRA and QLoRA papers. Explicit names match a
module's name or its last parts, as peft matches them (`q_proj` is every `*.q_proj`).

An MoE's experts are no Linear layers: transformers stacks each projection of all experts into
one 3-D parameter (Mixtral's `experts.gate_up_proj`, experts x out x in). `target_modules` cannot
reach them, and the log says which weights of the blocks it left so (`block_weights`);
`target_parameters` adapts them, through peft's parameter targeting (one B·A per expert,
added to the stacked weight in each forward): `[auto]` takes the 3-D weights in the blocks.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memexp.extras import install_hint
from memexp.models.blocks import (
    Blocks,
    Wrapper,
    all_named_modules,
    replace_module,
    resolve_blocks,
)
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
    quantized_by: str | None  # the library that holds them, once applied

    def apply(self, model: nn.Module, device: torch.device,
              compute_dtype: torch.dtype) -> nn.Module:
        """Adapt `model` (on the host, to train on `device`); `compute_dtype` is the
        precision's, which a 4-bit layer of bitsandbytes computes in."""

    def kept_apart(self) -> list[torch.Tensor]:
        """What the frozen weights keep outside the model's parameters and buffers, for the
        meter to count as frozen (bitsandbytes' 4-bit scales)."""

    def packed(self) -> int:
        """The weights that parameters hold beyond their own number of elements (bitsandbytes
        packs two 4-bit weights in a byte), for a count of the model's weights."""


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


def model_name(model: nn.Module, name: str) -> str:
    """`name` as the model names its module: a layer held by a technique's wrapper
    (memexp.models.blocks.Wrapper: the output head that loss=chunked_ce applies itself,
    memexp.models.head) goes by the wrapper's name, never by the wrapper's `inner`."""
    while True:
        parent, _, last = name.rpartition(".")
        if last != "inner" or not isinstance(model.get_submodule(parent), Wrapper):
            return name
        name = parent


def is_attention(name: str, module: nn.Module) -> bool:
    """An attention module, by its class's name or its own (GPT2Attention, LlamaAttention,
    BertSelfAttention, timm's Attention, memexp's CausalSelfAttention; `attn`, `self_attn`)."""
    return ("attention" in type(module).__name__.lower()
            or name.rpartition(".")[2].lower().endswith(("attn", "attention")))


def resolve_targets(model: nn.Module, spec: list[str]) -> dict[str, nn.Module]:
    """The modules `adapter.target_modules` names, by full name; a refusal naming the valid
    names where it names none (or `auto` finds none)."""
    linear = linear_names(model)
    shown = {name: model_name(model, name) for name in linear}
    valid = ", ".join(sorted({name.rpartition(".")[2] for name in shown.values()})) or "none"
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
                   if shown[name] == entry or shown[name].endswith(f".{entry}")}
        if not matched:
            raise ValueError(
                f"adapter.target_modules: {entry!r} names no Linear layer of "
                f"{type(model).__name__}" + (" (auto stands alone: [auto])" if entry == AUTO
                                             else "")
                + f". Valid names: {valid} (or [auto])")
        found.update(matched)
    return found


def block_weights(model: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
    """The weights of two or more dimensions inside the blocks ([auto]) that no Linear layer
    holds, which `target_modules` cannot adapt (an MoE's stacked experts, its router's weight):
    by full name, each with its name in its block and the parameter. None for a model with no
    blocks."""
    try:
        blocks = resolve_blocks(model, [AUTO], "adapter.target_parameters")
    except ValueError:
        return {}
    linear = linear_classes()
    found = {}
    for block, module in zip(blocks.names, blocks.modules, strict=True):
        for name, parameter in module.named_parameters():
            owner = module.get_submodule(name.rpartition(".")[0])
            if parameter.dim() >= 2 and not isinstance(owner, linear):
                found[f"{block}.{name}"] = (name, parameter)
    return found


def resolve_parameters(model: nn.Module, spec: list[str]) -> dict[str, nn.Parameter]:
    """The parameters `adapter.target_parameters` names, by full name: [auto] takes the 3-D
    weights in the blocks (an MoE's experts); names match a parameter's name or its last
    parts, as peft matches them. A refusal naming the valid names where one names none."""
    weights = block_weights(model)
    valid = ", ".join(dict.fromkeys(inner for inner, _ in weights.values())) or "none"
    if list(spec) == [AUTO]:
        found = {name: parameter for name, (_, parameter) in weights.items()
                 if parameter.dim() == 3}
        if not found:
            raise ValueError(
                f"adapter.target_parameters=[auto] found no 3-D weights (an MoE's experts) in "
                f"the blocks of {type(model).__name__}. Weights there that no Linear layer "
                f"holds: {valid}")
        return found
    parameters = dict(model.named_parameters())
    found = {}
    for entry in spec:
        matched = {name: parameter for name, parameter in parameters.items()
                   if (name == entry or name.endswith(f".{entry}")) and parameter.dim() >= 2}
        if not matched:
            raise ValueError(
                f"adapter.target_parameters: {entry!r} names no weight of two or more "
                f"dimensions of {type(model).__name__}" + (" (auto stands alone: [auto])"
                                                          if entry == AUTO else "")
                + f". Weights in its blocks that no Linear layer holds: {valid} (or [auto])")
        found.update(matched)
    return found


def left_out(model: nn.Module, adapted: dict[str, nn.Parameter]) -> str:
    """The weights in the blocks that neither target_modules nor target_parameters adapted, by
    their names in a block, for the log ("" for none)."""
    left = {inner: parameter.dim() for name, (inner, parameter) in block_weights(model).items()
            if name not in adapted}
    if not left:
        return ""
    hint = ("; adapter.target_parameters=[auto] adapts the 3-D ones (an MoE's experts)"
            if 3 in left.values() else "")
    names = ", ".join(f"{inner} ({dims}-D)" for inner, dims in left.items())
    return f"; not adapted in the blocks, as no Linear layer holds them: {names}{hint}"


@contextmanager
def as_resolved() -> Iterator[None]:
    """peft injects the targets as given. With transformers 5 installed, peft 0.21 converts a
    LoRA config as it injects it, for adapters trained on transformers 4's MoE layout: on the
    models whose checkpoints transformers converts to Qwen2-MoE's layout (DeepSeek-V2 and V3,
    dots1 and others) a target named gate_proj, up_proj or down_proj (v4's experts) becomes the
    stacked experts' parameters, with gate_up_proj's rank doubled, and the Linear layers of
    those names (the shared experts') are dropped. Resolved targets are this model's own: asked
    for DeepSeek-V3's shared experts, that adapted its routed experts instead, and the log
    named the wrong layers."""
    from peft.utils import transformers_weight_conversion as conversion

    converts = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = converts


def peft_or_refuse(option: str):
    if importlib.util.find_spec("peft") is None:
        raise ValueError(f"adapter={option} needs peft, which is not installed "
                         f"{install_hint('lora')}")
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
    quantized_by = None

    def apply(self, model: nn.Module, device: torch.device,
              compute_dtype: torch.dtype) -> nn.Module:
        return model

    def kept_apart(self) -> list[torch.Tensor]:
        return []

    def packed(self) -> int:
        return 0


@dataclass
class LoRA(Technique):
    """Freeze the weights and train, beside each adapted layer W, a product B·A of rank `r`
    scaled by alpha / r (Hu et al., 2021): W x + (alpha / r) B A dropout(x). B starts at zero,
    so the model starts as it was. `dropout` > 0 keeps a dropped-out copy of every adapted
    layer's input for backward (peft#1514), beside the input the frozen layer keeps.
    `target_parameters` adapts weights that are no Linear layer's (an MoE's stacked experts:
    [auto]), each expert's matrix with a B·A of its own."""

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: list[str] = (AUTO,)
    target_parameters: list[str] = ()
    planned = ({},)
    cost_rank = 0
    changes_math = ("only low-rank adapters train; the model's own weights stay as they are "
                    "(a low-rank update, not full fine-tuning)")
    quantized = False
    quantized_by = None

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"adapter.r={self.r}: must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"adapter.dropout={self.dropout}: must be in [0, 1)")
        if not self.target_modules and not self.target_parameters:
            raise ValueError("adapter.target_modules=[]: name the layers to adapt, or [auto]")
        if self.target_parameters and self.dropout:
            raise ValueError(
                f"adapter.dropout={self.dropout} with adapter.target_parameters: peft adapts a "
                "parameter by adding B·A to the weight, where no dropout of the layer's input "
                "can go; set adapter.dropout=0")

    def option(self) -> str:
        return "lora"

    def apply(self, model: nn.Module, device: torch.device,
              compute_dtype: torch.dtype) -> nn.Module:
        peft = peft_or_refuse(self.option())
        targets = resolve_targets(model, self.target_modules) if self.target_modules else {}
        names = list(targets)
        parameters = resolve_parameters(model, self.target_parameters)
        # the modules that hold the parameters: peft puts its wrapper in their place
        holders = {name: model.get_submodule(name) for name in
                   dict.fromkeys(name.rpartition(".")[0] for name in parameters)}
        skipped = left_out(model, parameters)
        targets = self.prepare(model, targets, device, compute_dtype)
        config = peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                                 target_modules=names, target_parameters=list(parameters),
                                 bias="none")
        # freezes every weight but the adapters' (peft's _mark_only_adapters_as_trainable)
        with as_resolved():
            model = peft.inject_adapter_in_model(config, model)
        # The adapters train in fp32. peft made each in its base layer's dtype, a 4-bit layer's
        # compute dtype (bf16 under bf16), and leaves the cast back to fp32 to PeftModel
        # (autocast_adapter_dtype=True), which inject_adapter_in_model is not.
        peft.tuners.tuners_utils.cast_adapter_dtype(model, "default")
        # By the model's names: the deferred head's adapter runs in the loss, and its wrapper
        # (which the model's forward calls) stands for it in the first forward's check.
        shown = [model_name(model, name) for name in names]
        self.changed = {name: model.get_submodule(name) for name in [*shown, *holders]}
        self.found = Blocks([*shown, *holders], [*(targets[name] for name in names),
                                                 *holders.values()])
        leaves = ", ".join(dict.fromkeys(name.rpartition(".")[2] for name in shown))
        weights = ", ".join(dict.fromkeys(".".join(name.split(".")[-2:]) for name in parameters))
        log.info("adapter: %s r=%d on %d layers (%s)%s%s%s", self.option(), self.r, len(names),
                 leaves or "none", f" and {len(parameters)} weights ({weights})" * bool(parameters),
                 self.stored(), skipped)
        return model

    def prepare(self, model: nn.Module, targets: dict[str, nn.Module], device: torch.device,
                compute_dtype: torch.dtype) -> dict[str, nn.Module]:
        """The layers as peft is to adapt them (QLoRA quantises them first)."""
        return targets

    def stored(self) -> str:
        return ""

    def kept_apart(self) -> list[torch.Tensor]:
        return []

    def packed(self) -> int:
        return 0


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
            extra = "qlora-cuda" if name == "bitsandbytes" else "lora"
            raise ValueError(f"adapter=qlora adapter.backend={name}: {name} is not installed "
                             f"{install_hint(extra)}; adapter.backend={AUTO} picks what runs")
        return name

    def prepare(self, model: nn.Module, targets: dict[str, nn.Module], device: torch.device,
                compute_dtype: torch.dtype) -> dict[str, nn.Module]:
        self.quantized_by = self.backend_for(device)
        bitsandbytes = self.quantized_by == "bitsandbytes"
        prepared, layouts = {}, {}
        for name, module in targets.items():
            linear = as_linear(module)
            prepared[name] = (quantize_bitsandbytes(name, linear, device, compute_dtype)
                              if bitsandbytes else quantize_torchao(name, linear, layouts))
            if prepared[name] is not module:
                replace_module(model, name, prepared[name])
        self._quantized = list(prepared.values())
        return prepared

    def stored(self) -> str:
        return f", base weights in NF4 by {self.quantized_by}"

    def kept_apart(self) -> list[torch.Tensor]:
        """bitsandbytes keeps a 4-bit weight's scales in its layer's QuantState, beside the
        parameter (which holds the 4-bit codes): each block's absmax (8 bits, double
        quantised), their offset, their own absmax and code, and NF4's code table. torchao's
        NF4Tensor holds its scales inside, where the meter finds them."""
        if self.quantized_by != "bitsandbytes":
            return []
        kept = []
        for layer in self._quantized:
            state = layer.quant_state
            kept += [state.absmax, state.code]
            if state.nested:
                kept += [state.offset, state.state2.absmax, state.state2.code]
        return kept

    def packed(self) -> int:
        """bitsandbytes' codes are a (weights / 2, 1) parameter of bytes; torchao's NF4Tensor
        has its weight's shape."""
        if self.quantized_by != "bitsandbytes":
            return 0
        return sum(layer.in_features * layer.out_features - layer.weight.numel()
                   for layer in self._quantized)


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


def quantize_torchao(name: str, linear: nn.Linear, layouts: dict) -> nn.Linear:
    """The layer's weight as torchao's NF4Tensor, frozen (F.linear dequantises it).

    In an estimate's trace (memexp.estimate) the weight is a fake tensor: its values are
    unknown, so every weight of one shape and dtype quantises to the same tensors. The first of
    each is quantised (some 300 ops under the trace: at 32 blocks, 224 weights took a tenth of
    an 8B QLoRA's), and `layouts` keeps it; each weight gets new fake tensors of its layout
    (_like), as many bytes as quantising gives. Nothing counts memory yet: the meter starts
    after the adapter (memexp.trainer)."""
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
    if not isinstance(weight, FakeTensor):
        quantized = to_nf4(weight, NF4_BLOCK, scalers)
    else:
        key = (weight.shape, weight.dtype, weight.device, scalers)
        if key not in layouts:
            layouts[key] = to_nf4(weight, NF4_BLOCK, scalers)
        quantized = _like(layouts[key])
    linear.weight = nn.Parameter(quantized, requires_grad=False)
    return linear


def _like(quantized: torch.Tensor) -> torch.Tensor:
    """A new NF4Tensor of `quantized`'s layout, its inner tensors fake: each on new storage of
    its storage's size, at its offset and strides (a single scale block's factor is a strided
    view of a larger one), none shared (quantising shares none: checked). NF4's code table,
    made from Python values, is real in `quantized` (memexp.estimate runs such ops for real);
    fake here, its reads in every dequantisation stay on fake tensors instead of turning it
    into one each time: the same bytes, the same ops."""
    names, context = quantized.__tensor_flatten__()
    held = {name: getattr(quantized, name) for name in names}
    if len({tensor.untyped_storage()._cdata for tensor in held.values()}) < len(held):
        raise RuntimeError("torchao's NF4Tensor shares a storage between its inner tensors: "
                           "memexp's copy of a quantised layout would not")
    inner = {}
    for name, tensor in held.items():
        elements, spare = divmod(tensor.untyped_storage().nbytes(), tensor.element_size())
        if spare:
            raise RuntimeError(f"torchao's NF4Tensor.{name} is not a whole number of "
                               f"{tensor.dtype} elements' storage")
        inner[name] = torch.empty(elements, dtype=tensor.dtype, device=tensor.device
                                  ).as_strided(tensor.shape, tensor.stride(),
                                               tensor.storage_offset())
    return type(quantized).__tensor_unflatten__(inner, context, quantized.shape,
                                                quantized.stride())


def quantize_bitsandbytes(name: str, linear: nn.Linear, device: torch.device,
                          compute_dtype: torch.dtype) -> nn.Module:
    """bitsandbytes' Linear4bit in the layer's place, computing in the precision's
    `compute_dtype`; its weight is quantised as the model moves onto the device, from the
    weight in that dtype, as from a base model loaded in it (its QuantState then dequantises
    to it). Built with the weight's own dtype (fp32 here, before precision casts anything), a
    layer under bf16 autocast cast its bf16 input to fp32, multiplied in fp32 and dequantised
    its weight to fp32 in backward."""
    import bitsandbytes as bnb

    weight = linear.weight.detach().to(compute_dtype)
    # on the meta device and outside any dispatch mode: plain tensors that hold nothing
    with torch._C._DisableTorchDispatch():
        quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features,
                                      bias=linear.bias is not None, compute_dtype=compute_dtype,
                                      quant_type="nf4", device="meta")
    if not isinstance(weight, FakeTensor):
        quantized.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                             module=quantized)
    else:
        # An estimate's trace (memexp.estimate): torch makes a Parameter subclass such as
        # Params4bit only of a plain tensor, never of a FakeTensor. The weight is quantised on
        # the device at once, by bitsandbytes' own quantize_4bit with Params4bit's settings,
        # into a plain frozen parameter that carries its QuantState as Params4bit does:
        # Linear4bit's forward and backward then run bitsandbytes' own ops on it. A fake
        # parameter is swapped for a new one wherever the model is moved or cast
        # (Module._apply), which leaves its attributes behind: each forward gives it the
        # state again.
        codes, state = bnb.functional.quantize_4bit(
            weight.to(device), blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4")
        quantized.weight = nn.Parameter(codes, requires_grad=False)
        quantized.quant_state = state
        quantized.register_forward_pre_hook(
            lambda module, _: setattr(module.weight, "quant_state", module.quant_state))
    if linear.bias is not None:
        quantized.bias = linear.bias
    return quantized
