"""Cross-entropy of an output head's logits, a chunk of tokens at a time, so that the (tokens x
vocabulary) logits, their fp32 upcast and their gradient never exist whole (loss=chunked_ce):
torchtune's chunked cross-entropy, Liger's fused linear cross-entropy, in plain PyTorch.

Pure math on tensors: the head and the option live in memexp.models.head and memexp.loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from memexp.data.tensors import IGNORE


def compute_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (as the model's own head
    would run under it), the tensor's otherwise."""
    device = tensor.device.type
    # (no autocast on the meta device, where the estimate's dry run checks the structure)
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


@dataclass
class Gradients:
    """Where each chunk adds its gradients (None: not wanted): the hidden rows' (each chunk its
    own rows), the weight's and the bias's (fp32 sums over the chunks)."""

    rows: Tensor | None
    weight: Tensor | None
    bias: Tensor | None

    def wanted(self) -> bool:
        return self.rows is not None or self.weight is not None or self.bias is not None


def softmax_loss(logits: Tensor, targets: Tensor, keep: Tensor, scale: Tensor,
                 wanted: bool) -> tuple[Tensor, Tensor | None]:
    """A chunk's summed loss from its fp32 `logits`, and, where `wanted`, its gradient with
    respect to them (of the mean: `scale`), computed in place over them."""
    # The softmax is taken in place, over this one tensor: logsumexp would allocate a second.
    targets = targets.clamp(min=0)[:, None]  # IGNORE rows count for nothing (keep)
    picked = logits.gather(1, targets)[:, 0]
    top = logits.amax(-1, keepdim=True)
    probs = logits.sub_(top).exp_()
    sums = probs.sum(-1, keepdim=True)
    total = (top + sums.log())[:, 0].sub_(picked).mul_(keep).sum()
    if not wanted:
        return total, None
    # d loss / d logits = (softmax - one-hot) / counted, in place
    grad = probs.div_(sums)
    grad.scatter_add_(1, targets, -keep[:, None].float())
    grad.mul_((keep * scale)[:, None])
    return total, grad


def after_head(post: Callable[[Tensor], Tensor], logits: Tensor, targets: Tensor, keep: Tensor,
               scale: Tensor, wanted: bool) -> tuple[Tensor, Tensor | None]:
    """softmax_loss of the model's step after its head (`post`, memexp.models.head.PostHead)
    taken on a chunk's head `logits`, and the gradient with respect to those logits: through
    the step by autograd, on this chunk alone."""
    with torch.enable_grad():
        logits.requires_grad_(wanted)  # a leaf: made where autograd records nothing
        out = post(logits)
    # a copy: the softmax is taken in place, and the step may have saved its output
    total, grad = softmax_loss(out.detach().to(torch.float32, copy=True), targets, keep, scale,
                               wanted)
    if grad is None:
        return total, None
    (grad,) = torch.autograd.grad(out, logits, grad.to(out.dtype))
    return total, grad.float()


def chunk_loss(h: Tensor, w: Tensor, b: Tensor | None, targets: Tensor, keep: Tensor,
               scale: Tensor, grads: Gradients, start: int,
               post: Callable[[Tensor], Tensor] | None) -> Tensor:
    """One chunk's summed loss, its gradients added to `grads`: a function of its own, so that
    its (chunk x vocabulary) tensor is gone before the next chunk's is made."""
    # fp32 for the loss, as Hugging Face's loss upcasts the logits.
    if post is None:
        total, grad = softmax_loss(torch.nn.functional.linear(h, w, b).float(), targets, keep,
                                   scale, grads.wanted())
    else:
        total, grad = after_head(post, torch.nn.functional.linear(h, w, b), targets, keep,
                                 scale, grads.wanted())
    if grad is None:
        return total
    if grads.bias is not None:
        grads.bias += grad.sum(0)
    grad = grad.to(h.dtype)
    if grads.rows is not None:
        grads.rows[start:start + len(h)] = grad @ w
    if grads.weight is not None:
        if h.dtype == torch.float32:
            grads.weight.addmm_(grad.T, h)
        else:  # added into the fp32 sum without a weight-sized fp32 temporary
            grads.weight += grad.T @ h
    return total


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `hidden @ weight.T + bias` against `targets` (IGNORE: not counted),
    over `chunk` rows at a time.

    The gradients are computed in forward, chunk by chunk, and backward only scales them (as
    Liger does), rather than saving the hidden states and recomputing each chunk's logits in
    backward. Both hold the same at the step's peak, the start of backward: a (tokens x hidden)
    tensor (the gradient of the hidden states here, the hidden states there) and the head's
    weight gradient, which backward allocates there and forward here; but recomputing costs a
    third more of the head's matmuls. What stays between chunks is never vocabulary-sized
    per token: the weight's gradient is the size of the weight, which a step holds anyway."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk: int, post: Callable[[Tensor], Tensor] | None) -> Tensor:
        dtype = compute_dtype(hidden)
        rows, targets, counted, scale = flat_rows(hidden, targets)
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grads = Gradients(
            torch.empty_like(rows) if wants_hidden else None,
            torch.zeros_like(weight, dtype=torch.float32) if wants_weight else None,
            torch.zeros_like(bias, dtype=torch.float32) if wants_bias and bias is not None
            else None)
        # Autocast off: each matmul states its dtype; the weight is cast once, not per chunk.
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, rows.shape[0], chunk):
                end = start + chunk
                total += chunk_loss(rows[start:end].to(dtype), w, b, targets[start:end],
                                    counted[start:end], scale, grads, start, post)
        ctx.grads = (grads.rows.view_as(hidden) if grads.rows is not None else None,
                     grads.weight.to(weight.dtype) if grads.weight is not None else None,
                     grads.bias.to(bias.dtype) if grads.bias is not None else None)
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        grads, ctx.grads = ctx.grads, None  # let AccumulateGrad take the weight's as its .grad
        return (*scaled_grads(grads, grad_loss), None, None, None)


def flat_rows(hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The hidden states and targets as rows, which targets count, and the mean's scale."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    counted = targets != IGNORE
    # the mean over the counted targets, as F.cross_entropy's: nan where none counts
    return rows, targets, counted, 1.0 / counted.sum().float()


def scaled_grads(grads, grad_loss: Tensor) -> list[Tensor | None]:
    # In place: a second weight-sized buffer would raise the peak. grad_loss is 1, or an
    # accumulated step's micro-batch weight.
    return [grad.mul_(grad_loss) if grad is not None else None for grad in grads]


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         chunk: int, post: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`post`: the model's step after its head, taken on each chunk's logits."""
    return LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk, post)


def module_chunk_loss(h: Tensor, module: Callable[[Tensor], Tensor], params: list[Tensor],
                      targets: Tensor, keep: Tensor, scale: Tensor, rows: Tensor | None,
                      sums: list[Tensor], start: int) -> Tensor:
    """One chunk's summed loss through the head `module` (and the step after it), by autograd
    on this chunk alone: its gradients added to `rows` and to `sums`, `params`' fp32 sums."""
    with torch.enable_grad():
        x = h.detach().requires_grad_(rows is not None)
        out = module(x)
    wanted = [x] * (rows is not None) + params
    # a copy: the softmax is taken in place, and the module may have saved its output
    total, grad = softmax_loss(out.detach().to(torch.float32, copy=True), targets, keep, scale,
                               bool(wanted))
    if grad is None:
        return total
    found = list(torch.autograd.grad(out, wanted, grad.to(out.dtype)))
    if rows is not None:
        rows[start:start + len(h)] = found.pop(0)
    for total_grad, param_grad in zip(sums, found, strict=True):
        total_grad += param_grad
    return total


class ModuleCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `module(hidden)` against `targets`, over `chunk` rows at a time,
    for a head that is more than a Linear (an adapter's layer around it): each chunk's logits
    and gradients by autograd, inside forward, as LinearCrossEntropy computes them by hand.
    `params` are the module's parameters that train (their gradients are fp32 sums over the
    chunks); the module runs under the caller's autocast, as it would in the model."""

    @staticmethod
    def forward(ctx, hidden: Tensor, targets: Tensor, chunk: int,
                module: Callable[[Tensor], Tensor], *params: Tensor) -> Tensor:
        rows, targets, counted, scale = flat_rows(hidden, targets)
        grads = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        trained = [p for p, wanted in zip(params, ctx.needs_input_grad[4:], strict=True)
                   if wanted]
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in trained]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows.shape[0], chunk):
            end = start + chunk
            total += module_chunk_loss(rows[start:end], module, trained, targets[start:end],
                                       counted[start:end], scale, grads, sums, start)
        by_param = iter(sums)
        ctx.grads = (grads.view_as(hidden) if grads is not None else None,
                     *(next(by_param).to(p.dtype) if wanted else None
                       for p, wanted in zip(params, ctx.needs_input_grad[4:], strict=True)))
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        grads, ctx.grads = ctx.grads, None
        rows, *params = scaled_grads(grads, grad_loss)
        return (rows, None, None, None, *params)


def module_cross_entropy(hidden: Tensor, module: Callable[[Tensor], Tensor],
                         params: list[Tensor], targets: Tensor, chunk: int) -> Tensor:
    """`module`: the head and the model's step after it, on a chunk of hidden rows; `params`:
    its parameters (those that need no gradient get none)."""
    return ModuleCrossEntropy.apply(hidden, targets, chunk, module, *params)


@torch.no_grad()
def chunked_argmax(hidden: Tensor, logits_of: Callable[[Tensor], Tensor], chunk: int) -> Tensor:
    """The argmax class of `logits_of` every row of `hidden`, a chunk of rows at a time."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    found = [logits_of(rows[start:start + chunk]).argmax(-1)
             for start in range(0, rows.shape[0], chunk)]
    return torch.cat(found).view(hidden.shape[:-1])
