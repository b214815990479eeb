"""How memexp plan settles its candidates: each one's estimate, as cheaply as it can be had, in
forked workers (memexp.forked) where cores are free, each reported as it is settled.

- What does not change between candidates is traced once: what a candidate holds in its first
  optimizer step (its parameters, the frozen ones too, their gradients, its optimizer's state
  and DDP's gradient buckets, per rank) depends on what is computed and on the parallel option
  only, not on the recomputation or the micro-batches. It is read from the trace of the model
  itself, stopped as that step ends (`group_bound`). Where it alone is over the budget, every
  candidate of that group is over it without tracing further (`Settled.bound`).
- A candidate whose model repeats alike blocks is traced at 2, 3 and 4 of them, and its figures
  extrapolated to its own depth (memexp.depth); where the copies cannot give them, and for a
  CUDA estimate (the caching allocator's reserved bytes are not affine in the depth), it is
  traced whole. Where one candidate's copies cannot, the others of its group with its
  recomputation are traced whole without tracing their copies first (and every other of its
  group, once a second recomputation's cannot either).
- A CPU estimate traced whole stops the moment its live bytes pass the budget: the candidate
  is over, with those bytes as its bound (`STOPPED`), and is not traced to its end.
- A candidate that the plan ranks after another whatever their peaks (its option's class names
  that one's `dominated_by`: parallel=zero1, ddp), with every other option the same, waits for
  that twin (Candidate.after): where the twin fits, it is left out untraced (`DOMINATED`), no
  plan of its own; where the twin does not, it is settled as any other.
- The order: each group's most recomputed or offloaded candidate first (the likeliest to fit;
  where it does, its group's bound could spare nothing, and is not traced; where it does not,
  the bound is traced next), then the rest, those traced whole first.

Either way an estimate it gives is the full trace's, to the byte: whether an estimate came from
a fresh trace or from its copies' is invisible to its reader (tests/test_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils._pytree import tree_leaves

from memexp import depth
from memexp.estimate import Estimate, estimate
from memexp.forked import Failed, Pool, workers_for
from memexp.memory.tracker import Follower, followed, tensor_storages

TRACED_WHOLE = "traced whole"  # a Settled's source where nothing was cut or bounded
# A Settled's source where it has a bound and no estimate: what held it over the budget
BOUNDED = "its parameters, gradients and optimizer state alone"
STOPPED = "the bytes live at a moment of its own trace"
# A Settled's source where the twin ranked before it fits (Candidate.after): no estimate, no bound
DOMINATED = "ranked after its twin, which fits"
# The roles the meter gives storages (memexp.memory.meter): the same in every candidate of a group
_ROLES = ("params", "frozen", "grads", "optimizer")
# The namespaces of torch.distributed's collectives
_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional")
_STEP = "optimizer"  # the trainer's phase of the optimizer step


@dataclass
class Candidate:
    """One combination of options to settle: `group` is what its kept bytes depend on (what is
    computed and the parallel option)."""

    overrides: list[str]
    cfg: DictConfig
    group: tuple
    # the candidate (its number) that the plan ranks before it whatever their peaks (its
    # class's `dominated_by`; a CPU estimate's plan only: memexp.plan.link_twins), or None
    after: int | None = None


@dataclass
class Settled:
    """A candidate's estimate and how it was had; or, where it cannot fit, no estimate and the
    bytes it holds at least (`bound`); or, `DOMINATED`, neither."""

    estimate: Estimate | None
    source: str
    bound: int | None = None
    why: str = ""  # why it was traced whole where its copies were tried


class _Stepped(BaseException):
    """The first optimizer step is done: what the trace of group_bound waited for."""


class _FirstStep(Follower):
    """A follower of the tracker (memexp.memory.tracker.followed) that stops the trace as its
    first optimizer step ends, with the most bytes that every candidate of its group holds at
    a moment of that step (`held`)."""

    def __init__(self):
        self.held = 0
        self.reduced: set = set()  # the tracker's records of what a collective read

    def op(self, tracker, func, args, kwargs) -> None:
        if func.namespace in _COLLECTIVES:
            self.reduced.update(record for tensor in tree_leaves((args, kwargs))
                                if isinstance(tensor, torch.Tensor)
                                for storage in tensor_storages(tensor)
                                if (record := tracker._live.get(id(storage))) is not None)

    def entering(self, tracker, phase: str) -> None:
        # the trainer's optimizer phase (memexp.trainer): entered with every gradient made
        # and reduced, left with the optimizer's state made and the gradients zeroed
        if phase == _STEP:
            self.held = self._bytes(tracker)
        elif tracker.phase == _STEP:
            self.held = max(self.held, self._bytes(tracker))
            raise _Stepped

    def _bytes(self, tracker) -> int:
        """The device bytes of the live storages with a role (parameters, gradients, optimizer
        state), or that a collective read (DDP's gradient buckets, which its parallel option
        makes in the first backward and keeps)."""
        tracker.refresh_roles()
        return sum(record.nbytes for record in tracker._live.values() if not record.host
                   and (record.role in _ROLES or record in self.reduced))


class _Over(BaseException):
    """A trace's live bytes went past the budget: what the trace of _traced stops at."""

    def __init__(self, held: int):
        super().__init__(held)
        self.held = held


class _Budget(Follower):
    """A follower of the tracker that stops the trace the moment its live device bytes pass
    `limit`: the candidate's peak is at least those bytes, so it cannot fit."""

    def __init__(self, limit: int):
        self.limit = limit

    def candidate(self, tracker) -> None:
        if tracker.current > self.limit:
            raise _Over(tracker.current)


def group_bound(cfg: DictConfig, world_size: int | None = None) -> int:
    """Bytes that every candidate of `cfg`'s group (what is computed, and the parallel option:
    Candidate.group) holds at a moment of its first optimizer step, on its traced rank: its
    parameters (frozen ones too), their gradients, its optimizer's state and what its
    collectives reduced (DDP's gradient buckets), as the step begins (every gradient made) and
    as it ends (AdamW's moments made, the gradients zeroed: ZeRO's of the parameters another
    rank steps stay). The larger, as the trace of `cfg`'s run finds them: the recomputation and
    the micro-batches, all that differs within a group, change none of them, so no candidate
    of the group peaks below it."""
    first = _FirstStep()
    try:
        with followed(first):
            estimate(cfg, "cpu", world_size=world_size)
    except _Stepped:
        return first.held
    raise RuntimeError("the trace ended before its first optimizer step did")


def settle(candidates: list[Candidate], limit: int, target: str, gpu_key: str,
           world_size: int | None, repeats: depth.Repeats | str,
           settled: Callable[[Candidate, Settled], None]) -> None:
    """Settle every candidate, calling `settled` as each one is (in the order they finish).
    `repeats`: the model's blocks, or why its depth cannot be cut. A candidate's error is
    raised, once the workers are ended; a Ctrl-C ends them too."""
    cut = (target == "cpu" and isinstance(repeats, depth.Repeats)
           and repeats.count > max(depth.DEPTHS))
    plain = [OmegaConf.to_container(candidate.cfg, resolve=True) for candidate in candidates]
    # how each is being settled: "shallow" (its copies), "whole", or None once it is
    state = {number: "shallow" if cut and depth.extrapolable(candidate.cfg) is None else "whole"
             for number, candidate in enumerate(candidates)}
    groups: dict[tuple, list[int]] = {}
    for number, candidate in enumerate(candidates):
        groups.setdefault(candidate.group, []).append(number)
    copies: dict[int, dict[int, tuple]] = {}  # candidate -> depth -> (estimate, trail)
    failed: dict[tuple, set[str]] = {}  # group -> the recomputations whose copies were not alike
    reasons: dict[int, str] = {}  # candidate -> why its copies did not give its figures

    def checkpointing(number: int) -> str:
        return candidates[number].cfg.checkpointing._target_

    # those that wait for their twin: left out where it fits, else settled as they were to be
    waiting: dict[int, list[int]] = {}
    for number, candidate in enumerate(candidates):
        if candidate.after is not None:
            waiting.setdefault(candidate.after, []).append(number)
    tasks = sum(1 if how == "whole" else len(depth.DEPTHS) for how in state.values())
    with Pool(workers_for(tasks)) as pool:

        def whole(number: int, first: bool = False, why: str = "") -> None:
            state[number] = "whole"
            reasons[number] = why
            copies.pop(number, None)
            pool.drop(lambda key: key[0] == "shallow" and key[1] == number)
            pool.submit(("whole", number), _traced, plain[number], target, gpu_key,
                        world_size, limit if target == "cpu" else None, first=first)

        def not_alike(number: int, why: str) -> None:
            """Its copies cannot give its figures (`why`): it is traced whole. So, without
            tracing their copies first, are the others of its group with its recomputation
            (they differ only in their micro-batches), and, once a second recomputation's copies
            fail too, every other of its group (what moves its moments is then what the group
            shares)."""
            whole(number, first=True, why=why)
            group = candidates[number].group
            failed.setdefault(group, set()).add(checkpointing(number))
            for sibling in groups[group]:
                if state[sibling] == "shallow" and (len(failed[group]) > 1 or checkpointing(
                        sibling) in failed[group]):
                    whole(sibling, why=f"not tried, as another's of its group: {why}")

        def report(number: int, result: Settled) -> None:
            state[number] = None
            pool.drop(lambda key: key[0] != "bound" and key[1] == number)
            group = candidates[number].group
            fits = result.estimate is not None and result.estimate.memory["peak_bytes"] <= limit
            if (number == groups[group][-1] and target == "cpu" and not fits
                    and result.source != DOMINATED):
                # its group's likeliest to fit is over: its bound may spare every other's trace
                pool.submit(("bound", group), _held, plain[groups[group][0]], world_size,
                            first=True)
            settled(candidates[number], result)
            for twin in waiting.pop(number, ()):
                if state[twin] is None:  # its group's bound settled it first
                    continue
                if fits:
                    report(twin, Settled(None, DOMINATED))
                else:
                    submit(twin)

        def submit(number: int) -> None:
            if state[number] == "whole":
                whole(number)
            else:
                for keep in reversed(depth.DEPTHS):
                    pool.submit(("shallow", number, keep), _shallow, plain[number], keep,
                                world_size)

        # First each group's last candidate (the most recomputed or offloaded: the likeliest to
        # fit); where it is over, its group's bound next (bounds only a CPU estimate's: the CUDA
        # trace runs in a process of its own); then the rest, those traced whole first.
        # A candidate waiting for its twin is submitted once the twin is over (report).
        later = {twin for twins in waiting.values() for twin in twins}
        probes = {numbers[-1] for numbers in groups.values()} - later
        for number in sorted(probes):
            submit(number)
        for number in sorted(state, key=lambda n: state[n] != "whole"):
            if number not in probes | later:
                submit(number)
        for (kind, which, *keep), result in pool.results():
            if kind == "bound":
                if not isinstance(result, Failed) and result > limit:
                    for number in groups[which]:
                        if state[number] is not None:
                            report(number, Settled(None, BOUNDED, result))
                continue  # else no use: its candidates are traced
            if state[which] != kind:  # settled meanwhile, or traced whole instead
                continue
            if kind == "whole":
                if isinstance(result, Failed):
                    raise result.error
                report(which, Settled(None, STOPPED, result) if isinstance(result, int) else
                       Settled(result, TRACED_WHOLE, why=reasons.get(which, "")))
            elif isinstance(result, Failed):
                not_alike(which, f"a copy failed: {result.error}")
            elif isinstance(result[1], str):
                not_alike(which, result[1])  # the copy's trail cannot give its figures
            else:
                copies.setdefault(which, {})[keep[0]] = result
                if len(copies[which]) < len(depth.DEPTHS):
                    continue
                by_depth = copies.pop(which)
                try:
                    result = depth.extrapolated([by_depth[at] for at in depth.DEPTHS],
                                                repeats.count)
                except depth.NotAlike as why:
                    not_alike(which, str(why))
                    continue
                report(which, Settled(result, f"{', '.join(map(str, depth.DEPTHS[:-1]))} and "
                                              f"{depth.DEPTHS[-1]} of its {repeats.count} "
                                              f"{repeats.kind} blocks"))


def _held(plain: dict, world_size: int | None) -> int:
    return group_bound(OmegaConf.create(plain), world_size)


def _traced(plain: dict, target: str, gpu_key: str, world_size: int | None,
            limit: int | None) -> Estimate | int:
    """The estimate of `plain`'s run; with a `limit` (a CPU estimate's budget), the live bytes
    at the first moment they pass it instead, where they do: the trace stops there."""
    cfg = OmegaConf.create(plain)
    if limit is None:
        return estimate(cfg, target, gpu_key, world_size)
    try:
        with followed(_Budget(limit)):
            return estimate(cfg, target, gpu_key, world_size)
    except _Over as over:
        return over.held


def _shallow(plain: dict, keep: int, world_size: int | None) -> tuple:
    return depth.shallow_trace(OmegaConf.create(plain), keep, world_size=world_size)
