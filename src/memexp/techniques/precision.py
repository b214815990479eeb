"""precision: the dtype of parameters and activations, and how backward and the step are done.

`apply(model)` receives the model on its training device; the per-step hooks are `autocast()`
(around the forward pass and the loss), `cast_inputs`, `backward(loss)` and `step(optimizer)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from memexp.techniques import Technique, model_device

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


@dataclass
class Autocast(Technique):
    """Mixed precision: parameters stay fp32, autocast runs matmuls and convolutions in `dtype`.
    float16 gets a GradScaler with a dynamic loss scale against gradient underflow (`amp`);
    bfloat16 has fp32's exponent range and needs none (`bf16`)."""

    dtype: str = "float16"
    needs_cuda = False
    planned = ({},)  # bf16 and amp
    changes_math = None  # parameters, their gradients and updates stay fp32

    def __post_init__(self) -> None:
        self._dtype = self.autocast_dtype = half_dtype(self.dtype, "precision.dtype")
        self.needs_all_grads = self.scales_loss = self._dtype == torch.float16
        self.numerics_rank = 3 if self.scales_loss else 2  # amp below bf16: fp16's range

    def apply(self, model: nn.Module) -> nn.Module:
        self._device_type = model_device(model).type
        self._scaler = grad_scaler(self._device_type, enabled=self.scales_loss)
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
        self._dtype = half_dtype(self.dtype, "precision.dtype")
        self.needs_all_grads = self.master_weights
        self.scales_loss = self.master_weights and self._dtype == torch.float16
        self.numerics_rank = 4 if self._dtype == torch.bfloat16 else 5
        self.changes_math = None if self.master_weights else (
            f"parameters are updated in {self.dtype}, without fp32 master weights: an update "
            "smaller than half a unit in a weight's last place is lost, every step")
        self._pairs: list[tuple[Tensor, Tensor]] = []

    def apply(self, model: nn.Module) -> nn.Module:
        model = model.to(self._dtype)
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
