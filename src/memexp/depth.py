"""A deep model's estimate from shallower copies of it: its repeated blocks cut to 2, 3 and 4,
each copy traced, and every figure extrapolated to the model's own depth (memexp plan).

The blocks are memexp.models.blocks' `[auto]`: the copy is the model with the container of its
blocks cut short (`cut_model`, built in place of the model by `shallow_config`), which needs the
blocks to be alike (one class, the same submodules, parameter and buffer shapes and dtypes, none
shared) and to fill one container in order (`repeats` says why not, where they do not).

Every figure of a copy's estimate must then be exactly affine in its depth, and is checked to be:
its second difference over the three depths is 0, or the model's own depth is traced instead.
That is not enough for the peaks. A phase's peak is the largest of many moments' live bytes,
each affine in the depth but not with the same slope: a moment that comes second at 4 blocks
can come first at 32. So the traces are followed moment by moment (Trail, which the live-storage
tracker tells of each op and each count: memexp.memory.tracker.followed), each moment labelled
by the block that made it: in forward and evaluation by the block running (module hooks), in
backward by the block whose autograd node runs (each node created in a block's forward carries
its index), in the optimizer step by the block whose parameters, gradients or state the op
reads. Each moment of the model's own depth is then known: the ones outside the blocks, the
first block's (which may differ: its input needs no gradient), and any other block's, affine in
its position among the blocks and in the depth (checked on the six such blocks the copies have),
of which the largest is the second's or the last's. The peak of each phase is the largest of
them, and its breakdown is the copies' breakdowns extrapolated, where the copies' peaks were at
the same moment (the same block, counted from the same end, and the same op within it).
Anything the labels cannot follow (blocks run out of order, a moment missing at one depth, a
figure not affine, a rank whose share of the state moves with the depth) sends the candidate to
a full trace: an extrapolated estimate is the full trace's to the byte or is not made
(tests/test_plan.py checks random candidates).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils._pytree import tree_leaves

from memexp import registry
from memexp.build import build_model
from memexp.estimate import Estimate, estimate
from memexp.memory.tracker import ACTIVATION_PHASES, IDLE, Follower, followed, tensor_storages
from memexp.models.blocks import AUTO, resolve_blocks
from memexp.steptime import extrapolation_doubt

# The depths a model is cut to: the first block differs from the others (its input needs no
# gradient where the embedding is frozen), so three depths from 2 give the first block at three
# depths and six others, enough to check that each moment is affine in both the block's place
# and the depth.
DEPTHS = (2, 3, 4)
# The block index an autograd node was created in, in its metadata.
_KEY = "memexp.depth.block"
# Estimate fields that are not figures of the run: how long the trace took.
_NOT_FIGURES = ("seconds",)
# The memory figures that are maxima over the run's moments, which Trail follows.
_RUNNING = {"activations_peak_bytes": "activations", "grads_peak_bytes": "grads",
            "offloaded_peak_bytes": "host"}


class NotAlike(Exception):
    """Why a candidate's copies cannot give its figures: it is traced at its own depth."""


@dataclass(frozen=True)
class Repeats:
    """A model's blocks as its depth can be cut: `count` alike modules of class `kind`, filling
    the container `container` in order."""

    container: str
    count: int
    kind: str

    def describe(self) -> str:
        return f"{self.kind} x{self.count} in {self.container}"


def repeats(model: nn.Module) -> Repeats | str:
    """`model`'s blocks ([auto]) where its depth can be cut, or why it cannot."""
    try:
        found = resolve_blocks(model, [AUTO], "blocks")
    except ValueError:
        return "it has no repeated blocks (memexp.models.blocks [auto] finds none)"
    parents = list(dict.fromkeys(name.rpartition(".")[0] for name in found.names))
    if len(parents) > 1:
        return f"its blocks ({found.describe()}) are held in {len(parents)} containers"
    container = model.get_submodule(parents[0])
    held = list(container._modules.values())
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or held != found.modules:
        return (f"its blocks ({found.describe()}) are not the whole of "
                f"{parents[0] or 'the model'}")
    if len({id(block) for block in found.modules}) < len(found.modules):
        return f"a block of {found.describe()} is held in several places"
    first = _layout(found.modules[0])
    if any(_layout(block) != first for block in found.modules[1:]):
        return f"its blocks ({found.describe()}) differ in their modules, shapes or dtypes"
    inside = {id(p) for block in found.modules for p in block.parameters()}
    per_block = sum(len(list(block.parameters())) for block in found.modules)
    outside = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
               if not any(name.startswith(f"{block}.") for block in found.names)}
    if len(inside) < per_block or inside & outside:
        return f"its blocks ({found.describe()}) share parameters"
    return Repeats(parents[0], len(found.modules), type(found.modules[0]).__name__)


def _layout(block: nn.Module) -> tuple:
    """What makes two blocks alike: their modules' classes, their parameters' and buffers'
    shapes, dtypes and whether they train."""
    return ([(name, type(module)) for name, module in block.named_modules()],
            [(name, tuple(p.shape), p.dtype, p.requires_grad)
             for name, p in block.named_parameters()],
            [(name, tuple(b.shape), b.dtype) for name, b in block.named_buffers()])


def shallow_config(cfg: DictConfig, keep: int) -> DictConfig:
    """`cfg` with its model cut to its first `keep` blocks (cut_model builds it)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["model"] = {"_target_": f"{__name__}.cut_model", "_recursive_": False,
                      "model": plain["model"], "keep": keep}
    return OmegaConf.create(plain)


def cut_model(model: DictConfig, keep: int) -> nn.Module:
    """The model `model` configures, its blocks cut to the first `keep`; each block tells the
    Trail that follows a trace when it runs."""
    built = build_model(model)
    found = repeats(built)
    if isinstance(found, str):
        raise NotAlike(f"the model's depth cannot be cut: {found}")
    container = built.get_submodule(found.container)
    for index, block in enumerate(list(container)[:keep]):
        block.register_forward_pre_hook(functools.partial(_block_entered, index),
                                        with_kwargs=True)
        block.register_forward_hook(functools.partial(_block_left, index), with_kwargs=True)
    del container[keep:]
    return built


# The Trail following the trace in this process (traced_by_block).
_TRAIL: Trail | None = None


def _block_entered(index: int, module: nn.Module, args, kwargs) -> None:
    if _TRAIL is not None:
        _TRAIL.block_entered(index, module, args, kwargs)


def _block_left(index: int, module: nn.Module, args, kwargs, output) -> None:
    if _TRAIL is not None:
        _TRAIL.block_left(index, output)


class _Segment:
    """A run of moments with one label (a block's index, or None outside the blocks): the live
    bytes at each candidate for a phase's peak, and the largest activations, gradients and host
    bytes reached."""

    __slots__ = ("label", "values", "activations", "grads", "host")

    def __init__(self, label: int | None):
        self.label = label
        self.values: list[int] = []
        self.activations = self.grads = self.host = None


def _merged(segments: list[_Segment]) -> tuple:
    """Consecutive segments as one: their values in order, the largest of each maximum."""
    values = [value for segment in segments for value in segment.values]
    maxima = [max((getattr(s, kind) for s in segments if getattr(s, kind) is not None),
                  default=None) for kind in ("activations", "grads", "host")]
    return (values, *maxima)


def _resolved(segments: list[_Segment]) -> list[tuple[int | None, list[_Segment]]]:
    """`segments` grouped by label, those of ops on no tensor the trail knows (_PENDING: a new
    scalar of the optimizer's state, made before the op that reads it with its parameter) in
    the group that follows them; at the end, outside the blocks."""
    groups: list[tuple[int | None, list[_Segment]]] = []
    waiting: list[_Segment] = []
    for segment in segments:
        if segment.label is _PENDING:
            waiting.append(segment)
        elif groups and groups[-1][0] == segment.label:
            groups[-1][1].extend([*waiting, segment])
            waiting = []
        else:
            groups.append((segment.label, [*waiting, segment]))
            waiting = []
    if waiting:
        groups.append((None, waiting))
    return groups


@dataclass
class _Occurrence:
    phase: str
    segments: list[_Segment] = field(default_factory=list)


# How each phase's moments are labelled: by the block running (its hooks), by the block whose
# autograd node runs, by the block whose tensors the op reads, or not at all.
_MODES = {"forward": "hooks", "eval": "hooks", "backward": "nodes", "optimizer": "owners"}
_PENDING = "pending"  # the label of an op whose block the next op's tells


class Trail(Follower):
    """One trace's moments, in order, by phase entered and by block (see the module's doc):
    the tracker tells it of each op, each count that grows and each candidate for a peak."""

    def __init__(self):
        self.tracker = None
        self.occurrences = [_Occurrence(IDLE)]  # the trainer built
        self.saved: list[int] = []  # activations alive at the end of each forward pass
        self.label: int | None = None
        self.mode = "none"
        self.blocks: dict[int, nn.Module] = {}
        self.inputs: dict[int, list] = {}  # the autograd nodes of a running block's inputs
        # storage id -> (its record, the block whose tensors it was made from, or None)
        self.owners: dict[int, tuple[object, int]] = {}

    # -- told by the tracker -----------------------------------------------------------------
    def op(self, tracker, func, args, kwargs) -> None:
        if self.mode != "owners":
            return
        owners = set()
        for leaf in tree_leaves((args, kwargs)):
            if not isinstance(leaf, torch.Tensor):
                continue
            for storage in tensor_storages(leaf):
                held = self.owners.get(id(storage))
                if held is not None and tracker._live.get(id(storage)) is held[0]:
                    owners.add(held[1])
        blocks = owners - {None}
        # An op on no tensor the trail knows (a new scalar of the state) is the next op's.
        self.label = (_PENDING if not owners else blocks.pop() if len(blocks) == 1 else None)

    def added(self, tracker, record, nbytes: int) -> None:
        if nbytes <= 0:
            return
        segment = self._segment(tracker)
        if record.host:
            segment.host = max(segment.host or 0, tracker.host_current)
        elif record.phase in ACTIVATION_PHASES:
            segment.activations = max(segment.activations or 0, tracker.activations_current)
        if self.mode == "owners" and record.born == tracker._clock and self.label is not _PENDING:
            self.owners[record.ref.key] = (record, self.label)

    def added_grad(self, tracker, nbytes: int) -> None:
        if nbytes > 0:
            segment = self._segment(tracker)
            segment.grads = max(segment.grads or 0, tracker.grads_current)

    def candidate(self, tracker) -> None:
        self._segment(tracker).values.append(tracker.current)

    def entering(self, tracker, phase: str) -> None:
        self._follow(tracker)
        if tracker.phase == "forward":
            self.saved.append(tracker.activations_current)
        self.occurrences.append(_Occurrence(phase))
        self.label, self.mode = None, _MODES.get(phase, "none")
        if self.mode == "owners":
            # The blocks' parameters and gradients, as they are now; everything else alive
            # that no block made is outside them (the other parameters, their gradients).
            for key, record in tracker._live.items():
                held = self.owners.get(key)
                if held is None or held[0] is not record:
                    self.owners[key] = (record, None)
            for index, block in self.blocks.items():
                for param in block.parameters():
                    for tensor in (param, param.grad):
                        for storage in tensor_storages(tensor) if tensor is not None else ():
                            record = tracker._live.get(id(storage))
                            if record is not None:
                                self.owners[id(storage)] = (record, index)

    # -- told by the blocks' hooks -------------------------------------------------------------
    def block_entered(self, index: int, module: nn.Module, args, kwargs) -> None:
        self.blocks[index] = module
        if self.mode != "hooks":  # a block recomputed in backward is labelled by its nodes
            return
        self.label = index
        if self.occurrences[-1].phase == "forward":
            self.inputs[index] = [leaf.grad_fn for leaf in tree_leaves((args, kwargs))
                                  if isinstance(leaf, torch.Tensor)
                                  and leaf.grad_fn is not None]

    def block_left(self, index: int, output) -> None:
        if self.mode != "hooks":
            return
        self.label = None
        # Every autograd node the block's forward made: from its outputs back to its inputs.
        stop = {id(node) for node in self.inputs.pop(index, ())}
        nodes = [leaf.grad_fn for leaf in tree_leaves(output)
                 if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
        while nodes:
            node = nodes.pop()
            if node is None or id(node) in stop or _KEY in node.metadata:
                continue
            node.metadata[_KEY] = index
            nodes.extend(following for following, _ in node.next_functions)

    # -- ----------------------------------------------------------------------------------------
    def _follow(self, tracker) -> None:
        if self.tracker is None:
            self.tracker = tracker
        elif tracker is not self.tracker:
            raise NotAlike("the estimate traced more than one process (a second rank, or an "
                           "unbalanced routing beside the even one)")

    def _segment(self, tracker) -> _Segment:
        self._follow(tracker)
        if self.mode == "nodes":
            node = torch._C._current_autograd_node()
            if node is not None:
                label = node.metadata.get(_KEY)
                if label is not None:
                    self.label = label
        segments = self.occurrences[-1].segments
        if not segments or segments[-1].label != self.label:
            segments.append(_Segment(self.label))
        return segments[-1]

    # -- afterwards ------------------------------------------------------------------------------
    def canonical(self, depth: int) -> dict:
        """The trail as the extrapolation reads it: for each phase entered, in order, its
        passes over the blocks (each: the moments before the first block, each block's, and
        those after the last), the moments of a phase that ran no block, and the activations at
        each forward pass's end. Moments outside the blocks between two of them count as the
        next block's."""
        occurrences = []
        for occurrence in self.occurrences:
            passes, pending = [], []
            for label, segments in _resolved(occurrence.segments):
                if label is None:
                    pending += segments
                    continue
                segment = _Segment(label)  # the group's moments, as one segment's
                segment.values, segment.activations, segment.grads, segment.host = (
                    _merged(segments))
                if not passes or len(passes[-1]["blocks"]) == depth:
                    if passes and pending:
                        passes[-1]["post"] = _merged(pending)
                        pending = []
                    ascending = segment.label == 0
                    if segment.label != (0 if ascending else depth - 1):
                        raise NotAlike(f"{occurrence.phase} ran block {segment.label} first")
                    passes.append({"step": 1 if ascending else -1, "pre": _merged(pending),
                                   "blocks": [], "post": _merged([])})
                    pending = []
                run = passes[-1]
                expected = (run["blocks"][-1][0] + run["step"] if run["blocks"] else
                            segment.label)
                if segment.label != expected:
                    raise NotAlike(f"{occurrence.phase} ran block {segment.label} where block "
                                   f"{expected} was next")
                run["blocks"].append((segment.label, _merged([*pending, segment])))
                pending = []
            if passes and len(passes[-1]["blocks"]) != depth:
                raise NotAlike(f"{occurrence.phase} ran {len(passes[-1]['blocks'])} of the "
                               f"{depth} blocks")
            if passes and pending:
                passes[-1]["post"] = _merged(pending)
            for run in passes:  # by block index, whichever way they ran
                run["blocks"] = [data for _, data in sorted(run["blocks"])]
            occurrences.append({"phase": occurrence.phase, "passes": passes,
                                "alone": None if passes else _merged(pending)})
        return {"depth": depth, "occurrences": occurrences, "saved": list(self.saved)}


@contextmanager
def traced_by_block():
    """A Trail of the trace run inside (of a model built by cut_model)."""
    global _TRAIL
    trail = Trail()
    _TRAIL = trail
    try:
        with followed(trail):
            yield trail
    finally:
        _TRAIL = None


# -- extrapolation ---------------------------------------------------------------------------
def _line(values: list, depths: tuple[int, ...], to: int):
    """The value at depth `to` of the line through `values` at `depths` (consecutive); None
    where they are all None. Not on a line: NotAlike."""
    if all(value is None for value in values):
        return None
    if any(value is None for value in values):
        raise NotAlike("a moment is at some depths only")
    steps = {b - a for a, b in zip(values, values[1:], strict=False)}
    if len(steps) != 1:
        raise NotAlike(f"{values} at depths {depths} is not affine in the depth")
    return values[0] + (to - depths[0]) * steps.pop()


class _Blocks:
    """One moment (the same op) of every block: c + a x index + b x depth, the first block and
    the last each offset by a constant of its own (the first's input needs no gradient where
    the embedding is frozen; the last prefetches no next block under FSDP). Fitted to the inner
    blocks of the two deeper copies, and checked on every block of all three: the first and
    the last check the slopes the inner blocks give. `start` 1: the first block has other
    moments, and is left out (a part of its own); `stop` 1: so has the last."""

    def __init__(self, by_depth: dict[int, list], start: int, stop: int = 0):
        values = [value for row in by_depth.values() for value in row]
        self.none = all(value is None for value in values)
        if self.none:
            return
        if any(value is None for value in values):
            raise NotAlike("a block's moment is at some depths only")
        shallow, middle, deep = sorted(by_depth)

        def value(index: int, depth: int) -> int:
            return by_depth[depth][index - start]

        self.a = value(2, deep) - value(1, deep)
        self.b = value(1, deep) - value(1, middle)
        self.c = value(1, middle) - self.a - middle * self.b
        self.first = value(0, shallow) - self._inner(0, shallow) if start == 0 else 0
        self.last = (value(shallow - 1, shallow) - self._inner(shallow - 1, shallow)
                     if stop == 0 else 0)
        for depth, row in by_depth.items():
            for index, found in enumerate(row, start):
                if self.at(index, depth) != found:
                    raise NotAlike(f"block {index}'s moment at depth {depth} is off the line of "
                                   "the others'")

    def _inner(self, index: int, depth: int) -> int:
        return self.c + self.a * index + self.b * depth

    def at(self, index: int, depth: int) -> int | None:
        if self.none:
            return None
        return (self._inner(index, depth) + (self.first if index == 0 else 0)
                + (self.last if index == depth - 1 else 0))


def _block_names(index: int, depth: int) -> frozenset[str]:
    """What a block is called at `depth` (at 2 blocks, block 0 is the first and the second to
    last)."""
    names = {name for name, at in (("first", 0), ("second", 1), ("second to last", depth - 2),
                                   ("last", depth - 1)) if at == index}
    return frozenset(names or {f"block {index}"})


@dataclass
class _Moment:
    """A moment of the model's own depth: its live bytes, when it comes, and where it is."""

    value: int
    when: tuple
    where: tuple  # (occurrence, pass, part, block: "first", "second" or "last"; ordinal)


def _moments(trails: list[dict], depths: tuple[int, ...], to: int) -> tuple[dict, dict]:
    """Every moment of the model at depth `to` that can be a phase's peak, by phase (of the
    blocks, the first, the second, the second to last and the last: the inner blocks' largest
    is one of the two at their ends), and the largest activations, gradients and host bytes
    reached, by kind."""
    shapes = [[(o["phase"], len(o["passes"]), o["alone"] is None) for o in trail["occurrences"]]
              for trail in trails]
    if any(shape != shapes[0] for shape in shapes):
        raise NotAlike("the phases ran differently at different depths")
    by_phase: dict[str, list[_Moment]] = {}
    running = {kind: [] for kind in ("activations", "grads", "host")}

    def fixed(datas: list[tuple], when: Callable[[int], tuple], where: tuple, phase: str):
        values = [data[0] for data in datas]
        if len({len(v) for v in values}) != 1:
            raise NotAlike(f"{phase}: a part outside the blocks has different moments at "
                           "different depths")
        for ordinal, at in enumerate(zip(*values, strict=True)):
            by_phase.setdefault(phase, []).append(
                _Moment(_line(list(at), depths, to), when(ordinal), (*where, ordinal)))
        for position, kind in enumerate(running, 1):
            value = _line([data[position] for data in datas], depths, to)
            if value is not None:
                running[kind].append(value)

    for number, occurrences in enumerate(zip(*(t["occurrences"] for t in trails),
                                             strict=True)):
        phase = occurrences[0]["phase"]
        if occurrences[0]["alone"] is not None:
            fixed([o["alone"] for o in occurrences], lambda n, c=number: (c, 0, -1, n),
                  (number, 0, "alone", None), phase)
        for run, passes in enumerate(zip(*(o["passes"] for o in occurrences), strict=True)):
            step = passes[0]["step"]
            if any(p["step"] != step for p in passes):
                raise NotAlike(f"{phase} ran its blocks in another order at another depth")
            fixed([p["pre"] for p in passes], lambda n, c=number, r=run: (c, r, -1, n),
                  (number, run, "pre", None), phase)
            fixed([p["post"] for p in passes], lambda n, c=number, r=run: (c, r, to, n),
                  (number, run, "post", None), phase)
            blocks = {depth: p["blocks"] for depth, p in zip(depths, passes, strict=True)}
            counts = {depth: [len(block[0]) for block in row] for depth, row in blocks.items()}
            # The first block may run other ops (no gradient for its input): a part of its own.
            start = 0 if len({n for row in counts.values() for n in row}) == 1 else 1
            if start:
                fixed([row[0] for row in blocks.values()],
                      lambda n, c=number, r=run, s=step: (c, r, 0 if s > 0 else to - 1, n),
                      (number, run, "block", "first"), phase)
            # So may the last (the first to run in the first backward, where DDP makes its
            # gradient buckets as the first gradients come)
            stop = 0 if len({n for row in counts.values() for n in row[start:]}) == 1 else 1
            if stop:
                fixed([row[-1] for row in blocks.values()],
                      lambda n, c=number, r=run, s=step: (c, r, to - 1 if s > 0 else 0, n),
                      (number, run, "block", "last"), phase)
            inner = {n for row in counts.values() for n in row[start:len(row) - stop]}
            if len(inner) != 1:
                raise NotAlike(f"{phase}: its blocks have different moments")
            indices = _ends(start, stop, to)
            for ordinal in range(inner.pop()):
                line = _Blocks({depth: [block[0][ordinal] for block in row[start:len(row) - stop]]
                                for depth, row in blocks.items()}, start, stop)
                for index in indices:
                    (name,) = _block_names(index, to) & {"first", "second", "second to last",
                                                         "last"}
                    position = index if step > 0 else to - 1 - index
                    by_phase.setdefault(phase, []).append(_Moment(
                        line.at(index, to), (number, run, position, ordinal),
                        (number, run, "block", name, ordinal)))
            for position, kind in enumerate(running, 1):
                # The first block and the last may each reach a running maximum where the
                # inner blocks do not, or the reverse (full_offload moves the first block's
                # input to the host before it, each later block's in it): then a part of its
                # own for that kind.
                first = start or _apart(blocks, position, 0, stop)
                last = stop or _apart(blocks, position, -1, first)
                for edge, own in ((0, first > start), (-1, last > stop)):
                    if own:
                        value = _line([row[edge][position] for row in blocks.values()],
                                      depths, to)
                        running[kind] += [] if value is None else [value]
                line = _Blocks({depth: [block[position] for block in row[first:len(row) - last]]
                                for depth, row in blocks.items()}, first, last)
                running[kind] += [value for value in (line.at(index, to)
                                                      for index in _ends(first, last, to))
                                  if value is not None]
    return by_phase, running


def _ends(start: int, stop: int, to: int) -> list[int]:
    """The blocks of the model at depth `to` whose moments can be the largest of the blocks
    between the parts of their own (`start` 1: the first is one; `stop` 1: the last): the first
    and the last of that run, and the model's second and second to last."""
    return list(dict.fromkeys((start, 1, to - 2, to - 1 - stop)))


def _apart(blocks: dict[int, list], position: int, edge: int, other: int) -> int:
    """1 where the block at `edge` (0: the first, -1: the last) reaches a running maximum of
    `position`'s kind at some depth where the blocks between it and the other end's `other`
    blocks do not, or does not where they do; else 0."""
    at_edge = {row[edge][position] is None for row in blocks.values()}
    inner = {block[position] is None for row in blocks.values()
             for block in (row[1:len(row) - other] if edge == 0 else row[other:-1])}
    return int(bool(inner) and at_edge != inner)


def _where_at(trail: dict, phase: str, peak: int) -> tuple:
    """Where a copy's phase reached `peak` first, as _Moment.where names it (a block by the
    names its index has: first, second, second to last, last); NotAlike where no moment
    followed did, or one went above it (the trail missed a moment, or saw one the tracker did
    not)."""
    depth = trail["depth"]
    found = None
    for number, occurrence in enumerate(trail["occurrences"]):
        if occurrence["phase"] != phase:
            continue
        parts = []  # (run, kind, block names, moments), in the order they ran
        if occurrence["alone"] is not None:
            parts.append((0, "alone", None, occurrence["alone"][0]))
        for run, data in enumerate(occurrence["passes"]):
            order = range(depth) if data["step"] > 0 else range(depth - 1, -1, -1)
            parts += [(run, "pre", None, data["pre"][0]),
                      *((run, "block", _block_names(index, depth), data["blocks"][index][0])
                        for index in order),
                      (run, "post", None, data["post"][0])]
        for run, kind, name, values in parts:
            for ordinal, value in enumerate(values):
                if value > peak:
                    raise NotAlike(f"a moment of {phase} is above its peak")
                if value == peak and found is None:
                    found = (number, run, kind, name, ordinal)
    if found is None:
        raise NotAlike(f"no moment followed reached {phase}'s peak")
    return found


def _same_where(at_depths: list[tuple], where: tuple) -> bool:
    """Whether the copies' peaks were at the moment `where` of the deep model: the same one,
    a block counted from the same end."""
    number, run, kind, name, ordinal = where
    return all(found[:3] == (number, run, kind) and found[4] == ordinal
               and (found[3] == name if kind != "block" else name in found[3])
               for found in at_depths)


def _affine(values: list, depths: tuple[int, ...], to: int):
    """Every figure of `values` (one object per depth) at depth `to`: numbers on a line,
    anything else the same at every depth."""
    first = values[0]
    if isinstance(first, bool) or first is None or isinstance(first, str):
        if any(value != first for value in values):
            raise NotAlike(f"{values} differ between depths")
        return first
    if isinstance(first, int):
        return _line(values, depths, to)
    if isinstance(first, float):
        steps = [b - a for a, b in zip(values, values[1:], strict=False)]
        if abs(steps[1] - steps[0]) > 1e-9 * max(map(abs, values), default=1.0):
            raise NotAlike(f"{values} at depths {depths} is not affine in the depth")
        return first + (to - depths[0]) * steps[0]
    if isinstance(first, dict):
        if any(set(value) != set(first) for value in values):
            raise NotAlike("a figure's keys differ between depths")
        return {key: _affine([value[key] for value in values], depths, to) for key in first}
    if isinstance(first, (list, tuple)):
        if any(len(value) != len(first) for value in values):
            raise NotAlike("a figure's length differs between depths")
        return type(first)(_affine(list(column), depths, to)
                           for column in zip(*values, strict=True))
    if dataclasses.is_dataclass(first):
        return type(first)(**{f.name: _affine([getattr(v, f.name) for v in values], depths, to)
                              for f in dataclasses.fields(first)})
    if any(value != first for value in values):
        raise NotAlike(f"{values} differ between depths")
    return first


def _memory(memories: list[dict], trails: list[dict], depths: tuple[int, ...],
            to: int) -> dict:
    """The memory section at depth `to`: each phase's peak and breakdown from the moments
    followed, the running maxima, and every other figure on its line."""
    by_phase, running = _moments(trails, depths, to)
    names = list(memories[0]["phases"])
    if any(list(memory["phases"]) != names for memory in memories):
        raise NotAlike("the phases with a peak differ between depths")
    phases = {}
    for name in names:
        peaks = [memory["phases"][name]["peak_bytes"] for memory in memories]
        at_depths = [_where_at(trail, name, peak)
                     for trail, peak in zip(trails, peaks, strict=True)]
        moments = by_phase.get(name, [])
        top = max(moment.value for moment in moments)
        first = min((m for m in moments if m.value == top), key=lambda m: m.when)
        if not _same_where(at_depths, first.where) or _line(peaks, depths, to) != top:
            raise NotAlike(f"{name}'s peak is at another moment at {to} blocks than at "
                           f"{', '.join(map(str, depths))}")
        phases[name] = {"peak_bytes": top, "breakdown": _affine(
            [memory["phases"][name]["breakdown"] for memory in memories], depths, to)}
    memory = _affine([{key: value for key, value in m.items() if key not in (
        "phases", "peak_bytes", "peak_phase", "breakdown_at_peak", "saved_activations_bytes",
        *_RUNNING)} for m in memories], depths, to)
    for key, kind in _RUNNING.items():
        if key in memories[0]:
            for trail_memory, trail in zip(memories, trails, strict=True):
                _check_running(trail, kind, trail_memory[key])
            memory[key] = max(running[kind], default=0)
    if "saved_activations_bytes" in memories[0]:
        saved = [trail["saved"] for trail in trails]
        for trail_memory, values in zip(memories, saved, strict=True):
            if max(values, default=0) != trail_memory["saved_activations_bytes"]:
                raise NotAlike("the forward passes' ends followed miss the saved activations")
        if len({len(values) for values in saved}) != 1:
            raise NotAlike("the forward passes differ between depths")
        memory["saved_activations_bytes"] = max(
            (_line(list(at), depths, to) for at in zip(*saved, strict=True)), default=0)
    memory["phases"] = phases
    peak_phase = max(phases, key=lambda name: phases[name]["peak_bytes"])
    memory.update(peak_bytes=phases[peak_phase]["peak_bytes"], peak_phase=peak_phase,
                  breakdown_at_peak=phases[peak_phase]["breakdown"])
    return {key: memory[key] for key in memories[0]}  # in the report's order


def _check_running(trail: dict, kind: str, figure: int) -> None:
    """That the moments followed reach the tracker's own running maximum of `kind`."""
    position = 1 + ("activations", "grads", "host").index(kind)
    seen = [0]
    for occurrence in trail["occurrences"]:
        parts = [occurrence["alone"]] if occurrence["alone"] is not None else []
        for run in occurrence["passes"]:
            parts += [run["pre"], *run["blocks"], run["post"]]
        seen += [part[position] for part in parts if part[position] is not None]
    if max(seen) != figure:
        raise NotAlike(f"the moments followed miss the {kind}' peak")


def extrapolated(traced: list[tuple[Estimate, dict]], to: int) -> Estimate:
    """The estimate of the model at depth `to` from its copies' (each with its Trail's
    canonical form, at DEPTHS), or NotAlike."""
    depths = tuple(trail["depth"] for _, trail in traced)
    if depths != DEPTHS:
        raise NotAlike(f"copies at {depths}, not {DEPTHS}")
    results = [result for result, _ in traced]
    if any(result.other_rank is not None or result.heaviest_rank != 0 for result in results):
        raise NotAlike("its parallel option gives another rank the most memory")
    # A step time's segments lie on a line at 2 to 4 blocks and may bend beyond: its own check
    doubt = results[0].step_time is not None and extrapolation_doubt(
        [result.step_time for result in results])
    if doubt:
        raise NotAlike(doubt)
    figures = {}
    for spec in dataclasses.fields(Estimate):
        values = [getattr(result, spec.name) for result in results]
        if spec.name == "memory":
            figures["memory"] = _memory(values, [trail for _, trail in traced], depths, to)
        elif spec.name in _NOT_FIGURES:
            figures[spec.name] = sum(values)
        else:
            figures[spec.name] = _affine(values, depths, to)
    return Estimate(**figures)


def extrapolable(cfg: DictConfig) -> str | None:
    """Why an option of `cfg` keeps its copies from giving its figures (its class's
    `shallow_differs`), or None."""
    for group in registry.techniques():
        why = registry.stated(get_class(cfg[group]._target_), "shallow_differs", None)
        if why:
            return f"{group}={cfg[group].get('_target_', '?').rpartition('.')[2]}: {why}"
    return None


def shallow_trace(cfg: DictConfig, keep: int, target: str = "cpu", gpu_key: str = "h100",
                  world_size: int | None = None) -> tuple[Estimate, dict | str]:
    """The estimate of `cfg`'s model cut to `keep` blocks, with its Trail's canonical form (or
    why the trail cannot give the deep model's figures)."""
    with traced_by_block() as trail:
        result = estimate(shallow_config(cfg, keep), target, gpu_key, world_size)
    try:
        return result, trail.canonical(keep)
    except NotAlike as why:
        return result, str(why)
