"""Cross-entropy of an output head's logits, a chunk of tokens at a time, so that the (tokens x
vocabulary) logits, their fp32 upcast and their gradient never exist whole (loss=chunked_ce):
torchtune's chunked cross-entropy, Liger's fused linear cross-entropy, in plain PyTorch.

Pure math on tensors: the head and the option live in memexp.models.head and memexp.loss.
"""

from __future__ import annotations

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


def chunk_loss(h: Tensor, w: Tensor, b: Tensor | None, targets: Tensor, keep: Tensor,
               scale: Tensor, grads: Gradients, start: int) -> Tensor:
    """One chunk's summed loss, its gradients added to `grads`: a function of its own, so that
    its (chunk x vocabulary) tensor is gone before the next chunk's is made."""
    # fp32 for the loss, as Hugging Face's loss upcasts the logits. The softmax is taken in
    # place, over this one tensor: logsumexp would allocate a second.
    logits = torch.nn.functional.linear(h, w, b).float()
    targets = targets.clamp(min=0)[:, None]  # IGNORE rows count for nothing (keep)
    picked = logits.gather(1, targets)[:, 0]
    top = logits.amax(-1, keepdim=True)
    probs = logits.sub_(top).exp_()
    sums = probs.sum(-1, keepdim=True)
    total = (top + sums.log())[:, 0].sub_(picked).mul_(keep).sum()
    if not grads.wanted():
        return total
    # d loss / d logits = (softmax - one-hot) / counted, in place
    grad = probs.div_(sums)
    grad.scatter_add_(1, targets, -keep[:, None].float())
    grad.mul_((keep * scale)[:, None])
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
                chunk: int) -> Tensor:
        dtype = compute_dtype(hidden)
        rows = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        counted = targets != IGNORE
        # the mean over the counted targets, as F.cross_entropy's: nan where none counts
        scale = 1.0 / counted.sum().float()
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
                                    counted[start:end], scale, grads, start)
        ctx.grads = (grads.rows.view_as(hidden) if grads.rows is not None else None,
                     grads.weight.to(weight.dtype) if grads.weight is not None else None,
                     grads.bias.to(bias.dtype) if grads.bias is not None else None)
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        grads, ctx.grads = ctx.grads, None  # let AccumulateGrad take the weight's as its .grad
        # In place: a second weight-sized buffer would raise the peak. grad_loss is 1, or an
        # accumulated step's micro-batch weight.
        scaled = [grad.mul_(grad_loss) if grad is not None else None for grad in grads]
        return (*scaled, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         chunk: int) -> Tensor:
    return LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk)


@torch.no_grad()
def chunked_argmax(hidden: Tensor, weight: Tensor, bias: Tensor | None, chunk: int) -> Tensor:
    """The head's argmax class for every row of `hidden`, a chunk of rows at a time."""
    dtype = compute_dtype(hidden)
    rows = hidden.reshape(-1, hidden.shape[-1])
    w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
    found = [torch.nn.functional.linear(rows[start:start + chunk].to(dtype), w, b).argmax(-1)
             for start in range(0, rows.shape[0], chunk)]
    return torch.cat(found).view(hidden.shape[:-1])
