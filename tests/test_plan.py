"""memexp plan, round 2: every candidate settled, each estimate as a full trace would give it
(from copies of the model with fewer blocks, memexp.depth, where the traces show them alike),
in forked workers, printed as it comes; the interface (overrides and flags in any order, each
override once in a command, --headroom, Ctrl-C)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import signal

import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from memexp import cli, depth, settle
from memexp import estimate as estimate_module
from memexp import plan as planner
from memexp.build import build_model
from memexp.estimate import compose_config, estimate
from memexp.plan import fits_in, plan, refusal
from memexp.settle import group_bound
from memexp.steptime import duration

from conftest import CPU_SMALL

# A decoder of 5 blocks, small enough that a trace takes a fraction of a second (a trace's time is
# its ops', whatever their sizes: a Hugging Face Llama's blocks run twice as many).
DECODER = ("model=transformer", "model.n_layers=5", "model.d_model=32", "model.n_heads=2",
           "data.seq_len=16", "data.batch_size=2", "data.num_train=8", "data.num_eval=4",
           *CPU_SMALL)
# A plan's other groups, held at one option (they would multiply its candidates)
PINNED = ("optim=adamw", "adapter=none", "loss=cross_entropy", "optim.accumulate=1")
# What the random candidates are drawn from: one option of each
OPTIONS = {"precision": ["fp32", "bf16", "bf16_pure"],
           "checkpointing": ["none", "full", "selective_ops", "offload"],
           "adapter": ["none", "lora"], "optim": ["adamw", "sgd_momentum", "adafactor"],
           "optim.accumulate": ["1", "2"], "loss": ["cross_entropy", "chunked_ce"],
           "parallel": ["none", "fsdp", "ddp"]}


def figures(result) -> dict:
    """An estimate's every figure: all but how long it took."""
    found = dataclasses.asdict(result)
    found.pop("seconds")
    return found


def by_depth(overrides) -> tuple:
    """The estimate of `overrides`' run from its copies at memexp.depth.DEPTHS blocks (or why
    they cannot give it), and the full trace's."""
    cfg = compose_config(list(overrides))
    world_size = cfg.trainer.nproc
    with torch.device("meta"):
        blocks = depth.repeats(build_model(cfg.model))
    copies = [depth.shallow_trace(cfg, keep, world_size=world_size) for keep in depth.DEPTHS]
    try:
        for _, trail in copies:
            if isinstance(trail, str):
                raise depth.NotAlike(trail)
        extrapolated = depth.extrapolated(copies, blocks.count)
    except depth.NotAlike as why:
        extrapolated = str(why)
    return extrapolated, estimate(cfg, world_size=world_size)


def drawn(draw: random.Random) -> list[str]:
    """A candidate drawn from OPTIONS that train.py and the estimate take, as overrides."""
    while True:
        picks = {group: draw.choice(options) for group, options in OPTIONS.items()}
        overrides = [f"{group}={option}" for group, option in picks.items()
                     if group != "parallel"]
        overrides.append(f"data.batch_size={2 // int(picks['optim.accumulate'])}")
        if picks["parallel"] != "none":
            overrides += [f"parallel={picks['parallel']}", "trainer.nproc=2"]
        cfg = compose_config([*DECODER, *overrides])
        if refusal(cfg, "cpu", cfg.trainer.nproc) is None:
            return overrides


# The draws' seed: another draws others (MEMEXP_PLAN_SEED=7 pytest tests/test_plan.py).
SEED = int(os.environ.get("MEMEXP_PLAN_SEED", "39"))


def test_an_estimate_from_copies_with_fewer_blocks_is_the_full_trace_s_to_the_byte():
    """A random candidate on a decoder of 5 blocks, and the 8B question's options: traced at 2,
    3 and 4 blocks and extrapolated to 5, every figure of the estimate (the peak and breakdown
    of each phase, the running peaks, FLOPs, ops, parameters) equals the full trace's; or the
    copies say why they cannot give it, and the plan traces the candidate whole. The 8B
    question's options are extrapolated."""
    for overrides in (drawn(random.Random(SEED)), ["adapter=lora", "loss=chunked_ce",
                                                 "precision=bf16_pure",
                                                 "checkpointing=selective_ops"]):
        extrapolated, full = by_depth([*DECODER, *overrides])
        if isinstance(extrapolated, str):
            assert overrides[0] != "adapter=lora", extrapolated
            continue
        assert figures(extrapolated) == figures(full), overrides


def test_ddp_s_first_backward_makes_its_buckets_in_the_last_block_and_is_extrapolated():
    """DDP with LoRA on 2 ranks: the first backward's first block to run (the model's last)
    makes DDP's gradient buckets as its first gradients come, moments no other block has. That
    block is a part of its own, as the first block is, and the copies give every figure of the
    full trace (they could not before: "its blocks have different moments")."""
    for checkpointing in ("none", "full"):
        extrapolated, full = by_depth([*DECODER, "adapter=lora", "parallel=ddp",
                                       "trainer.nproc=2", "optim=adamw",
                                       f"checkpointing={checkpointing}"])
        assert not isinstance(extrapolated, str), extrapolated
        assert figures(extrapolated) == figures(full)


def test_a_first_block_whose_input_is_already_offloaded_is_a_part_of_its_own_for_host_bytes():
    """checkpointing=full_offload: each block's input goes to the host as the block begins,
    the first block's in the part before the blocks (as the trail divides the trace): so the
    first block raises no running maximum of host bytes, where every later block does. For that
    kind the first block is a part of its own, and the
    copies give every figure of the full trace (they could not before: "a block's moment is at
    some depths only"), on one process and on DDP's ranks with LoRA."""
    for overrides in (["checkpointing=full_offload", "optim=adamw"],
                      ["checkpointing=full_offload", "optim=adamw", "adapter=lora",
                       "parallel=ddp", "trainer.nproc=2", "optim.accumulate=2",
                       "data.batch_size=1"]):
        extrapolated, full = by_depth([*DECODER, *overrides])
        assert not isinstance(extrapolated, str), extrapolated
        assert figures(extrapolated) == figures(full), overrides


class SpikeBeforeTheBlocks(nn.Module):
    """A peak that moves: forward makes a large temporary before its blocks run (a constant
    spike), and the blocks keep activations for backward (growing with the depth). With few
    blocks the spike is forward's peak, with many the blocks' activations are."""

    def __init__(self, vocab_size: int = 64, width: int = 64, depth: int = 12,
                 spike: int = 3 * 2**20):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, vocab_size)
        self.spike = spike

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        spike = x.new_zeros(self.spike)
        x = x + spike[0]
        del spike  # freed before the blocks run
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


SPIKE = ("model=custom", "model._target_=test_plan.SpikeBeforeTheBlocks", "data=tokens",
         "data.batch_size=8", "data.num_train=16", "data.num_eval=8", "optim=sgd", *CPU_SMALL)


def test_a_peak_that_moves_to_another_moment_at_the_model_s_depth_is_not_extrapolated():
    """Forward's peak is the spike's moment at 2, 3 and 4 blocks, and the last block's at 12:
    the peaks of the copies lie on a line, and the line misses the full trace's. The copies'
    moments, followed block by block, show where the peak goes, and the estimate is traced
    whole."""
    cfg = compose_config(list(SPIKE))
    copies = [depth.shallow_trace(cfg, keep) for keep in depth.DEPTHS]
    full = estimate(cfg)
    peaks = [result.memory["phases"]["forward"]["peak_bytes"] for result, _ in copies]
    assert peaks[2] - peaks[1] == peaks[1] - peaks[0]  # a line through the copies' peaks ...
    on_the_line = peaks[0] + (12 - depth.DEPTHS[0]) * (peaks[1] - peaks[0])
    assert full.memory["phases"]["forward"]["peak_bytes"] > on_the_line  # ... that misses it
    with pytest.raises(depth.NotAlike, match="forward's peak is at another moment"):
        depth.extrapolated(copies, 12)


def counted_shallow(plain: dict, keep: int, world_size):
    """memexp.settle's trace of a copy, each call written to the file MEMEXP_TEST_COPIES names
    (the forked workers count it there)."""
    with open(os.environ["MEMEXP_TEST_COPIES"], "a") as counted:
        counted.write(f"{keep}\n")
    return depth.shallow_trace(OmegaConf.create(plain), keep,
                               world_size=world_size)


class SpikePerSample(SpikeBeforeTheBlocks):
    """SpikeBeforeTheBlocks with a spike as large per sample as the default's at batch 8: its
    peak moves at the same depth whatever the micro-batch."""

    def forward(self, tokens: Tensor) -> Tensor:
        self.spike = 3 * 2**20 * tokens.shape[0] // 8
        return super().forward(tokens)


def test_a_recomputation_whose_copies_are_not_alike_is_traced_whole_without_more_copies(
        monkeypatch, tmp_path):
    """Without recomputation SpikePerSample's copies cannot give its figures (its forward's
    peak moves with the depth), with full checkpointing they can: once the first candidate
    without recomputation says so, the other (its micro-batches halved) is traced whole
    without tracing its copies first; those with full checkpointing are still extrapolated.
    Each estimate is the full trace's. (One worker: the order the copies are traced in is the
    order they were submitted.)"""
    counted = tmp_path / "copies"
    monkeypatch.setenv("MEMEXP_TEST_COPIES", str(counted))
    monkeypatch.setattr(settle, "_shallow", counted_shallow)
    monkeypatch.setattr(settle, "workers_for", lambda tasks: 1)
    spike = [*SPIKE, "model._target_=test_plan.SpikePerSample"]
    plans = plan([*spike, "precision=fp32", "adapter=none", "loss=cross_entropy",
                  "checkpointing=none,full", "optim.accumulate=1,2"], "1GiB")
    sources = {tuple(o for o in p.overrides if o.startswith(("checkpointing", "optim.acc"))):
               p.settled.source for p in plans}
    assert sources == {("checkpointing=none", "optim.accumulate=1"): "traced whole",
                       ("checkpointing=none", "optim.accumulate=2"): "traced whole",
                       ("checkpointing=full", "optim.accumulate=1"): "2, 3 and 4 of its 12 "
                                                                     "Sequential blocks",
                       ("checkpointing=full", "optim.accumulate=2"): "2, 3 and 4 of its 12 "
                                                                     "Sequential blocks"}
    # the copies of three candidates; of the second without recomputation, at most the one
    # a worker had begun when the first's were found not alike
    assert 3 * len(depth.DEPTHS) <= len(counted.read_text().split()) < 4 * len(depth.DEPTHS)
    for p in plans:
        assert figures(p.estimate) == figures(estimate(compose_config([*spike, *p.overrides])))


def test_the_bound_of_a_group_holds_its_state_in_the_first_step_and_no_candidate_less():
    """A group's bound is the larger of what its first optimizer step begins with (parameters
    and their gradients: twice the parameters in fp32) and ends with (parameters and AdamW's
    two moments, three times, and a float32 `step` counter each, on the run's device, the CPU
    here; SGD's: the parameters alone). On one rank of 2 under DDP, its gradient buckets too, a
    copy of every gradient that the rank's all-reduce read. No candidate of the group peaks
    below it."""
    one, ddp = ["optim=adamw"], ["optim=adamw", "parallel=ddp", "trainer.nproc=2"]
    adamw, sgd, on_ranks = (compose_config([*DECODER, "precision=fp32", *options])
                            for options in (one, ["optim=sgd"], ddp))
    with torch.device("meta"):
        weights = list(build_model(adamw.model).parameters())
    params = sum(p.numel() * 4 for p in weights)
    state = 3 * params + 4 * len(weights)
    assert group_bound(sgd) == 2 * params
    assert group_bound(adamw) == state
    assert group_bound(on_ranks, 2) >= state + params
    for group, ranks in ((one, None), (ddp, 2)):
        bound = group_bound(compose_config([*DECODER, "precision=fp32", *group]), ranks)
        for options in (["checkpointing=none"], ["checkpointing=full", "optim.accumulate=2",
                                                  "data.batch_size=1"]):
            candidate = compose_config([*DECODER, "precision=fp32", *group, *options])
            assert estimate(candidate, world_size=ranks).memory["peak_bytes"] >= bound


def test_each_plan_is_its_command_s_full_estimate_and_a_group_over_by_its_state_untraced(
        capsys, monkeypatch):
    """A plan with its overrides and flags in any order and --headroom: what a run holds in its
    first optimizer step (its parameters, their gradients, AdamW's moments) is traced once for
    the candidates that share it, and no peak of theirs is less: fp32's, over the budget less
    the headroom, leaves its candidates over without a trace of their steps, once the one
    traced first (full checkpointing, the likeliest to fit) is over.
    bf16_pure's are settled from copies of the model's 5 blocks, and each plan's printed
    command, with each override once, has a `memexp estimate` equal to the plan's to the
    byte."""
    fp32 = compose_config([*DECODER, "precision=fp32"])
    kept = group_bound(fp32)
    with torch.device("meta"):
        blocks = depth.repeats(build_model(fp32.model))
    budget = kept  # fp32 is over its 90% by its parameters alone; bf16_pure's are half
    returned = []
    monkeypatch.setattr(planner, "plan", lambda *args, **kwargs: returned.append(
        plan(*args, **kwargs)) or returned[-1])
    assert cli.main(["plan", f"budget={budget}", *DECODER[:3], "--headroom", "10%",
                     *DECODER[3:], *PINNED, "precision=fp32,bf16_pure",
                     "checkpointing=none,full"]) in (0, 1)
    out, err = capsys.readouterr()
    [plans] = returned
    assert out.splitlines()[0].split(" (")[0].endswith(
        f"ways fit in {budget} less 10% headroom")
    assert err.count("(its parameters, gradients and optimizer state alone)") == 1
    assert "over  precision=fp32 optim=adamw bn_mode=train adapter=none loss=cross_entropy " \
           "compile=none checkpointing=none optim.accumulate=1 data.batch_size=2  (its " \
           "parameters, gradients and optimizer state alone)" in err
    assert f"(2, 3 and 4 of its 5 {blocks.kind} blocks)" in err
    fp32_plan = next(p for p in plans if p.precision == "fp32")
    assert fp32_plan.estimate is None and fp32_plan.peak_bytes == kept and not fp32_plan.fits
    traced = [p for p in plans if p.estimate is not None]
    assert traced and all(p.fits == (p.peak_bytes <= 0.9 * budget) for p in traced)
    commands = [line.split("python train.py ")[1].split() for line in out.splitlines()
                if "python train.py " in line]
    for p, command in zip(plans, commands, strict=True):
        assert len({o.split("=")[0] for o in command}) == len(command)  # each override once
        if p.estimate is not None:
            assert figures(estimate(compose_config(command))) == figures(p.estimate)


def test_a_candidate_traced_whole_stops_as_its_live_bytes_pass_the_budget():
    """A candidate traced whole (ZeRO-1's: which rank holds the most state changes with the
    depth) stops at the first moment its live bytes pass the budget, and is settled over with
    those bytes: more than the budget, no more than its full estimate's peak. One that fits is
    traced to its end."""
    ranks = [*DECODER, *PINNED, "precision=fp32", "parallel=zero1", "trainer.nproc=2"]
    cfgs = {option: compose_config([*ranks, f"checkpointing={option}"])
            for option in ("none", "full")}
    peaks = {option: estimate(cfg, world_size=2).memory["peak_bytes"]
             for option, cfg in cfgs.items()}
    limit = (peaks["none"] + peaks["full"]) // 2
    assert peaks["full"] <= limit < peaks["none"]
    with torch.device("meta"):
        blocks = depth.repeats(build_model(cfgs["none"].model))
    found = {}
    settle.settle([settle.Candidate([option], cfg, ("zero1",)) for option, cfg in cfgs.items()],
                  limit, "cpu", "h100", 2, blocks,
                  lambda candidate, result: found.update({candidate.overrides[0]: result}))
    assert found["full"].source == settle.TRACED_WHOLE
    assert found["full"].estimate.memory["peak_bytes"] == peaks["full"]
    stopped = found["none"]
    assert stopped.estimate is None and stopped.source == settle.STOPPED
    assert limit < stopped.bound <= peaks["none"]


@pytest.mark.parametrize("headroom, limit", [("10%", 900), ("0.1", 900), ("100B", 900),
                                             (None, 1000)])
def test_headroom_is_a_share_of_the_budget_or_a_size(headroom, limit):
    assert fits_in("1000", headroom) == limit
    with pytest.raises(ValueError, match="--headroom"):
        fits_in("1000", "120%")


class InterruptedAfterOne:
    """stderr that gives a Ctrl-C (SIGINT) once the plan says it settled a candidate."""

    def __init__(self):
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines += text.splitlines()
        if " fits " in text or " over " in text:
            os.kill(os.getpid(), signal.SIGINT)

    def flush(self) -> None:
        pass


def test_ctrl_c_prints_what_was_settled_so_far(monkeypatch, capsys):
    """A Ctrl-C while candidates are traced: the workers end, and the plan prints the table of
    the candidates settled before it, saying so; the command exits 130."""
    # as a terminal gives it (a shell's background job starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    stderr = InterruptedAfterOne()
    monkeypatch.setattr("sys.stderr", stderr)
    try:
        code = cli.main(["plan", "budget=1GiB", "model=mlp", *CPU_SMALL, "optim=sgd",
                         "precision=fp32,bf16", "checkpointing=none,full",
                         "optim.accumulate=1"])
    finally:
        signal.signal(signal.SIGINT, previous)
    out = capsys.readouterr().out.splitlines()
    assert code == 130
    assert out[1].startswith("interrupted: ") and out[1].endswith(
        " of the 4 candidates were settled, and only those are ranked")
    settled = int(out[1].split()[1])
    assert 1 <= settled < 4
    assert sum(" python train.py " in line for line in out) >= 1
    assert any(line.startswith("memexp plan: interrupted") for line in stderr.lines)
    assert not multiprocessing.active_children()  # the workers are ended


def test_a_data_set_built_once_for_several_traces_gives_each_the_same_figures():
    """memexp plan traces one stand-in data set many times in a process (memexp.estimate
    keeps the last ones built): a trace only reads it, so the figures are a fresh set's."""
    cfg = compose_config(["model=mlp", *CPU_SMALL, "optim=sgd"])
    estimate_module._built.cache_clear()
    fresh = estimate(cfg)
    assert estimate_module._built.cache_info().currsize == 1
    again = estimate(cfg)
    assert estimate_module._built.cache_info().hits >= 1
    assert figures(again) == figures(fresh)


def test_a_plan_for_a_gpu_is_ranked_by_its_predicted_step_time(capsys, monkeypatch):
    """With --target cuda --gpu NAME each plan's estimate predicts its step time on that GPU
    (memexp.steptime): the table prints it, and ranks the plans that keep the math by it, the
    fastest first; full checkpointing recomputes the forward, so it is never the fastest."""
    returned = []
    monkeypatch.setattr(planner, "plan", lambda *args, **kwargs: returned.append(
        plan(*args, **kwargs)) or returned[-1])
    assert cli.main(["plan", "budget=80GB", "--target", "cuda", "--gpu", "a100-80gb", *DECODER,
                     *PINNED, "precision=fp32,bf16", "checkpointing=none,full"]) == 0
    out = capsys.readouterr().out.splitlines()
    [plans] = returned
    assert out[0].endswith("fastest first (predicted step time on the a100-80gb, memexp.steptime)")
    assert all(p.fits and p.estimate.step_time.gpu == "a100-80gb" for p in plans)
    times = [p.step_seconds for p in plans]
    assert times == sorted(times) and len(set(times)) == 4
    assert plans[-1].step_seconds > plans[0].step_seconds
    assert "checkpointing=none" in plans[0].overrides
    rows = [line for line in out if "python train.py " in line]
    assert all(f"  {duration(t)}  " in row for t, row in zip(times, rows, strict=True))


def test_an_option_the_user_fixed_is_said_once_not_held_against_every_plan(capsys):
    """adapter=lora alone on the command line is the user's decision: what it changes is said
    once above the table, and the plans are not all listed as changing what is learned."""
    assert cli.main(["plan", "budget=1GiB", *DECODER, "optim=adamw", "loss=cross_entropy",
                     "optim.accumulate=1", "adapter=lora", "precision=fp32",
                     "checkpointing=none,full"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("every plan keeps your adapter=lora, which changes what is "
                             "learned: only low-rank adapters train")
    assert not any("fit, but change what is learned" in line for line in out)
    assert sum("python train.py " in line for line in out) == 2


def test_zero1_is_left_out_where_its_ddp_twin_fits_and_traced_where_it_does_not(capsys):
    """ZeRO1.dominated_by: a zero1 candidate recomputes, moves and accumulates as its ddp twin
    (the same options, parallel=ddp) does and communicates more, so a CPU estimate's plan ranks
    it after the twin whatever their peaks. Where the twin fits, it is left out untraced (it
    took a whole trace of the 8B Llama each: half the 8-rank plan's time) and said once; where
    the twin is over, it is traced, and may fit where DDP does not."""
    ranks = [*DECODER, *PINNED, "precision=fp32", "trainer.nproc=2"]
    ddp = {option: estimate(compose_config([*ranks, "parallel=ddp",
                                            f"checkpointing={option}"]), world_size=2)
           for option in ("none", "full")}
    limit = (ddp["none"].memory["peak_bytes"] + ddp["full"].memory["peak_bytes"]) // 2
    assert ddp["full"].memory["peak_bytes"] <= limit < ddp["none"].memory["peak_bytes"]
    shown = []
    plans = plan([*ranks, "checkpointing=none,full"], str(limit), world_sizes=(2,),
                 show=shown.append)
    search = plans[0].search
    [left] = search.dominated
    assert left.overrides[-2:] == ["parallel=zero1", "trainer.nproc=2"]
    assert "checkpointing=full" in left.overrides and left.estimate is None
    twin = left.dominated_by
    assert twin.fits and twin.overrides == [o.replace("zero1", "ddp") for o in left.overrides]
    [traced] = [line for line in shown if "checkpointing=none" in line and "zero1" in line]
    assert " over  " in traced or " fits  " in traced  # its own trace's figure
    assert search.settled == search.candidates
    # what the ranking claims: the same recomputation and moves, more communication
    zero1 = estimate(compose_config([*ranks, "parallel=zero1", "checkpointing=full"]),
                     world_size=2)
    for key in ("forward", "backward"):
        assert zero1.flops[key] == ddp["full"].flops[key]
    assert zero1.memory.get("transfer_bytes_per_step") == ddp["full"].memory.get(
        "transfer_bytes_per_step")
    assert left.communication_rank > twin.communication_rank
    text = planner.describe([*ranks, "checkpointing=none,full"], str(limit), plans)
    assert "1 more left out untraced, each ranked after one of them (below)" in text
    assert (f"  parallel=zero1 in place of parallel=ddp in #{plans.index(twin) + 1}: it "
            "recomputes, moves and accumulates as parallel=ddp does") in text


def test_a_candidate_s_values_set_on_its_groups_compose_are_hydra_s_own():
    """plan composes once for each choice of config groups and sets the micro-batches and the
    batch split into them as values (plan.with_values): the config equals a full compose of
    the candidate's overrides, the user's own batch size overridden, and the copy it was set on
    is left as it was."""
    chosen = [*DECODER, "optim=adamw", "checkpointing=full", "parallel=ddp", "trainer.nproc=2"]
    composed = compose_config(chosen)
    before = OmegaConf.to_yaml(composed)
    values = {"optim.accumulate": 2, "data.batch_size": 1}
    made = planner.with_values(composed, values)
    full = compose_config([*chosen, "optim.accumulate=2", "data.batch_size=1"])
    assert OmegaConf.to_yaml(made) == OmegaConf.to_yaml(full)
    assert OmegaConf.is_struct(made) == OmegaConf.is_struct(full)
    assert OmegaConf.to_yaml(composed) == before
