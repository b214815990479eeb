"""memexp estimate --world-size N for parallel=ddp|zero1|fsdp: one rank traced on torch's fake
process group, against the ranks of a real run (gloo, trainer.nproc=2), each measured by
memexp's own meter."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from memexp import cli
from memexp.build import build_model
from memexp.estimate import compose_config, describe, estimate
from memexp.estimate_parallel import MOST_RANKS, RANK_BYTES, check_world_size
from memexp.gpus import gpu
from memexp.models.blocks import AUTO, resolve_blocks

from conftest import CPU_SMALL, job, needs_cuda_build

SMALL_GPT = ("model=transformer", "model.d_model=64", "model.n_layers=2", "data.seq_len=32",
             "data.batch_size=4", "data.num_train=64", "data.num_eval=16", "trainer.max_steps=2",
             "logger=none")
# Parameters of uneven sizes, which ZeRO partitions whole, largest first: at 2 ranks rank 1
# holds the most optimizer state (the two hidden 32x32 weights, 2,048 elements, against rank 0's
# 1,962 in six tensors).
UNEVEN_MLP = ("model=mlp", "model.hidden=32", "model.depth=2", "data.image_size=4",
              "optim=adam", "data.batch_size=4", "data.num_eval=16", "trainer.max_steps=2",
              "logger=none")


def real_ranks(tmp_path: Path, *overrides: str) -> list[dict]:
    """Each rank's memory report from a run with trainer.nproc=2 (conftest.job: its 2 ranks
    spawned from this process, as train.py spawns them)."""
    done = job(tmp_path / "run", "trainer.nproc=2", *overrides, "parallel.timeout_s=60")
    return done["memory"]["per_rank"]


def largest_unit_bytes(cfg) -> int:
    """The fp32 bytes of the largest of fully_shard's units (each block, and the model's
    other parameters): a unit's unsharded gradients, which its reduce-scatter reads."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    blocks = resolve_blocks(model, [AUTO], "parallel.blocks").modules
    inside = {id(p) for block in blocks for p in block.parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    return 4 * max([rest, *(sum(p.numel() for p in block.parameters()) for block in blocks)])


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    ("parallel=ddp",),
    ("parallel=zero1",),
    ("parallel=fsdp",),
    ("parallel=fsdp", "parallel.cpu_offload=true", "checkpointing=full"),
], ids=" ".join)
def test_each_rank_s_peak_is_estimated_within_2_percent_of_real_ranks(tmp_path, options):
    overrides = (*CPU_SMALL, *SMALL_GPT, *options)
    result = estimate(compose_config(list(overrides)), world_size=2)
    ranks = real_ranks(tmp_path, *SMALL_GPT, *options)
    assert (result.rank, result.world_size) == (0, 2)
    assert not dist.is_initialized()  # the fake group is gone with the estimate
    real = ranks[0]
    if "parallel.cpu_offload=true" in options:
        # gloo's worker thread holds a reduce-scatter's input (a unit's unsharded fp32
        # gradients) until it lets go of the finished work, after wait() has returned: where
        # the rank's peak comes first, that unit's bytes are in it (seen: 1,517,960 and
        # 1,450,504 B against 1,318,024, a block's 199,936 B freed on a thread of gloo's in
        # backward). The trace's collectives end at once, as the ideal run's.
        late = largest_unit_bytes(compose_config(list(overrides)))
        assert 0.98 * result.memory["peak_bytes"] <= real["peak_bytes"] <= (
            1.02 * result.memory["peak_bytes"] + late)
    else:
        assert result.memory["peak_bytes"] == pytest.approx(real["peak_bytes"], rel=0.02)
    assert result.memory["peak_phase"] == real["peak_phase"]
    assert result.memory["offloaded_peak_bytes"] == pytest.approx(
        real["offloaded_peak_bytes"], rel=0.02)
    if "parallel.cpu_offload=true" not in options:
        assert max(r["peak_bytes"] for r in ranks) == pytest.approx(real["peak_bytes"], rel=0.02)
    # With the gradients offloaded, whether a rank's peak holds a unit's reduce-scatter input
    # depends on when gloo's thread lets go of it (above): the ranks' peaks are not compared.


@pytest.mark.slow
def test_fsdp_keeps_no_gathered_parameters_between_steps():
    # Between steps a rank holds its shards and their optimizer state: fully_shard frees each
    # block's gathered parameters after use (storage.resize_(0)), as a GPU's allocator sees.
    result = estimate(compose_config([*CPU_SMALL, *SMALL_GPT, "parallel=fsdp"]), world_size=2)
    between = result.memory["phases"]["other"]["breakdown"]
    assert between["activations"] == 0
    # AdamW: 2 fp32 moments per shard (and a step count per tensor)
    assert between["optimizer"] == pytest.approx(2 * between["params"], rel=0.01)


def test_zero1_reports_the_rank_its_partition_gives_the_most(tmp_path):
    result = estimate(compose_config([*CPU_SMALL, *UNEVEN_MLP, "parallel=zero1"]),
                      world_size=2)
    ranks = real_ranks(tmp_path, *UNEVEN_MLP, "parallel=zero1")
    state = [r["phases"]["optimizer"]["breakdown"]["optimizer"] for r in ranks]
    assert result.heaviest_rank == result.rank == state.index(max(state)) == 1
    assert result.other_rank["rank"] == 0
    breakdown = result.memory["phases"]["optimizer"]["breakdown"]
    assert breakdown["optimizer"] == state[1]  # its sharded Adam state, to the byte
    assert result.memory["peak_bytes"] == pytest.approx(ranks[1]["peak_bytes"], rel=0.02)


def test_the_world_size_is_refused_where_it_cannot_be_estimated(capsys):
    assert cli.main(["estimate", "model=mlp", *CPU_SMALL, "--world-size", "2"]) == 2
    assert "--world-size 2 with parallel=none" in capsys.readouterr().err
    assert cli.main(["estimate", "model=mlp", *CPU_SMALL, "parallel=ddp",
                     "--world-size", "0"]) == 2
    assert "--world-size 0: must be >= 1" in capsys.readouterr().err
    # a loss that applies the head outside forward: DDP's trace on the fake group marks the
    # head's weight ready twice (a RuntimeError deep in the reducer, before this refusal)
    assert cli.main(["estimate", "model=transformer", *CPU_SMALL, "loss=chunked_ce",
                     "parallel=ddp", "--world-size", "2"]) == 2
    assert ("loss=chunked_ce --world-size 2: the rank's trace builds DDP"
            in capsys.readouterr().err)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert cli.main(["estimate", "model=mlp", *CPU_SMALL, "parallel=fsdp",
                         "--world-size", "2"]) == 2
        assert "already in one" in capsys.readouterr().err
    finally:
        dist.destroy_process_group()


TINY_MLP = ("model=mlp", "model.hidden=8", "model.depth=1", "data.image_size=4",
            "data.batch_size=4", "data.num_train=32", "data.num_eval=8")


@pytest.mark.parametrize("option", ["ddp", "zero1", "fsdp"])
def test_a_world_that_cannot_be_traced_is_refused_before_its_group_is_made(option):
    """torch's init_process_group keeps a dict of every rank: at 10**9 ranks it grew past the
    host's memory (OOM-killed, or a raw MemoryError) before the trace met any check. More ranks
    than the samples (8 batches of 4 here) are refused before the group is made: the refusal
    allocates less than the group's least bookkeeping for that world (RANK_BYTES a rank;
    joining it first, as before, took 85 MB of Python objects at 10**6 ranks). More ranks than
    c10d counts (2**31, a raw TypeError before) are refused by name."""
    cfg = compose_config([*CPU_SMALL, *TINY_MLP, f"parallel={option}"])
    with pytest.raises(ValueError, match="is more than the 32 training samples"):
        estimate(cfg, world_size=9)  # the modules a trace imports, imported before it is measured
    world = 10**6
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"^data.batch_size=4 x {world} rank\(s\) is more "
                                             r"than the 32 training samples$"):
            estimate(cfg, world_size=world)
        allocated = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert allocated < world * RANK_BYTES and not dist.is_initialized()
    with pytest.raises(ValueError, match=r"^--world-size 2147483648: more ranks than torch's "
                                         r"process groups count \(a C int: at most 2147483647\)$"):
        estimate(cfg, world_size=2**31)


def test_more_ranks_than_the_machine_can_hold_the_groups_bookkeeping_of_are_refused():
    """The bound is this machine's physical memory over RANK_BYTES: the first world past it is
    refused in one line, with the figures; a world within it is left to the other checks."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    beyond = min(memory // RANK_BYTES + 1, MOST_RANKS)
    if beyond == MOST_RANKS:
        pytest.skip("this machine's memory holds the bookkeeping of as many ranks as c10d counts")
    with pytest.raises(ValueError, match=rf"^--world-size {beyond}: more ranks than a process "
                                         r"group can hold on this machine: torch keeps at least "
                                         rf"{RANK_BYTES} B .* GiB of memory$"):
        check_world_size(beyond)
    check_world_size(beyond - 1)


@pytest.mark.slow
def test_plan_at_world_size_2_picks_a_sharded_plan_that_fits_when_run(tmp_path, monkeypatch,
                                                                      capsys):
    """Per rank, ddp needs 2.93 MiB, zero1 2.51 and fsdp 2.49 (estimated): in 2.7 MiB zero1,
    the least communicated option that fits, is the plan; run with trainer.nproc=2, its
    largest rank is measured at its estimate."""
    monkeypatch.chdir(tmp_path)  # the plan folder, outputs/plans
    assert cli.main(["plan", "budget=2.7MiB", *CPU_SMALL, *SMALL_GPT, "precision=fp32",
                     "optim=adamw", "checkpointing=none", "optim.accumulate=1",
                     "--world-size", "2", "--verify", "1", "--verify-steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert "over  precision=fp32 optim=adamw" in err and "parallel=ddp" in err  # tried first
    assert "fit in 2.7MiB per rank, on 2 ranks" in out
    plans = out[out.index("command\n"):].splitlines()
    assert "parallel=zero1 trainer.nproc=2" in plans[1]
    verified = out[out.index("verified in"):].splitlines()[2].split()
    ratio, status = float(verified[-2]), verified[-1]
    assert status == "ok" and ratio == pytest.approx(1, abs=0.02)


def test_plan_leaves_out_a_combination_train_py_refuses_and_says_why(capsys):
    """torch's Adafactor cannot step FSDP2's sharded parameters (seen: `aten.pow_.Scalar:
    in-place operations that require placement changes are not supported`, which ended the
    README's `plan --world-size 2,4`): plan estimates ddp and zero1 and leaves fsdp out with
    check_combination's reason, instead of failing on it."""
    assert cli.main(["plan", "budget=1KiB", *CPU_SMALL, *SMALL_GPT, "precision=fp32",
                     "optim=adafactor", "checkpointing=none", "optim.accumulate=1",
                     "adapter=none", "--world-size", "2"]) == 1  # nothing fits in 1 KiB
    out, err = capsys.readouterr()
    assert "over  precision=fp32 optim=adafactor" in err and "parallel=zero1" in err
    assert "parallel=fsdp trainer.nproc=2: optim=adafactor with parallel=fsdp" in err
    assert ("left out 1 refused: optim=adafactor with parallel=fsdp: torch's Adafactor squares"
            in out)


def test_plan_plans_each_world_size_once(capsys):
    """--world-size 2,2 planned 2 ranks twice: every candidate estimated again."""
    assert cli.main(["plan", "budget=1KiB", *CPU_SMALL, *TINY_MLP, "precision=fp32",
                     "optim=adamw", "checkpointing=none", "optim.accumulate=1", "adapter=none",
                     "parallel=ddp", "--world-size", "2,2"]) == 1  # nothing fits in 1 KiB
    assert capsys.readouterr().err.count("memexp plan: settling") == 1


def test_a_ranks_ddp_prints_no_advice_of_torchs_into_an_estimate(tmp_path):
    """A rank's DDP searches for unused parameters; torch's reducer then printed, in C++ on
    stderr, once a process, "find_unused_parameters=True was specified in DDP constructor, but
    did not find any unused parameters": into `memexp estimate` and `memexp plan`. Once a
    process, so a process of its own: the rank's DDP as the trace builds it, one step."""
    script = ("import torch\n"
              "from torch import nn\n"
              "from memexp.estimate_parallel import fake_rank\n"
              "from memexp.techniques.parallel import DDP\n"
              "with fake_rank(0, 2):\n"
              "    model = DDP().apply(nn.Linear(4, 4), None)\n"
              "    model(torch.ones(2, 4)).sum().backward()\n")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "find_unused_parameters" not in ran.stderr, ran.stderr


# fully_shard's split of a parameter across ranks: even, uneven, fewer rows than ranks (padded
# with empty chunks), no rows, another dimension, and an 8B Llama's embedding at 128 ranks.
@pytest.mark.parametrize("shape, count, dim", [
    ((10, 4), 2, 0), ((10, 4), 4, 0), ((3, 5), 8, 0), ((0, 3), 4, 0), ((7, 6), 3, 1),
    ((128256, 4096), 128, 0)])
def test_a_rank_makes_fully_shard_s_chunks_when_read_as_torch_makes_them(shape, count, dim):
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from memexp.estimate_parallel import Chunks, fake_rank

    tensor = torch.empty(shape, device="meta")
    made = _fsdp_param._chunk_with_empty(tensor, count, dim)
    when_read = Chunks(tensor, count, dim)
    assert len(when_read) == len(made) == count
    for chunk, read in zip(made, when_read, strict=True):
        assert (read.shape, read.stride(), read.storage_offset()) == (
            chunk.shape, chunk.stride(), chunk.storage_offset())
        assert read.numel() == 0 or read._base is tensor  # a view, as torch.chunk's
    with fake_rank(0, 2):  # only while a rank is traced
        assert _fsdp_param._chunk_with_empty is Chunks
    assert _fsdp_param._chunk_with_empty is not Chunks


# -- --target cuda ---------------------------------------------------------------------------------
def nccl_line(text: str) -> str | None:
    return next((line for line in text.splitlines() if line.startswith("  + NCCL")), None)


def test_a_rank_s_cuda_estimate_adds_nccl_s_buffers_on_a_line_of_their_own(monkeypatch):
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")  # the CPU stand-in: the same lines
    cfg = compose_config([*CPU_SMALL, *SMALL_GPT, "model.n_layers=1", "data.num_train=16",
                          "data.num_eval=8", "parallel=fsdp"])
    nccl = gpu("h100").nccl_buffers
    for world_size, expected in ((2, nccl.nbytes), (1, 0)):  # one rank has no peer
        result = estimate(cfg, "cuda", "h100", world_size=world_size)
        memory = result.memory
        assert memory["nccl_bytes"] == expected
        # outside torch's allocator, as the context is: in the device total, not in reserved
        assert memory["device_peak_bytes"] == (memory["reserved_peak_bytes"]
                                               + memory["context_bytes"] + expected)
        line = nccl_line(describe(cfg, result))
        if world_size == 1:
            assert line is None
        else:
            assert line.split()[2:4] == ["160.0", "MiB"] and nccl.source in line
    assert nccl.source.startswith("not measured: ") and "NCCL_BUFFSIZE" in nccl.source


@pytest.mark.cudabuild
@needs_cuda_build
def test_the_cuda_build_traces_an_fsdp_rank_on_its_fake_group(monkeypatch):
    """fully_shard on CUDA's kernels: its gather and reduce streams, events and pinned CPU
    offload, on the fake device. What it shards is what it shards on the CPU stand-in, to
    the byte: the sharded state on the host at every phase's peak, and the gathered parameters
    in eval. (Backward's peak comes at another moment on CUDA's kernels, whose activations
    differ: there the head's backward, while the final norm's unit is still gathered, 1,024 B
    more parameters than at the stand-in's, a block's reduce-scatter later.)"""
    cfg = compose_config([*CPU_SMALL, *SMALL_GPT, "parallel=fsdp", "parallel.cpu_offload=true",
                          "precision=bf16"])
    result = estimate(cfg, "cuda", "h100", world_size=2)
    assert (result.trace, result.rank, result.world_size) == ("cuda", 0, 2)
    calls = result.device["runtime_calls"]
    assert calls["cudaStreamCreateWithPriority"] > 0 and calls["cudaStreamWaitEvent"] > 0
    assert result.memory["offloaded_peak_bytes"] > 0  # the sharded state, pinned on the host
    assert result.memory["nccl_bytes"] == gpu("h100").nccl_buffers.nbytes
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")
    stand_in = estimate(cfg, "cuda", "h100", world_size=2)
    categories = [(phase, "offloaded") for phase in ("forward", "backward", "optimizer", "eval")]
    for phase, category in (*categories, ("eval", "params")):
        assert (result.memory["phases"][phase]["breakdown"][category]
                == stand_in.memory["phases"][phase]["breakdown"][category] > 0), (phase, category)


@pytest.mark.cudabuild
@needs_cuda_build
@pytest.mark.parametrize("option", ["ddp", "zero1"])
def test_the_cuda_build_traces_a_ddp_rank_on_its_fake_group(monkeypatch, option):
    """DistributedDataParallel's reducer on CUDA's kernels: its pinned host copy of the used
    parameters' map, and the events its logger times, on the fake device. Its buckets and
    ZeRO's shard of the state are what they are on the CPU stand-in, to the byte, in every
    phase. (SGD's momentum: Adam's step counts sit on the host on CUDA, and on the stand-in's
    one device.)"""
    cfg = compose_config([*CPU_SMALL, *SMALL_GPT, f"parallel={option}", "optim=sgd_momentum"])
    result = estimate(cfg, "cuda", "h100", world_size=2)
    assert (result.trace, result.world_size) == ("cuda", 2)
    assert result.device["runtime_calls"]["cudaEventElapsedTime"] > 0
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")
    stand_in = estimate(cfg, "cuda", "h100", world_size=2)
    for phase, figures in stand_in.memory["phases"].items():
        for category in ("params", "grads", "optimizer"):
            assert (result.memory["phases"][phase]["breakdown"][category]
                    == figures["breakdown"][category]), (phase, category)
    assert all(stand_in.memory["phases"]["optimizer"]["breakdown"][category] > 0
               for category in ("params", "grads", "optimizer"))
