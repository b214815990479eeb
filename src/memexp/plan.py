"""`memexp plan budget=24GiB <overrides>`: which technique combinations fit, and what each costs.

The search space is precision x optim x bn_mode x adapter x loss ("what is computed") times
checkpointing x accumulation ("how much is kept"). Each group's candidates come from the command
line (sweep syntax: `precision=fp32,bf16`) or else from the classes (their `planned`,
memexp.registry; for optim, the configured optimizer, the options its class plans (bf16
moments, a step on the host) and those of the `lighter` classes its class names;
the adapters only where `adapter.target_modules=[auto]` finds layers to adapt; for the loss, the
user's and the planned ones that compute the same on the model: loss=chunked_ce in place of a
cross-entropy, where it finds the head). Every combination of a "what is computed" choice and
a "how much is kept" choice is a candidate, and every candidate is settled (memexp.settle): its
estimate, or a bound that shows it cannot fit. Each is printed as it is settled, and a Ctrl-C
ends the search with the table of what was settled so far. Every candidate that fits is a plan
(a card's usable memory may be below its nominal size: `headroom` plans below the budget by
that much); a choice that fits in no way is listed once, with its smallest peak.

The estimates are the planner's cost: each is had as cheaply as it can be, and equals a full
`memexp estimate` of its plan to the byte. Candidates are traced in parallel in forked
workers where cores are free; what they hold once their first optimizer step is done is traced
once for every candidate that shares it, and a candidate over the budget by that alone is not
traced further; and a model of repeated alike blocks is traced at 2, 3 and 4 of them, its
figures extrapolated to its own depth where the traces show the blocks alike (memexp.depth),
except in a group whose copies once were not: its candidates are traced whole.

With a world size above 1 (`--world-size N`), parallel=ddp, zero1 and fsdp are searched too, each
estimated for its rank with the largest peak (memexp.estimate_parallel), and run with
trainer.nproc=N.
Given several world sizes (`--world-size 2,4,8`), the plan is for the smallest at which one fits.

Any other group with options its classes plan (a technique added to conf/ with `planned` on its
class) is searched too, on the "what is computed" side: the configured option and the planned
ones. A planned option states `changes_math` as well. The
plan ends with the space it covered: every group, the options it tried, and why it left out
each of the others (`covered`).

Accumulation keeps the global batch: `optim.accumulate=k` runs k micro-batches of
data.batch_size / k samples (only for k that divide the batch).

Cost is measured where it can be: for a CUDA estimate (`--target cuda --gpu NAME`), the
predicted time of one optimizer step on that GPU (memexp.steptime, from the traced ops); then
recomputed FLOPs (from the traced backward pass against the same run without checkpointing),
bytes a step copies to the host and back (offloading: the meter's `transfer_bytes_per_step`),
and the number of micro-batches per step. The plans are ranked by those, in that order, and
then by numerics (the precision class's `numerics_rank`: fp32 first) and peak memory. A CPU
estimate predicts no step time (the CPU is not the GPU the run is for), so its plans are
ranked from the recomputed FLOPs on.

Options that change what is learned (each option's `changes_math`, see memexp.techniques:
frozen BatchNorm statistics, pure half precision, another optimizer, accumulation with
BatchNorm's batch statistics) are marked, and ranked after every plan that keeps the math,
unless the user allows them (`allow_changes`, `--allow-changes`). A plan is not cheaper for
learning something else.
"""

from __future__ import annotations

import copy
import itertools
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch import nn

from memexp import depth, registry
from memexp.app import Job, run_job
from memexp.build import build, build_model
from memexp.config import config_dir
from memexp.estimate import (
    Estimate,
    check_before_tracing,
    compose_config,
)
from memexp.memory.sizes import parse_size
from memexp.report import write_report
from memexp.result import mib
from memexp.settle import DOMINATED, TRACED_WHOLE, Candidate, Settled, settle
from memexp.steptime import duration
from memexp.techniques import check_combination, check_estimable, check_loss_combination
from memexp.techniques.adapter import AUTO, resolve_targets
from memexp.techniques.parallel import NoParallel

# The searched groups: what is computed, then how much is kept.
COMPUTED = ("precision", "optim", "bn_mode", "adapter")
KEPT = ("checkpointing", "parallel", "optim.accumulate")
# The loss, where another computes the same with less memory (chunked_ce for a cross-entropy).
LOSS = "loss"
ACCUMULATE = ["1", "2", "4"]  # the micro-batches a step is tried in


@dataclass
class Search:
    """The space a plan covered: the options tried in each searched group, why each other
    option was left out, and the groups not searched (with the run's own choice)."""

    space: dict[str, list[str]]
    left_out: dict[str, dict[str, str]]
    fixed: dict[str, str]
    # the combinations train.py refuses (memexp.techniques.check_combination), or the
    # estimate does (check_estimable), by its reason, with the number of candidates each left
    # out
    refused: dict[str, int] = field(default_factory=dict)
    candidates: int = 0  # the combinations to settle
    # how the options the command line fixed change what is learned: the user's choice, so
    # every plan's, said once and not ranked by
    own_changes: list[str] = field(default_factory=list)
    settled: int = 0  # those settled (fewer where a Ctrl-C ended the search)
    # those left out untraced: each ranked after a plan that fits (memexp.settle.DOMINATED)
    dominated: list[Plan] = field(default_factory=list)


@dataclass
class Plan:
    overrides: list[str]  # the technique overrides, beyond the user's own
    precision: str
    accumulate: int
    communication_rank: int  # the parallel option's cost_rank (0: one process)
    # its estimate (None where its bound alone is over the budget: `settled.bound`)
    estimate: Estimate | None
    # what recomputation adds to the same run without it (None: that run is not settled)
    recompute_flops: int | None
    numerics_rank: int  # the precision option's (0: fp32)
    changes: list[str]  # how its options change what is learned, a line each (none: same math)
    search: Search  # the space it was chosen from
    settled: Settled | None = None  # how its estimate was had (memexp.settle)
    fits: bool = False
    # the plan ranked before it whatever their peaks, which fits: it was left out untraced
    # (memexp.settle.DOMINATED)
    dominated_by: Plan | None = None

    @property
    def peak_bytes(self) -> int:
        """What must fit: reserved memory for a CUDA estimate, live bytes for a CPU one; where
        it has no estimate, the bytes it holds at least."""
        if self.estimate is None:
            return self.settled.bound
        memory = self.estimate.memory
        return memory.get("reserved_peak_bytes") or memory["peak_bytes"]

    @property
    def transfer_bytes(self) -> int:
        """Bytes a step copies to the host and back (offloading: activations, checkpoints'
        inputs, the optimizer stepped on the host)."""
        if self.estimate is None:
            return 0
        return sum((self.estimate.memory.get("transfer_bytes_per_step") or {}).values())

    @property
    def step_seconds(self) -> float | None:
        """Its predicted step time on the estimate's GPU (memexp.steptime); None for a CPU
        estimate, or without an estimate."""
        if self.estimate is None or self.estimate.step_time is None:
            return None
        return self.estimate.step_time.seconds

    def cost(self) -> tuple:
        """What ranks it: its predicted step time where it has one (a CUDA estimate), then
        what recomputation adds, the bytes it moves, its micro-batches, its communication and
        its numerics."""
        step = float("inf") if self.step_seconds is None else self.step_seconds
        recompute = float("inf") if self.recompute_flops is None else self.recompute_flops
        return (step, recompute, self.transfer_bytes, self.accumulate,
                self.communication_rank, self.numerics_rank, self.peak_bytes)


def with_values(cfg: DictConfig, values: dict[str, object]) -> DictConfig:
    """A copy of the composed `cfg` with `values` overridden, as Hydra overrides a value once
    it has composed the config groups (OmegaConf.update, merging): the config of `cfg`'s
    overrides and `key=value` for each of `values`, without composing it again (0.1 s of CPU
    a compose, 80 of them for an 8-rank plan)."""
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, merge=True)
    return cfg


def computed_groups() -> tuple[str, ...]:
    """The "what is computed" groups: COMPUTED, then every other group with planned options."""
    return (*COMPUTED, *(group for group in registry.groups()
                         if group not in (*COMPUTED, *KEPT) and registry.planned(group)))


def split_arguments(arguments: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The fixed overrides, and the searched groups given in sweep syntax (a,b,c)."""
    fixed, searched, groups = [], {}, (*computed_groups(), *KEPT)
    for argument in arguments:
        key, _, value = argument.partition("=")
        if key in groups:
            searched[key] = value.split(",")
        else:
            fixed.append(argument)
    return fixed, searched


def search_space(cfg: DictConfig, choices: dict[str, str], searched: dict[str, list[str]],
                 world_size: int = 1, overrides: tuple[str, ...] = ()) -> Search:
    """What a plan tries in each group, from `searched` (the command line's lists) or the
    classes, and why it leaves out each other option; `choices` are the run's own (a model may
    pick its optimizer) and `overrides` the user's fixed ones (the losses are composed with
    them)."""
    space, left_out = {}, {}
    for group in (*computed_groups(), *KEPT):
        if group in searched:
            space[group] = searched[group]
            why = "not in the command line's list"
        elif group == "optim":
            optim, own = choices["optim"], get_class(cfg.optim._target_)
            # the options of its class that the class plans (adamw_bf16, adamw_offload), then
            # those of its lighter classes
            variants = [name for name in registry.planned("optim")
                        if name in registry.options_of("optim", own)]
            lighter = [name for light in own.lighter
                       for name in registry.options_of("optim", light)]
            space[group] = list(dict.fromkeys([optim, *variants, *lighter]))
            why = f"not lighter than optim={optim}, by its class"
        elif group == "parallel" and world_size == 1:
            space[group] = [registry.options_of("parallel", NoParallel)[0]]
            why = "one process: --world-size N searches them"
        elif group == "optim.accumulate":
            space[group] = ACCUMULATE
            why = ""
        elif group == "bn_mode" and not has_batch_norm(cfg):
            space[group] = [registry.baseline_option("bn_mode")]
            why = "the model has no BatchNorm"
        elif group == "adapter" and not adaptable(cfg):
            space[group] = [registry.baseline_option("adapter")]
            why = "adapter.target_modules=[auto] finds no layers to adapt in the model"
        elif group == LOSS:
            space[group] = loss_options(list(overrides), choices[LOSS], world_size)
            why = ""
        elif group in COMPUTED or group in KEPT:
            space[group] = registry.planned(group)
            why = ""
        else:  # a group beyond the built-in search: the run's own option, and the planned ones
            space[group] = list(dict.fromkeys([choices[group], *registry.planned(group)]))
            why = ""
        if group == "optim.accumulate":  # micro-batches of data.batch_size / k samples
            batch = cfg.data.batch_size
            left_out[group] = {k: f"does not divide data.batch_size={batch}"
                               for k in space[group] if batch % int(k)}
            space[group] = [k for k in space[group] if k not in left_out[group]]
        else:
            left_out[group] = {name: why or not_planned(group, name)
                               for name in registry.options(group) if name not in space[group]}
        if group == LOSS and group not in searched:
            left_out[group].update({name: f"does not compute loss={choices[LOSS]} on this model"
                                          if world_size == 1 else
                                          "applies the head outside forward: a rank's trace "
                                          "refuses it (estimate it with --world-size 1)"
                                    for name in registry.planned(LOSS)
                                    if name not in space[group]})
    fixed = {group: choices[group] for group in registry.groups() if group not in space}
    return Search(space, left_out, fixed)


def loss_options(fixed: list[str], loss: str, world_size: int = 1) -> list[str]:
    """The user's loss, and the planned losses (memexp.registry) that compute the same on this
    model: chunked_ce in place of a cross-entropy, where the model has an output head for it
    and takes nothing after the head that chunked_ce cannot (a forward pass on the meta device,
    as the estimate checks before tracing), and at one rank (a rank's trace refuses a loss that
    applies the head: memexp.techniques.check_estimable)."""
    options = [loss]
    configured = compose_config(fixed).loss
    if OmegaConf.is_missing(configured, "_target_"):  # loss=custom without its target
        return options
    for option in registry.planned(LOSS):
        cfg = compose_config([*fixed, f"{LOSS}={option}"])
        target = get_class(cfg.loss._target_)
        if option == loss or configured._target_ not in map(registry.target_path,
                                                            target.replaces):
            continue
        if world_size > 1 and target.applies_params:
            continue
        try:
            check_before_tracing(cfg)
        except ValueError:  # no head it can take, or a step after the head it cannot take
            continue
        options.append(option)
    return options


def not_planned(group: str, option: str) -> str:
    """Why `memexp plan` does not try an option of a group it searches: its class says."""
    path = registry.options(group)[option]["_target_"]
    if path == registry.UNSET:
        return f"the user names its {group}._target_"
    target = get_class(path)
    wanted = registry.stated(target, "planned", ())
    if not wanted:
        return f"{target.__name__} plans none"
    return (f"{target.__name__} plans only "
            + " or ".join(", ".join(f"{k}={v}" for k, v in args.items()) or "every option"
                          for args in wanted))


def group_choices(overrides: list[str]) -> dict[str, str]:
    """The option of every group that these overrides select (a model may pick its
    optimizer)."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    return dict(cfg.hydra.runtime.choices)


def has_batch_norm(cfg: DictConfig) -> bool:
    with torch.device("meta"):  # structure only: no memory, no time
        model = build_model(cfg.model)
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def adaptable(cfg: DictConfig) -> bool:
    """Whether adapter.target_modules=[auto] finds layers to adapt in the model (attention and
    MLP projections): elsewhere the adapters are not tried."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    try:
        resolve_targets(model, [AUTO])
    except ValueError:
        return False
    return True


def built_options(fixed: list[str], space: dict[str, list[str]]) -> dict[str, dict]:
    """Each searched option of the technique groups, built: the option objects alone, no model.
    One compose (a second each on 2 busy cores) builds the n-th option of every group."""
    groups = (*computed_groups(), "checkpointing", "parallel")
    built: dict[str, dict] = {group: {} for group in groups}
    for options in itertools.zip_longest(*(space[group] for group in groups)):
        chosen = {group: option for group, option in zip(groups, options, strict=True) if option}
        cfg = compose_config([*fixed, *(f"{group}={option}" for group, option in chosen.items())])
        for group, option in chosen.items():
            # a parallel option joins a process group as it is built: its class says its cost
            built[group][option] = (get_class(cfg[group]._target_) if group == "parallel"
                                    else build(cfg[group]))
    return built


def math_changes(chosen: dict[str, dict], choices: dict[str, str], accumulate: int,
                 batch_norm: bool, own: dict[str, str]) -> list[str]:
    """How a plan changes what is learned: each chosen option's `changes_math`, and what
    accumulation changes with its bn_mode. bn_mode changes nothing in a model without
    BatchNorm, and a group beyond the built-in search changes nothing at the run's own option
    (`own`: a loss class need not say), nor does an option the user fixed (also `own`: it is
    said once, Search.own_changes)."""
    bn_mode = chosen["bn_mode"][choices["bn_mode"]]
    choices = {group: choice for group, choice in choices.items()
               if (group != "bn_mode" or batch_norm) and own.get(group) != choice}
    found = [f"{group}={choice}: {chosen[group][choice].changes_math}"
             for group, choice in choices.items() if chosen[group][choice].changes_math]
    if batch_norm and accumulate > 1 and bn_mode.accumulation_changes_math:
        found.append(f"optim.accumulate={accumulate}: {bn_mode.accumulation_changes_math}")
    return found


def plan(arguments: list[str], budget: str, target: str = "cpu",
         gpu: str = "h100", allow_changes: bool = False,
         show: Callable[[str], None] = lambda line: None,
         world_sizes: tuple[int, ...] = (1,), headroom: str | None = None) -> list[Plan]:
    """The plans at the smallest of `world_sizes` at which one fits (at the largest, if none
    does): see plan_ranks. Each size is planned once, however often it is given. A Ctrl-C
    ends the search: the plans settled so far are returned (their Search says how many)."""
    limit = fits_in(budget, headroom)
    for world_size in sorted(set(world_sizes)):
        plans = plan_ranks(arguments, limit, target, gpu, allow_changes, show, world_size)
        if any(p.fits for p in plans) or plans and plans[0].search.settled < (
                plans[0].search.candidates):
            break
    return plans


def fits_in(budget: str, headroom: str | None = None) -> int:
    """The bytes a plan may reach: `budget`, less `headroom` (a share of it, as 10% or 0.1, or
    a size, as 2GiB) where memory the card reports is not all usable."""
    limit = parse_size(budget, "budget")
    if headroom is None:
        return limit
    try:
        share = (float(headroom.removesuffix("%")) / 100 if headroom.endswith("%")
                 else float(headroom))
    except ValueError:
        return limit - parse_size(headroom, "--headroom")
    if not 0 <= share < 1:
        raise ValueError(f"--headroom {headroom}: a share of the budget, from 0 up to 100% (10% "
                         "or 0.1), or a size such as 2GiB")
    return int(limit * (1 - share))


def plan_ranks(arguments: list[str], limit: int, target: str, gpu: str, allow_changes: bool,
               show: Callable[[str], None], world_size: int) -> list[Plan]:
    """Every searched combination that fits in `limit` bytes on `world_size` ranks, cheapest
    first, then each "what is computed" choice that fits in no way, with its smallest peak, as
    `fits=False`. Unless `allow_changes`, a plan that changes what is learned comes after every
    one that keeps it. `show` gets a line for each candidate as it is settled."""
    fixed, searched = split_arguments(arguments)
    base = compose_config(fixed)
    batch = base.data.batch_size
    choices = group_choices(fixed)
    search = search_space(base, choices, searched, world_size, tuple(fixed))
    space = search.space
    groups = computed_groups()
    computed_options = list(itertools.product(*(space[group] for group in groups)))
    # the run's own option of each group beyond the built-in search, and of each group the
    # command line holds at one option: the user's own decision, said once (Search.own_changes)
    given = {group: options[0] for group, options in searched.items()
             if len(options) == 1 and group in groups}
    own = {**{group: choices[group] for group in groups if group not in COMPUTED}, **given}
    chosen = built_options(fixed, space)
    search.own_changes = [f"{group}={option}, which changes what is learned: "
                          f"{chosen[group][option].changes_math}"
                          for group, option in given.items() if group in COMPUTED
                          and chosen[group][option].changes_math]
    batch_norm = has_batch_norm(base)  # bn_mode changes nothing without one
    # Nothing recomputed or moved first, then recomputation, then offloading (the classes say);
    # within each, the fewest micro-batches, then the parallel options from the least
    # communicated: the order candidates are listed in, and settled in where they take alike.
    kept_options = sorted(
        ((c, p, int(k)) for c in space["checkpointing"] for p in space["parallel"]
         for k in space["optim.accumulate"]),
        key=lambda option: (chosen["checkpointing"][option[0]].cost_rank, option[2],
                            chosen["parallel"][option[1]].cost_rank))
    candidates, plans, refused = [], {}, []
    composed: dict[tuple, DictConfig] = {}  # by the options chosen: micro-batches are values
    for picks in computed_options:
        picked = dict(zip(groups, picks, strict=True))
        computed = [f"{group}={option}" for group, option in picked.items()]
        for checkpointing, parallel, accumulate in kept_options:
            kept = [f"checkpointing={checkpointing}"]
            ranks = [f"parallel={parallel}", f"trainer.nproc={world_size}"] * (world_size > 1)
            values = {"optim.accumulate": accumulate, "data.batch_size": batch // accumulate}
            overrides = [*computed, *kept, *(f"{key}={value}" for key, value in values.items()),
                         *ranks]
            options = (*computed, *kept, *ranks)
            if options not in composed:
                composed[options] = compose_config([*fixed, *options])
            cfg = with_values(composed[options], values)
            why = refusal(cfg, target, world_size)
            if why:  # train.py (or the estimate) would refuse it: nothing to estimate
                search.refused[why] = search.refused.get(why, 0) + 1
                refused.append(f"  {'refused':>10}        {' '.join(overrides)}: "
                               f"{why.split(': ')[0]}")
                continue
            candidates.append(Candidate(overrides, cfg, (picks, parallel)))
            plans[id(candidates[-1])] = Plan(
                overrides, picked["precision"], accumulate,
                chosen["parallel"][parallel].cost_rank, None, None,
                chosen["precision"][picked["precision"]].numerics_rank,
                math_changes(chosen, {**picked, "checkpointing": checkpointing}, accumulate,
                             batch_norm, own), search)
    search.candidates = len(candidates)
    if target == "cpu":  # a CUDA plan ranks by predicted step time first, on which they differ
        link_twins(candidates, chosen["parallel"])
    if not candidates:
        raise ValueError("train.py or the estimate refuses every combination "
                         "searched: " + "; ".join(f"{why} ({count} of them)"
                                                  for why, count in search.refused.items()))
    with torch.device("meta"):  # structure only
        blocks = depth.repeats(build_model(base.model))
    ranks = f" on {world_size} ranks (trainer.nproc)" if world_size > 1 else ""
    show(f"memexp plan: settling {len(candidates)} candidates{ranks} against "
         f"{mib(limit)} per rank, each as it comes:")
    unsearched = not_searched()
    if unsearched:
        show(f"  not searched: {', '.join(unsearched)} (memexp estimate cannot trace a compiled "
             "model: measure them with train.py)")
    for line in refused:
        show(line)
    if isinstance(blocks, str) or target != "cpu":
        show(f"  each traced whole: {blocks if isinstance(blocks, str) else 'a CUDA estimate'}"
             " (memexp.depth)")

    def settled(candidate: Candidate, result: Settled) -> None:
        found = plans[id(candidate)]
        found.estimate, found.settled = result.estimate, result
        search.settled += 1
        if result.source == DOMINATED:
            found.dominated_by = plans[id(candidates[candidate.after])]
            show(f"  {'left out':>11}  {' '.join(candidate.overrides)}  ({result.source})")
            return
        found.fits = found.estimate is not None and found.peak_bytes <= limit
        at_least = ">" if found.estimate is None else " "
        show(f"  {at_least}{mib(found.peak_bytes):>10}  {'fits' if found.fits else 'over':<4}  "
             f"{' '.join(candidate.overrides)}  ({result.source}"
             f"{': its copies, ' + result.why if result.why else ''})")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP threads before the workers fork (memexp.forked)
    try:
        settle(candidates, limit, target, gpu, world_size, blocks, settled)
    except KeyboardInterrupt:
        show(f"memexp plan: interrupted, {search.settled} of {len(candidates)} candidates "
             "settled")
    finally:
        torch.set_num_threads(threads)
    search.dominated = [p for p in plans.values() if p.dominated_by is not None]
    done = [p for p in plans.values() if p.settled is not None and p.dominated_by is None]
    recompute_flops(done, chosen)
    # every plan that fits; and each choice that fits in no way, with its smallest peak
    kept = [p for p in done if p.fits]
    choices_over: dict[tuple, Plan] = {}
    for p in done:
        key = tuple(p.overrides[:len(groups)])
        if not any(f.fits and tuple(f.overrides[:len(groups)]) == key for f in kept):
            if key not in choices_over or p.peak_bytes < choices_over[key].peak_bytes:
                choices_over[key] = p
    return sorted([*kept, *choices_over.values()],
                  key=lambda p: (not p.fits, not allow_changes and bool(p.changes), p.cost()))


def link_twins(candidates: list[Candidate], parallel: dict[str, type]) -> None:
    """Each candidate whose parallel option's class names another as ranked before it
    (`dominated_by`) waits for its twin: the candidate of that option with every other choice
    the same (memexp.settle)."""
    numbers = {tuple(candidate.overrides): number for number, candidate in enumerate(candidates)}
    for candidate in candidates:
        option = candidate.group[1]
        before = registry.stated(parallel[option], "dominated_by", None)
        twin = next((name for name, target in parallel.items() if target is before), None)
        if twin is not None:
            overrides = [f"parallel={twin}" if override == f"parallel={option}" else override
                         for override in candidate.overrides]
            candidate.after = numbers.get(tuple(overrides))


def recompute_flops(plans: list[Plan], chosen: dict[str, dict]) -> None:
    """Each plan's recomputed FLOPs: its forward and backward FLOPs less those of the same run
    with the baseline checkpointing (none), where that run is settled (on the same parallel
    option if it is, else another: a rank computes the same)."""
    def key(p: Plan, parallel: bool = True) -> tuple:
        options = dict(o.split("=", 1) for o in p.overrides)
        return (*(v for k, v in options.items() if k not in (
            "checkpointing", *(("parallel",) if not parallel else ()))),)

    def train_flops(p: Plan) -> int:
        return p.estimate.flops["forward"] + p.estimate.flops["backward"]

    baseline = {}
    for p in plans:
        options = dict(o.split("=", 1) for o in p.overrides)
        if p.estimate is not None and chosen["checkpointing"][options["checkpointing"]].baseline:
            baseline[key(p)] = baseline[key(p, False)] = train_flops(p)
    for p in plans:
        if p.estimate is not None:
            base = baseline.get(key(p), baseline.get(key(p, False)))
            p.recompute_flops = None if base is None else max(train_flops(p) - base, 0)


def refusal(cfg: DictConfig, target: str, world_size: int = 1) -> str | None:
    """Why train.py refuses this combination of options before it builds anything (the rules
    on the classes: memexp.techniques.check_combination), or the estimate of a rank of
    `world_size` does (check_estimable), or None. The options alone are built, no model; the
    parallel option as its class, which states what the rules read (building it joins a
    process group)."""
    options = {group: build(cfg[group]) for group in registry.techniques() if group != "parallel"}
    parallel = get_class(cfg.parallel._target_)
    loss = (get_class(cfg.loss._target_) if cfg.loss._target_ in registry.target_names("loss")
            else None)
    try:
        check_combination(**options, parallel=parallel, device=torch.device(target))
        check_loss_combination(build(cfg.loss), parallel)
        check_estimable(parallel, world_size, loss)
    except ValueError as error:
        return str(error)
    return None


def not_searched() -> list[str]:
    """The technique options that no estimate traces (their class says `estimable = False`:
    compile's): plan cannot weigh them, and says so."""
    return [f"{group}={name}" for group in registry.techniques()
            for target in registry.targets(group) if not target.estimable
            for name in registry.options_of(group, target)]


def run_overrides(fixed: list[str], plan_: Plan) -> list[str]:
    """The user's overrides and the plan's, each key once: where the plan sets a key the user
    did (data.batch_size, split into micro-batches), the plan's value in the user's place."""
    own = {override.split("=", 1)[0]: override for override in plan_.overrides}
    merged = [own.pop(override.split("=", 1)[0], override) for override in fixed]
    return [*merged, *own.values()]


def command(fixed: list[str], plan_: Plan) -> str:
    return shlex.join(["python", "train.py", *run_overrides(fixed, plan_)])


def describe(arguments: list[str], budget: str, plans: list[Plan],
             allow_changes: bool = False) -> str:
    fixed, _ = split_arguments(arguments)
    fitting = [p for p in plans if p.fits]
    changing = [p for p in fitting if p.changes]
    traced = [p.estimate for p in plans if p.estimate is not None]
    ranks = traced[0].world_size if traced else 1
    per_rank = f" per rank, on {ranks} ranks" if ranks > 1 else ""
    timed = [p.estimate.step_time.gpu for p in plans if p.step_seconds is not None]
    order = (f"fastest first (predicted step time on the {timed[0]}, memexp.steptime)" if timed
             else "by what recomputation adds (a CPU estimate predicts no step time: "
                  "--target cuda --gpu NAME ranks by it)")
    search = plans[0].search if plans else None
    dominated = (f"; {len(search.dominated)} more left out untraced, each ranked after one of "
                 "them (below)" if search is not None and search.dominated else "")
    lines = [f"memexp plan: {len(fitting)} of {len(plans)} ways fit in {budget}{per_rank} "
             f"({traced[0].target if traced else 'cpu'} estimate), {order}{dominated}"]
    if search is not None and search.settled < search.candidates:
        lines.append(f"interrupted: {search.settled} of the {search.candidates} candidates "
                     "were settled, and only those are ranked")
    if search is not None:
        lines += [f"every plan keeps your {change}"
                  for change in search.own_changes]
    if changing:
        lines.append(f"{len(changing)} of them change what is learned, "
                     + ("ranked with the rest (--allow-changes)" if allow_changes else
                        "after every one that keeps it (--allow-changes ranks them by cost too)"))
    header = (f"  {'#':>2}  {'peak':>11}  {'step':>9}  {'recompute':>10}  {'moved':>10}  "
              f"{'micro':>5}  command")
    lines += ["", header]
    titles = {"changes": "fit, but change what is learned:",
              "over": "do not fit in any searched way:"}
    section = "fits"
    for number, p in enumerate(plans, 1):
        was, section = section, ("over" if not p.fits else
                                 "changes" if p.changes and not allow_changes else "fits")
        if section != was:
            lines += ["", f"  {titles[section]}"]
        peak = mib(p.peak_bytes) if p.estimate is not None else f">{mib(p.peak_bytes)}"
        recompute = ("-" if p.recompute_flops is None else
                     f"{p.recompute_flops / 1e9:.2f} G")
        step = "-" if p.step_seconds is None else duration(p.step_seconds)
        lines.append(f"  {number:>2}  {peak:>11}  {step:>9}  {recompute:>10}  "
                     f"{mib(p.transfer_bytes):>10}  {p.accumulate:>5}  {command(fixed, p)}")
        lines += [f"      changes what is learned: {change}" for change in p.changes]
    return "\n".join(lines + sources(plans) + left_out(plans))


def left_out(plans: list[Plan]) -> list[str]:
    """The candidates left out untraced (memexp.settle.DOMINATED), by the parallel options
    swapped: each the run of a plan above with its parallel option, which fits, in place of
    another that ranks after it whatever their peaks."""
    if not plans:
        return []
    swaps: dict[tuple[str, str], list[int]] = {}
    for p in plans[0].search.dominated:
        twin = p.dominated_by
        (own,) = set(p.overrides) - set(twin.overrides)
        (theirs,) = set(twin.overrides) - set(p.overrides)
        swaps.setdefault((own, theirs), []).append(plans.index(twin) + 1)
    lines = ["", "left out, untraced:"] if swaps else []
    for (own, theirs), numbers in swaps.items():
        which = ", ".join(f"#{n}" for n in sorted(numbers))
        lines.append(f"  {own} in place of {theirs} in {which}: it recomputes, moves and "
                     f"accumulates as {theirs} does and communicates more, so it ranks after "
                     "each of them, which fit, whatever its peak (memexp estimate gives it)")
    return lines


def sources(plans: list[Plan]) -> list[str]:
    """How the plans' peaks were had (memexp.settle), a line each way, where any was had
    otherwise than by a trace of the whole run."""
    ways: dict[str, list[int]] = {}
    for number, p in enumerate(plans, 1):
        ways.setdefault(p.settled.source, []).append(number)
    if set(ways) <= {TRACED_WHOLE}:
        return []
    lines = ["", "peaks:"]
    for source, numbers in ways.items():
        which = ", ".join(f"#{n}" for n in numbers)
        if source == TRACED_WHOLE:
            lines.append(f"  {which}: traced whole")
        elif plans[numbers[0] - 1].estimate is None:
            lines.append(f"  {which}: over the budget with {source}, not traced further")
        else:
            lines.append(f"  {which}: extrapolated from traces of {source} (memexp.depth); "
                         "each equals the full trace to the byte")
    return lines


def covered(search: Search) -> str:
    """The search space a plan covered, a line a group: the options tried, and the others with
    why they were left out; then the groups held at the run's own option."""
    lines = ["search space covered:"]
    for group, options in search.space.items():
        reasons: dict[str, list[str]] = {}
        for option, why in search.left_out[group].items():
            reasons.setdefault(why, []).append(option)
        left = "".join(f"; left out {', '.join(names)} ({why})"
                       for why, names in reasons.items())
        lines.append(f"  {group}: tried {', '.join(options)}{left}")
    lines += [f"  left out {count} refused: {why}" for why, count in search.refused.items()]
    lines.append("  not searched, the run's own (their classes plan no other): "
                 + ", ".join(f"{group}={choice}" for group, choice in search.fixed.items()))
    return "\n".join(lines)


def verify(arguments: list[str], plans: list[Plan], steps: int) -> str:
    """Run `plans` for real, one after another, into a plan folder (with the sweep report), and
    set each measured peak beside its estimate."""
    fixed, _ = split_arguments(arguments)
    folder = Path("outputs/plans") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    lines = [f"verified in {folder} ({steps} steps each):",
             f"  {'#':>2}  {'estimate':>10}  {'measured':>10}  {'ratio':>6}  status"]
    for number, p in enumerate(plans, 1):
        overrides = [*run_overrides(fixed, p), f"trainer.max_steps={steps}", "logger=none"]
        cfg = compose_config(overrides)
        job = Job(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                  folder / str(number), {}, overrides, folder.name)
        try:
            result = run_job(job, cfg.trainer.nproc)  # trainer.nproc: its ranks, spawned
        except Exception as error:  # recorded in its result.json; the others still run
            lines.append(f"  {number:>2}  {mib(p.peak_bytes):>10}  {'':>10}  {'':>6}  "
                         f"{type(error).__name__}: {error}")
            continue
        memory = result["memory"]
        measured = memory.get("reserved_peak_bytes") or memory["peak_bytes"]
        lines.append(f"  {number:>2}  {mib(p.peak_bytes):>10}  {mib(measured):>10}  "
                     f"{p.peak_bytes / measured:>6.3f}  {result['status']}")
    write_report(folder, None)
    return "\n".join(lines)
