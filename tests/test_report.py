"""The report's logic: sizes, baselines per workload, the Pareto front and the budget pick.
(The report of a real sweep is checked in test_sweep.py.)"""

from __future__ import annotations

import pytest
import yaml

from memexp.baseline import is_baseline
from memexp.config import config_dir
from memexp.memory.sizes import parse_size
from memexp.report import (
    HALF_MARK,
    add_ratios,
    describe_rows,
    markdown_table,
    pick,
    ratio_notes,
)
from memexp.rows import Row, pareto_front

GIB = 2**30


@pytest.mark.parametrize(("text", "expected"), [
    ("12GiB", 12 * GIB), ("16GB", 16 * 10**9), ("500 MiB", 500 * 2**20), ("1024", 1024),
    ("1.5gib", int(1.5 * GIB)),
])
def test_sizes(text, expected):
    assert parse_size(text, "report.budget") == expected


@pytest.mark.parametrize("text", ["lots", "12 apples", "-1GiB", "", "0GiB"])
def test_bad_sizes_name_the_key_and_the_units(text):
    with pytest.raises(ValueError, match=r"report.budget=.*expected a positive size such as 12GiB"):
        parse_size(text, "report.budget")


def test_pareto_front_keeps_what_nothing_certainly_beats():
    def exact(*values: float) -> dict:
        return {(("trainer.seed", str(seed)),): (v, v) for seed, v in enumerate(values)}

    points = [(1.0, exact(1.0)), (2.0, exact(3.0)), (3.0, exact(2.0)), (4.0, exact(4.0)),
              (4.0, exact(3.5))]
    assert pareto_front(points) == [0, 1, 3]
    # a spread that reaches above the one that would beat it keeps a point on the front
    assert pareto_front([(1.0, {(): (2.0, 3.0)}), (2.0, {(): (2.9, 3.1)})]) == [0, 1]
    assert pareto_front([(1.0, {(): (3.2, 3.3)}), (2.0, {(): (2.9, 3.1)})]) == [0]
    # repeats are compared seed by seed: the same accuracy at each seed on less memory beats,
    # though the two seeds' accuracies are far apart
    assert pareto_front([(1.0, exact(0.9, 0.6)), (2.0, exact(0.9, 0.6))]) == [0]
    assert pareto_front([(1.0, exact(0.9, 0.6)), (2.0, exact(0.8, 0.7))]) == [0, 1]


def chosen_techniques(**techniques: str) -> dict[str, str]:
    return {"precision": "fp32", "checkpointing": "none", "optim": "sgd", "parallel": "none",
            "bn_mode": "train", "adapter": "none", "compile": "none", **techniques}


def config_of(chosen: dict[str, str]) -> dict:
    """The resolved config names each option's class, whose `baseline` the report reads."""
    return {group: {"_target_": yaml.safe_load(
        (config_dir() / group / f"{option}.yaml").read_text())["_target_"]}
        for group, option in chosen.items()}


def result(overrides: list[str], peak: float, step: float, accuracy: float,
           status: str = "ok", **techniques) -> dict:
    chosen = chosen_techniques(**techniques)
    config = config_of(chosen)
    config["data"], config["optim"]["accumulate"] = {"batch_size": 64}, 1
    return {"status": status, "overrides": overrides, "techniques": chosen, "config": config,
            "memory": {"peak_bytes": int(peak * GIB)} if status == "ok" else None,
            "metrics": {"step_time_s": step, "eval_accuracy": accuracy, "throughput": 1 / step,
                        "throughput_unit": "samples/s"} if status == "ok" else None}


def rows_of(*results: dict) -> list[Row]:
    rows = [Row(str(i), r) for i, r in enumerate(results)]
    describe_rows(rows)
    add_ratios(rows)
    return rows


def test_a_record_from_before_a_group_existed_is_at_that_groups_baseline():
    """result.json files written before adapter and compile were groups still report."""
    def without_new_groups(chosen: dict[str, str]) -> dict:
        return {group: option for group, option in config_of(chosen).items()
                if group not in ("adapter", "compile")}

    assert is_baseline(without_new_groups(chosen_techniques()))
    assert not is_baseline(without_new_groups(chosen_techniques(precision="bf16")))
    assert not is_baseline(config_of(chosen_techniques(adapter="lora")))


def test_a_job_standing_in_for_a_baseline_that_failed_is_named():
    rows = rows_of(
        result(["precision=fp32"], 10.0, 1.0, 0.8, status="oom"),
        result(["precision=amp"], 6.0, 0.5, 0.8, precision="amp"),
        result(["precision=bf16"], 5.0, 0.6, 0.8, precision="bf16"),
    )
    assert rows[1].memory_ratio == 1.0 and rows[2].memory_ratio == pytest.approx(5 / 6)
    assert [bool(row.stand_in_base) for row in rows] == [False, True, False]
    assert any(note.startswith("- job 1 is the base of its workload's ratios, though it is not "
                               "a baseline config") for note in ratio_notes(rows))
    # with the baseline there, no stand-in to name; only how its time ratio was taken
    rows = rows_of(result(["precision=fp32"], 10.0, 1.0, 0.8),
                   result(["precision=amp"], 6.0, 0.5, 0.8, precision="amp"))
    assert not any(row.stand_in_base for row in rows)
    assert ratio_notes(rows) == ["- job 1: step time x base divides the medians of two runs, "
                                 "each its own process, so it carries the two processes' speeds "
                                 "as well"]


def test_ratios_compare_techniques_on_the_same_workload():
    rows = rows_of(
        result(["model=resnet", "precision=amp"], 6.0, 0.5, 0.80, precision="amp"),
        result(["model=resnet", "precision=fp32"], 10.0, 1.0, 0.81),
        result(["model=mlp", "precision=fp32"], 2.0, 0.2, 0.50),
        result(["model=mlp", "precision=amp"], 3.0, 0.4, 0.49, precision="amp"),
    )
    # the fp32 row is each model's baseline, wherever it stands in the sweep
    assert [r.memory_ratio for r in rows] == [0.6, 1.0, 1.0, 1.5]
    assert [r.step_time_ratio for r in rows] == [0.5, 1.0, 1.0, 2.0]
    assert rows[0].label == "model=resnet precision=amp"
    assert rows[0].workload == (("model", "resnet"),)


def test_without_a_baseline_row_the_first_success_is_the_reference():
    rows = rows_of(
        result(["bn_mode=eval"], 4.0, 1.0, 0.1, status="failed", bn_mode="eval"),
        result(["bn_mode=eval"], 4.0, 1.0, 0.1, bn_mode="eval"),
        result(["bn_mode=efficient_eval"], 2.0, 0.9, 0.1, bn_mode="efficient_eval"),
    )
    assert [r.memory_ratio for r in rows] == [None, 1.0, 0.5]


def test_budget_names_the_fastest_and_the_most_accurate_that_fit():
    rows = rows_of(
        result(["optim=sgd"], 10.0, 1.0, 0.70),
        result(["optim=adam"], 11.5, 1.2, 0.90, optim="adam"),
        result(["optim=adamw"], 13.0, 0.8, 0.95, optim="adamw"),
        result(["optim=adafactor"], 9.0, 1.1, 0.85, optim="adafactor"),
    )
    choice = pick(rows, parse_size("12GiB", "report.budget"))
    assert [r.job for r in choice.fitting] == ["0", "1", "3"]
    assert choice.fastest.job == "0"
    assert choice.most_accurate.job == "1"
    assert not pick(rows, parse_size("1GiB", "report.budget")).fitting


def test_half_precision_times_measured_on_a_cpu_are_marked():
    bf16, fp32 = (result([f"precision={p}"], 1.0, 0.5, 0.8, precision=p) for p in ("bf16", "fp32"))
    for record, dtype in ((bf16, "bfloat16"), (fp32, None)):
        record["env"] = {"device_name": "cpu"}
        record["config"]["precision"]["dtype"] = dtype
    table = markdown_table(rows_of(bf16, fp32)).splitlines()
    bf16_row, fp32_row = table[2], table[3]
    assert bf16_row.count(HALF_MARK) == 2 and HALF_MARK not in fp32_row  # step time, throughput
    assert table[-1].startswith(f"{HALF_MARK} half precision on a CPU")


def test_each_row_is_against_its_own_baseline_where_the_sweep_ran_it(tmp_path):
    """`make run` of old: checkpointing with AdamW timed its baseline (AdamW, no
    checkpointing) beside its steps; the table divided by the SGD job instead, and the line
    and the table gave that job two ratios. Each row's ratios are against the job that ran
    its baseline config, the table names it, throughput follows from the ratio, and the job's
    line as the sweep ran, report.csv and the table say the same."""
    import csv
    import json

    from test_timing import result as timed

    from memexp.report import job_line, write_report

    records = [timed(["checkpointing=none", "optim=sgd"], 1.0),
               timed(["checkpointing=none", "optim=adamw"], 1.2, optim="adamw"),
               timed(["checkpointing=full", "optim=sgd"], 1.6, paired=1.3,
                     checkpointing="full"),
               timed(["checkpointing=full", "optim=adamw"], 1.9, paired=1.25,
                     checkpointing="full", optim="adamw")]
    lines = []
    for job, record in enumerate(records):  # as the sweep writes them, one by one
        peak = record["memory"]["peak_bytes"]
        record["memory"] |= {"phases": {"forward": {"peak_bytes": peak}},
                             "peak_phase": "forward"}
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "result.json").write_text(json.dumps(record))
        lines.append(job_line(tmp_path, tmp_path / str(job), {}))
    report = write_report(tmp_path)
    rows = report.rows
    assert [row.time_base.job for row in rows] == ["0", "0", "0", "1"]
    assert [row.memory_base.job for row in rows] == ["0", "0", "0", "1"]
    assert [row.step_time_ratio for row in rows] == [1.0, pytest.approx(1.2), 1.3, 1.25]
    assert lines == [", step time x base 1.00 (base: job 0)",
                     ", step time x base 1.20 (base: job 0)",
                     ", step time x base 1.30 (base: job 0)",
                     ", step time x base 1.25 (base: job 1)"]
    with open(report.csv) as f:
        written = list(csv.DictReader(f))
    table = report.table.splitlines()[2:]
    for row, line, cells in zip(written, lines, table, strict=True):
        ratio = float(row["step_time_x_base"])
        assert f"{ratio:.2f} " in cells.split(" | ")[13] and f"{ratio:.2f}" in line
        assert f"| {row['step_time_base']} |" in cells
        # throughput is the base's over the ratio, and step time the base's times it
        base = next(r for r in written if r["job"] == row["step_time_base"])
        assert float(row["throughput"]) == pytest.approx(float(base["throughput"]) / ratio)
        assert float(row["step_time_s"]) == pytest.approx(float(base["step_time_s"]) * ratio)
    assert float(written[3]["throughput"]) == pytest.approx(64 / 1.2 / 1.25)


def test_repeats_say_whether_a_difference_in_accuracy_is_more_than_the_seeds():
    def seeded(seed: int, accuracy: float, **techniques) -> dict:
        overrides = [f"{group}={option}" for group, option in techniques.items()]
        record = result([*overrides, f"trainer.seed={seed}"], 1.0, 1.0, accuracy,
                        **techniques)
        return record

    runs = [seeded(0, 0.94, bn_mode="train"), seeded(1, 0.85, bn_mode="train"),
            seeded(0, 0.53, bn_mode="eval"), seeded(1, 0.34, bn_mode="eval"),
            seeded(0, 0.92, bn_mode="group_norm"), seeded(1, 0.88, bn_mode="group_norm"),
            seeded(0, 0.94, bn_mode="sync"), seeded(1, 0.85, bn_mode="sync")]
    notes = ratio_notes(rows_of(*runs))
    assert notes[-3] == ("- bn_mode=eval: eval acc -0.410, -0.510 against the base "
                         "(trainer.seed=0,1); the same config's accuracy moves by up to 0.190 "
                         "between seeds: larger: a difference of the technique, not of the seed")
    assert notes[-2].startswith("- bn_mode=group_norm: eval acc -0.020, +0.030 against")
    assert notes[-2].endswith("not larger: not told apart from a difference of the seed")
    assert notes[-1] == ("- bn_mode=sync: eval acc the base's exactly at each of 2 seeds "
                         "(trainer.seed=0,1): the same math")
