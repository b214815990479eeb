"""precision: the dtype of parameters and activations, and how backward and the step are done.

`apply(model)` receives the model on its training device; the per-step hooks are `autocast()`
(around the forward pass and the loss), `cast_inputs`, `backward(loss)` and `step(optimizer)`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memexp.models.blocks import resolve_blocks
from memexp.quiet import quiet_torchao_import
from memexp.techniques import Technique, model_device

log = logging.getLogger("memexp")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class Precision(Protocol):
    # True when the step needs every gradient at once (loss-scale unscaling, master copies),
    # which rules out stepping parameters one by one inside backward.
    needs_all_grads: bool
    # A GradScaler scales the loss (float16): it finds NaN and infinite gradients itself and
    # skips their steps (`step` returns False). Otherwise the trainer checks them.
    scales_loss: bool
    # The dtype autocast computes in (None without autocast): FSDP gathers parameters in it.
    autocast_dtype: torch.dtype | None
    # The dtype the model's matmuls run in (fp32, autocast's or pure half's): adapter=qlora's
    # bitsandbytes layers compute in it.
    compute_dtype: torch.dtype
    # Runs only on a CUDA device (check_combination).
    needs_cuda: bool
    # The option the report compares the others with (fp32).
    baseline: bool
    # Numerics from the closest to fp32 (0) down: memexp plan prefers the lower at equal cost.
    numerics_rank: int
    # How it changes what is learned, or None where it keeps the math (see memexp.techniques).
    changes_math: str | None

    def apply(self, model: nn.Module) -> nn.Module: ...

    def autocast(self) -> AbstractContextManager: ...

    def cast_inputs(self, inputs: Tensor) -> Tensor: ...

    def parameters(self, model: nn.Module) -> Iterable[Tensor]:
        """What the optimizer updates: the model's trained parameters, or fp32 master copies
        of them."""

    def backward(self, loss: Tensor) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """One optimizer step; False when it was skipped (non-finite gradients)."""

    def loss_scale(self) -> float:
        """The factor gradients carry after backward (1 without loss scaling)."""

    def state_dict(self) -> dict:
        """What a checkpoint must keep (loss scaler, master copies)."""

    def load_state_dict(self, state: dict) -> None: ...


def half_dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"{key}={name}: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def grad_scaler(device_type: str, enabled: bool) -> torch.amp.GradScaler:
    """A GradScaler; across several ranks the sharded one, which all-reduces "found inf" so
    that every rank skips the same steps (FSDP's gradient shards overflow separately)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, enabled=enabled)
    return torch.amp.GradScaler(device_type, enabled=enabled)


def scaled_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """GradScaler's step; it skips the step on inf/NaN gradients and then lowers the scale."""
    if not scaler.is_enabled():
        optimizer.step()
        return True
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= scale


@dataclass
class FP32(Technique):
    """Full precision: the baseline the other options are compared with."""

    needs_all_grads = False
    scales_loss = False
    autocast_dtype = None
    compute_dtype = torch.float32
    needs_cuda = False
    baseline = True
    planned = ({},)
    numerics_rank = 0
    changes_math = None  # TF32's products too: rounded within a step, accumulated in fp32

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self) -> AbstractContextManager:
        return nullcontext()

    def cast_inputs(self, inputs: Tensor) -> Tensor:
        return inputs

    def parameters(self, model: nn.Module) -> Iterable[Tensor]:
        return trained(model)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def loss_scale(self) -> float:
        return 1.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class TF32(FP32):
    """fp32 storage with TF32 tensor-core math for matmuls and convolutions (NVIDIA Ampere and
    newer): faster, same memory, about 10 mantissa bits in the products."""

    needs_cuda = True
    baseline = False
    planned = ()  # CUDA only, and fp32's memory: nothing for memexp plan to find
    numerics_rank = 1

    def apply(self, model: nn.Module) -> nn.Module:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return model


class Frozen(str, enum.Enum):
    """precision.frozen: the dtype autocast precisions store the weights that do not train in
    (adapter=lora's and qlora's base weights)."""

    compute = "compute"  # autocast's dtype, as practitioners load a base model for LoRA
    fp32 = "fp32"  # fp32, as the trained ones: autocast casts them for every matmul


@dataclass
class Autocast(Technique):
    """Mixed precision: autocast runs matmuls and convolutions in `dtype`. float16 gets a
    GradScaler with a dynamic loss scale against gradient underflow (`amp`); bfloat16 has fp32's
    exponent range and needs none (`bf16`).

    The parameters that train stay fp32. Those that do not (an adapter's base weights) are
    stored in `dtype` (`frozen=compute`), as practitioners load a base model for LoRA
    (`from_pretrained(torch_dtype=torch.bfloat16)`, then peft, whose `autocast_adapter_dtype`
    keeps the adapters fp32): half their bytes, and no per-step cast of them for each matmul.
    BatchNorm's weights stay fp32 (`frozen_weights`). `frozen=fp32` keeps them all fp32, as
    the trained ones."""

    dtype: str = "float16"
    frozen: Frozen = Frozen.compute
    needs_cuda = False
    planned = ({},)  # bf16 and amp
    # Trained parameters, their gradients and updates stay fp32. A frozen weight stored in
    # `dtype` holds the values autocast rounds a matmul's weight to at every step, and never
    # changes; the embeddings and norms, which autocast leaves in fp32, are rounded too, and
    # what is computed from them is in `dtype` (a decoder's residual stream): rounding within
    # a step that no later step inherits, as bf16_pure's with fp32 master weights
    # (bench/frozen_weights.py: the losses within autocast's own distance from fp32's).
    changes_math = None

    def __post_init__(self) -> None:
        self._dtype = self.autocast_dtype = self.compute_dtype = half_dtype(self.dtype,
                                                                            "precision.dtype")
        self.frozen = Frozen(self.frozen)
        self.needs_all_grads = self.scales_loss = self._dtype == torch.float16
        self.numerics_rank = 3 if self.scales_loss else 2  # amp below bf16: fp16's range

    def apply(self, model: nn.Module) -> nn.Module:
        self._device_type = model_device(model).type
        self._scaler = grad_scaler(self._device_type, enabled=self.scales_loss)
        if self.frozen is Frozen.compute:
            stored, kept = frozen_weights(model)
            cast(model, self._dtype, stored)
            if stored or kept:
                log.info("precision: %s frozen weights stored in %s (precision.frozen=compute)%s",
                         f"{sum(p.numel() for p in stored):,}", self.dtype,
                         f"; {sum(p.numel() for p in kept):,} of BatchNorm layers kept in fp32"
                         * bool(kept))
        return model

    @contextmanager
    def autocast(self) -> Iterator[None]:
        # Without nn.MultiheadAttention's fused fast path (nn.TransformerEncoderLayer in eval),
        # as torch's own guard intends: it turns the path off under autocast, but asks only
        # about CUDA's. Under CPU autocast the fused kernel gets half-precision inputs beside
        # fp32 weights and relies on autocast re-dispatching its inner matmuls, which does not
        # happen below a TorchDispatchMode (the meter's storage tracker): "expected m1 and m2 to
        # have the same dtype". Off everywhere, a run measured and a run timed take one path.
        enabled = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with torch.autocast(self._device_type, dtype=self._dtype):
                yield
        finally:
            torch.backends.mha.set_fastpath_enabled(enabled)

    def cast_inputs(self, inputs: Tensor) -> Tensor:
        return inputs

    def parameters(self, model: nn.Module) -> Iterable[Tensor]:
        return trained(model)

    def backward(self, loss: Tensor) -> None:
        self._scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        return scaled_step(self._scaler, optimizer)

    def loss_scale(self) -> float:
        return self._scaler.get_scale() if self._scaler.is_enabled() else 1.0

    def state_dict(self) -> dict:
        return {"scaler": self._scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._scaler.load_state_dict(state["scaler"])


def cast(model: nn.Module, dtype: torch.dtype, only: Iterable[Tensor] | None = None
         ) -> nn.Module:
    """`model.to(dtype)` (or of the parameters `only` names), but a quantised weight keeps its
    bits, and a weight tied to two modules stays one parameter. adapter=qlora's base weights
    (torchao's NF4Tensor) are tensor subclasses that hold their values in tensors of their own
    (4-bit codes and their scales), and their `.to(dtype)` dequantises: `Module.to` would then
    set the dequantised copy as the subclass's `.data`, leaving the 4-bit tensors in place
    beside a dense copy that nothing reads and that the storage tracker, which counts a
    subclass by its inner tensors, never sees (2 bytes a weight at bf16, 4x NF4's); under an
    estimate's fake tensors it swapped the dense copy in for the subclass. They are left as
    they are: an NF4 layer dequantises to its input's dtype as it runs."""
    chosen = None if only is None else {id(tensor) for tensor in only}
    return model._apply(lambda tensor: tensor if is_traceable_wrapper_subclass(tensor) or not (
        tensor.is_floating_point() or tensor.is_complex()) or (
            chosen is not None and id(tensor) not in chosen) else tensor.to(dtype))


def frozen_weights(model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """The weights that do not train, as precision.frozen=compute stores them: those it casts
    to the compute dtype, and BatchNorm's, which stay fp32 (as PyTorch's FSDP keeps BatchNorm
    out of its mixed precision, `MixedPrecision._module_classes_to_ignore`). batch_norm reads
    its weight and bias with its running statistics, fp32 buffers, and takes the four in one
    dtype (or fp32 beside a half input): a half weight fails ("expected scalar type BFloat16
    but found Float"). The other normalization layers take half weights beside the half inputs
    they get once the embeddings are half, as in a model loaded in half precision; CUDA's
    autocast runs layer_norm and group_norm in fp32 anyway. Buffers are no weights (running
    statistics, rotary frequencies): they stay as they are. A tensor subclass (qlora's NF4) or
    an integer tensor (bitsandbytes' 4-bit codes) keeps its bits."""
    kept = {id(p) for module in model.modules() if isinstance(module, _BatchNorm)
            for p in module.parameters(recurse=False)}
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()
              and not is_traceable_wrapper_subclass(p)]
    return [p for p in frozen if id(p) not in kept], [p for p in frozen if id(p) in kept]


def trained(model: nn.Module) -> list[Tensor]:
    """The parameters that train: frozen ones (adapter=lora's base weights) get no gradient,
    and parallel=zero1 would broadcast them after every step for nothing."""
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class Pure(Technique):
    """The source's `model.half()`: parameters, buffers, inputs and activations all in `dtype`.

    With `master_weights=true` the optimizer updates an fp32 copy of every parameter and the
    result is copied back, since a half-precision update loses small steps to rounding; float16
    then also gets a dynamic loss scale (the classic fp16 recipe). Without master weights the
    update happens in half precision, as in the source."""

    dtype: str = "float16"
    master_weights: bool = False
    autocast_dtype = None  # parameters are in `dtype` already: nothing to cast
    needs_cuda = False
    # bf16_pure; fp16_pure without master weights has no loss scale for its fp16 gradients
    planned = ({"dtype": "bfloat16"},)

    def __post_init__(self) -> None:
        self._dtype = self.compute_dtype = half_dtype(self.dtype, "precision.dtype")
        self.needs_all_grads = self.master_weights
        self.scales_loss = self.master_weights and self._dtype == torch.float16
        self.numerics_rank = 4 if self._dtype == torch.bfloat16 else 5
        self.changes_math = None if self.master_weights else (
            f"parameters are updated in {self.dtype}, without fp32 master weights: an update "
            "smaller than half a unit in a weight's last place is lost, every step")
        self._pairs: list[tuple[Tensor, Tensor]] = []

    def apply(self, model: nn.Module) -> nn.Module:
        model = cast(model, self._dtype)
        self._scaler = grad_scaler(model_device(model).type, enabled=self.scales_loss)
        return model

    def autocast(self) -> AbstractContextManager:
        return nullcontext()

    def cast_inputs(self, inputs: Tensor) -> Tensor:
        return inputs.to(self._dtype) if inputs.is_floating_point() else inputs

    def parameters(self, model: nn.Module) -> Iterable[Tensor]:
        if not self.master_weights:
            return trained(model)
        self._pairs = [(p, p.detach().float()) for p in model.parameters() if p.requires_grad]
        return [master for _, master in self._pairs]

    def backward(self, loss: Tensor) -> None:
        self._scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self.master_weights:
            optimizer.step()
            return True
        for param, master in self._pairs:
            if param.grad is not None:
                master.grad = param.grad.float()
                param.grad = None  # one half-precision gradient less, as soon as it is copied
        stepped = scaled_step(self._scaler, optimizer)
        with torch.no_grad():
            for param, master in self._pairs:
                param.copy_(master)
        return stepped

    def loss_scale(self) -> float:
        return self._scaler.get_scale() if self._scaler.is_enabled() else 1.0

    def state_dict(self) -> dict:
        return {"scaler": self._scaler.state_dict(),
                "masters": [master for _, master in self._pairs]}

    def load_state_dict(self, state: dict) -> None:
        self._scaler.load_state_dict(state["scaler"])
        with torch.no_grad():
            for (_, master), saved in zip(self._pairs, state["masters"], strict=True):
                master.copy_(saved)


class Float8Recipe(str, enum.Enum):
    """precision.recipe: torchao's float8 training recipes (Float8LinearConfig.from_recipe_name)."""

    tensorwise = "tensorwise"  # one dynamic scale per tensor, cuBLAS's kernel: the fastest
    rowwise = "rowwise"  # a scale per row, power-of-2 scales, CUTLASS's kernel
    rowwise_with_gw_hp = "rowwise_with_gw_hp"  # rowwise, the weight's gradient in bf16


@dataclass
class Float8(Autocast):
    """bf16 autocast with torchao's float8 training (torchtitan's `float8` converter): every
    nn.Linear inside the blocks whose dimensions are multiples of 16 (torch._scaled_mm's rule)
    becomes a Float8Linear, whose three matmuls cast their operands to float8 with dynamic
    scales (`recipe`) and multiply in float8; the output head and the rest stay bf16, as
    torchtitan leaves its `output`. Parameters stay fp32. For backward each layer keeps its
    input (bf16) and its weight as they are, the weight being the fp32 parameter itself where
    bf16 autocast keeps a bf16 copy of it, and casts both to float8 again there: the casts and
    their scales are temporaries. With parallel=fsdp the weights are gathered in bf16: torchao's
    float8 all-gather (enable_fsdp_float8_all_gather) fails where memexp evaluates, under
    inference mode (torchao 0.18: its gathered weight's `.t()` sets a version counter, "Cannot
    set version_counter for inference tensor"), so it is not offered. Needs an NVIDIA GPU of
    compute capability 8.9 or above (Ada, Hopper, Blackwell): refused elsewhere, estimated with
    `memexp estimate ... --target cuda --gpu h100`."""

    dtype: str = "bfloat16"
    recipe: Float8Recipe = Float8Recipe.tensorwise
    blocks: list[str] = ("auto",)
    needs_cuda = True
    # check_combination's reason for a CPU run
    cuda_reason = ("its matmuls run in float8 (torch._scaled_mm), on NVIDIA GPUs of compute "
                   "capability 8.9 or above; estimate it with memexp estimate ... --target cuda "
                   "--gpu h100")
    capability = (8, 9)
    planned = ({},)
    # float8's rounding happens within each matmul; parameters, gradients and updates stay fp32
    changes_math = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.recipe = Float8Recipe(self.recipe)
        if self._dtype != torch.bfloat16:
            raise ValueError(f"precision.dtype={self.dtype}: float8 training runs its other ops "
                             "in bf16 (float16 would need a loss scale it does not keep); use "
                             "bfloat16")
        self.numerics_rank = 6  # float8's 3 mantissa bits in every converted matmul

    def apply(self, model: nn.Module) -> nn.Module:
        device = model_device(model)
        have = torch.cuda.get_device_capability(device)
        if have < self.capability:
            raise ValueError(
                f"precision=float8 on {torch.cuda.get_device_name(device)}: torch._scaled_mm's "
                f"float8 matmuls need compute capability {self.capability[0]}."
                f"{self.capability[1]} or above, and it has {have[0]}.{have[1]}. Use "
                "precision=bf16")
        with quiet_torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        self.found = resolve_blocks(model, self.blocks, "precision.blocks")
        inside = {name: module for block, prefix in zip(self.found.modules, self.found.names,
                                                        strict=True)
                  for name, module in block.named_modules(prefix=prefix)
                  if type(module) is nn.Linear and module.in_features % 16 == 0
                  and module.out_features % 16 == 0}
        if not inside:
            raise ValueError(
                f"precision=float8 converts the nn.Linear layers inside the blocks "
                f"({self.found.describe()}) whose sizes are multiples of 16, and they have none "
                "(GPT-2's Conv1D is not an nn.Linear). Use precision=bf16")
        chosen = {id(module) for module in inside.values()}
        config = Float8LinearConfig.from_recipe_name(self.recipe.value)
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda module, _: id(module) in chosen)
        self.changed = {name: model.get_submodule(name) for name in inside}
        log.info("precision=float8 (%s): %d nn.Linear layers of %s made Float8Linear",
                 self.recipe.value, len(inside), self.found.describe())
        return super().apply(model)

