"""loss: what a step minimizes, from the model's outputs and the batch; and accuracy, where there
is one.

Its options are `Technique`s (memexp.techniques): `planned` says which `memexp plan` tries.

The output contract: a model's forward may return a tensor of logits, a tuple (its first element
is the logits), or a mapping such as Hugging Face's `ModelOutput`, from which memexp takes
`logits`, and `loss` when the model computed one. Nothing else is asked of a model.

Every option is called as `loss(outputs, batch)`; `hits(outputs, batch)` gives the correct and
the counted predictions of a batch (`Hits`), or None where accuracy means nothing (regression);
`items(batch)` how many items its loss is a mean over, and `sums` whether it is their sum instead,
which weigh the micro-batches of an accumulated step (`shares`).
`passes_labels` says whether a mapping batch's `labels` go into the model's call (a model
computes its own loss from them) or stay memexp's targets. `check(outputs, batch)` refuses, at a
run's first forward pass, what the loss could not use; `key` names the option in its errors.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memexp.data.tensors import IGNORE, LABELS, Batch, targets_of
from memexp.linear_cross_entropy import (
    chunked_argmax,
    compute_dtype,
    linear_cross_entropy,
    module_cross_entropy,
)
from memexp.models.head import Head, PostHead, defer_head
from memexp.reduction import REDUCTIONS, Reduction
from memexp.techniques import Technique

log = logging.getLogger("memexp")


@dataclass
class Outputs:
    """A forward pass's result, read by the output contract."""

    logits: Tensor | None
    loss: Tensor | None  # the model's own loss, when it computed one
    raw: Any  # what forward returned, for a loss of your own


def read_outputs(raw: Any) -> Outputs:
    if isinstance(raw, Tensor):
        return Outputs(raw, None, raw)
    if isinstance(raw, Mapping):  # ModelOutput is a mapping that leaves out its None fields
        return Outputs(raw.get("logits"), raw.get("loss"), raw)
    if isinstance(raw, (tuple, list)) and raw and isinstance(raw[0], Tensor):
        return Outputs(raw[0], None, raw)
    raise ValueError(
        f"model._target_: the model's forward returned {type(raw).__name__}; memexp reads a "
        "tensor of logits, a tuple whose first element is the logits, or a mapping with "
        "`logits` and/or `loss` (see memexp.loss)")


def call_model(model: nn.Module, batch: Batch, passes_labels: bool) -> Outputs:
    """`model(inputs)` for a pair; `model(**batch)` for a mapping, `labels` only if asked."""
    if isinstance(batch, Mapping):
        kwargs = batch if passes_labels else {k: v for k, v in batch.items() if k != LABELS}
        return read_outputs(model(**kwargs))
    return read_outputs(model(batch[0]))


class Hits(NamedTuple):
    """An eval batch's correct and counted predictions, and its targets outside the logits'
    classes (never counted: tensors on the batch's device, read once the eval is over); and the
    number of classes."""

    correct: Tensor
    counted: Tensor
    outside: Tensor
    classes: int


class Loss(Protocol):
    passes_labels: bool
    # computes its loss from `outputs.logits` in its call (not the model, not from `raw`): the
    # meter counts what it allocates, and its backward down to the logits, as the loss's own
    reads_logits: bool
    # applies the model's parameters itself, outside the model's forward (chunked_ce its head):
    # a parallel option must leave them whole between forwards
    # (memexp.techniques.check_loss_combination)
    applies_params: bool
    key: str  # the option, as its errors name it
    # a sum over the batch's items, not a mean: the step's loss is its micro-batches' sum
    sums: bool

    def __call__(self, outputs: Outputs, batch: Batch) -> Tensor: ...

    def hits(self, outputs: Outputs, batch: Batch) -> Hits | None:
        """The batch's predictions, or None where there is no accuracy."""

    def check(self, outputs: Outputs, batch: Batch) -> None:
        """A ValueError if the first batch's outputs and targets do not fit this loss."""

    def items(self, batch: Batch) -> int | None:
        """How many items (targets that are not IGNORE) the loss of `batch` is a mean over;
        None where that is unknown."""


def shares(loss: Loss, batches: list[Batch]) -> list[float]:
    """Each micro-batch's weight in an accumulated step: its items over all of theirs, so that
    the weighted sum of their mean losses is the mean over every item of the step, as one batch
    of them all would give (with padded sequences, micro-batches count different numbers of
    tokens). Equal weights where the loss cannot count its items, or they count none; a weight
    of 1 each where the loss is a sum, which the micro-batches' sum is. Across ranks, DDP
    averages the ranks' gradients with equal weights, as it always does."""
    if loss.sums:
        return [1.0] * len(batches)
    counts = [loss.items(batch) for batch in batches]
    total = None if None in counts else sum(counts)
    if not total:
        return [1 / len(batches)] * len(batches)
    return [count / total for count in counts]


def counted(targets: Tensor | None, shift: bool) -> int | None:
    """Integer targets that count (not IGNORE), past the first position with `shift`; float
    targets (regression, class probabilities) all count; None without targets."""
    if targets is None:
        return None
    if targets.is_floating_point():
        return targets.numel()
    return int(((targets[..., 1:] if shift else targets) != IGNORE).sum())


def logits_of(outputs: Outputs, option: str) -> Tensor:
    if outputs.logits is None:
        raise ValueError(f"loss={option} needs logits, and the model's output has none "
                         f"({type(outputs.raw).__name__}); try loss=model")
    return outputs.logits


def targets_for(batch: Batch, option: str) -> Tensor:
    """The batch's targets, which the loss needs: a mapping batch may have no `labels`."""
    targets = targets_of(batch)
    if targets is None:
        raise ValueError(
            f"loss={option} needs targets, and the batch has none: its keys are {list(batch)}, "
            f"and a mapping batch gives its targets as `{LABELS}`. Add `{LABELS}` to the data's "
            "items (data.train), or choose a loss that needs none (loss=model, loss=custom)")
    return targets


def aligned(logits: Tensor, targets: Tensor, shift: bool) -> tuple[Tensor, Tensor]:
    """Logits and targets position by position; `shift`: position t predicts target t + 1 (causal
    language modelling, where the labels are the inputs, as Hugging Face gives them)."""
    if shift:
        return logits[..., :-1, :], targets[..., 1:]
    return logits, targets


def outside_classes(targets: Tensor, counted: Tensor, classes: int) -> Tensor:
    """Which of the counted integer `targets` name no class of the `classes` the logits have."""
    return counted & ((targets < 0) | (targets >= classes))


def class_hits(logits: Tensor | None, targets: Tensor | None, shift: bool) -> Hits | None:
    """Argmax hits where there are class logits and integer targets of their shape."""
    if logits is None or targets is None or targets.is_floating_point():
        return None
    logits, targets = aligned(logits, targets, shift)
    if logits.shape[:-1] != targets.shape:
        return None
    counted = targets != IGNORE
    correct = ((logits.argmax(-1) == targets) & counted).sum()
    # After `correct`, whose argmax is the larger temporary: the eval's peak stays where it was.
    classes = logits.shape[-1]
    return Hits(correct, counted.sum(), outside_classes(targets, counted, classes).sum(), classes)


def check_classes(logits: Tensor, targets: Tensor, key: str, classes: int | None = None) -> None:
    """Integer targets within the logits' classes (`classes`, where the logits are a head's
    input: loss=chunked_ce), at a run's first forward pass (and before an estimate:
    memexp.prechecks). Only a count is read, which a traced run, whose values are unknown,
    reads as 0."""
    classes = logits.shape[-1] if classes is None else classes
    outside = outside_classes(targets, targets != IGNORE, classes)
    if int(outside.sum()):
        found = targets[outside]
        raise ValueError(
            f"{key}: the batch's targets include {int(outside.sum())} outside the model's "
            f"{classes} classes (from {int(found.min())} to {int(found.max())}; logits "
            f"{tuple(logits.shape)}): valid targets are 0 to {classes - 1}, and {IGNORE} (not "
            "counted). Match the data's labels (data) to the model's head (model).")


def check_class_logits(logits: Tensor, targets: Tensor, key: str) -> None:
    """Logits with a class dimension, one row per integer target."""
    if targets.is_floating_point():
        raise ValueError(f"{key} needs integer class targets, and the batch's are "
                         f"{targets.dtype}; for regression choose loss=mse")
    if logits.dim() < 2 or logits.shape[:-1].numel() != targets.numel():
        raise ValueError(
            f"{key}: the model's logits {tuple(logits.shape)} do not fit the batch's targets "
            f"{tuple(targets.shape)}: it needs one row of class scores per target, logits of "
            "(batch, classes) or (batch, positions, classes). The model (model._target_) must "
            "return them unreduced")


@dataclass
class CrossEntropy(Technique):
    """Cross-entropy of the logits against integer targets (today's default); targets equal to
    -100 count for nothing. `shift=true` compares position t with target t + 1, for causal
    language models given their inputs as labels (the Hugging Face convention)."""

    shift: bool = False
    passes_labels = False
    reads_logits = True
    applies_params = False
    key = "loss=cross_entropy"
    sums = False

    def __call__(self, outputs: Outputs, batch: Batch) -> Tensor:
        logits, targets = aligned(logits_of(outputs, "cross_entropy"), targets_of(batch),
                                  self.shift)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    def hits(self, outputs: Outputs, batch: Batch) -> Hits | None:
        return class_hits(outputs.logits, targets_of(batch), self.shift)

    def items(self, batch: Batch) -> int | None:
        return counted(targets_of(batch), self.shift)

    def check(self, outputs: Outputs, batch: Batch) -> None:
        logits, targets = aligned(logits_of(outputs, "cross_entropy"),
                                  targets_for(batch, "cross_entropy"), self.shift)
        check_class_logits(logits, targets, self.key)
        check_classes(logits, targets, self.key)


@dataclass
class ModelLoss(Technique):
    """The loss the model computed itself: Hugging Face models do when given `labels`, which a
    mapping batch then passes in. Accuracy from its logits, where it has class logits;
    `shift=true` aligns them for causal language models, as cross_entropy's `shift`.
    `reduction` is the model's, not an option: `as_loss` reads it from the built model."""

    shift: bool = False
    passes_labels = True
    reads_logits = False
    applies_params = False
    key = "loss=model"
    reduction = Reduction.LABELS

    @property
    def sums(self) -> bool:
        return self.reduction is Reduction.SUM

    def __call__(self, outputs: Outputs, batch: Batch) -> Tensor:
        if outputs.loss is None:
            raise ValueError(
                f"loss=model: the model returned no loss ({type(outputs.raw).__name__}). Hugging "
                "Face models compute one when the batch has `labels` (a mapping batch, such as "
                "data=hf_tokens); otherwise choose loss=cross_entropy or mse")
        return outputs.loss

    def hits(self, outputs: Outputs, batch: Batch) -> Hits | None:
        return class_hits(outputs.logits, targets_of(batch), self.shift)

    def items(self, batch: Batch) -> int | None:
        """The labels that are not -100 (shifted for causal language models), or the samples
        where the model's loss is a mean over them (CTC's)."""
        targets = targets_of(batch)
        if self.reduction is Reduction.SAMPLES and targets is not None:
            return len(targets)
        return counted(targets, self.shift)

    def check(self, outputs: Outputs, batch: Batch) -> None:
        targets = targets_of(batch)
        if outputs.logits is not None and targets is not None and not targets.is_floating_point():
            check_classes(*aligned(outputs.logits, targets, self.shift), self.key)


class Kernel(str, enum.Enum):
    """loss.impl: who computes chunked_ce's chunks."""

    torch = "torch"  # memexp.linear_cross_entropy: pure PyTorch, any device
    liger = "liger"  # liger-kernel's fused linear cross-entropy (Triton: CUDA)
    cce = "cce"  # Apple's Cut Cross-Entropy (cut-cross-entropy, Triton: CUDA)


# The package each kernel needs, where it needs one.
KERNEL_PACKAGES = {Kernel.liger: "liger_kernel", Kernel.cce: "cut_cross_entropy"}


def kernel_on(wanted: Kernel, device: torch.device,
              dtype: torch.dtype) -> tuple[Kernel, str | None]:
    """The kernel a run on `device`, its head's matmul in `dtype` (autocast's where it is on),
    uses for loss.impl=`wanted`, and why it is not the one wanted, where it is not: liger's and
    cce's Triton kernels need CUDA and their package; cce's, bf16 or fp16 and an Ampere GPU."""
    if wanted is Kernel.torch:
        return wanted, None
    if device.type != "cuda":
        return Kernel.torch, f"its Triton kernels need a CUDA device, and this run is on {device}"
    # cut_cross_entropy/cce_backward.py asserts bf16/fp16 (with triton < 3.2), and its README
    # states its kernels for bf16/fp16 (apple/ml-cross-entropy at d42911f9b1a1)
    if wanted is Kernel.cce and dtype not in (torch.bfloat16, torch.float16):
        return Kernel.torch, (f"its kernels take bf16 or fp16, and the head's matmul is {dtype}: "
                              "precision=amp|bf16|bf16_pure|fp16_pure runs it")
    package = KERNEL_PACKAGES[wanted]
    if importlib.util.find_spec(package) is None:
        return Kernel.torch, f"{package} is not installed"
    # cut_cross_entropy/cce.py raises on a GPU without bf16 (older than Ampere)
    if wanted is Kernel.cce and not torch.cuda.is_bf16_supported():
        return Kernel.torch, f"it needs an Ampere GPU or newer, and {device} is older"
    return wanted, None


@dataclass
class ChunkedCrossEntropy(Technique):
    """Cross-entropy of a language model's output head, `chunk_tokens` tokens at a time, which
    never holds the whole (tokens x vocabulary) logits, their fp32 upcast or their gradient
    (memexp.linear_cross_entropy): the same loss and gradients as cross_entropy. The model's
    head is found once (memexp.models.head) and deferred: the model returns its last hidden
    states, and the loss applies the head, as it now is (an adapter's layer around it too), and
    then what the model's forward took on its output (a soft cap, a scale), each chunk's; a
    step no chunk can take is refused as the model runs it. `impl=liger|cce` uses that
    library's fused kernel where it imports, the device is CUDA and the head is a plain Linear
    with nothing after it; otherwise the run says why and uses `torch`. `shift` as
    cross_entropy's: targets -100 (padding) count for nothing."""

    shift: bool = False
    chunk_tokens: int = 256
    impl: Kernel = Kernel.torch
    passes_labels = False
    reads_logits = True
    applies_params = True
    key = "loss=chunked_ce"
    sums = False
    # `memexp plan` tries it in place of a cross-entropy, where the model has an output head
    # (memexp.plan.loss_options)
    planned: ClassVar[tuple[Mapping[str, object], ...]] = ({},)
    changes_math = None  # the same loss and gradients (within float rounding: tested)
    # the losses it computes the same as (a model's own: where its head is found)
    replaces: ClassVar[tuple[type, ...]] = (CrossEntropy, ModelLoss)
    # what the run uses: impl, once the first forward pass says on which device (check)
    kernel: Kernel = field(default=Kernel.torch, init=False)
    head: Head | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # a run's resolved config (memexp.app) gives the enum as its value
        self.impl = Kernel(self.impl)
        if self.chunk_tokens < 1:
            raise ValueError(f"loss.chunk_tokens={self.chunk_tokens}: must be >= 1")

    def attach(self, model: nn.Module) -> None:
        """Find the model's output head, and defer it to this loss."""
        self.head = defer_head(model, self.key, lambda raw: read_outputs(raw).logits)

    def __call__(self, outputs: Outputs, batch: Batch) -> Tensor:
        hidden, targets = logits_of(outputs, "chunked_ce"), targets_of(batch)
        if self.shift:  # position t predicts t + 1: the last has nothing to predict
            targets = F.pad(targets[..., 1:], (0, 1), value=IGNORE)
        hidden, targets = hidden.flatten(0, -2), targets.flatten()
        post = self.head.program()
        if not self.head.plain:  # an adapter's layer around the head: through autograd
            return module_cross_entropy(hidden, self.logits_of(post),
                                        list(self.head.module.parameters()), targets,
                                        self.chunk_tokens)
        linear = self.head.module
        # Both libraries' calls compute what the torch kernel does: the mean over the targets
        # that are not IGNORE (shifted above), fp32 sums of the weight's gradient, and the
        # gradient scaled by the loss's own (an accumulated step's weight).
        if self.kernel is Kernel.liger:
            # linkedin/Liger-Kernel, src/liger_kernel/transformers/functional.py at ead96b618e5c:
            # (input, weight, target, bias=None, ce_weight=None, ignore_index=-100, ...,
            # reduction="mean", ..., accum_dtype=None, ...) returns the loss alone unless
            # z-loss, accuracy or predictions are asked for. accum_dtype=None would sum the
            # weight's gradient in the weight's dtype (bf16 under precision=bf16_pure).
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            return liger_fused_linear_cross_entropy(
                hidden, linear.weight, targets, linear.bias, ignore_index=IGNORE,
                reduction="mean", accum_dtype=torch.float32)
        if self.kernel is Kernel.cce:
            # apple/ml-cross-entropy, cut_cross_entropy/linear_cross_entropy.py at d42911f9b1a1:
            # (e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean",
            # shift=0, ..., filter_eps="auto", accum_e_fp32=False, accum_c_fp32=False, ...,
            # impl="cce"); e (..., D) and targets (...) of one shape but the last. shift=0: the
            # targets are shifted above (its shift=1 would drop the last position, the same
            # loss). filter_eps=None: its default skips the gradient where the softmax is below
            # eps, which is not cross_entropy's gradient. It casts to autocast's dtype itself.
            from cut_cross_entropy import linear_cross_entropy as cut_cross_entropy

            return cut_cross_entropy(hidden, linear.weight, targets, bias=linear.bias,
                                     ignore_index=IGNORE, reduction="mean", shift=0,
                                     filter_eps=None, accum_e_fp32=True, accum_c_fp32=True,
                                     impl="cce")
        return linear_cross_entropy(hidden, linear.weight, linear.bias, targets,
                                    self.chunk_tokens, post or None)

    def logits_of(self, post: PostHead) -> Callable[[Tensor], Tensor]:
        """A chunk of hidden rows' logits, as the model would return them: its head as it is
        now, then its step after the head."""
        head = self.head.module
        return (lambda rows: post(head(rows))) if post else head

    def hits(self, outputs: Outputs, batch: Batch) -> Hits | None:
        targets = targets_of(batch)
        if outputs.logits is None or targets is None or targets.is_floating_point():
            return None
        hidden, targets = aligned(outputs.logits, targets, self.shift)
        predicted = chunked_argmax(hidden, self.logits_of(self.head.program()),
                                   self.chunk_tokens)
        counted = targets != IGNORE
        correct = ((predicted == targets) & counted).sum()
        classes = self.head.linear.out_features
        return Hits(correct, counted.sum(), outside_classes(targets, counted, classes).sum(),
                    classes)

    def items(self, batch: Batch) -> int | None:
        return counted(targets_of(batch), self.shift)

    def check(self, outputs: Outputs, batch: Batch) -> None:
        hidden, targets = aligned(logits_of(outputs, "chunked_ce"),
                                  targets_for(batch, "chunked_ce"), self.shift)
        post = self.head.program()
        if targets.is_floating_point() or hidden.shape[:-1] != targets.shape:
            raise ValueError(
                f"{self.key}: the head's input {tuple(hidden.shape)} does not fit the batch's "
                f"targets {tuple(targets.shape)}: it needs integer targets, one per position")
        check_classes(hidden, targets, self.key, self.head.linear.out_features)
        if post:
            log.info("%s: after its output head, the model's forward takes %s on the logits: "
                     "the loss takes them on each chunk of logits", self.key, post.describe())
        self.kernel, why = kernel_on(self.impl, hidden.device, compute_dtype(hidden))
        if why is None and self.kernel is not Kernel.torch and (post or not self.head.plain):
            self.kernel, why = Kernel.torch, (
                f"its kernel takes the head's weight alone, and the model takes {post.describe()} "
                "after its head" if post else
                f"its kernel takes the head's weight alone, and the head is "
                f"{type(self.head.module).__name__} (an adapter's layer)")
        if why is not None:
            log.info("%s: loss.impl=%s unavailable (%s): using loss.impl=torch", self.key,
                     self.impl.value, why)


@dataclass
class MSE(Technique):
    """Mean squared error of the logits against float targets of the same shape (regression);
    no accuracy."""

    passes_labels = False
    reads_logits = True
    applies_params = False
    key = "loss=mse"
    sums = False

    def __call__(self, outputs: Outputs, batch: Batch) -> Tensor:
        logits, targets = logits_of(outputs, "mse"), targets_of(batch)
        return F.mse_loss(logits.float(), targets.float().view_as(logits))

    def hits(self, outputs: Outputs, batch: Batch) -> None:
        return None

    def items(self, batch: Batch) -> int | None:
        return counted(targets_of(batch), shift=False)

    def check(self, outputs: Outputs, batch: Batch) -> None:
        logits, targets = logits_of(outputs, "mse"), targets_for(batch, "mse")
        if logits.numel() != targets.numel():
            raise ValueError(f"loss=mse: logits {tuple(logits.shape)} and targets "
                             f"{tuple(targets.shape)} differ in size")


@dataclass
class UserLoss:
    """Your callable `(outputs, batch) -> loss` (`loss=custom loss._target_=pkg.fn`); `outputs`
    is an `Outputs` (logits, loss, and `raw`, what forward returned). No accuracy."""

    function: Callable[[Outputs, Batch], Tensor]
    passes_labels = False
    reads_logits = False
    applies_params = False  # a function of the outputs and the batch
    sums = False  # unknown: taken for a mean, whose items are unknown too (equal weights)

    @property
    def key(self) -> str:
        """loss._target_ as given: Hydra's `_partial_: true` wraps the function."""
        function = (self.function.func if isinstance(self.function, functools.partial)
                    else self.function)
        return f"loss._target_={function.__module__}.{function.__qualname__}"

    def __call__(self, outputs: Outputs, batch: Batch) -> Tensor:
        return self.function(outputs, batch)

    def hits(self, outputs: Outputs, batch: Batch) -> None:
        return None

    def items(self, batch: Batch) -> None:
        """Unknown: what your loss is a mean over is yours (micro-batches weigh equally)."""
        return None

    def check(self, outputs: Outputs, batch: Batch) -> None:
        pass


def as_loss(built: Any, model: nn.Module) -> Loss:
    """A `loss` option as built, for `model`: memexp's own options, or a user's callable.
    loss=model takes the reduction of the model's own loss (`REDUCTIONS`); loss=chunked_ce
    takes over the model's output head."""
    if isinstance(built, ModelLoss):
        built.reduction = REDUCTIONS.get(model, Reduction.LABELS)
        return built
    if isinstance(built, ChunkedCrossEntropy):
        built.attach(model)
        return built
    if isinstance(built, (CrossEntropy, MSE)):
        return built
    if callable(built):
        return UserLoss(built)
    raise TypeError(f"loss: {built!r} is not callable as (outputs, batch) -> loss")

