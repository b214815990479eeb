"""The sweep plots stand alone: labels are overrides, failed jobs are marked, axes have units.
(What the PNGs look like was checked by eye; these tests check what is drawn, not pixels.)"""

from __future__ import annotations

import itertools

from test_report import result, rows_of

from memexp.plots import overlap, place_labels, write_plots

MIB = 2**20


def oom(overrides: list[str], peak_mib: float) -> dict:
    """A job that ran out of memory in its forward pass at step 2, having reached `peak_mib`."""
    record = result(overrides, 0, 0, 0, status="oom")
    record["memory"] = {"peak_bytes": int(peak_mib * MIB), "oom": {"phase": "forward", "step": 2},
                        "breakdown_at_peak": {"params": 2 * MIB, "activations": 30 * MIB}}
    return record


def test_a_sweep_with_an_oom_and_a_killed_job_gets_every_plot_labelled_by_overrides(tmp_path):
    rows = rows_of(
        result(["checkpointing=none", "optim=sgd"], 0.08, 0.2, 0.71),
        result(["checkpointing=full", "optim=sgd"], 0.05, 0.3, 0.71, checkpointing="full"),
        result(["checkpointing=none", "optim=adamw"], 0.09, 0.25, 0.75, optim="adamw"),
        oom(["checkpointing=none", "optim=adam"], 40),
        result(["checkpointing=full", "optim=adam"], 0, 0, 0, status="killed"),
    )
    charts = {chart.path.name: chart for chart in write_plots(rows, tmp_path)}
    assert sorted(charts) == ["memory_breakdown.png", "memory_vs_accuracy.png",
                              "memory_vs_throughput.png"]
    for chart in charts.values():
        assert chart.path.stat().st_size > 10_000
        assert "MiB" in chart.axes[0] and chart.title
        assert not any(label.isdigit() for label in chart.labels)
    bars = charts["memory_breakdown.png"]
    # the OOM job is a bar (its peak is known); the killed job, with none, is in the note
    assert "checkpointing=none\noptim=adam" in bars.labels and len(bars.labels) == 4
    assert any("job 4 (checkpointing=full optim=adam): killed" in n for n in bars.notes)
    speed = charts["memory_vs_throughput.png"]
    assert speed.labels == ["checkpointing=none\noptim=sgd", "checkpointing=full\noptim=sgd",
                            "checkpointing=none\noptim=adamw"]
    assert speed.axes[1] == "throughput (samples/s)"  # 3.3 to 5 samples/s: linear
    assert "accuracy" in charts["memory_vs_accuracy.png"].axes[1]


def test_throughput_spanning_more_than_10x_is_on_a_log_axis_accuracy_never(tmp_path):
    rows = rows_of(result(["model=mlp"], 1.0, 0.01, 0.05), result(["model=resnet"], 2.0, 0.5, 0.8))
    charts = {chart.path.name: chart for chart in write_plots(rows, tmp_path)}
    assert charts["memory_vs_throughput.png"].axes[1] == "throughput (samples/s), log scale"
    assert charts["memory_vs_accuracy.png"].axes[1] == "eval accuracy (fraction correct)"


def test_labels_of_points_at_one_spot_do_not_overlap_nor_cover_a_point():
    anchors = [(200.0, 150.0)] * 4 + [(205.0, 152.0), (260.0, 150.0)]
    sizes = [(90.0, 24.0)] * len(anchors)
    boxes = place_labels(anchors, sizes, (0.0, 0.0, 600.0, 400.0))
    assert boxes == place_labels(anchors, sizes, (0.0, 0.0, 600.0, 400.0))  # deterministic
    for a, b in itertools.combinations(boxes, 2):
        assert overlap(a, b) == 0
    for box, (x, y) in itertools.product(boxes, anchors):
        assert overlap(box, (x - 5, y - 5, x + 5, y + 5)) == 0
    assert all(0 <= box[0] and box[2] <= 600 and 0 <= box[1] and box[3] <= 400 for box in boxes)
