"""Checks that turn a run that cannot work into a clear error, before or at its first forward pass.

- `check_signature`: the batch's keys against the model's forward signature (before a run).
- `FirstForward`: during a run's first forward pass, every embedding lookup is in range (a token
  id past the vocabulary, a sequence longer than the position table), and afterwards every module
  a technique changed has run (no silent no-op: a technique that wrapped a copy of the layers
  would otherwise report the memory of `none` as its own).
- `check_loss` and `check_reached`: a run's first loss is one floating-point number, computed
  from the model's parameters, and its backward gives at least one of them a gradient (a loss
  that reaches none would train nothing, and the run would still measure its memory as ok).
- `dry_run`: for `memexp estimate`, whose traced values are unknown, the same embedding and
  target checks on a forward pass of the model on the meta device (nothing allocated), with the
  batch's integer tensors (token ids, positions, masks) computed for real.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from memexp.data.tensors import LABELS, Batch
from memexp.estimate_moe import SHAPES, Routing
from memexp.loss import call_model

log = logging.getLogger("memexp")


def check_signature(model: nn.Module, batch: Batch, passes_labels: bool) -> None:
    """A mapping batch's keys must be arguments of forward, and forward's required arguments
    must be in the batch; a pair's inputs are one positional argument."""
    parameters = inspect.signature(model.forward).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters)
    required = [p.name for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    model_name = type(model).__name__
    if not isinstance(batch, Mapping):
        if len(required) > 1:
            raise ValueError(f"{model_name}.forward requires {required}, and a batch of "
                             "(inputs, targets) gives one argument; use a mapping batch")
        return
    given = [key for key in batch if passes_labels or key != LABELS]
    unknown = [key for key in given if key not in named and not takes_any]
    missing = [name for name in required if name not in given]
    if unknown or missing:
        raise ValueError(
            f"the batch's keys {given} do not fit "
            f"{model_name}.forward{inspect.signature(model.forward)}"
            + (f": it takes no {unknown}" if unknown else "")
            + (f": it requires {missing}" if missing else "")
            + (". `labels` go to the model only with loss=model" if LABELS in missing else ""))


def inputs_of(batch: Batch) -> dict[str, Tensor]:
    """What the model gets from `batch`, by name (a pair's inputs as `inputs`)."""
    return dict(batch) if isinstance(batch, Mapping) else {"inputs": batch[0]}


def check_lookup(name: str, embedding: nn.Embedding, indices: Tensor,
                 inputs: dict[str, Tensor]) -> None:
    """An embedding's indices must be rows it has; the error says where they came from, where
    that is known: `inputs` are the tensors the forward pass was given."""
    if indices.numel() == 0 or indices.is_meta:  # meta: made from the model's own buffers
        return
    low, high = int(indices.min()), int(indices.max())
    rows = embedding.num_embeddings
    if 0 <= low and high < rows:
        return
    index = high if high >= rows else low
    raise ValueError(f"{name} (nn.Embedding with {rows} rows) is looked up at index {index}, "
                     f"out of range: {lookup_origin(indices, index, low, high, inputs)}")


def lookup_origin(indices: Tensor, index: int, low: int, high: int,
                  inputs: dict[str, Tensor]) -> str:
    """Where the out-of-range `index` among `indices` came from, as far as the values show: the
    batch's own ids, positions the model counted (a run of consecutive indices along each
    sequence), ids the model made from a tensor of the batch that holds `index` (Whisper's
    decoder inputs: its labels shifted right), or none of these."""
    fed = [key for key, value in inputs.items() if value.shape == indices.shape
           and value.dtype == indices.dtype and bool((value == indices).all())]
    if fed:
        return (f"the batch's {fed[0]!r}: token ids from {low} to {high}; the data's vocabulary "
                "must fit the model's (data.vocab_size)")
    if indices.dim() > 0 and indices.shape[-1] > 1 and bool((indices.diff() == 1).all()):
        return (f"computed by the model from the batch (a position table: positions up to "
                f"{high}, for sequences {indices.shape[-1]} long, data.seq_len; enlarge the "
                "table in the model's config, such as +model.config.n_positions or "
                "max_position_embeddings)")
    holding = [key for key, value in inputs.items()
               if _integer(value) and bool((value == index).any())]
    if holding:
        return (f"an id that the batch's {holding[0]!r} holds, from which the model makes this "
                "lookup's indices: the ids in the data must be rows of the model's vocabulary")
    return ("made by the model itself: no tensor of the batch holds it, and it is not one of a "
            "run of positions")


class Lookups(TorchFunctionMode):
    """Active while an embedding module runs: each lookup of its own table (F.embedding) is
    checked, with the indices it really looks up. What the module's forward was given may be no
    index at all: Whisper's positional embedding takes the token ids only for their length and
    slices its table, and BART's adds an offset to the positions it makes from them."""

    def __init__(self, name: str, module: nn.Embedding, inputs: Callable[[], dict[str, Tensor]]):
        super().__init__()
        self.name, self.module, self.inputs = name, module, inputs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and (args[1:2] or [kwargs.get("weight")])[0] is self.module.weight:
            check_lookup(self.name, self.module, args[0] if args else kwargs["input"],
                         self.inputs())
        return func(*args, **kwargs)


def watch_lookups(model: nn.Module, inputs: Callable[[], dict[str, Tensor]]) -> list:
    """Hooks that check every embedding module's lookups (Lookups) while it runs; `inputs`
    gives the tensors the forward pass was given. Their handles, to remove."""
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            mode = Lookups(name, module, inputs)

            def enter(module, args, mode=mode) -> None:
                mode.__enter__()

            def leave(module, args, output, mode=mode) -> None:
                mode.__exit__(None, None, None)

            handles.append(module.register_forward_pre_hook(enter))
            # always_call: the mode leaves with the module even when its lookup is refused
            handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


class FirstForward:
    """Hooks for a run's first forward pass, removed after it: embedding lookups in range, then
    the no-op check over `changed` ({group: {module name: module}})."""

    def __init__(self, model: nn.Module, changed: dict[str, Mapping[str, nn.Module]],
                 lookups: bool = True):
        """`lookups=False` leaves the embedding checks out: in a compiled model they would run
        inside the traced region, where reading the indices (`.item()`) breaks the graph at
        every embedding for good (dynamo does not guard on hooks, so the breaks outlive them);
        Inductor checks indirect indices itself (`assert_indirect_indexing`)."""
        self.changed = {group: dict(modules) for group, modules in changed.items() if modules}
        self.ran: set[int] = set()
        # The first forward pass's tensors, weakly: a pass that fails (out of memory) must not
        # keep its batch alive.
        self.inputs: dict[str, weakref.ref] = {}
        self.handles = [model.register_forward_pre_hook(self._capture, with_kwargs=True)]
        self.handles += [module.register_forward_pre_hook(self._mark)
                         for modules in self.changed.values() for module in modules.values()]
        self.handles += watch_lookups(model, self._alive_inputs) if lookups else []
        self.handles.append(model.register_forward_hook(self._verify))

    def _capture(self, model: nn.Module, args, kwargs) -> None:
        named = {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs}
        self.inputs = {k: weakref.ref(v) for k, v in named.items() if isinstance(v, Tensor)}

    def _mark(self, module: nn.Module, args) -> None:
        self.ran.add(id(module))

    def _alive_inputs(self) -> dict[str, Tensor]:
        return {key: tensor for key, ref in self.inputs.items() if (tensor := ref()) is not None}

    def _verify(self, model: nn.Module, args, output) -> None:
        for handle in self.handles:
            handle.remove()
        for group, modules in self.changed.items():
            if not any(id(module) in self.ran for module in modules.values()):
                names = list(modules)
                shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more"
                                                if len(names) > 6 else "")
                raise RuntimeError(
                    f"{group}: none of the {len(names)} modules it changed ran in the first "
                    f"forward pass ({shown}): the technique would do nothing, and the run would "
                    "report the baseline's memory as its own. The model's forward does not call "
                    "them: a copy of its layers, or a container it loops over or indexes rather "
                    f"than calls whole? Point {group} at the modules forward runs "
                    "(memexp.models.blocks: [auto], class names or module-name globs).")


def check_trainable(trainable: int) -> None:
    """Before the optimizer is built over them: some parameter trains (`trainable`: how many of
    the model's parameters require gradients)."""
    if trainable == 0:
        raise ValueError("model: none of the model's parameters requires a gradient (all are "
                         "frozen): nothing would be trained")


def check_loss(loss: Any, key: str) -> None:
    """The first loss, before its backward: one floating-point number that autograd can follow
    back to the model. Only what a tensor says of itself is read: no value, no host sync."""
    if not isinstance(loss, Tensor):
        raise ValueError(f"{key}: the loss is {type(loss).__name__}, not a tensor: it must "
                         "return the loss computed from the model's outputs")
    if loss.numel() != 1:
        raise ValueError(f"{key}: the loss is a tensor of shape {tuple(loss.shape)}, not one "
                         "number: reduce it (its .mean() or .sum())")
    if not loss.is_floating_point():
        raise ValueError(f"{key}: the loss is a {loss.dtype} tensor: gradients need a "
                         "floating-point loss computed from the model's outputs (a count or "
                         "an argmax has none)")
    if not loss.requires_grad:
        raise ValueError(f"{key}: the loss needs no gradient: it does not depend on the "
                         "model's parameters (computed from detached outputs, or from "
                         "constants?)")
    if loss.grad_fn is None:
        raise ValueError(f"{key}: the loss is a tensor of its own (a leaf with "
                         "requires_grad=True), not computed from the model's outputs: "
                         "backward would train nothing")


def check_reached(reached: bool, key: str, trainable: int) -> None:
    """After the first backward: some parameter got a gradient."""
    if not reached:
        raise ValueError(f"{key}: backward gave none of the model's {trainable} trainable "
                         "parameters a gradient: the loss depends on tensors of its own, not "
                         "on the model's")


# -- memexp estimate: a forward pass on the meta device with real integer values -------------------
def _integer(tensor: Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex()


class IntegerValues(TorchDispatchMode):
    """Floating-point tensors live on the meta device (shapes only); integer and boolean ones
    that can be computed from real values (token ids, positions from arange, masks) are computed
    on the CPU, so that embedding lookups can be checked. An op on real values whose result is
    floating-point is not run on the CPU either (attention's additive mask from a real boolean
    one: 512 MiB of floats a block for 2 x 8192 x 8192, most of the check's time and memory at
    long contexts): its result is made on the meta device. An MoE router's choices are made on
    the CPU as the estimate assumes them (memexp.estimate_moe), and its grouped matmul takes
    any float."""

    def __init__(self):
        super().__init__()
        self.routing = Routing()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0]):
            args, kwargs = _to_meta(args, kwargs)
            return self.routing.choose(func, args, kwargs,
                                       SHAPES.get(func, func)(*args, **kwargs))
        if not func._schema.is_mutable:  # an op that writes a real tensor runs on it
            shaped = _on_meta(func, args, kwargs)
            if shaped is not None and not all(_integer(t) for t in tree_flatten(shaped)[0]
                                              if isinstance(t, Tensor)):
                return shaped
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:  # no CPU kernel for the dtype asked for the meta device
            args, kwargs = _to_meta(args, kwargs)
            return func(*args, **kwargs)
        # Integers made for the meta device (torch.arange(n, device=embeddings.device)) are
        # made for real instead: positions are what position tables are checked against.
        if (kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta"
                and all(_integer(t) for t in tree_flatten(out)[0] if isinstance(t, Tensor))):
            return func(*args, **{**kwargs, "device": torch.device("cpu")})
        return out


def _to_meta(args, kwargs) -> tuple:
    """`args` and `kwargs` with their tensors on the meta device."""
    return tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs))


def _on_meta(func, args, kwargs):
    """`func`'s result on the meta device (shapes and dtypes only), or None where it has no
    meta kernel or cannot run there (a size read from values)."""
    args, kwargs = _to_meta(args, kwargs)
    try:
        return func(*args, **kwargs)
    except Exception:  # run on the CPU instead, as before
        return None


def dry_run(model: nn.Module, batch: Batch, loss) -> None:
    """`model` (built on the meta device) on `batch`: embedding lookups and the loss's targets
    checked for real. A model that cannot run on the meta device is skipped (logged): the trace
    that follows meets the same error, or the real run's first forward pass the same checks."""
    inputs = inputs_of(batch)
    hooks = watch_lookups(model, lambda: inputs)
    try:
        with torch.random.fork_rng(devices=[]), IntegerValues():
            outputs = call_model(model, batch, loss.passes_labels)
    except ValueError:
        raise
    except Exception as error:  # meta tensors cannot do everything
        log.warning("memexp estimate: the checks before tracing could not run %s on the meta "
                    "device (%s: %s); tracing without them", type(model).__name__,
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return
    finally:
        for hook in hooks:
            hook.remove()
    loss.check(outputs, batch)
