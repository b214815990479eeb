"""memexp estimate --world-size N for parallel=ddp|zero1|fsdp: one rank traced on torch's fake
process group, against the ranks of a real run (gloo, trainer.nproc=2), each measured by
memexp's own meter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from memexp import cli
from memexp.estimate import compose_config, estimate

from conftest import CPU_SMALL, job

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
    assert result.memory["peak_bytes"] == pytest.approx(real["peak_bytes"], rel=0.02)
    assert result.memory["peak_phase"] == real["peak_phase"]
    assert result.memory["offloaded_peak_bytes"] == pytest.approx(
        real["offloaded_peak_bytes"], rel=0.02)
    assert max(r["peak_bytes"] for r in ranks) == pytest.approx(real["peak_bytes"], rel=0.02)


@pytest.mark.slow
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
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert cli.main(["estimate", "model=mlp", *CPU_SMALL, "parallel=fsdp",
                         "--world-size", "2"]) == 2
        assert "already in one" in capsys.readouterr().err
    finally:
        dist.destroy_process_group()


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
