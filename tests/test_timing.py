"""Time and memory measured apart: memory on the first steps (tracker on), time on the rest;
the report's time ratios from untracked steps, with their spread, and never a fastest config
named on an uncertain one. Nothing here depends on how fast anything runs."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch
from hydra import compose, initialize_config_dir
from test_report import chosen_techniques, config_of, rows_of

from memexp import timing as timing_module
from memexp.config import config_dir
from memexp.device import free_cached_memory
from memexp.memory import LiveStorageTracker
from memexp.report import pick, ratio_notes
from memexp.timing import MachineLoad, step_timing

from conftest import train

MIB = 2**20
MLP = ("model=mlp", "data.batch_size=16", "data.num_train=256", "data.num_eval=64")


@pytest.mark.parametrize("overrides", [
    (*MLP, "optim=adam"),
    ("model.width=4", "model.blocks_per_stage=[1,1,1,1]", "data.image_size=16",
     "data.batch_size=8", "data.num_train=64", "data.num_eval=16", "optim=sgd_momentum",
     "checkpointing=full"),
], ids=["mlp adam", "resnet momentum checkpointing"])
def test_memory_of_the_first_steps_is_the_memory_of_every_step(overrides):
    every, _ = train(*overrides, "memory.measure_steps=null", steps=6)
    first, metrics = train(*overrides, "memory.measure_steps=2", steps=6)
    # every figure, the evaluation's included (measured after step 2 on two batches)
    assert first.meter.report() == every.meter.report()
    timing = first.summary_metrics()["timing"]
    assert metrics.measured_steps == [1, 2]
    assert timing["measured_steps"] == [[1, 2]] and timing["timed_steps"] == [[3, 6]]
    assert timing["tracked"] is False
    # the run's accuracy is the last evaluation's, not the measured one's
    assert metrics.eval_accuracy == every.metrics.eval_accuracy


def test_a_run_too_short_for_untracked_steps_says_its_time_is_tracked():
    trainer, _ = train(*MLP, "memory.measure_steps=10", steps=3)
    timing = trainer.summary_metrics()["timing"]
    assert timing["tracked"] is True and timing["measured_steps"] == [[1, 3]]
    _, untracked = train(*MLP, "memory.track=false", steps=3)
    assert untracked.measured_steps == []


def test_step_timing_takes_untracked_steps_past_warmup():
    times = [9.0, 8.0, 7.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    timing = step_timing(times, measured=[1, 2, 3], warmup_steps=4, others_share=0.5,
                         baseline_times=[], unpaired="the run is its own baseline", spread=0.1)
    assert timing["timed_steps"] == [[5, 8]]
    assert timing["step_time_s"] == 3.5 and timing["step_time_iqr_s"] == [2.75, 4.25]
    assert timing["busy"] is True
    assert timing["paired"] == {"skipped": "the run is its own baseline"}
    assert step_timing(times, [1, 2, 3], 1, 0.0, [], None, 0.1)["timed_steps"] == [[4, 8]]
    # every step measured: the tracked ones past warm-up
    tracked = step_timing(times[:3], [1, 2, 3], 1, None, [], None, 0.1)
    assert tracked["tracked"] is True and tracked["timed_steps"] == [[2, 3]]


def test_the_paired_ratio_is_the_median_of_the_step_by_step_ratios_over_timed_steps():
    times = [9.0, 9.0, 2.0, 3.0, 4.0, 6.0, 1.5]
    # the baseline beside steps 3-7; step 3 is warm-up, so it is not timed and not paired
    beside = [[3, 1.0], [4, 2.0], [5, 2.0], [6, 2.0], [7, 1.0]]
    paired = step_timing(times, [1, 2], 3, None, beside, None, 0.1)["paired"]
    # step-by-step ratios 1.5, 2.0, 3.0, 1.5
    assert paired == {"steps": [[4, 7]], "baseline_step_time_s": 2.0, "ratio": 1.75,
                      "ratio_iqr": [1.5, 2.25], "settled": False}


def test_the_step_time_is_of_the_steps_that_ran_alone_where_enough_did():
    times = [9.0, 9.0, 2.0, 3.0, 4.0, 6.0, 1.5, 1.0, 1.0, 1.5, 1.0]
    beside = [[4, 2.0], [5, 2.0], [6, 2.0]]  # two models taking turns: slower steps
    timing = step_timing(times, [1, 2], 3, None, beside, None, 0.1)
    assert timing["timed_steps"] == [[7, 11]] and timing["step_time_s"] == 1.0
    assert timing["beside_baseline"] is False and timing["paired"]["steps"] == [[4, 6]]
    # fewer than ALONE_STEPS alone: every untracked step, and the record says so
    timing = step_timing(times[:8], [1, 2], 3, None, beside, None, 0.1)
    assert timing["timed_steps"] == [[4, 8]] and timing["beside_baseline"] is True
    # no step ran alone
    timing = step_timing(times[:6], [1, 2], 3, None, beside, None, 0.1)
    assert timing["timed_steps"] == [[4, 6]] and timing["beside_baseline"] is True
    # a baseline that failed after its first pairs: the partial ratio says why it stopped
    stopped = step_timing(times, [1, 2], 3, None, beside, "the baseline failed", 0.1)["paired"]
    assert stopped["steps"] == [[4, 6]] and stopped["stopped"] == "the baseline failed"


@pytest.mark.parametrize("overrides", [
    ("model=transformer", "model.dropout=0.2", "model.n_layers=2", "model.d_model=32",
     "data.batch_size=4", "data.seq_len=16", "data.num_train=128", "data.num_eval=8",
     "checkpointing=full"),
    (*MLP, "optim.accumulate=4", "data.batch_size=4"),
], ids=["transformer dropout checkpointing", "mlp accumulate"])
def test_a_run_times_its_baseline_beside_it_and_trains_as_it_would_alone(overrides):
    alone, _ = train(*overrides, "memory.measure_steps=3", "timing.paired_steps=0", steps=14)
    # spread 0: the pairs run to their cap, 6, on a machine of any speed (from 5 pairs a steady
    # ratio would settle, and only where the machine is quiet)
    paired, metrics = train(*overrides, "memory.measure_steps=3", "timing.paired_steps=6",
                            "timing.paired_spread=0", steps=14)
    # the same losses and weights, to the bit: the baseline beside it took none of its random
    # numbers (dropout), data or state
    assert metrics.losses == alone.metrics.losses
    for mine, theirs in zip(paired.model.parameters(), alone.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    # steps 4-9 ran beside a baseline step (6 of them); the ratio is over the timed ones
    timing = paired.summary_metrics()["timing"]
    assert [step for step, _ in metrics.baseline_step_times] == [4, 5, 6, 7, 8, 9]
    assert timing["paired"]["steps"] == [[4, 9]] and timing["paired"]["ratio"] > 0
    # its own step time is of the steps after the pairs, which ran alone
    assert timing["timed_steps"] == [[10, 14]] and timing["beside_baseline"] is False
    assert alone.summary_metrics()["timing"]["paired"] == {"skipped": "timing.paired_steps=0"}


def test_the_pairs_stop_once_their_ratio_settles_and_an_unsettled_ratio_is_uncertain():
    """timing.paired_steps is a cap: a spread this wide settles at MIN_PAIRS pairs, whatever
    the machine's speed, and the steps after them run alone. A ratio whose pairs ran out
    before it settled (4 pairs, fewer than MIN_PAIRS) is marked uncertain in the report."""
    trainer, metrics = train(*MLP, "optim.accumulate=2", "data.batch_size=8",
                             "memory.measure_steps=3", "timing.paired_steps=30",
                             "timing.paired_spread=1000", steps=16)
    timing, pairs = trainer.summary_metrics()["timing"], timing_module.MIN_PAIRS
    assert [step for step, _ in metrics.baseline_step_times] == list(range(4, 4 + pairs))
    assert timing["paired"]["settled"] is True
    assert timing["timed_steps"] == [[4 + pairs, 16]] and not timing["beside_baseline"]
    short = step_timing([1.0] * 10, [1, 2], 3, None, [[s, 1.0] for s in range(4, 8)], None,
                        1000)["paired"]
    assert short["settled"] is False
    record = result(["checkpointing=full"], 1.3, paired=1.3, checkpointing="full")
    record["metrics"]["timing"]["paired"] |= {"settled": False}
    rows = rows_of(result(["checkpointing=none"], 1.0), record)
    assert rows[1].time_doubt.startswith("its step-by-step ratios had not settled")


def test_the_median_interval_covers_the_median_with_90_percent_whatever_the_distribution():
    """The k-th lowest and highest of n draws miss the median when k or more fall on one side:
    its coverage, exact from the binomial, and checked on draws of a skewed distribution (the
    step times of a shared machine are)."""
    ranks = {n: timing_module.median_interval_rank(n) for n in range(1, 13)}
    assert timing_module.MIN_PAIRS == 5
    assert ranks == {1: None, 2: None, 3: None, 4: None, 5: 1, 6: 1, 7: 1, 8: 2, 9: 2, 10: 2,
                     11: 3, 12: 3}
    generator = torch.Generator().manual_seed(0)
    draws = torch.empty(20_000, 8).exponential_(generator=generator).tolist()
    median = math.log(2)  # the exponential's
    covered = [lo <= median <= hi for lo, hi in map(timing_module.median_interval, draws)]
    assert abs(sum(covered) / len(covered) - 0.9297) < 0.01  # 1 - 2 * 9/256


def test_a_steady_ratio_settles_after_5_pairs_and_a_wide_interval_does_not_settle():
    """Five ratios within 10% of their median settle; eight whose interquartile range is
    within 10% but whose 90% interval of the median is not (two far off at each end) do not."""
    times, measured = [1.0] * 20, [1, 2]
    steady = [[4 + i, 1 / r] for i, r in enumerate([1.0, 1.05, 0.97, 1.02, 0.99])]
    assert step_timing(times, measured, 3, None, steady, None, 0.1)["paired"]["settled"]
    wide = [[4 + i, 1 / r] for i, r in enumerate([0.7, 0.8, 0.98, 1.0, 1.0, 1.0, 1.05, 1.4])]
    paired = step_timing(times, measured, 3, None, wide, None, 0.1)["paired"]
    assert paired["ratio_iqr"][1] - paired["ratio_iqr"][0] <= 0.1 and not paired["settled"]


def test_the_quick_sweep_has_the_steps_its_figures_need():
    """experiment=quick (`make run`) is sized to its figures: its measured steps run the leak
    check (3 growths past warm-up, memexp.memory.meter.find_leak), and at least ALONE_STEPS run
    alone after the most pairs it may take, for its own step time."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=quick"])
    measured, pairs = cfg.memory.measure_steps, cfg.timing.paired_steps
    assert measured - max(cfg.trainer.warmup_steps, 1) >= 4
    assert cfg.trainer.max_steps - measured - pairs >= timing_module.ALONE_STEPS


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_times_its_baseline_beside_it_and_its_counters_leave_the_baseline_out():
    overrides = ("trainer.device=cuda", "model=transformer", "model.n_layers=2",
                 "data.num_train=512", "checkpointing=full", "memory.measure_steps=3")

    def run(paired_steps: int) -> tuple[dict, list, list, list]:
        trainer, metrics = train(*overrides, f"timing.paired_steps={paired_steps}", steps=14)
        phases = trainer.meter.report()["phases"]
        peaks = {name: phase["peak_bytes"] for name, phase in phases.items()}
        counted = trainer.meter.live_after_steps
        del trainer  # its model and optimizer state leave the device before the next run
        free_cached_memory(torch.device("cuda"))
        return peaks, counted, metrics.losses, metrics.baseline_step_times

    alone, alone_counted, alone_losses, _ = run(0)
    paired, counted, losses, beside = run(6)
    assert losses == alone_losses
    assert [step for step, _ in beside] == [4, 5, 6, 7, 8, 9]
    # CUDA's counters stood aside while the baseline ran, and counted steps 10-14 and the
    # evaluation again: every peak is the run's own (allocated bytes; the reserved peak is
    # taken before the baseline)
    assert paired == alone
    # leak detection looks at the steps before the baseline only: the steps after it do not
    # follow on from them
    assert len(counted) == 3 and len(alone_counted) == 14


@pytest.mark.parametrize(("overrides", "why"), [
    ((), "the run is its own baseline"),
    (("checkpointing=full", "memory.measure_steps=null"), "every step of the run measured memory"),
    (("checkpointing=full", "memory.budget=1GiB"), "every step of the run measured memory"),
], ids=["baseline", "measure every step", "budget"])
def test_a_run_without_a_baseline_beside_it_says_why(overrides, why):
    trainer, _ = train(*MLP, *overrides, steps=4)
    assert trainer.summary_metrics()["timing"]["paired"]["skipped"].startswith(why)


def test_a_baseline_that_runs_out_of_memory_beside_the_run_is_dropped_and_the_run_goes_on():
    """Accumulation makes a batch fit that does not: the baseline's batch of 32 (the run's 4
    micro-batches of 8) meets a real CPU allocation failure in its first step. The run trains
    on, its own figures stand, and its record says why it has no paired ratio."""
    overrides = ("model=custom", "model._target_=chaos.Chaos", "+model.mode=oom",
                 "+model.oom_above=8", "data.batch_size=8", "optim.accumulate=4",
                 "data.num_train=256", "data.num_eval=16", "memory.measure_steps=2")
    trainer, metrics = train(*overrides, steps=5)
    assert metrics.baseline_step_times == [] and len(metrics.losses) == 5
    skipped = trainer.summary_metrics()["timing"]["paired"]["skipped"]
    assert skipped.startswith("the baseline ran out of memory beside the run: RuntimeError:")
    assert trainer.summary_metrics()["step_time_s"] > 0


def test_machine_load_counts_other_processes():
    load = MachineLoad()
    load.start()
    # another process keeps a core busy while this one sleeps
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                               "while time.time() - t < 1.5: pass"])
    burner.wait()
    time.sleep(0.1)
    share = load.others_share(load.own_cpu())
    assert share is not None and 0.2 < share <= 1.0


def test_the_peak_is_classified_as_it_was_at_the_peak():
    roles: dict[int, str] = {}
    tracker = LiveStorageTracker(lambda: dict(roles))
    with tracker:
        tracker.enter("forward")
        a = torch.zeros(MIB // 4)
        b = torch.zeros(MIB // 4)  # the peak: a and b
        roles[id(b.untyped_storage())] = "params"  # a role given after the peak
        del a  # freed after the peak: still counted, at its size then
        c = torch.zeros(MIB // 8)  # after the peak, no new one: not counted
        tracker.enter("other")
    breakdown = tracker.settled_peaks()["forward"].breakdown
    assert breakdown["activations"] == MIB and breakdown["params"] == MIB
    assert sum(breakdown.values()) == 2 * MIB
    del b, c


# -- the report ----------------------------------------------------------------------------------
def result(overrides: list[str], step: float, spread: float = 0.01, peak: int | None = 100,
           tracked_time: bool = False, busy: bool = False, batch: int = 64,
           accumulate: int = 1, paired: float | None = None, beside: bool = False,
           **techniques) -> dict:
    chosen = chosen_techniques(**techniques)
    timing = {"step_time_s": step, "step_time_iqr_s": [step - spread, step + spread],
              "tracked": tracked_time, "busy": busy, "beside_baseline": beside,
              "paired": {"skipped": "timing.paired_steps=0"} if paired is None else
              {"ratio": paired, "ratio_iqr": [paired - 0.02, paired + 0.02]}}
    return {"status": "ok", "overrides": overrides, "techniques": chosen,
            "config": {**config_of(chosen), "data": {"batch_size": batch},
                       "optim": {**config_of(chosen)["optim"], "accumulate": accumulate}},
            "memory": {"peak_bytes": peak * MIB if peak else None, "tracked": peak is not None},
            "metrics": {"step_time_s": step, "throughput": batch / step,
                        "throughput_unit": "samples/s", "eval_accuracy": 0.5, "timing": timing}}


def test_time_ratios_come_from_untracked_steps_even_without_tracking():
    rows = rows_of(result(["memory.track=false"], 1.0, peak=None),
                   result(["checkpointing=full"], 1.3, peak=60, checkpointing="full"),
                   result(["checkpointing=offload"], 1.1, peak=50, tracked_time=True,
                          checkpointing="offload"))
    assert [r.step_time_ratio for r in rows] == [1.0, pytest.approx(1.3), None]
    assert rows[1].step_time_range == pytest.approx((1.29 / 1.01, 1.31 / 0.99))
    # no measured peak, no memory ratio; the full row is the memory baseline
    assert [r.memory_ratio for r in rows] == [None, 1.0, pytest.approx(50 / 60)]


def test_accumulation_at_the_same_samples_per_step_is_compared_with_the_baseline():
    rows = rows_of(result(["optim.accumulate=1", "data.batch_size=64"], 1.0),
                   result(["optim.accumulate=4", "data.batch_size=16"], 1.1, batch=16,
                          accumulate=4),
                   result(["optim.accumulate=4", "data.batch_size=64"], 4.0, accumulate=4))
    assert rows[0].workload == rows[1].workload != rows[2].workload
    assert rows[1].step_time_ratio == pytest.approx(1.1) and rows[2].step_time_ratio == 1.0


def test_an_uncertain_ratio_is_marked_and_never_names_the_fastest():
    base = result(["checkpointing=none"], 1.0)
    close = result(["checkpointing=offload"], 0.99, spread=0.05, checkpointing="offload")
    clear = result(["checkpointing=full"], 1.5, checkpointing="full")
    rows = rows_of(base, close, clear)
    assert rows[1].time_doubt == "its spread overlaps 1.0" and rows[2].time_doubt is None
    choice = pick(rows, 200 * MIB)
    assert choice.fastest is None and choice.fastest_doubt == "job 0 within job 1's timing spread"
    # without the close one, the fastest is named; a busy machine takes that back
    assert pick(rows_of(base, clear), 200 * MIB).fastest.job == "0"
    busy = rows_of(base, result(["checkpointing=full"], 1.5, busy=True, checkpointing="full"))
    assert "busy during job 1" in busy[1].time_doubt
    assert pick(busy, 200 * MIB).fastest is None


def test_a_ratio_timed_beside_the_baseline_is_the_reports_where_that_baseline_is_the_bases():
    rows = rows_of(
        result(["optim=sgd", "checkpointing=none"], 1.0),
        # timed beside its baseline (sgd, none): that ratio, not the medians' 1.6
        result(["optim=sgd", "checkpointing=full"], 1.6, paired=1.3, checkpointing="full"),
        # its baseline would be adamw's, which is not the base: the medians' ratio
        result(["optim=adamw", "checkpointing=full"], 1.5, paired=1.2, checkpointing="full",
               optim="adamw"),
        # four micro-batches of 16 beside one batch of 64, the base's
        result(["optim=sgd", "optim.accumulate=4", "data.batch_size=16"], 1.1, batch=16,
               accumulate=4, paired=1.25))
    assert rows[0].workload == rows[1].workload == rows[2].workload == rows[3].workload
    assert [r.step_time_ratio for r in rows] == [1.0, 1.3, 1.5, 1.25]
    assert rows[1].step_time_range == (1.28, 1.32)
    assert [r.time_paired for r in rows] == [None, True, False, True]
    notes = "\n".join(ratio_notes(rows))
    assert "jobs 1 and 3: step time x base timed beside the baseline" in notes
    assert "job 2: step time x base divides the medians of two runs" in notes
    # a busy machine during the base's run does not touch a ratio timed beside the baseline
    busy_base = rows_of(result(["checkpointing=none"], 1.0, busy=True),
                        result(["checkpointing=full"], 1.6, paired=1.3, checkpointing="full"))
    assert busy_base[1].time_doubt is None
    # a median of steps that all took turns with a baseline's is slower than the step alone:
    # a ratio of medians from it is uncertain, and names no fastest config
    beside = rows_of(result(["optim=sgd"], 1.0),
                     result(["optim=adamw", "checkpointing=full"], 1.5, paired=1.2,
                            beside=True, checkpointing="full", optim="adamw"))
    assert beside[1].time_doubt == ("job 1 timed no step alone, only beside their baseline's, "
                                    "which slows a step")
    assert pick(beside, 200 * MIB).fastest is None


def test_the_fastest_config_is_picked_on_the_ratio_timed_beside_the_baseline():
    """A run's own median (here 1.6 s, from its process) would make the base the faster; the
    ratio timed beside the base's config says it is 0.8x the base's time. Steps that all ran
    beside the baseline do not stop the pick where that ratio is the one used."""
    rows = rows_of(result(["checkpointing=none"], 1.0),
                   result(["checkpointing=full"], 1.6, paired=0.8, beside=True,
                          checkpointing="full"))
    choice = pick(rows, 200 * MIB)
    assert choice.fastest is rows[1] and choice.fastest_doubt is None
