"""Mixture-of-experts models in `memexp estimate`: what the router decides is data the estimate
assumes, and says so where the figure is.

An MoE layer's router picks, for each token, `top_k` of its experts (`torch.topk` over the
router's scores: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 in transformers 5.24). Which
ones depends on the model's values, which a trace does not have. Two things follow:

- transformers runs the experts by default with `torch._grouped_mm` (`experts_implementation=
  grouped_mm`): every token's rows sorted by expert, and one matmul over groups whose sizes
  (`offs`) are the router's counts. No size depends on them: the rows are tokens x top_k, however
  they are spread. torch's meta kernel for it takes bf16 only (CUDA's grouped GEMM's dtype),
  while the CPU kernel, and the run, take any float: GROUPED_MM below gives the output's shape
  for any dtype, from torch's own helper.
- its eager loop (`experts_implementation=eager`) takes each expert's tokens with `nonzero`:
  their number sets the size of every tensor an expert makes and saves. There the choices
  decide sizes, and the estimate has to assume them.

So the router's choices (topk's indices, `Routing`) are made for real under the trace, as an
assumption: `even`, each expert receives its share, tokens x top_k / experts (token t takes the
experts t*k .. t*k+k-1, modulo their number: top_k different experts a token, and as even a
spread as the counts allow); `unbalanced`, the first top_k - 1 experts receive every token (an
expert takes a token once at most: no group can be larger) and the last choice is spread over
the others, so that every expert still runs (with top_k 1, the first expert takes them all).
What the ops make from them runs for real too (memexp.estimate._Values), and where one of those
ops decides a size or a branch (`nonzero`, a read of a value), the estimate says that it assumed
the spread, and traces the unbalanced case beside it.

The unbalanced case is not a bound: an expert's tensors are as large as its group, but the
experts' groups always add up to tokens x top_k, and which spread peaks highest depends on when
each expert runs. On small Mixtral and Qwen2-MoE models (width 32, 2 layers, top 2 of 4
experts, 128 tokens) it peaked the highest of the spreads tried (every token to the first, or
the last, top_k experts; the last top_k - 1 for every token), and above the measured peak
where the even spread was below it (Mixtral with checkpointing=full: even -3.0%, unbalanced
+0.8%).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch import nn
from torch._meta_registrations import _create_grouped_mm_output_tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import arg_tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

ROUTINGS = ("even", "unbalanced")
_TOPK = torch.ops.aten.topk.default


def calling_frame():
    """The innermost module method on the stack: (the module, its frame, the line), or None
    outside any. Where the model runs the op being dispatched."""
    for frame, line in traceback.walk_stack(None):
        if isinstance(frame.f_locals.get("self"), nn.Module):
            return frame.f_locals["self"], frame, line
    return None


def where_name() -> str:
    """`Class.method` of the innermost module method on the stack ("" outside any)."""
    found = calling_frame()
    return "" if found is None else f"{type(found[0]).__name__}.{found[1].f_code.co_name}"


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`torch._grouped_mm`'s output, for any float dtype: torch's meta kernel checks for bf16
    (its CUDA kernel's type), then makes its output with this helper, which takes any. The
    CPU kernel multiplies fp32 and fp16 as well, into the same shape."""
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


# Ops whose shape function stands in for torch's meta kernel under the trace.
SHAPES = {torch.ops.aten._grouped_mm.default: grouped_mm}


@dataclass
class Router:
    """One place the model picks `top_k` of `experts` for each of `tokens` rows, and how often
    the trace ran it (each layer's router is a place of its own; each pass a call)."""

    where: str
    tokens: int
    experts: int
    top_k: int
    calls: int = 0
    used: bool = False  # whether an op read its choices


def choices(shape: torch.Size, dim: int, experts: int, top_k: int, kind: str) -> torch.Tensor:
    """topk's indices of `shape`, along `dim`, as `kind` (ROUTINGS) assumes the router picks."""
    rows = shape.numel() // top_k if top_k else 0
    if kind == "even":
        picked = (torch.arange(rows * top_k) % experts).reshape(rows, top_k)
    elif top_k == 1:
        picked = torch.zeros(rows, 1, dtype=torch.long)
    else:
        last = top_k - 1 + torch.arange(rows) % (experts - top_k + 1)
        picked = torch.cat([torch.arange(top_k - 1).expand(rows, -1), last[:, None]], 1)
    return picked.reshape(*shape[:dim], *shape[dim + 1:], top_k).movedim(-1, dim)


class Routing:
    """The router's choices under a trace: topk's indices (on fake scores) made for real, as
    `kind` assumes, and what follows from them tracked: `decides` says whether an op on them
    set a size or read a value (the eager loop over experts), or none did (grouped_mm)."""

    def __init__(self, kind: str = "even"):
        if kind not in ROUTINGS:
            raise ValueError(f"routing={kind}: choose one of {', '.join(ROUTINGS)}")
        self.kind = kind
        self.routers: dict[tuple, Router] = {}  # by (where, tokens, experts, top_k)
        self.decides = False
        # the storages of the real tensors made from the choices (held weakly) -> their router
        self.made = WeakIdKeyDictionary()

    def choose(self, func, args, kwargs, out):
        """`out` of `func` on fake tensors, with topk's indices replaced by the assumed choices
        (made on the host, where the trace's real tensors are; a fake device's indices stay
        fake)."""
        for router in self._routers_of(args, kwargs):
            router.used = True
        if func is not _TOPK:
            return out
        scores, top_k = args[0], args[1]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        values, indices = out
        if indices.device.type not in ("cpu", "meta"):  # made on the host, or for the meta
            return out                                    # device's dry run (memexp.prechecks)
        dim = dim % scores.dim() if scores.dim() else 0
        experts = scores.shape[dim] if scores.dim() else 1
        with unset_fake_temporarily():  # under the trace: a real tensor, not a fake one
            picked = choices(indices.shape, dim, experts, top_k, self.kind).contiguous()
        key = (where_name(), indices.numel() // max(top_k, 1), experts, top_k)
        router = self.routers.setdefault(key, Router(*key))
        router.calls += 1
        self.made[picked.untyped_storage()] = router
        return values, picked

    def follow(self, func, args, kwargs, out) -> None:
        """An op run for real: its outputs are made from the choices where an input is, and
        where it is, whether it sets a size or gives a value the model reads."""
        routers = self._routers_of(args, kwargs)
        if not routers:
            return
        for router in routers:
            router.used = True
        if (torch.Tag.dynamic_output_shape in func.tags
                or torch.Tag.data_dependent_output in func.tags):
            self.decides = True
        for made in arg_tree_leaves(out):
            if isinstance(made, torch.Tensor):
                self.made[made.untyped_storage()] = routers[0]

    def _routers_of(self, args, kwargs) -> list[Router]:
        """The routers whose choices (or what was made from them) `args` hold."""
        if not len(self.made):
            return []
        storages = [t.untyped_storage() for t in arg_tree_leaves(*args, **kwargs)
                    if isinstance(t, torch.Tensor)]
        return [self.made[storage] for storage in storages if storage in self.made]

    def record(self) -> dict | None:
        """For Estimate.routing: each router whose choices the model used (not a topk whose
        values alone it reads, as DeepSeek-V3 scores its groups), with its sizes, what was
        assumed of its choices, and whether they set sizes. None without one."""
        used = [vars(router) for router in self.routers.values() if router.used]
        if not used:
            return None
        return {"assumed": self.kind, "decides_sizes": self.decides, "routers": used}


def routing_lines(routing: dict | None, peak: int, mib) -> list[str]:
    """What the estimate assumed of an MoE router's choices, where the figure is: a line for
    each router (the module that runs it, its sizes), and the unbalanced case's peak."""
    if routing is None:
        return []
    lines = []
    for router in routing["routers"]:
        tokens, top_k, experts = router["tokens"], router["top_k"], router["experts"]
        picks = (f"  routing      {router['where'] or 'topk'} picks {top_k} of {experts} for "
                 f"each of {tokens:,} tokens")
        if routing["decides_sizes"]:
            lines.append(f"{picks}; sizes depend on which: assumed an even spread, each of the "
                         f"{experts} receiving tokens x {top_k} / {experts} = "
                         f"{tokens * top_k / experts:,.4g}")
        else:
            lines.append(f"{picks}; no size depends on which (the experts run as one grouped "
                         "matmul over tokens x top_k rows): nothing assumed")
    unbalanced = routing.get("unbalanced")
    if unbalanced is not None:
        change = unbalanced["peak_bytes"] / peak - 1 if peak else 0.0
        lines.append(f"  unbalanced   each router's first top_k - 1 choices take every token, "
                     f"its last is spread over the rest (top_k 1: the first takes all): peak "
                     f"{mib(unbalanced['peak_bytes']).strip()} in {unbalanced['peak_phase']} "
                     f"({change:+.1%}; a case, not a bound)")
    return lines
