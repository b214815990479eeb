"""The output head of a language model, for a loss that applies it itself (loss=chunked_ce).

Found once, by what the model is: a Hugging Face model's `get_output_embeddings()` (GPT-2's tied
`lm_head`, Llama's own, BERT's masked-LM decoder), memexp's Transformer's `head`. Its place in
the model then holds a `DeferredHead`, which hands the head's input on: the model's own forward
returns the last hidden states in place of the logits, and never computes them whole.

What the model's forward does to its head's output before returning it (Gemma 2's soft cap
`tanh(x / cap) * cap`, Cohere's `* logit_scale`, Granite's `/ logits_scaling`) would then be
done to the hidden states. So from the head's call to the forward's end every step taken on its
output is held back and recorded instead (`PostHead`), for the loss to take on each chunk of
logits: read from what the model does, every forward, not from a list of models. A step is
taken on a chunk only where that gives the chunk's rows of what it gives the whole logits: an
elementwise op (its aten ops tagged pointwise, or a cast) whose other operands are the same for
every token. Anything else is refused as the model runs it, naming the step and the model.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from memexp.linear_cross_entropy import compute_dtype
from memexp.models.blocks import Wrapper, replace_module
from memexp.models.transformer import Transformer

log = logging.getLogger("memexp")

# Queries whose answer for the held-back output is the head's input's, not the logits': where
# they live and whether autograd follows them. Every other query (shape, dtype) is answered as
# the logits would answer it.
SAME_AS_INPUT = (Tensor.device.__get__, Tensor.is_cuda.__get__, Tensor.is_cpu.__get__,
                 Tensor.get_device, Tensor.requires_grad.__get__)


@dataclass(frozen=True)
class Ref:
    """A step's operand that is an earlier value of the program (0: the head's output)."""

    index: int


@dataclass
class Step:
    """One call the model made on its head's output: `func` on `flat` (its arguments, pytree
    leaves, the program's own values as Refs), rebuilt by `spec`."""

    func: Callable
    flat: list
    spec: Any
    in_place: bool

    def name(self) -> str:
        return resolve_name(self.func) or getattr(self.func, "__name__", repr(self.func))


@dataclass
class PostHead:
    """What a forward did to its head's output before returning it as the logits: `steps`, and
    which value it returned (`output`; 0: the head's output itself; None: the logits it returned
    are not its head's output), to be taken again on each chunk's logits (`__call__`), under the
    autocast the forward ran them in."""

    steps: list[Step] = field(default_factory=list)
    output: int | None = 0
    autocast: tuple[str, torch.dtype | None, bool] = ("cpu", None, False)

    def needed(self) -> list[int]:
        """The steps the returned value depends on, in order."""
        wanted = {self.output}
        for index in range(len(self.steps), 0, -1):
            if index in wanted:
                wanted.update(ref.index for ref in self.steps[index - 1].flat
                              if isinstance(ref, Ref))
        return [index for index in range(1, len(self.steps) + 1) if index in wanted]

    def __bool__(self) -> bool:
        """Whether the logits the model returned are more than its head's output."""
        return bool(self.output)  # (None: refused before it is asked: Head.program)

    def describe(self) -> str:
        return ", ".join(self.steps[index - 1].name() for index in self.needed())

    def __call__(self, logits: Tensor) -> Tensor:
        needed = self.needed()
        # An in-place step would change the chunk's logits themselves, which the loss holds
        # (a leaf, where it asks autograd for their gradient): it changes a copy.
        start = logits.clone() if any(self.steps[i - 1].in_place for i in needed) else logits
        values = {0: start}
        device, dtype, enabled = self.autocast
        autocast = (torch.autocast(device, dtype, enabled=True) if enabled
                    else contextlib.nullcontext())
        with autocast:
            for index in needed:
                step = self.steps[index - 1]
                flat = [values[x.index] if isinstance(x, Ref) else x for x in step.flat]
                args, kwargs = tree_unflatten(flat, step.spec)
                values[index] = step.func(*args, **kwargs)
        # (rows, classes): an operand of shape (1, 1, classes) broadcasts a chunk's rows to
        # (1, rows, classes), the same values
        return values[self.output].reshape(logits.shape)


class AtenOps(TorchDispatchMode):
    """The aten ops a call runs (on meta tensors: shapes only)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, kwargs or {}))
        return func(*args, **(kwargs or {}))


def meta_like(tensor: Tensor) -> Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def elementwise(func, kwargs: dict) -> bool:
    """An aten op that computes each element from the same element of its operands: tagged
    pointwise, or a cast of the dtype alone."""
    if torch.Tag.pointwise in func.tags:
        return True
    return (func is torch.ops.aten._to_copy.default
            and kwargs.get("device") in (None, torch.device("meta"))
            and kwargs.get("layout") in (None, torch.strided))


class Recorder(TorchFunctionMode):
    """From the head's call to the end of the model's forward: each call on the head's output
    (or on a value made from it) is checked on meta tensors of the logits' shape and dtype,
    recorded, and answered with a view of the head's input standing for its result."""

    def __init__(self, head: DeferredHead, hidden: Tensor):
        super().__init__()
        self.head, self.hidden = head, hidden
        # the values standing for the program's, by id: (a weak reference, the value's index)
        self.tracked: dict[int, tuple[weakref.ref, int]] = {}
        with _disable_current_modes():
            logits = torch.empty((*hidden.shape[:-1], head.classes),
                                 dtype=compute_dtype(hidden), device="meta")
        self.shadows: list[Tensor] = [logits]  # each value's shape and dtype, on meta
        self.steps: list[Step] = []
        device = hidden.device.type
        on = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        self.autocast = (device, torch.get_autocast_dtype(device) if on else None, on)

    def stand_in(self, index: int) -> Tensor:
        value = self.hidden.view_as(self.hidden)
        self.tracked[id(value)] = (weakref.ref(value), index)
        return value

    def index(self, value: Any) -> int | None:
        entry = self.tracked.get(id(value)) if isinstance(value, Tensor) else None
        return entry[1] if entry is not None and entry[0]() is value else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        found = [self.index(x) for x in flat]
        if all(index is None for index in found):
            return func(*args, **kwargs)
        if func in SAME_AS_INPUT:
            return func(*args, **kwargs)
        key = self.signature(func, spec, flat, found)
        checked = self.head.checked.get(key) if key is not None else None
        if checked is None:
            checked = self.check(func, spec, flat, found)
            if key is not None:  # the same call every forward: checked once
                self.head.checked[key] = checked
        out, why, in_place, returned = checked
        if why is not None:
            self.refuse(func, why)
        if not isinstance(out, Tensor):  # a query: shape and dtype as the logits'
            return out
        self.steps.append(Step(func, [Ref(index) if index is not None else x
                                      for x, index in zip(flat, found, strict=True)],
                               spec, in_place))
        self.shadows.append(out)
        index = len(self.steps)
        if returned is not None:
            # The call returned one of its operands (in place, or a cast to the dtype it has):
            # the model holds that same tensor, which now stands for the new value.
            self.tracked[id(flat[returned])] = (weakref.ref(flat[returned]), index)
            return flat[returned]
        return self.stand_in(index)

    def signature(self, func, spec, flat: list, found: list) -> tuple | None:
        """What a call's check depends on: the function, and its operands' shapes and dtypes
        (the program's values by their shadows'), its other arguments by value; None where one
        cannot be told by value (not hashable)."""
        leaves = []
        for x, index in zip(flat, found, strict=True):
            if index is not None:
                shadow = self.shadows[index]
                leaves.append((Ref, shadow.shape, shadow.dtype))
            elif isinstance(x, Tensor):
                leaves.append((Tensor, x.shape, x.dtype, x.requires_grad))
            else:
                try:
                    hash(x)
                except TypeError:
                    return None
                leaves.append((type(x), x))
        return func, spec, tuple(leaves)

    def check(self, func, spec, flat: list, found: list) -> tuple:
        """The call run on meta tensors of the logits' shape and dtype: what it gives (a
        shadow, or a query's answer), why no chunk can take it (or None), whether it changes
        an operand in place, and which operand it returns as its result (or None)."""
        shadowed = [self.shadows[index] if index is not None
                    else meta_like(x) if isinstance(x, Tensor) else x
                    for x, index in zip(flat, found, strict=True)]
        with _disable_current_modes(), AtenOps() as aten:
            try:
                margs, mkwargs = tree_unflatten(shadowed, spec)
                out = func(*margs, **mkwargs)
            except Exception as error:  # the logits' values, which meta tensors do not have
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                return None, (f"cannot be taken on their shape and dtype alone "
                              f"({type(error).__name__}: {first})"), False, None
        if not any(isinstance(x, Tensor) for x in tree_flatten(out)[0]):
            return out, None, False, None
        why = self.unreproducible(out, aten.ops, flat, found)
        in_place = any(op._schema.is_mutable for op, _ in aten.ops)
        returned = next((position for position, (shadow, index)
                         in enumerate(zip(shadowed, found, strict=True))
                         if shadow is out and index is not None), None)
        return out, why, in_place, returned

    def unreproducible(self, out: Any, ops: list, flat: list, found: list) -> str | None:
        """Why the call, taken on each chunk of rows, would not give those rows of what it gives
        the whole logits; None where it would."""
        logits = self.shadows[0]
        if not isinstance(out, Tensor):
            return "returns several tensors"
        if out.shape != logits.shape:
            return (f"makes a tensor of shape {tuple(out.shape)} from logits of shape "
                    f"{tuple(logits.shape)}")
        for func, kwargs in ops:
            if not elementwise(func, kwargs):
                return f"runs {func} (not elementwise)"
        for x, index in zip(flat, found, strict=True):
            if index is not None or not isinstance(x, Tensor):
                continue
            if x.requires_grad:
                return (f"takes a trainable operand (shape {tuple(x.shape)}), whose gradient "
                        "the chunked loss does not compute")
            if any(size != 1 for size in x.shape[:-1]):
                return f"takes an operand of shape {tuple(x.shape)} that differs between tokens"
        return None

    def refuse(self, func, why: str) -> None:
        head = self.head
        raise ValueError(
            f"{head.key}: after its output head {head.name}, {head.owner}'s forward takes "
            f"{resolve_name(func) or func} on the logits, which {why}. The chunked loss computes "
            "the logits a chunk of tokens at a time, and takes on each chunk only elementwise "
            "steps whose other operands are the same for every token (a scale, a soft cap, a "
            "bias per class). Use loss=model or loss=cross_entropy with this model")

    def program(self, logits: Any) -> PostHead:
        return PostHead(self.steps, self.index(logits), self.autocast)


class DeferredHead(Wrapper):
    """Holds the head (its parameters stay the model's, tied ones included) and returns its
    input: the loss applies the head, a chunk of tokens at a time. What the forward does to that
    output after the call is recorded (`Recorder`) until the model returns (`finish`)."""

    def __init__(self, inner: nn.Module, name: str, owner: str, key: str):
        super().__init__(inner)
        self.name, self.owner, self.key = name, owner, key
        self.classes = inner.out_features
        # each distinct call on the head's output, checked (Recorder.check): by its signature
        self.checked: dict[tuple, tuple] = {}
        self.recorder: Recorder | None = None
        # the last forward's PostHead, or None where it did not call the head
        self.post: PostHead | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        if self.recorder is not None:
            raise ValueError(
                f"{self.key}: {self.owner}'s forward calls its output head {self.name} more "
                "than once, and the chunked loss applies it to one output. Use loss=model or "
                "loss=cross_entropy with this model")
        self.recorder = Recorder(self, hidden)
        output = self.recorder.stand_in(0)
        self.recorder.__enter__()
        return output

    def finish(self, logits: Any) -> None:
        """The model's forward has ended (or raised), returning `logits`."""
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            self.post = None
            return
        recorder.__exit__(None, None, None)
        self.post = recorder.program(logits)


@dataclass
class Head:
    name: str
    linear: nn.Linear  # the model's head itself: its weight as the optimizer and precision see it
    deferred: DeferredHead

    @property
    def module(self) -> nn.Module:
        """The head as it is now: the Linear, or an adapter's layer around it (adapter=lora)."""
        return self.deferred.inner

    @property
    def plain(self) -> bool:
        """Whether the head computes its Linear's function alone (an adapter's layer adds its
        own)."""
        return type(self.module).forward is nn.Linear.forward

    def program(self) -> PostHead:
        """What the last forward did to the head's output: a refusal where the logits it
        returned were not that output."""
        post, deferred = self.deferred.post, self.deferred
        if post is None or post.output is None:
            raise ValueError(
                f"{deferred.key}: {deferred.owner}'s forward "
                + ("never called its output head " if post is None else
                   "returned logits that are not made from its output head ")
                + f"{self.name}: the chunked loss would take its place, and the model's logits "
                "come from elsewhere. Use loss=model or loss=cross_entropy with this model")
        return post

    def describe(self) -> str:
        linear = self.linear
        return (f"{self.name} ({type(linear).__name__} {linear.in_features} -> "
                f"{linear.out_features}, bias {linear.bias is not None})")


def find_head(model: nn.Module, key: str) -> nn.Module | None:
    """The output head of memexp's Transformer or of a Hugging Face model that has one."""
    if isinstance(model, Transformer):
        return model.head
    # A Hugging Face model exists only once transformers is imported (memexp.models.hf).
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        if model.config.is_encoder_decoder:
            raise ValueError(
                f"{key}: {type(model).__name__}'s decoder takes its inputs from the labels, "
                "which only its own loss passes in: use loss=model")
        return model.get_output_embeddings()
    raise ValueError(
        f"{key} applies the model's output head itself, and {type(model).__name__} is neither a "
        "Hugging Face model (model=hf) nor memexp's transformer (model=transformer), whose "
        "heads it finds. Use loss=cross_entropy, or one of those models")


def defer_head(model: nn.Module, key: str, returned: Callable[[Any], Tensor | None]) -> Head:
    """Find the model's output head and put a DeferredHead in its place; `returned` reads the
    logits from what the model's forward returns."""
    head = find_head(model, key)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{key} needs an output head of vocabulary logits (an nn.Linear), and "
            f"{type(model).__name__} has {'none' if head is None else type(head).__name__}: a "
            "task with a language-model head does (model.task=causal_lm or masked_lm). Use "
            "loss=cross_entropy or loss=model for this model")
    name = next(name for name, module in model.named_modules() if module is head)
    deferred = DeferredHead(head, name, type(model).__name__, key)
    replace_module(model, name, deferred)

    def finish(model: nn.Module, args, output) -> None:
        # (output is None where the forward raised: the recording ends all the same)
        logits = None
        try:
            logits = None if output is None else returned(output)
        finally:
            deferred.finish(logits)

    # always_call: the recording ends with the forward, even one that raised
    model.register_forward_hook(finish, always_call=True)
    found = Head(name, head, deferred)
    log.info("%s: output head %s", key, found.describe())
    return found
