"""How memexp plan settles its candidates: each one's estimate, as cheaply as it can be had, in
forked workers (memexp.forked) where cores are free, each reported as it is settled.

- What does not change between candidates is traced once: what a candidate holds from its first
  step to its last (its parameters, the frozen ones too, and what its optimizer holds from its
  start, per rank) depends on what is computed and on the parallel option only, not on the
  recomputation or the micro-batches. It is read from the trace of the model itself, stopped as
  its first step begins (`persistent_bytes`). Where it alone is over the budget, every candidate
  of that group is over it without tracing its steps (`Settled.bound`).
- A candidate whose model repeats alike blocks is traced at 2, 3 and 4 of them, and its figures
  extrapolated to its own depth (memexp.depth); where the copies cannot give them, and for a
  CUDA estimate (the caching allocator's reserved bytes are not affine in the depth), it is
  traced whole.

Either way its estimate is the full trace's, to the byte: whether an estimate came from a fresh
trace or from its copies' is invisible to its reader (tests/test_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from memexp import depth
from memexp.estimate import Estimate, estimate
from memexp.forked import Failed, Pool, workers_for
from memexp.memory.tracker import IDLE, followed

TRACED_WHOLE = "traced whole"  # a Settled's source where nothing was cut or bounded
# The roles a storage keeps from the run's start to its end (memexp.memory.meter): gradients
# come and go, and the rest is made by the steps.
_KEPT_ROLES = ("params", "frozen", "optimizer")


@dataclass
class Candidate:
    """One combination of options to settle: `group` is what its kept bytes depend on (what is
    computed and the parallel option)."""

    overrides: list[str]
    cfg: DictConfig
    group: tuple


@dataclass
class Settled:
    """A candidate's estimate and how it was had; or, where it cannot fit, no estimate and the
    bytes it holds at least (`bound`)."""

    estimate: Estimate | None
    source: str
    bound: int | None = None


class _Begun(BaseException):
    """The first step begins: what the trace of persistent_bytes waited for."""


class _FirstStep:
    """A follower of the tracker (memexp.memory.tracker.followed) that stops the trace as its
    first step begins, with the bytes of the storages that stay from then on."""

    kept = None

    def op(self, tracker, args, kwargs) -> None:
        pass

    def added(self, tracker, record, nbytes: int) -> None:
        pass

    def added_grad(self, tracker, nbytes: int) -> None:
        pass

    def candidate(self, tracker) -> None:
        pass

    def entering(self, tracker, phase: str) -> None:
        if phase == IDLE:
            return
        tracker.refresh_roles()
        self.kept = sum(record.nbytes for record in tracker._live.values()
                        if not record.host and record.role in _KEPT_ROLES)
        raise _Begun


def persistent_bytes(cfg: DictConfig, world_size: int | None = None) -> int:
    """The device bytes `cfg`'s run (its traced rank) holds from its first step to its last:
    its parameters, frozen ones too, and what its optimizer holds from its start, as the trace
    of the run finds them when its first step begins. No moment of the run holds less."""
    first = _FirstStep()
    try:
        with followed(first):
            estimate(cfg, "cpu", world_size=world_size)
    except _Begun:
        return first.kept
    raise RuntimeError("the trace ended before its first step")


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
    bounds = groups if target == "cpu" else {}  # the CUDA trace runs in a process of its own
    tasks = len(bounds) + sum(1 if how == "whole" else len(depth.DEPTHS)
                              for how in state.values())
    with Pool(workers_for(tasks)) as pool:

        def whole(number: int, first: bool = False) -> None:
            state[number] = "whole"
            pool.drop(lambda key: key[0] == "shallow" and key[1] == number)
            pool.submit(("whole", number), _traced, plain[number], target, gpu_key,
                        world_size, first=first)

        def report(number: int, result: Settled) -> None:
            state[number] = None
            pool.drop(lambda key: key[0] != "bound" and key[1] == number)
            settled(candidates[number], result)

        for group, numbers in bounds.items():  # first: each may spare its group every trace
            pool.submit(("bound", group), _persistent, plain[numbers[0]], world_size)
        for number in sorted(state, key=lambda n: state[n] != "whole"):  # the longest first
            if state[number] == "whole":
                whole(number)
            else:
                for keep in reversed(depth.DEPTHS):
                    pool.submit(("shallow", number, keep), _shallow, plain[number], keep,
                                world_size)
        for (kind, which, *keep), result in pool.results():
            if kind == "bound":
                if not isinstance(result, Failed) and result > limit:
                    for number in groups[which]:
                        if state[number] is not None:
                            report(number, Settled(None, "its parameters and optimizer alone",
                                                   result))
                continue  # else no use: its candidates are traced
            if state[which] != kind:  # settled meanwhile, or traced whole instead
                continue
            if kind == "whole":
                if isinstance(result, Failed):
                    raise result.error
                report(which, Settled(result, TRACED_WHOLE))
            elif isinstance(result, Failed) or isinstance(result[1], str):
                whole(which, first=True)  # the copies cannot give its figures
            else:
                copies.setdefault(which, {})[keep[0]] = result
                if len(copies[which]) < len(depth.DEPTHS):
                    continue
                by_depth = copies.pop(which)
                try:
                    result = depth.extrapolated([by_depth[at] for at in depth.DEPTHS],
                                                repeats.count)
                except depth.NotAlike:
                    whole(which, first=True)
                    continue
                report(which, Settled(result, f"{', '.join(map(str, depth.DEPTHS[:-1]))} and "
                                              f"{depth.DEPTHS[-1]} of its {repeats.count} "
                                              f"{repeats.kind} blocks"))


def _persistent(plain: dict, world_size: int | None) -> int:
    return persistent_bytes(OmegaConf.create(plain), world_size)


def _traced(plain: dict, target: str, gpu_key: str, world_size: int | None) -> Estimate:
    return estimate(OmegaConf.create(plain), target, gpu_key, world_size)


def _shallow(plain: dict, keep: int, world_size: int | None) -> tuple:
    return depth.shallow_trace(OmegaConf.create(plain), keep, world_size=world_size)
