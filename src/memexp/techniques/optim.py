"""optim: the optimizer, when it steps (gradient accumulation), and where (optimizer in backward).

Every option has `lr`, `accumulate`, `in_backward` and `keep_grads`; `build(params)` returns the
optimizer the trainer steps. Gradients are zeroed with set_to_none (the trainer does it right
after the step), so no gradient memory lives between steps, unless keep_grads asks for the old
way.

torch's own optimizers also take `foreach` (and `fused` where torch has a fused kernel), passed
to torch as given. Null leaves the choice to torch: for Adam, AdamW and SGD its foreach kernels
on CUDA, whose temporaries are lists the size of all the parameters, and its loop over
parameters on CPU, whose temporaries are one parameter's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from memexp.quiet import quiet_torchao_import
from memexp.techniques import Technique

MakeOptimizer = Callable[[list[Tensor]], torch.optim.Optimizer]


class StepInBackward:
    """One optimizer per parameter, stepped from that parameter's post-accumulate-grad hook,
    which then frees the gradient: the full set of gradients never exists at once (torchtune's
    optimizer-in-backward). `step()` does nothing: the work is done in backward. The trainer,
    which sees no gradient, reads what the last backward did in `reached` (some parameter got a
    gradient) and `non_finite` (some gradient was NaN or infinite); `zero_grad()` resets them.
    `state`, `param_groups` and the state_dict cover every per-parameter optimizer."""

    def __init__(self, params: list[Tensor], make: MakeOptimizer):
        self.optimizers = {p: make([p]) for p in params if p.requires_grad}
        self.reached = self.non_finite = False
        for param in self.optimizers:
            param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: Tensor) -> None:
        optimizer = self.optimizers[param]
        self.reached = True
        # The step happens before the trainer sees the loss, so a non-finite gradient is caught
        # here: it never reaches the weights.
        if torch.isfinite(param.grad).all():
            optimizer.step()
        else:
            self.non_finite = True
        optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reached = self.non_finite = False

    def state_dict(self) -> dict:
        return {"per_parameter": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state: dict) -> None:
        for optimizer, saved in zip(self.optimizers.values(), state["per_parameter"],
                                    strict=True):
            optimizer.load_state_dict(saved)


@dataclass(kw_only=True)
class OptimizerChoice(Technique):
    """The keys every optim option has.

    accumulate:  step every k micro-batches of data.batch_size samples, the loss scaled by 1/k
                 (MMEngine's accumulative_counts, Lightning's accumulate_grad_batches).
    in_backward: step each parameter as soon as its gradient is complete (StepInBackward);
                 not with accumulate > 1 (memexp.techniques.check_combination).
    keep_grads:  zero gradients in place after the step instead of freeing them (torch < 2.0's
                 `zero_grad()` default, set_to_none=False): they stay allocated through the
                 next forward pass. For comparing with runs made that way; it only costs memory.
                 Not with in_backward.
    """

    lr: float
    accumulate: int = 1
    in_backward: bool = False
    keep_grads: bool = False
    # optimizer classes that keep less state for the same job: `memexp plan` also tries their
    # options (memexp.registry.options_of)
    lighter: ClassVar[tuple[type[OptimizerChoice], ...]] = ()
    # how it changes what is learned, or None where it keeps the math (see memexp.techniques);
    # accumulation keeps it, save for BatchNorm's statistics (bn_mode's
    # accumulation_changes_math), and so does stepping in backward
    changes_math: ClassVar[str | None] = None
    # whether it steps parameters that parallel=fsdp holds as sharded DTensors
    # (memexp.techniques.check_combination)
    steps_shards: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr}: the learning rate must be positive")
        if self.accumulate < 1:
            raise ValueError(
                f"optim.accumulate={self.accumulate}: must be >= 1 (1 means no accumulation)"
            )

    def build(self, params: Iterable[Tensor]) -> torch.optim.Optimizer | StepInBackward:
        params = list(params)
        return StepInBackward(params, self.make) if self.in_backward else self.make(params)

    def make(self, params: list[Tensor]) -> torch.optim.Optimizer:
        raise NotImplementedError


@dataclass(kw_only=True)
class SGD(OptimizerChoice):
    """SGD: no state without momentum (`sgd`); one buffer per parameter with it (`sgd_momentum`).

    fused:   torch's fused kernel (`_fused_sgd_`); null: torch's choice (not fused).
    foreach: true: torch's foreach kernels; false: its loop over parameters; null: torch's
             choice (foreach on CUDA, the loop on CPU).
    """

    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    fused: bool | None = None
    foreach: bool | None = None

    def make(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay, fused=self.fused,
                               foreach=self.foreach)


@dataclass(kw_only=True)
class Adam(OptimizerChoice):
    """Adam: two moments per parameter, 8 bytes per fp32 parameter.

    fused:   true: torch's fused kernel (one kernel per step, `_fused_adam_`), which has no
             temporaries; null: torch's choice (not fused).
    foreach: true: torch's foreach kernels, whose temporaries are lists the size of all the
             parameters (`sqrt(exp_avg_sq)` of each); false: its loop over parameters, whose
             temporaries are one parameter's size; null: torch's choice (foreach on CUDA, the
             loop on CPU). torch reads fused=false with foreach=null as the loop.
    """

    lr: float = 1e-3
    betas: list[float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: bool | None = None
    foreach: bool | None = None

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return torch.optim.Adam

    def make(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return self.optimizer_class()(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                      weight_decay=self.weight_decay, fused=self.fused,
                                      foreach=self.foreach)


@dataclass(kw_only=True)
class AdamW(Adam):
    """AdamW (decoupled weight decay): two moments per parameter, 8 bytes per fp32 parameter."""

    weight_decay: float = 0.01

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return torch.optim.AdamW


@dataclass(kw_only=True)
class Adafactor(OptimizerChoice):
    """torch.optim.Adafactor: the second moment of a 2-D weight is kept as a row and a column
    vector, (rows + columns) numbers instead of rows x columns; no first moment.

    foreach: true: torch's foreach kernels; false or null: its loop over parameters (torch
             takes the loop unless foreach=true asks otherwise, on any device). No fused kernel.
    """

    changes_math: ClassVar[str | None] = (
        "another optimizer: factored second moments, no first moment, its own step size")
    # torch's Adafactor squares a parameter's norm in place, which a sharded DTensor's partial
    # norm cannot do (aten.pow_ on a _NormPartial placement)
    steps_shards: ClassVar[bool] = False
    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps: float = 1e-3
    d: float = 1.0
    weight_decay: float = 0.0
    foreach: bool | None = None

    def make(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(params, lr=self.lr, beta2_decay=self.beta2_decay,
                                     eps=(None, self.eps), d=self.d,
                                     weight_decay=self.weight_decay, foreach=self.foreach)


@dataclass(kw_only=True)
class AdamW8bit(AdamW):
    """AdamW with block-quantized 8-bit moments (torchao's AdamW8bit): about 2 bytes of state per
    parameter instead of 8. Where torchao does not run, a clear error: never a silent fallback
    to 32-bit AdamW, which would measure the wrong thing."""

    lighter: ClassVar[tuple[type[OptimizerChoice], ...]] = ()
    changes_math: ClassVar[str | None] = ("AdamW's moments are kept quantized to 8 bits, "
                                          "rounded again every step")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fused is not None or self.foreach is not None:
            raise ValueError("optim.fused and optim.foreach: optim=adamw_8bit has one kernel of "
                             "its own; leave them unset (null)")

    def make(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return self.optimizer_class()(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                      weight_decay=self.weight_decay)

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        try:
            with quiet_torchao_import():
                from torchao.optim import AdamW8bit
        except Exception as error:  # ImportError, or a torchao built for another torch
            raise RuntimeError(
                "optim=adamw_8bit needs torchao's AdamW8bit, which does not import here "
                f"({type(error).__name__}: {error}). Install a torchao release built for "
                f"torch {torch.__version__} (pip install torchao), or choose optim=adafactor "
                "for small optimizer state."
            ) from error
        return AdamW8bit


# Adam's and AdamW's lighter classes, named once both are defined.
Adam.lighter = (Adafactor, AdamW8bit)
