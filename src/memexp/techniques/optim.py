"""optim: the optimizer, when it steps (gradient accumulation), and where (optimizer in backward,
or on the host).

Every option has `lr`, `accumulate`, `in_backward`, `keep_grads`, `offload` and
`offload_gradients`; `build(params)` returns the optimizer the trainer steps. Gradients are
zeroed with set_to_none (the trainer does it right after the step), so no gradient memory lives
between steps, unless keep_grads asks for the old way.

torch's own optimizers also take `foreach` (and `fused` where torch has a fused kernel), passed
to torch as given. Null leaves the choice to torch: for Adam, AdamW and SGD its foreach kernels
on CUDA, whose temporaries are lists the size of all the parameters, and its loop over
parameters on CPU, whose temporaries are one parameter's size.

The state each option keeps is whatever its optimizer object holds: the meter reads it there
(memexp.memory.meter), never from a bytes-per-parameter formula.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from memexp import registry
from memexp.extras import install_hint
from memexp.memory import host_resident
from memexp.models.blocks import resolve_blocks
from memexp.quiet import quiet_torchao_import
from memexp.techniques import Technique

log = logging.getLogger("memexp")
MakeOptimizer = Callable[[list], torch.optim.Optimizer]


class Several:
    """Several optimizers stepped as one: `state`, `param_groups` and the state_dict cover every
    one of them (the meter reads their state, a checkpoint keeps it)."""

    # the state_dict's key for the list of the optimizers' own
    KEY = "optimizers"

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {self.KEY: [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for optimizer, saved in zip(self.optimizers, state[self.KEY], strict=True):
            optimizer.load_state_dict(saved)


class StepInBackward(Several):
    """One optimizer per parameter, stepped from that parameter's post-accumulate-grad hook,
    which then frees the gradient: the full set of gradients never exists at once (torchtune's
    optimizer-in-backward). `step()` does nothing: the work is done in backward. The trainer,
    which sees no gradient, reads what the last backward did in `reached` (some parameter got a
    gradient) and `non_finite` (some gradient was NaN or infinite); `zero_grad()` resets them."""

    KEY = "per_parameter"

    def __init__(self, params: list[Tensor], make: MakeOptimizer):
        self.by_param = {p: make([p]) for p in params if p.requires_grad}
        super().__init__(list(self.by_param.values()))
        self.reached = self.non_finite = False
        for param in self.by_param:
            param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: Tensor) -> None:
        optimizer = self.by_param[param]
        self.reached = True
        # The step happens before the trainer sees the loss, so a non-finite gradient is caught
        # here: it never reaches the weights.
        if torch.isfinite(param.grad).all():
            optimizer.step()
        else:
            self.non_finite = True
        optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reached = self.non_finite = False


class StepOnHost(Several):
    """torchao's CPUOffloadOptimizer: each parameter of 4096 values or more gets a pinned fp32
    copy on the host, with a host gradient that backward's hook fills (a copy on a second CUDA
    stream as soon as the parameter's gradient is complete), and its own optimizer there, which
    keeps its state on the host and steps there; the updated copy goes back to the device after
    the step. Smaller parameters stay on the device with an optimizer of their own. What the
    host holds is made and stepped under `host_resident(device_stays=True)`: the meter counts it
    as `offloaded`, and what stays on the device as the device's.

    With `gradients` the device's gradient is freed once copied (torchao's offload_gradients):
    the trainer then sees none, and reads `reached` and `non_finite` as for StepInBackward,
    from a hook that runs before torchao's."""

    def __init__(self, params: list[Tensor], make: MakeOptimizer, gradients: bool):
        with quiet_torchao_import():
            from torchao.optim import CPUOffloadOptimizer
        trained = [p for p in params if p.requires_grad]
        self.reached, self._finite = False, None
        if gradients:  # registered first: torchao's hook frees the gradient
            for param in trained:
                param.register_post_accumulate_grad_hook(self._check)
        with host_resident(device_stays=True):
            # make() gets one host parameter group at a time (or the small ones' group)
            self.offload = CPUOffloadOptimizer(trained, optimizer_class=make,
                                               offload_gradients=gradients)
        on_device = [self.offload.d_opt] if self.offload.d_opt is not None else []
        super().__init__([*self.offload.optim_dict.values(), *on_device])

    def _check(self, param: Tensor) -> None:
        self.reached = True
        # no host sync here: one flag on the device, read once by the trainer (an estimate's
        # fake flag reads as True: finite, as the trainer's own check reads)
        finite = param.grad.isfinite().all()
        self._finite = finite if self._finite is None else self._finite & finite

    @property
    def non_finite(self) -> bool:
        return self._finite is not None and not bool(self._finite)

    @property
    def param_groups(self) -> list[dict]:
        return self.offload.param_groups

    def step(self) -> None:
        with host_resident(device_stays=True):
            self.offload.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.offload.zero_grad(set_to_none=set_to_none)
        self.reached, self._finite = False, None

    def state_dict(self) -> dict:
        return self.offload.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.offload.load_state_dict(state)


class StateDtype(str, enum.Enum):
    """optim.state_dtype: how the Adam family keeps its two moments."""

    fp32 = "fp32"  # torch's own Adam and AdamW: 8 bytes per parameter
    bf16 = "bf16"  # Bf16StateAdam: 4 bytes per parameter, stochastically rounded


class Offload(str, enum.Enum):
    """optim.offload: where the optimizer's state lives and its step runs."""

    none = "none"  # with the parameters, on the training device
    cpu = "cpu"  # on the host (StepOnHost): CUDA runs only


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
    offload:     cpu: the state on the host, where the step runs (StepOnHost, torchao's
                 CPUOffloadOptimizer): a CUDA run's device keeps none of it. Refused on a CPU
                 run, whose device is the host (check_combination).
    offload_gradients: with offload=cpu, free each device gradient once it is copied to the
                 host; not with accumulate > 1 (the next micro-batch would start from none).
    """

    lr: float
    accumulate: int = 1
    in_backward: bool = False
    keep_grads: bool = False
    offload: Offload = Offload.none
    offload_gradients: bool = False
    # optimizer classes that keep less state for the same job: `memexp plan` also tries their
    # options (memexp.registry.options_of)
    lighter: ClassVar[tuple[type[OptimizerChoice], ...]] = ()
    # how it changes what is learned, or None where it keeps the math (see memexp.techniques);
    # accumulation keeps it, save for BatchNorm's statistics (bn_mode's
    # accumulation_changes_math), and so does stepping in backward, or on the host
    changes_math: ClassVar[str | None] = None
    # why it cannot step parameters that parallel=fsdp holds as sharded DTensors, or None where
    # it can (memexp.techniques.check_combination)
    shards_refused: ClassVar[str | None] = None
    # why parallel=zero1's ZeroRedundancyOptimizer cannot wrap it, or None where it can
    partition_refused: ClassVar[str | None] = None
    # whether its step can run on the host's copies (offload=cpu): it must not tell parameters
    # apart by identity, as Muon's split does
    offloads: ClassVar[bool] = True

    def __post_init__(self) -> None:
        # a run's resolved config (memexp.app) gives the enum as its value
        self.offload = Offload(self.offload)
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr}: the learning rate must be positive")
        if self.accumulate < 1:
            raise ValueError(
                f"optim.accumulate={self.accumulate}: must be >= 1 (1 means no accumulation)"
            )
        on_host = self.offload is Offload.cpu
        if self.offload_gradients and not on_host:
            raise ValueError("optim.offload_gradients=true moves the gradients of an optimizer "
                             "that steps on the host: it needs optim.offload=cpu")
        if on_host and not self.offloads:
            raise ValueError(f"optim.offload=cpu with {type(self).__name__}: its split of the "
                             "parameters is by identity, and the host steps copies of them. "
                             "Use optim.offload=none with it")
        if on_host and self.in_backward:
            raise ValueError("optim.offload=cpu with optim.in_backward=true: both step from "
                             "each parameter's gradient hook, one on the host and one on the "
                             "device. Use one or the other")
        if on_host and self.keep_grads:
            raise ValueError("optim.offload=cpu with optim.keep_grads=true: the host step copies "
                             "each gradient into its own, and frees the device's (torchao's "
                             "zero_grad takes set_to_none only). Use one or the other")
        if self.offload_gradients and self.accumulate > 1:
            raise ValueError(
                f"optim.offload_gradients=true with optim.accumulate={self.accumulate}: each "
                "micro-batch's backward frees the device gradient it copies, so the next one "
                "accumulates into nothing (torchao: not compatible with gradient accumulation). "
                "Use optim.offload_gradients=false to accumulate")

    @property
    def grads_leave_in_backward(self) -> bool:
        """Whether backward takes the gradients off the device (stepped in backward, or copied
        to the host and freed): the trainer then reads `reached` and `non_finite` from the
        optimizer."""
        return self.in_backward or self.offload_gradients

    def apply(self, model: nn.Module) -> nn.Module:
        """Read from the model what the optimizer needs (Muon: which weights it steps); the
        trainer calls it on the model as it will train, before build()."""
        return model

    def offloaded(self) -> AbstractContextManager:
        """Around what reads the optimizer's host tensors (the meter's watch): StepOnHost makes
        and steps them under it itself."""
        return host_resident(device_stays=True) if self.offload is Offload.cpu else nullcontext()

    def build(self, params: Iterable[Tensor]) -> torch.optim.Optimizer | Several:
        params = list(params)
        if self.in_backward:
            return StepInBackward(params, self.make)
        if self.offload is Offload.cpu:
            return StepOnHost(params, self.make, self.offload_gradients)
        return self.make(params)

    def make(self, params: list) -> torch.optim.Optimizer | Several:
        """The optimizer over `params`: tensors, or parameter groups (StepOnHost's)."""
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


def stochastic_round(into: Tensor, values: Tensor, generator: torch.Generator) -> None:
    """Write fp32 `values` into the bf16 tensor `into`, each rounded down or up to a bf16
    neighbour at random, up with the probability of its distance from the lower one: the
    rounding is unbiased, so updates smaller than a bf16 step still add up over many steps
    (round-to-nearest would drop every one of them). bf16 is fp32's upper 16 bits: a uniform
    random 16-bit number is added to the lower ones, which are then cleared."""
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, device=values.device,
                          generator=generator)
    noise.add_(values.view(torch.int32)).bitwise_and_(-(1 << 16))
    into.copy_(noise.view(torch.float32))


class Bf16StateAdam(torch.optim.Optimizer):
    """Adam or AdamW (`decoupled`) whose two moments are stored in bf16: 4 bytes per parameter
    instead of 8, as torchtitan and DeepSeek-V3 keep them. Each step reads a parameter's moments
    into fp32, updates them and the parameter in fp32 exactly as torch's single-tensor Adam
    does, and writes the moments back with stochastic rounding (stochastic_round), whose random
    bits come from a generator of its own per device (seeded from torch's initial seed, kept in
    the state_dict): dropout's draws are not moved. The first step's update is therefore torch's
    (its moments are used before they are rounded). Temporaries: three fp32 tensors the size of
    the parameter being stepped, one parameter at a time."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled = decoupled
        self.seed = torch.initial_seed()
        self.generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if str(device) not in self.generators:
            self.generators[str(device)] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[str(device)]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = (group[key] for key in
                                              ("lr", "betas", "eps", "weight_decay"))
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    for name in ("exp_avg", "exp_avg_sq"):
                        state[name] = torch.zeros_like(param, dtype=torch.bfloat16,
                                                       memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"]
                # fp32 views where parameter and gradient are fp32, copies where they are half
                value, grad = param.float(), param.grad.float()
                if self.decoupled:
                    value.mul_(1 - lr * decay)
                elif decay:
                    grad = grad.add(value, alpha=decay)
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(
                    grad, grad, value=1 - beta2)
                generator = self.generator(param.device)
                stochastic_round(state["exp_avg_sq"], exp_avg_sq, generator)
                denominator = exp_avg_sq.sqrt_().div_(math.sqrt(1 - beta2 ** step)).add_(eps)
                value.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))
                stochastic_round(state["exp_avg"], exp_avg, generator)
                if value is not param:
                    param.copy_(value)

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "rounding": {device: g.get_state() for device, g in self.generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        rounding = state.pop("rounding", {})
        super().load_state_dict(state)
        for device, generator_state in rounding.items():
            self.generator(torch.device(device)).set_state(generator_state)


@dataclass(kw_only=True)
class Adam(OptimizerChoice):
    """Adam: two moments per parameter, 8 bytes per fp32 parameter.

    fused:   true: torch's fused kernel (one kernel per step, `_fused_adam_`), which has no
             temporaries; null: torch's choice (not fused).
    foreach: true: torch's foreach kernels, whose temporaries are lists the size of all the
             parameters (`sqrt(exp_avg_sq)` of each); false: its loop over parameters, whose
             temporaries are one parameter's size; null: torch's choice (foreach on CUDA, the
             loop on CPU). torch reads fused=false with foreach=null as the loop.
    state_dtype: fp32 (torch's own optimizer) or bf16 (Bf16StateAdam: both moments in bf16,
             4 bytes per parameter, stochastically rounded; a loop over parameters, so fused and
             foreach stay null).
    """

    lr: float = 1e-3
    betas: list[float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: bool | None = None
    foreach: bool | None = None
    state_dtype: StateDtype = StateDtype.fp32
    # `memexp plan` also tries the options of its class with these keys (memexp.plan): the same
    # optimizer with bf16 moments, or stepped on the host
    planned: ClassVar[tuple[Mapping[str, object], ...]] = ({"state_dtype": "bf16"},
                                                           {"offload": "cpu"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.state_dtype = StateDtype(self.state_dtype)
        if self.state_dtype is StateDtype.bf16:
            if self.fused is not None or self.foreach is not None:
                raise ValueError("optim.fused and optim.foreach with optim.state_dtype=bf16: its "
                                 "step is memexp's loop over parameters (Bf16StateAdam); leave "
                                 "them unset (null)")
            self.changes_math = ("Adam's moments are kept in bf16, stochastically rounded every "
                                 "step (8 bits of mantissa for fp32's 24)")

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return torch.optim.Adam

    def make(self, params: list) -> torch.optim.Optimizer:
        if self.state_dtype is StateDtype.bf16:
            return Bf16StateAdam(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay,
                                 decoupled=self.optimizer_class() is torch.optim.AdamW)
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
    shards_refused: ClassVar[str | None] = (
        "torch's Adafactor squares each parameter's norm in place, and FSDP2 holds parameters as "
        "sharded DTensors, whose norm is a partial sum over the ranks (torch: 'aten.pow_.Scalar: "
        "in-place operations that require placement changes are not supported').")
    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps: float = 1e-3
    d: float = 1.0
    weight_decay: float = 0.0
    foreach: bool | None = None

    def make(self, params: list) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(params, lr=self.lr, beta2_decay=self.beta2_decay,
                                     eps=(None, self.eps), d=self.d,
                                     weight_decay=self.weight_decay, foreach=self.foreach)


@dataclass(kw_only=True)
class LowBitAdamW(OptimizerChoice):
    """torchao's AdamW with quantized moments (`adamw_8bit`, `adamw_4bit`, `adamw_fp8`): each
    tensor of 4096 values or more keeps them block-wise quantized, with an fp32 scale per block,
    and is updated in fp32 one parameter at a time (torchao's single_param_adam); smaller ones
    keep fp32 moments. The classes run on CPU and CUDA alike (checked on torch 2.13's CPU build
    with torchao 0.18). Where torchao does not import, a clear error: never a silent fallback to
    32-bit AdamW, which would measure the wrong thing."""

    lr: float = 1e-3
    betas: list[float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    # its class in torchao.optim
    torchao_class: ClassVar[str]

    def make(self, params: list) -> torch.optim.Optimizer:
        return self.optimizer_class()(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                      weight_decay=self.weight_decay)

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        name = self.torchao_class
        try:
            with quiet_torchao_import():
                import torchao.optim
        except Exception as error:  # ImportError, or a torchao built for another torch
            option = "|".join(registry.options_of("optim", type(self)))
            raise RuntimeError(
                f"optim={option} needs torchao's {name}, which does not import here "
                f"({type(error).__name__}: {error}). Install a torchao release built for "
                f"torch {torch.__version__} {install_hint('lowbit')}, or choose "
                "optim=adafactor for small optimizer state."
            ) from error
        return getattr(torchao.optim, name)


@dataclass(kw_only=True)
class AdamW8bit(LowBitAdamW):
    """torchao's AdamW8bit: 8-bit codes (a dynamic map) and an fp32 scale per 256 values, about
    2 bytes of state per parameter instead of 8."""

    torchao_class: ClassVar[str] = "AdamW8bit"
    changes_math: ClassVar[str | None] = ("AdamW's moments are kept quantized to 8 bits, "
                                          "rounded again every step")


@dataclass(kw_only=True)
class AdamW4bit(LowBitAdamW):
    """torchao's AdamW4bit (Li et al. 2023, "Memory Efficient Optimizers with 4-bit States"):
    4-bit codes, two to a byte, and an fp32 scale per 128 values, about 1.06 bytes of state per
    parameter."""

    torchao_class: ClassVar[str] = "AdamW4bit"
    changes_math: ClassVar[str | None] = ("AdamW's moments are kept quantized to 4 bits, "
                                          "rounded again every step")


@dataclass(kw_only=True)
class AdamWFp8(LowBitAdamW):
    """torchao's AdamWFp8: float8 (e4m3) codes and an fp32 scale per 256 values, about 2 bytes
    of state per parameter."""

    torchao_class: ClassVar[str] = "AdamWFp8"
    changes_math: ClassVar[str | None] = ("AdamW's moments are kept in float8 (e4m3, 3 bits of "
                                          "mantissa), rounded again every step")


@dataclass(kw_only=True)
class Muon(OptimizerChoice):
    """torch.optim.Muon on the 2-D weights inside the model's blocks, AdamW on everything else
    (embeddings, the output head, norms, biases), as torchtitan and Moonlight split them: one
    momentum buffer (4 bytes per fp32 parameter) where AdamW keeps two. Which weights are the
    blocks' is read once from the model (`blocks`, memexp.models.blocks) and logged.

    adjust_lr_fn: match_rms_adamw (Moonlight's) scales Muon's update to AdamW's typical size,
                  so one lr and weight_decay serve both; original is Keller Jordan's scaling,
                  null torch's default (none). momentum, nesterov, ns_steps: Muon's own;
                  betas, eps: the AdamW part's.
    """

    lr: float = 1e-3
    weight_decay: float = 0.01
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str | None = "match_rms_adamw"
    betas: list[float] = (0.9, 0.999)
    eps: float = 1e-8
    blocks: list[str] = ("auto",)
    changes_math: ClassVar[str | None] = (
        "another optimizer: the blocks' 2-D weights are stepped by Muon (orthogonalized "
        "momentum), the rest by AdamW")
    shards_refused: ClassVar[str | None] = (
        "Muon orthogonalizes each weight's whole update matrix (Newton-Schulz), and FSDP2 steps "
        "each rank's shard of it alone.")
    partition_refused: ClassVar[str | None] = (
        "ZeroRedundancyOptimizer builds one optimizer over each rank's share of the parameters "
        "and keeps its parameter groups in step with its own, and Muon is two (Muon for the "
        "blocks' 2-D weights, AdamW for the rest). It picks its weights by tensor, and ZeRO "
        "hands it parameter groups.")
    offloads: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"optim.adjust_lr_fn={self.adjust_lr_fn}: choose original, "
                             "match_rms_adamw or null")
        self._stepped: frozenset[int] | None = None  # ids of the weights Muon steps

    def apply(self, model: nn.Module) -> nn.Module:
        self.found = resolve_blocks(model, self.blocks, "optim.blocks")
        inside = {id(p): name for block, prefix in zip(self.found.modules, self.found.names,
                                                       strict=True)
                  for name, p in block.named_parameters(prefix=prefix)
                  if p.requires_grad and p.ndim == 2}
        if not inside:
            raise ValueError(
                f"optim=muon: the blocks ({self.found.describe()}) hold no trainable 2-D weight "
                "for Muon to step, and AdamW would step everything. Name other blocks "
                "(optim.blocks=[ClassName] or ['glob.*']), or use optim=adamw")
        self._stepped = frozenset(inside)
        rest = [(name, p) for name, p in model.named_parameters()
                if p.requires_grad and id(p) not in inside]
        muon = sum(p.numel() for p in model.parameters() if id(p) in inside)
        adamw = sum(p.numel() for _, p in rest)
        log.info("optim=muon: Muon on %d 2-D weights of %s (%s parameters, %.0f%%); AdamW on %d "
                 "others (%s parameters: %s)", len(inside), self.found.describe(), f"{muon:,}",
                 100 * muon / (muon + adamw), len(rest), f"{adamw:,}",
                 ", ".join(name for name, _ in rest[:6]) + (" ..." if len(rest) > 6 else ""))
        return model

    def build(self, params: Iterable[Tensor]) -> torch.optim.Optimizer | Several:
        params = list(params)
        if self._stepped is None:
            raise RuntimeError("optim=muon: apply(model) finds the weights Muon steps; call it "
                               "before build()")
        if not any(id(p) in self._stepped for p in params):
            raise ValueError(
                "optim=muon: none of the tensors the optimizer steps is a weight of the model's "
                "blocks: they are copies (precision.master_weights=true keeps fp32 masters), and "
                "AdamW would step them all. Use precision.master_weights=false, or bf16 autocast")
        return super().build(params)

    def make(self, params: list) -> torch.optim.Optimizer | Several:
        stepped = [p for p in params if id(p) in self._stepped]
        rest = [p for p in params if id(p) not in self._stepped]
        optimizers = []
        if stepped:
            optimizers.append(torch.optim.Muon(
                stepped, lr=self.lr, weight_decay=self.weight_decay, momentum=self.momentum,
                nesterov=self.nesterov, ns_steps=self.ns_steps, adjust_lr_fn=self.adjust_lr_fn))
        if rest:
            optimizers.append(torch.optim.AdamW(rest, lr=self.lr, betas=tuple(self.betas),
                                                eps=self.eps, weight_decay=self.weight_decay))
        return optimizers[0] if len(optimizers) == 1 else Several(optimizers)


# Adam's and AdamW's lighter classes, named once all are defined.
Adam.lighter = (Adafactor, AdamW8bit, AdamW4bit, AdamWFp8, Muon)
